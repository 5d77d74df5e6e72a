"""The stored cubin is the whole of NVRTC's output and a well-formed CUDA ELF.

The ELF checks here use a reader written in this file (not fagen.elf): header and section
header table inside the file, every section's bytes inside unless SHT_NOBITS, every kernel
of the spec an STT_FUNC symbol of ``.symtab`` in its own ``.text.<kernel>`` section; and,
with nvdisasm installed, the disassembler takes the cubin.
"""
from __future__ import annotations

import ctypes
import json
import os
import struct
import subprocess
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


# --------------------------------------------------------------------------- an ELF64 reader of its own
class Malformed(Exception):
    """The bytes are not a complete ELF64 little-endian CUDA object."""


_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")  # e_ident .. e_shstrndx: 64 bytes
_SHDR = struct.Struct("<IIQQQQIIQQ")  # sh_name .. sh_entsize: 64 bytes
_SYM = struct.Struct("<IBBHQQ")  # st_name, st_info, st_other, st_shndx, st_value, st_size: 24 bytes
_PHENTSIZE = 56
SHT_SYMTAB, SHT_NOBITS, STT_FUNC, EM_CUDA = 2, 8, 2, 190


def _cstr(data: bytes, table: tuple[int, int], off: int) -> str:
    start, size = table
    end = data.find(b"\0", start + off, start + size)
    if off >= size or end < 0:
        raise Malformed(f"name at {off} outside its string table of {size} bytes")
    return data[start + off:end].decode()


def read_elf(data: bytes) -> tuple[dict[str, tuple[int, int, int, int]], list[tuple[str, int, str]]]:
    """(sections: name -> (index, type, offset, size); functions: [(symbol, size, section name)] of
    the STT_FUNC symbols of .symtab), or :class:`Malformed` naming what lies outside ``data``."""
    n = len(data)
    if n < _EHDR.size:
        raise Malformed(f"{n} bytes: no room for the 64-byte ELF64 header")
    ident, _t, machine, _v, _e, phoff, shoff, _f, ehsize, phentsize, phnum, shentsize, shnum, shstrndx = \
        _EHDR.unpack_from(data)
    if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1 or machine != EM_CUDA or ehsize != _EHDR.size:
        raise Malformed(f"not an ELF64 little-endian EM_CUDA header: {ident[:6]!r} machine {machine}")
    if shentsize != _SHDR.size or shnum == 0 or shoff + shnum * shentsize > n:
        raise Malformed(f"section header table [{shoff}, +{shnum}x{shentsize}) outside {n} bytes")
    if phnum and (phentsize != _PHENTSIZE or phoff + phnum * phentsize > n):
        raise Malformed(f"program header table [{phoff}, +{phnum}x{phentsize}) outside {n} bytes")
    raw = [_SHDR.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    for i, (_nm, typ, _fl, _ad, off, size, *_rest) in enumerate(raw):
        if typ != SHT_NOBITS and off + size > n:
            raise Malformed(f"section {i} [{off}, +{size}) outside {n} bytes")
    if not 0 < shstrndx < shnum:
        raise Malformed(f"e_shstrndx {shstrndx} of {shnum} sections")
    names = (raw[shstrndx][4], raw[shstrndx][5])
    sections = {_cstr(data, names, r[0]): (i, r[1], r[4], r[5]) for i, r in enumerate(raw)}
    symtabs = [r for r in raw if r[1] == SHT_SYMTAB]
    if len(symtabs) != 1:
        raise Malformed(f"{len(symtabs)} .symtab sections")
    _nm, _typ, _fl, _ad, off, size, link, _info, _al, entsize = symtabs[0]
    if entsize != _SYM.size or size % entsize or not 0 < link < shnum:
        raise Malformed(f".symtab of {size} bytes, entries of {entsize}, string table {link}")
    strtab = (raw[link][4], raw[link][5])
    functions = []
    for pos in range(off, off + size, entsize):
        st_name, st_info, _other, shndx, value, fsize = _SYM.unpack_from(data, pos)
        if st_info & 0xF != STT_FUNC:
            continue
        if not 0 < shndx < shnum:
            raise Malformed(f"function symbol in section {shndx} of {shnum}")
        if value + fsize > raw[shndx][5]:
            raise Malformed(f"function [{value}, +{fsize}) outside its section of {raw[shndx][5]} bytes")
        functions.append((_cstr(data, strtab, st_name), fsize, _cstr(data, names, raw[shndx][0])))
    return sections, functions


def _nvdisasm(cubin: bytes, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    return subprocess.run([str(sass.nvdisasm_path()), "-c", str(path)], capture_output=True, text=True, check=False)


COMPLETE_SPECS = [SPEC, KernelSpec(head_dim=32, dtype="bfloat16", direction="fwd", arch="sm_80"),
                  KernelSpec(head_dim=16, dtype="float32", arch="sm_86"),
                  KernelSpec(head_dim=32, dtype="float32", arch="sm_90", deterministic=True, causal=True),
                  KernelSpec(head_dim=64, dtype="bfloat16", direction="fwd", arch="sm_90", dropout=True,
                             softcap=True, alibi=True, window=True, varlen=True)]


@pytest.mark.parametrize("spec", COMPLETE_SPECS, ids=lambda s: s.name)
def test_cubin_is_a_complete_cuda_elf(spec: KernelSpec, tmp_path: Path) -> None:
    cubin = compile_spec(spec).cubin
    sections, functions = read_elf(cubin)
    kernels = [k.name for k in render(spec).kernels]
    assert len(kernels) == (4 if spec.deterministic and spec.direction == "bwd" else
                            3 if spec.direction == "bwd" else 1)
    for name in kernels:
        assert sections[f".text.{name}"][1] != SHT_NOBITS and sections[f".text.{name}"][3] > 0, name
        (found,) = [f for f in functions if f[0] == name]
        assert found[1] > 0 and found[2] == f".text.{name}", found
    # fagen's own reader agrees
    h = elf.header(cubin)
    assert h.machine == elf.EM_CUDA and elf.cubin_arch(cubin) == spec.arch
    assert {n: (t, o, sz) for n, (_i, t, o, sz) in sections.items()} == elf.sections(cubin)
    if sass.nvdisasm_path() is not None:  # the disassembler takes it, every kernel's code section included
        res = _nvdisasm(cubin, tmp_path)
        assert res.returncode == 0, res.stderr
        for name in kernels:
            assert f".text.{name}" in res.stdout and "EXIT" in res.stdout, name


def _damaged(cubin: bytes) -> dict[str, bytes]:
    """The cubin cut or corrupted in the ways a short read or a bad write leaves it."""
    *_, phoff, shoff, _flags, _eh, _phe, _phn, shentsize, shnum, _strndx = _EHDR.unpack_from(cubin)
    assert shoff < phoff  # this toolchain's layout: sections, section table, program table last
    sections, _ = read_elf(cubin)
    text = max((v for k, v in sections.items() if k.startswith(".text.")), key=lambda v: v[3])
    past = bytearray(cubin)
    struct.pack_into("<Q", past, 40, len(cubin) - shnum * shentsize + 8)  # e_shoff: table 8 bytes past the end
    beyond = bytearray(cubin)
    struct.pack_into("<Q", beyond, shoff + text[0] * shentsize + 24, len(cubin) - text[3] + 1)  # its sh_offset
    return {
        "after-header": cubin[:64],
        "half": cubin[:len(cubin) // 2],
        "mid-section-table": cubin[:shoff + shnum * shentsize // 2 + 5],
        "end-of-section-table": cubin[:shoff + shnum * shentsize],
        "one-byte-short": cubin[:-1],
        "section-table-past-end": bytes(past),
        "text-section-past-end": bytes(beyond),
    }


DAMAGE = ["after-header", "half", "mid-section-table", "end-of-section-table", "one-byte-short",
          "section-table-past-end", "text-section-past-end"]
#: A small spec (a single forward kernel): the cache checks below rebuild it once per damage.
SMALL = KernelSpec(direction="fwd", head_dim=16, dtype="float32", arch="sm_86", impl="simt")


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_cubin_is_rejected(damage: str, tmp_path: Path) -> None:
    good = compile_spec(SMALL).cubin
    bad = _damaged(good)[damage]
    assert set(_damaged(good)) == set(DAMAGE) and len(bad) <= len(good) and bad != good
    with pytest.raises(Malformed):
        read_elf(bad)
    with pytest.raises(elf.ElfError):
        elf.check_cubin(bad, SMALL.arch)
    if sass.nvdisasm_path() is not None:
        assert _nvdisasm(bad, tmp_path).returncode != 0


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_cache_entry_is_rebuilt(damage: str, fresh_cache: Path) -> None:
    """An entry holding a damaged cubin, its recorded size agreeing, is never served: rebuilt and replaced."""
    good = compile_spec(SMALL)
    (entry,) = (fresh_cache / "cubin").glob("*.bin")
    meta, _payload = cache.read_entry(entry)
    bad = _damaged(good.cubin)[damage]
    cache.atomic_write(entry, cache.encode({**meta, "cubin_size": len(bad)}, bad))
    clear_memo()
    again = compile_spec(SMALL)  # the index names the entry: rejected there, then on the full path
    assert again.cached is False and again.cubin == good.cubin and read_elf(again.cubin)
    assert cache.read_entry(entry)[1] == good.cubin


def test_cubin_cut_in_half_by_nvrtc_is_a_typed_error_and_never_stored(fresh_cache: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real = nvrtc.cubin_of
    monkeypatch.setattr(nvrtc, "cubin_of", lambda lib, prog: real(lib, prog)[:len(real(lib, prog)) // 2])
    with pytest.raises(nvrtc.NvrtcError, match="unusable cubin .* past the end"):
        compile_spec(SMALL)
    assert not list((fresh_cache / "cubin").glob("*.bin"))


def test_truncated_cubin_file_for_the_gpu_loader_is_rewritten() -> None:
    """The file cupy.RawModule loads is the whole cubin, even where a cut copy was left on disk."""
    from fagen.runtime import gpu

    cubin = compile_spec(SMALL).cubin
    path = gpu._cubin_path(cubin)
    path.write_bytes(cubin[:len(cubin) // 2])
    assert gpu._cubin_path(cubin) == path and path.read_bytes() == cubin


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


@needs_nvdisasm
def test_the_disassembly_is_remembered_in_process_and_on_disk(fresh_cache, monkeypatch: pytest.MonkeyPatch) -> None:
    """One nvdisasm run per cubin: a second call is served from memory, a new process (the memo
    cleared) from the cache dir; a torn cache file is disassembled again; another cubin runs it."""
    import subprocess

    cubin = compile_spec(SPEC).cubin
    runs = []
    real = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: runs.append(cmd) or real(cmd, **kw))
    sass.clear_memo()
    first = sass.disassemble(cubin)
    assert len(runs) == 1 and first and ".text." in first
    assert sass.disassemble(cubin) == first and len(runs) == 1
    sass.clear_memo()
    assert sass.disassemble(cubin) == first and len(runs) == 1  # from the disk
    (cached,) = (fresh_cache / "sass").glob("*.txt.gz")
    cached.write_bytes(cached.read_bytes()[:20])  # torn
    sass.clear_memo()
    assert sass.disassemble(cubin) == first and len(runs) == 2
    other = compile_spec(SPEC.replace(head_dim=32)).cubin
    assert sass.disassemble(other) != first and len(runs) == 3
    sass.clear_memo()


def test_no_disassembler_gives_none(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(sass, "nvdisasm_path", lambda: None)
    sass._analysis.cache_clear()
    sass._disassembly.cache_clear()
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
