"""fagen.cache: unusable cache dirs, file modes for shared caches, stale temp files."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fagen.settings
from fagen import cache
from fagen.errors import CacheDirError, InputError


@pytest.fixture
def cache_dir_env(monkeypatch: pytest.MonkeyPatch):
    def use(path: Path | str) -> None:
        monkeypatch.setenv("FAGEN_CACHE_DIR", str(path))
        fagen.settings.reset()

    yield use
    fagen.settings.reset()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def unwritable_dir(tmp_path: Path):
    """A directory this process cannot create files in (chmod 555; for root, the immutable attribute)."""
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
            pytest.skip("running as root and cannot make a directory immutable")
    yield d
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(d)], capture_output=True)
    d.chmod(0o755)


# ---------------------------------------------------------------- unusable cache dir
@pytest.mark.parametrize("where", ["/etc/passwd/x", "/dev/null", "a file"])
def test_unusable_cache_dir_is_a_typed_error_naming_the_variable(where: str, tmp_path: Path, cache_dir_env) -> None:
    if where == "a file":
        (tmp_path / "f").write_text("")
        where = str(tmp_path / "f")
    cache_dir_env(where)
    with pytest.raises(CacheDirError) as info:
        cache.cache_root("cubin")
    err = info.value
    assert isinstance(err, InputError) and err.argument == "FAGEN_CACHE_DIR"
    assert str(err).startswith(f"FAGEN_CACHE_DIR: expected a writable directory for fagen's cache, got {where} (")
    assert "\n" not in str(err)


def test_unwritable_cache_dir(unwritable_dir: Path, cache_dir_env) -> None:
    cache_dir_env(unwritable_dir)
    with pytest.raises(CacheDirError, match="FAGEN_CACHE_DIR: .* got " + str(unwritable_dir)):
        cache.cache_root("cubin")


def test_unwritable_kind_folder(tmp_path: Path, cache_dir_env) -> None:
    """The folder exists (a shared cache made by someone else) but cannot be written: writes and locks fail typed."""
    cache_dir_env(tmp_path)
    kind = cache.cache_root("cubin")
    kind.chmod(0o555)
    locked_down = os.geteuid() == 0 and subprocess.run(["chattr", "+i", str(kind)], capture_output=True).returncode == 0
    if os.geteuid() == 0 and not locked_down:
        pytest.skip("running as root and cannot make a directory immutable")
    try:
        assert cache.cache_root("cubin") == kind  # reading an existing folder is fine
        with pytest.raises(CacheDirError, match="FAGEN_CACHE_DIR"):
            cache.atomic_write(kind / "k.bin", b"x")
        with pytest.raises(CacheDirError, match="FAGEN_CACHE_DIR"):
            with cache.locked(kind / "k.bin"):
                pass
        with pytest.raises(CacheDirError):
            cache.get_or_build(kind / "k.bin", lambda: ({}, b"payload"))
    finally:
        if locked_down:
            subprocess.run(["chattr", "-i", str(kind)], capture_output=True)
        kind.chmod(0o755)


def test_an_explicit_cache_dir_argument_is_named_as_such(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(CacheDirError) as info:
        cache.make_dir(tmp_path / "f" / "emu")
    assert info.value.argument == "cache_dir"


# ---------------------------------------------------------------- modes for a shared cache
@pytest.mark.parametrize("umask, expected", [(0o002, 0o664), (0o022, 0o644), (0o077, 0o600)])
def test_entries_and_locks_follow_the_umask(tmp_path: Path, umask: int, expected: int) -> None:
    old = os.umask(umask)
    try:
        assert cache.current_umask() == umask
        path = tmp_path / "kind" / "k.bin"
        with cache.locked(tmp_path / "k.bin"):
            assert _mode(tmp_path / "k.bin.lock") == expected
        meta, payload, cached = cache.get_or_build(path, lambda: ({"a": 1}, b"payload"))
        assert (meta, payload, cached) == ({"a": 1}, b"payload", False)
        assert _mode(path) == expected
        assert _mode(path.parent) == 0o777 & ~umask
    finally:
        os.umask(old)


# ---------------------------------------------------------------- stale temps
def test_stale_temps_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    dead = cache.temp_path(tmp_path / "abc.so", pid=_dead_pid())
    live = cache.temp_path(tmp_path / "abc.so")  # this process
    foreign = tmp_path / ".abc.so.0badc0de-1-00000000.tmp"  # another host: age decides
    foreign_old = tmp_path / ".def.so.0badc0de-1-00000000.tmp"
    legacy_old = tmp_path / ".0123456789abcdef01234567.a1b2_c3d.so"  # an earlier version's temp .so
    keep = [tmp_path / "abc.so", tmp_path / "abc.so.lock", tmp_path / ".hidden", tmp_path / "k.bin"]
    for p in [dead, live, foreign, foreign_old, legacy_old, *keep]:
        p.write_bytes(b"x")
    two_hours_ago = time.time() - 7200
    for p in (foreign_old, legacy_old):
        os.utime(p, (two_hours_ago, two_hours_ago))
    removed = cache.remove_stale_temps(tmp_path)
    assert sorted(removed) == sorted([dead, foreign_old, legacy_old])
    assert all(p.exists() for p in [live, foreign, *keep])


def test_a_build_cleans_its_folder(tmp_path: Path) -> None:
    dead = cache.temp_path(tmp_path / "k.bin", pid=_dead_pid())
    dead.write_bytes(b"half a cubin")
    cache.get_or_build(tmp_path / "k.bin", lambda: ({}, b"payload"))
    assert not dead.exists()
    assert {p.name for p in tmp_path.iterdir()} - {"k.bin.lock"} == {"k.bin"}
