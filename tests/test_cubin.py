"""The stored cubin is the whole of NVRTC's output and a well-formed CUDA ELF."""
from __future__ import annotations

import ctypes
import json
import struct
from pathlib import Path

import pytest

from fagen import cache, elf, nvrtc
from fagen.compiler import cache_key, clear_memo, compile as compile_spec, options_for
from fagen.renderer import render
from fagen.spec import KernelSpec

SPEC = KernelSpec(head_dim=64, dtype="float16", causal=True, arch="sm_90")


def _nvrtc_cubin_size(spec: KernelSpec) -> int:
    """nvrtcGetCUBINSize of an independent compile of ``spec``'s source."""
    lib = nvrtc._nvrtc().lib
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), render(spec).source.encode(),
                                  f"{spec.name}.cu".encode(), 0, None, None) == 0
    try:
        opts = [o.encode() for o in [*options_for(spec), f"-I{nvrtc.include_dir()}"]]
        assert lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) == 0
        n = ctypes.c_size_t()
        assert lib.nvrtcGetCUBINSize(prog, ctypes.byref(n)) == 0
        return n.value
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def test_cached_cubin_has_every_byte(fresh_cache: Path) -> None:
    mod = compile_spec(SPEC)
    (entry,) = (fresh_cache / "cubin").glob("*.bin")
    meta, payload = cache.read_entry(entry)
    assert payload == mod.cubin
    assert len(payload) == _nvrtc_cubin_size(SPEC) == meta["cubin_size"]


@pytest.mark.parametrize("spec", [SPEC, KernelSpec(head_dim=32, dtype="bfloat16", direction="fwd", arch="sm_80"),
                                  KernelSpec(head_dim=16, dtype="float32", arch="sm_86")], ids=lambda s: s.name)
def test_cubin_is_a_complete_cuda_elf(spec: KernelSpec) -> None:
    cubin = compile_spec(spec).cubin
    assert cubin[:4] == b"\x7fELF" and cubin[4] == 2 and cubin[5] == 1  # ELF64, little-endian
    h = elf.header(cubin)
    assert h.machine == elf.EM_CUDA == 190
    assert h.phoff + h.phnum * h.phentsize <= len(cubin) and h.phnum > 0
    assert h.shoff + h.shnum * h.shentsize <= len(cubin) and h.shnum > 0
    assert elf.cubin_arch(cubin) == spec.arch
    names = elf.sections(cubin)
    for k in render(spec).kernels:
        assert f".text.{k.name}" in names


def test_short_cubin_is_rejected() -> None:
    cubin = compile_spec(SPEC).cubin
    with pytest.raises(elf.ElfError, match="past the end"):
        elf.check_cubin(cubin[:-1])
    with pytest.raises(elf.ElfError, match="expected sm_80"):
        elf.check_cubin(cubin, "sm_80")
    bad = bytearray(cubin)
    struct.pack_into("<H", bad, 18, 62)  # EM_X86_64
    with pytest.raises(elf.ElfError, match="EM_CUDA"):
        elf.check_cubin(bytes(bad))


def test_stale_short_entry_is_rebuilt(fresh_cache: Path) -> None:
    """An intact entry holding a one-byte-short cubin (as older releases stored) is never served."""
    good = compile_spec(SPEC)
    (entry,) = (fresh_cache / "cubin").glob("*.bin")
    assert entry.name == f"{cache_key(render(SPEC), options_for(SPEC))}.bin"
    meta, payload = cache.read_entry(entry)
    for stale_meta in ({k: v for k, v in meta.items() if k != "cubin_size"}, {**meta, "cubin_size": len(payload) - 1}):
        cache.atomic_write(entry, cache.encode(stale_meta, payload[:-1]))
        clear_memo()
        again = compile_spec(SPEC)
        assert again.cached is False and again.cubin == good.cubin
        assert cache.read_entry(entry)[1] == good.cubin  # replaced on disk
    clear_memo()
    assert compile_spec(SPEC).cached is True


def test_meta_records_cubin_size(fresh_cache: Path) -> None:
    compile_spec(SPEC)
    (entry,) = (fresh_cache / "cubin").glob("*.bin")
    meta, payload = cache.read_entry(entry)
    assert json.loads(json.dumps(meta))["cubin_size"] == len(payload)
