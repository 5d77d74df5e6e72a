"""JIT fast paths keep their promises: a disk hit renders nothing and loads neither NVRTC nor
CuPy, and any change to what determines the cubin (template, Python source, NVRTC build,
CUDA header) is a miss. No timings here: benchmarks/jit.py measures them."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import fagen.settings
from fagen import cache, compiler, nvrtc
from fagen.compiler import cache_key, clear_memo, compile as compile_spec, options_for
from fagen.renderer import render
from fagen.spec import KernelSpec

SPEC = KernelSpec(direction="fwd", head_dim=16, dtype="float32", arch="sm_80")


def _no_render(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(spec):
        raise AssertionError("rendered on a path that must not render")
    monkeypatch.setattr(compiler, "render", fail)


# --------------------------------------------------------------------------- toolchain identity
def test_full_nvrtc_version_and_build_id() -> None:
    major, minor = nvrtc.version()
    full = nvrtc.full_version()
    assert full.startswith(f"{major}.{minor}")
    try:
        wheel = metadata.version("nvidia-cuda-nvrtc")
    except metadata.PackageNotFoundError:
        pytest.skip("NVRTC not from the nvidia-cuda-nvrtc wheel")
    assert full == ".".join(wheel.split(".")[:3]) and full.count(".") == 2
    tid = nvrtc.toolchain_id()
    assert f"nvrtc {full} build-id " in tid
    bid = tid.rsplit(" ", 1)[1]
    assert len(bid) >= 16 and int(bid, 16) >= 0  # the GNU build id (hex)


def test_header_set_follows_includes() -> None:
    rel = {str(p.relative_to(nvrtc.include_dir())) for p in nvrtc.header_files()}
    for name in ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp", "vector_types.h",
                 "vector_functions.h", "crt/host_defines.h", "nv/target"):
        assert name in rel, name


def test_version_change_changes_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    rendered, options = render(SPEC), options_for(SPEC)
    before = cache_key(rendered, options)
    monkeypatch.setattr(nvrtc, "toolchain_id", lambda: "nvrtc 13.5.38 build-id 00")
    assert cache_key(rendered, options) != before


# --------------------------------------------------------------------------- header change
@pytest.fixture
def include_copy(tmp_path: Path, fresh_cache: Path) -> Path:
    """A private copy of the CUDA header dir (without the large cccl tree), used through settings."""
    src = nvrtc.include_dir()
    dst = tmp_path / "include"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("cccl"), symlinks=True)
    fagen.settings.configure(cuda_include=dst)
    clear_memo()
    yield dst
    fagen.settings.reset()
    clear_memo()


@pytest.mark.parametrize("header", ["vector_functions.h", "nv/target"])
def test_header_change_is_a_miss(include_copy: Path, header: str, monkeypatch: pytest.MonkeyPatch) -> None:
    first = compile_spec(SPEC)
    assert first.cached is False
    clear_memo()
    with monkeypatch.context() as m:
        _no_render(m)
        assert compile_spec(SPEC).cached is True  # through the index
    path = include_copy / header
    st = path.stat()
    path.write_bytes(path.read_bytes() + b"\n/* patched */\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    clear_memo()
    again = compile_spec(SPEC)
    assert again.cached is False and again.key != first.key


def test_header_content_change_with_same_stat_changes_the_key(include_copy: Path) -> None:
    """The full key digests contents: an edit that keeps size and mtime still changes it."""
    rendered, options = render(SPEC), options_for(SPEC)
    before = cache_key(rendered, options)
    path = include_copy / "vector_functions.h"
    st = path.stat()
    data = path.read_bytes()
    path.write_bytes(data[:-1] + (b" " if data[-1:] != b" " else b"\t"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    nvrtc.clear_caches()
    assert cache_key(rendered, options) != before


# --------------------------------------------------------------------------- templates and sources
def test_source_digest_sees_template_contents_and_python_stat(tmp_path: Path) -> None:
    templates = tmp_path / "templates"
    shutil.copytree(compiler._templates_dir(), templates)
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "renderer.py").write_text("x = 1\n")
    base = compiler.source_digest(templates, package)
    assert compiler.source_digest(templates, package) == base
    tpl = next(templates.rglob("*.j2"))
    st = tpl.stat()
    data = tpl.read_bytes()
    tpl.write_bytes(data.replace(b"\n", b" ", 1))  # same size, same mtime, other content
    os.utime(tpl, ns=(st.st_atime_ns, st.st_mtime_ns))
    edited = compiler.source_digest(templates, package)
    assert edited != base
    (package / "renderer.py").write_text("x = 22\n")
    assert compiler.source_digest(templates, package) != edited


def test_template_edit_is_a_miss(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A template edit changes the templates' digest (so the index misses) and the rendered
    source (so the full key differs): NVRTC runs again."""
    first = compile_spec(SPEC)
    good = render(SPEC)
    edited = type(good)(good.spec, good.source + "\n// edited template\n", good.kernels)
    clear_memo()
    monkeypatch.setattr(compiler, "installed_source_digest", lambda: "templates-after-the-edit")
    monkeypatch.setattr(compiler, "render", lambda spec: edited)
    again = compile_spec(SPEC)
    assert again.cached is False and again.key != first.key


# --------------------------------------------------------------------------- the index
def _index_files(root: Path) -> list[Path]:
    return sorted((root / "cubin" / "index").glob("*.json"))


def test_index_hit_renders_nothing(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = compile_spec(SPEC)
    (index,) = _index_files(fresh_cache)
    rec = json.loads(index.read_text())
    assert rec["key"] == first.key
    paths = [f[0] for f in rec["files"]]
    assert paths[0] == str(nvrtc.library_path()) and str(nvrtc.include_dir() / "nv" / "target") in paths
    clear_memo()
    _no_render(monkeypatch)
    hit = compile_spec(SPEC)
    assert hit.cached is True and hit.cubin == first.cubin and hit.resources == first.resources
    assert hit.key == first.key and hit.options == first.options


@pytest.mark.parametrize("damage", ["library", "garbage", "bad key", "missing entry", "short entry"])
def test_a_stale_or_broken_index_falls_back_to_the_full_path(fresh_cache: Path, damage: str) -> None:
    first = compile_spec(SPEC)
    (index,) = _index_files(fresh_cache)
    rec = json.loads(index.read_text())
    entry = fresh_cache / "cubin" / f"{first.key}.bin"
    if damage == "library":  # the NVRTC library changed (another release installed in place)
        rec["files"][0][1] += 1
        index.write_text(json.dumps(rec))
    elif damage == "garbage":
        index.write_bytes(b"\x00not json")
    elif damage == "bad key":
        index.write_text(json.dumps({**rec, "key": "../../etc/passwd"}))
    elif damage == "missing entry":
        entry.unlink()
    else:
        meta, payload = cache.read_entry(entry)
        cache.atomic_write(entry, cache.encode(meta, payload[:-1]))
    clear_memo()
    calls = []
    real = compiler.compile_full
    compiler_full = lambda *a: calls.append(a) or real(*a)  # noqa: E731
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compiler, "compile_full", compiler_full)
        again = compile_spec(SPEC)
    assert calls and again.cubin == first.cubin and again.key == first.key
    assert again.cached is (damage in ("library", "garbage", "bad key"))
    assert json.loads(index.read_text())["key"] == first.key  # rewritten


def test_memo_is_per_cache_dir(fresh_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = compile_spec(SPEC)
    assert compile_spec(SPEC) is compile_spec(SPEC)
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "other"))
    fagen.settings.reset()
    b = compile_spec(SPEC)
    assert b.cached is False and b.cubin == a.cubin and (tmp_path / "other" / "cubin").is_dir()


def test_cache_root_makes_its_folder_once(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = cache.make_dir
    monkeypatch.setattr(cache, "make_dir", lambda p: calls.append(p) or real(p))
    first = cache.cache_root("cubin")
    assert first.is_dir() and cache.cache_root("cubin") == first and len(calls) == 1


_CHILD = """
import json, sys
import fagen, fagen.renderer
from fagen.spec import KernelSpec
mod = fagen.compile(KernelSpec(direction="fwd", head_dim=16, dtype="float32", arch="sm_80"))
print(json.dumps({"cached": mod.cached, "key": mod.key, "renders": fagen.renderer.render.cache_info().misses,
                  "loaded": sorted(m for m in ("cupy", "cuda.pathfinder", "cupy_backends") if m in sys.modules),
                  "sources": fagen.compiler.installed_source_digest()}))
"""


def test_fresh_process_disk_hit_loads_no_compiler(fresh_cache: Path) -> None:
    env = {**os.environ, "FAGEN_CACHE_DIR": str(fresh_cache)}

    def child() -> dict:
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold = child()
    assert cold["cached"] is False and cold["renders"] == 1
    for _ in range(3):  # a source file edited between two runs is (rightly) a miss: run again
        warm = child()
        if warm["sources"] == cold["sources"]:
            break
        cold = warm
    assert {k: v for k, v in warm.items() if k != "sources"} == {
        "cached": True, "key": cold["key"], "renders": 0, "loaded": []}


def test_resources_keep_launch_order_on_every_path(fresh_cache: Path) -> None:
    spec = KernelSpec(head_dim=32, dtype="float16", arch="sm_90")
    order = [k.name for k in render(spec).kernels]
    assert [r.kernel for r in compile_spec(spec).resources] == order  # built
    clear_memo()
    assert [r.kernel for r in compile_spec(spec).resources] == order  # through the index


def test_a_read_only_cache_still_serves_hits(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a miss writes: no index entry can be written, yet a cached cubin is served."""
    from fagen.errors import CacheDirError

    first = compile_spec(SPEC)
    shutil.rmtree(fresh_cache / "cubin" / "index")
    clear_memo()

    def refuse(path, data):
        raise CacheDirError(fresh_cache, "Read-only file system", "FAGEN_CACHE_DIR")
    monkeypatch.setattr(cache, "atomic_write", refuse)
    again = compile_spec(SPEC)
    assert again.cached is True and again.cubin == first.cubin


def test_untuned_lookup_asks_nothing_of_nvrtc(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no tuning recorded, the per-call tuned-choice lookup returns at once (no key, no NVRTC)."""
    from fagen import choices

    def fail(*a, **k):
        raise AssertionError("built a tuning key with nothing tuned")
    monkeypatch.setattr(choices, "make_key", fail)
    assert choices.lookup(SPEC, batch=1, heads=1, seqlen_q=64, seqlen_k=64, device_name="H200",
                          capability=(9, 0)) is None
