"""NVRTC compile of a representative matrix (sm_80 and sm_90), resources, and the cache."""
from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import replace
from pathlib import Path

import pytest

from fagen import CompileError, KernelSpec
from fagen.compiler import clear_memo, compile as compile_spec, parse_ptxas
from fagen.renderer import render

VARIANTS = [(False, False, False), (True, False, False), (False, True, False), (True, True, True)]


def _representative() -> list[KernelSpec]:
    """All four head dims x three dtypes x two archs x both directions; mask/dropout variants cycle."""
    out = []
    i = 0
    for arch in ("sm_80", "sm_90"):
        for direction in ("bwd", "fwd"):
            for d in (32, 64, 96, 128):
                for dt in ("float16", "bfloat16", "float32"):
                    c, kp, dr = VARIANTS[i % len(VARIANTS)]
                    i += 1
                    out.append(KernelSpec(direction=direction, head_dim=d, dtype=dt, causal=c, key_padding=kp,
                                          dropout=dr, arch=arch))
    # extremes of the head-dim range, every flag
    out.append(KernelSpec(head_dim=8, dtype="float16", causal=True, key_padding=True, dropout=True, arch="sm_90"))
    out.append(KernelSpec(head_dim=256, dtype="bfloat16", causal=True, key_padding=True, dropout=True, arch="sm_80"))
    out.append(KernelSpec(head_dim=256, dtype="float32", arch="sm_86"))
    return out


@pytest.mark.parametrize("spec", _representative(), ids=lambda s: s.name)
def test_compiles_without_spills(spec: KernelSpec) -> None:
    mod = compile_spec(spec)
    assert mod.cubin[:4] == b"\x7fELF"
    assert len(mod.resources) == len(mod.rendered.kernels)
    for r in mod.resources:
        assert r.spill_bytes == 0, f"{r.kernel} spills {r.spill_bytes} bytes"
        assert r.smem_bytes <= spec.sram_bytes
        assert 0 < r.registers <= 255
        assert r.registers * spec.num_threads <= 65536
    assert mod.resource("main").dynamic_smem_bytes == spec.smem_bytes
    assert f"-arch={spec.arch}" in mod.options and "-std=c++17" in mod.options


def test_parse_ptxas_log() -> None:
    log = (
        "ptxas info    : Compiling entry function 'k1' for 'sm_90'\n"
        "ptxas info    : Function properties for k1\n"
        "ptxas         .     8 bytes stack frame, 12 bytes spill stores, 20 bytes spill loads\n"
        "ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]\n"
        "ptxas info    : Compile time = 5.5 ms\n"
    )
    (r,) = parse_ptxas(log, {"k1": 4096})
    assert (r.registers, r.spill_store_bytes, r.spill_load_bytes, r.spill_bytes) == (168, 12, 20, 32)
    assert (r.static_smem_bytes, r.dynamic_smem_bytes, r.smem_bytes, r.barriers) == (1024, 4096, 5120, 1)


SPEC = KernelSpec(head_dim=32, dtype="float16", arch="sm_80")


def test_cache_miss_hit_and_memo(fresh_cache: Path) -> None:
    first = compile_spec(SPEC)
    assert first.cached is False
    again = compile_spec(SPEC)  # in-process memo
    assert again.cached is True and again.cubin == first.cubin
    clear_memo()
    disk = compile_spec(SPEC)  # from disk
    assert disk.cached is True and disk.cubin == first.cubin and disk.key == first.key
    assert len(list((fresh_cache / "cubin").glob("*.bin"))) == 1


def test_corrupt_entry_is_recompiled(fresh_cache: Path) -> None:
    """Each damage in turn (one NVRTC compile to start from, one rebuild per damage)."""
    first = compile_spec(SPEC)
    (entry,) = (fresh_cache / "cubin").glob("*.bin")
    blob = entry.read_bytes()
    for damage in ("truncate", "flip", "garbage", "empty"):
        if damage == "truncate":
            entry.write_bytes(blob[: len(blob) // 2])
        elif damage == "flip":
            entry.write_bytes(blob[:100] + bytes([blob[100] ^ 0xFF]) + blob[101:])
        elif damage == "garbage":
            entry.write_bytes(os.urandom(len(blob)))
        else:
            entry.write_bytes(b"")
        clear_memo()
        again = compile_spec(SPEC)
        assert again.cached is False, damage  # recompiled, never loaded
        assert again.cubin == first.cubin, damage
        clear_memo()
        assert compile_spec(SPEC).cached is True, damage  # and the entry is healthy again


def _compile_in_child(cache_dir: str, q: "mp.Queue") -> None:
    os.environ["FAGEN_CACHE_DIR"] = cache_dir
    import fagen.settings

    fagen.settings.reset()
    mod = fagen.compile(KernelSpec(head_dim=48, dtype="bfloat16", arch="sm_90"))
    q.put((mod.cached, mod.cubin))


def test_two_processes_compile_the_same_spec(fresh_cache: Path) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_compile_in_child, args=(str(fresh_cache), q)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0][1] == results[1][1]
    assert sorted(c for c, _ in results) == [False, True]  # one compiled, the other waited and loaded
    assert len(list((fresh_cache / "cubin").glob("*.bin"))) == 1


def test_nvrtc_error_is_typed(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = KernelSpec(head_dim=16, dtype="float32")
    good = render(spec)
    bad = replace(good, source=good.source + "\nthis is not C++;\n")
    monkeypatch.setattr("fagen.compiler.render", lambda s: bad)
    with pytest.raises(CompileError) as ei:
        compile_spec(spec)
    assert ei.value.spec_name == spec.name
    assert "error" in ei.value.log
    assert spec.name in str(ei.value)
    assert not list((fresh_cache / "cubin").glob("*.bin"))  # nothing half-written
