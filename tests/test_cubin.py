"""The stored cubin is the whole of NVRTC's output and a well-formed CUDA ELF."""
from __future__ import annotations

import ctypes
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fagen import cache, cli, elf, nvrtc, sass
from fagen.compiler import cache_key, clear_memo, compile as compile_spec, options_for
from fagen.generate import standard_matrix
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


# --------------------------------------------------------------------------- SASS (nvdisasm)
needs_nvdisasm = pytest.mark.skipif(sass.nvdisasm_path() is None,
                                    reason="nvdisasm not installed (pip install -e '.[test]')")


@needs_nvdisasm
def test_nvdisasm_disassembles_every_kernel_of_the_standard_matrix() -> None:
    specs = standard_matrix()
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:  # NVRTC and nvdisasm drop the GIL
        mods = list(pool.map(compile_spec, specs))
        mixes = list(pool.map(lambda m: sass.instruction_mix(m.cubin), mods))
    for mod, mix in zip(mods, mixes):
        names = {k.name for k in mod.rendered.kernels}
        assert set(mix) == names, mod.spec.name
        for name in names:
            assert sum(mix[name].values()) > 10 and mix[name].get("EXIT", 0) >= 1, name


@needs_nvdisasm
def test_nvdisasm_rejects_a_short_cubin() -> None:
    with pytest.raises(sass.SassError, match="invalid ELF"):
        sass.disassemble(compile_spec(SPEC).cubin[:-1])


@needs_nvdisasm
def test_simt_backward_is_ffma_without_local_memory() -> None:
    spec = KernelSpec(head_dim=64, dtype="float16", causal=True, arch="sm_90", impl="simt")
    mod = compile_spec(spec)
    main = mod.rendered.kernel("main").name
    mix = sass.instruction_mix(mod.cubin)[main]
    assert mix.get("FFMA", 0) > 0
    assert mix.get("HMMA", 0) == 0
    assert mix.get("LDL", 0) == 0 and mix.get("STL", 0) == 0
    loop = sass.loop_mix(mod.cubin)[main]
    assert 0 < loop["FFMA"] <= mix["FFMA"] and sum(loop.values()) < sum(mix.values())


_TEXT = """\
//--------------------- .text.k_main --------------------------
\t.section\t.text.k_main,"ax",@progbits
k_main:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0020*/               @!P0 LDSM.16.M88.4 R8, [R2] ;
        /*0030*/                   FFMA R0, R1, R2, R0 ;
        /*0040*/               @P1 BRA `(.L_x_1) ;
        /*0050*/                   EXIT ;
"""


def test_parse_and_mix_of_a_listing() -> None:
    (name, instrs), = sass.parse(_TEXT).items()
    assert name == "k_main"
    assert [i.opcode for i in instrs] == ["LDC", "HMMA", "LDSM", "FFMA", "BRA", "EXIT"]
    assert instrs[2].predicate == "@!P0" and instrs[1].mnemonic == "HMMA.16816.F32"
    assert sass.mix_of(instrs)["HMMA"] == 1
    assert sass._loops(_TEXT) == {"k_main": (0x10, 0x40)}
    assert sass.loop_spans(_TEXT) == {"k_main": [(0x10, 0x40)]}
    nested = _TEXT.replace("        /*0050*/", "        /*0048*/                   BRA `(.L_x_0) ;\n        /*0050*/")
    nested = nested.replace("k_main:\n", "k_main:\n.L_x_0:\n")
    assert sass.loop_spans(nested) == {"k_main": [(0x10, 0x40), (0x0, 0x48)]}
    assert sass._loops(nested) == {"k_main": (0x0, 0x48)}


def test_no_disassembler_gives_none(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(sass, "nvdisasm_path", lambda: None)
    sass._analysis.cache_clear()
    cubin = compile_spec(SPEC).cubin
    assert sass.instruction_mix(cubin) is None and sass.loop_mix(cubin) is None and sass.disassemble(cubin) is None
    assert cli.main(["compile", "--head-dim", "64", "--causal", "--json"]) == 0
    assert all("sass" not in row for row in json.loads(capsys.readouterr().out))
    sass._analysis.cache_clear()


@needs_nvdisasm
def test_compile_json_reports_sass(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["compile", "--head-dim", "64", "--causal", "--impl", "simt", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    main = next(r for r in rows if r["kernel"].endswith("_main"))
    assert main["sass"]["FFMA"] > 0 and "registers" in main and "smem_bytes" in main


def test_an_unusable_cubin_from_nvrtc_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from fagen.errors import FagenError

    real = nvrtc.cubin_of
    monkeypatch.setattr(nvrtc, "cubin_of", lambda lib, prog: real(lib, prog)[:-1])  # as CuPy's getCUBIN returned
    r = render(SPEC)
    with pytest.raises(nvrtc.NvrtcError, match="unusable cubin .* past the end") as ei:
        nvrtc.compile_cubin(r.source, f"{SPEC.name}.cu", options_for(SPEC), SPEC.arch)
    assert isinstance(ei.value, FagenError)
    with pytest.raises(nvrtc.NvrtcError, match="expected sm_80"):
        monkeypatch.setattr(nvrtc, "cubin_of", real)
        nvrtc.compile_cubin(r.source, f"{SPEC.name}.cu", options_for(SPEC), "sm_80")
