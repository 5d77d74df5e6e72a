"""On-disk artifact cache shared by the cubin compiler and the emulator.

Entries are single files ``<key>.bin``: magic, a JSON metadata block, the
payload, and a trailing sha256 over all of it. A torn or corrupt entry fails
the checksum and reads as a miss. Writes go to a temp file then ``os.replace``;
builders hold a per-key file lock and look again after acquiring it, so two
processes building the same key do the work once.

Sharing: entries, temp files and lock files are created with ``0o666`` minus
the process umask (directories ``0o777`` minus it), so with umask 002 and a
group-owned setgid cache dir every member of the group can use the cache.
Temp files are named ``.<name>.<host>-<pid>-<random>.tmp``; one whose process is
gone (or any older than :data:`STALE_TEMP_SECONDS`) is removed by the next build
in that folder. A cache dir that cannot be created or written raises
:class:`~fagen.errors.CacheDirError` naming ``FAGEN_CACHE_DIR``.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import socket
import struct
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout

from .errors import CacheDirError
from .settings import get_settings

_MAGIC = b"FAGENC01"
#: A temp file older than this is removed even when its owner cannot be checked (another host).
STALE_TEMP_SECONDS = 3600.0
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_TEMP = re.compile(r"^\..+\.(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}\.tmp$")
# Temp names of earlier versions (tempfile.mkstemp): removed by age only.
_OLD_TEMP = re.compile(r"^(?:.+\.tmp|\.[0-9a-f]{24}\.[A-Za-z0-9_]{8}\.so)$")


def dir_error(path: Path, exc: OSError) -> CacheDirError:
    """The typed error for an OSError while creating or writing under the cache dir ``path``."""
    root = get_settings().cache_dir
    inside = Path(path).absolute().is_relative_to(root.absolute())
    reason = exc.strerror or str(exc)
    if exc.filename is not None and str(exc.filename) != str(path):
        reason += f": {exc.filename}"
    return CacheDirError(root if inside else path, reason, "FAGEN_CACHE_DIR" if inside else "cache_dir")


def make_dir(path: Path) -> Path:
    """``mkdir -p path``, an unusable cache dir raising :class:`CacheDirError`."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise dir_error(path, exc) from None
    return path


_roots: dict[tuple[Path, str], Path] = {}


def cache_root(kind: str) -> Path:
    """Folder of one artifact kind under the settings' cache dir, created on its first use in
    this process (later calls only look it up; :func:`atomic_write` re-creates a removed folder)."""
    base = get_settings().cache_dir
    found = _roots.get((base, kind))
    if found is None:
        found = _roots[(base, kind)] = make_dir(base / kind)
    return found


def digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        b = part.encode() if isinstance(part, str) else part
        h.update(struct.pack("<Q", len(b)))
        h.update(b)
    return h.hexdigest()


def encode(meta: dict, payload: bytes) -> bytes:
    mb = json.dumps(meta, sort_keys=True).encode()
    body = _MAGIC + struct.pack("<QQ", len(mb), len(payload)) + mb + payload
    return body + hashlib.sha256(body).digest()


def decode(blob: bytes) -> tuple[dict, bytes] | None:
    """(meta, payload), or None for anything truncated, corrupt or foreign."""
    if len(blob) < len(_MAGIC) + 16 + 32 or not blob.startswith(_MAGIC):
        return None
    body, check = blob[:-32], blob[-32:]
    if hashlib.sha256(body).digest() != check:
        return None
    n_meta, n_payload = struct.unpack_from("<QQ", body, len(_MAGIC))
    start = len(_MAGIC) + 16
    if start + n_meta + n_payload != len(body):
        return None
    try:
        meta = json.loads(body[start:start + n_meta])
    except ValueError:
        return None
    return meta, body[start + n_meta:]


def current_umask() -> int:
    """The process umask, read without changing it (Linux), else by setting it back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """Mode of new cache files: ``0o666`` minus the umask."""
    return 0o666 & ~current_umask()


def temp_path(path: Path, pid: int | None = None) -> Path:
    """A fresh temp name next to ``path`` recording this host and process (see :func:`remove_stale_temps`)."""
    return path.with_name(f".{path.name}.{_HOST}-{os.getpid() if pid is None else pid}-{secrets.token_hex(4)}.tmp")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, under another user
        return True
    return True


def remove_stale_temps(folder: Path, max_age: float = STALE_TEMP_SECONDS) -> list[Path]:
    """Removes temp files left in ``folder`` by killed writers; returns them.

    A temp is stale when it was made on this host by a process that no longer
    exists, or when it is older than ``max_age`` seconds. Others are in use.
    """
    removed = []
    now = time.time()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP.match(entry.name)
        if m is None and not _OLD_TEMP.match(entry.name):
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            dead = m is not None and m["host"] == _HOST and not _pid_alive(int(m["pid"]))
            if dead or now - entry.stat(follow_symlinks=False).st_mtime > max_age:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    return removed


def atomic_write(path: Path, data: bytes) -> None:
    """Writes ``path`` all at once (temp file + ``os.replace``), mode ``0o666`` minus the umask."""
    make_dir(path.parent)
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as exc:
        raise dir_error(path.parent, exc) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise dir_error(path.parent, exc) from None
        raise


def read_entry(path: Path) -> tuple[dict, bytes] | None:
    try:
        return decode(path.read_bytes())
    except OSError:
        return None


@contextmanager
def locked(path: Path, timeout: float = 600.0) -> Iterator[None]:
    """Holds ``<path>.lock`` (created ``0o666`` minus the umask, so other users of a shared cache can take it)."""
    lock = FileLock(str(path) + ".lock", timeout=timeout, mode=file_mode())
    try:
        lock.acquire()
    except Timeout:
        raise
    except OSError as exc:
        raise dir_error(path.parent, exc) from None
    try:
        yield
    finally:
        lock.release()


def get_or_build(path: Path, build: Callable[[], tuple[dict, bytes]],
                 valid: Callable[[dict, bytes], bool] | None = None) -> tuple[dict, bytes, bool]:
    """Load ``path`` or build it under its lock (double-checked). Returns (meta, payload, cached).

    ``valid(meta, payload)`` can reject an intact but unusable entry (e.g. one written by an
    older, buggy build): it is rebuilt and replaced like a corrupt one."""
    hit = read_entry(path)
    if hit is not None and (valid is None or valid(*hit)):
        return (*hit, True)
    with locked(path):
        hit = read_entry(path)
        if hit is not None and (valid is None or valid(*hit)):
            return (*hit, True)
        remove_stale_temps(path.parent)
        meta, payload = build()
        atomic_write(path, encode(meta, payload))
        return meta, payload, False
