"""On-disk artifact cache shared by the cubin compiler and the emulator.

Entries are single files ``<key>.bin``: magic, a JSON metadata block, the
payload, and a trailing sha256 over all of it. A torn or corrupt entry fails
the checksum and reads as a miss. Writes go to a temp file then ``os.replace``;
builders hold a per-key file lock and look again after acquiring it, so two
processes building the same key do the work once.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from filelock import FileLock

from .settings import get_settings

_MAGIC = b"FAGENC01"


def cache_root(kind: str) -> Path:
    """Folder of one artifact kind under the settings' cache dir."""
    p = get_settings().cache_dir / kind
    p.mkdir(parents=True, exist_ok=True)
    return p


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


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_entry(path: Path) -> tuple[dict, bytes] | None:
    try:
        return decode(path.read_bytes())
    except OSError:
        return None


@contextmanager
def locked(path: Path, timeout: float = 600.0) -> Iterator[None]:
    with FileLock(str(path) + ".lock", timeout=timeout):
        yield


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
        meta, payload = build()
        atomic_write(path, encode(meta, payload))
        return meta, payload, False
