"""Just enough ELF64 to check a cubin and to read a shared library's build id.

A cubin is an ELF64 little-endian file with ``e_machine == EM_CUDA`` (190); its
target SM is in ``e_flags``. :func:`check_cubin` rejects anything truncated
(section or program header table past the end of the file, a section's bytes
past the end) so a short cubin is never cached or loaded.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

EM_CUDA = 190
_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")  # ELF64 header after e_ident
_SHDR = struct.Struct("<IIQQQQIIQQ")
_PHDR = struct.Struct("<IIQQQQQQ")
SHT_NOBITS = 8
PT_NOTE = 4


class ElfError(ValueError):
    """Not a well-formed (complete) ELF64 little-endian file."""


@dataclass(frozen=True)
class ElfHeader:
    machine: int
    flags: int
    phoff: int
    phentsize: int
    phnum: int
    shoff: int
    shentsize: int
    shnum: int
    shstrndx: int


def header(data: bytes) -> ElfHeader:
    """Parse and bounds-check the ELF64 header and both header tables."""
    if len(data) < _EHDR.size:
        raise ElfError(f"{len(data)} bytes: shorter than an ELF64 header")
    ident, _type, machine, _ver, _entry, phoff, shoff, flags, ehsize, phentsize, phnum, shentsize, shnum, shstrndx = \
        _EHDR.unpack_from(data)
    if ident[:4] != b"\x7fELF":
        raise ElfError("bad magic (not ELF)")
    if ident[4] != 2 or ident[5] != 1:
        raise ElfError(f"not ELF64 little-endian (class {ident[4]}, data {ident[5]})")
    if ehsize != _EHDR.size:
        raise ElfError(f"e_ehsize {ehsize} != {_EHDR.size}")
    if phnum and (phentsize != _PHDR.size or phoff + phnum * phentsize > len(data)):
        raise ElfError(f"program header table [{phoff}, +{phnum}x{phentsize}) past the end ({len(data)} bytes)")
    if shnum and (shentsize != _SHDR.size or shoff + shnum * shentsize > len(data)):
        raise ElfError(f"section header table [{shoff}, +{shnum}x{shentsize}) past the end ({len(data)} bytes)")
    return ElfHeader(machine, flags, phoff, phentsize, phnum, shoff, shentsize, shnum, shstrndx)


def sections(data: bytes) -> dict[str, tuple[int, int, int]]:
    """name -> (type, offset, size) for every section; raises :class:`ElfError` on truncation."""
    h = header(data)
    raw = [_SHDR.unpack_from(data, h.shoff + i * h.shentsize) for i in range(h.shnum)]
    for name, typ, _f, _a, off, size, *_ in raw:
        if typ != SHT_NOBITS and off + size > len(data):
            raise ElfError(f"section at [{off}, +{size}) past the end ({len(data)} bytes)")
    if not raw:
        return {}
    _, _, _, _, str_off, str_size, *_ = raw[h.shstrndx]
    strtab = data[str_off:str_off + str_size]
    out = {}
    for name, typ, _f, _a, off, size, *_ in raw:
        end = strtab.find(b"\0", name)
        out[strtab[name:end].decode(errors="replace")] = (typ, off, size)
    return out


def cubin_arch(data: bytes) -> str:
    """``sm_XY`` of a cubin (from ``e_flags``), after checking it is complete."""
    h = header(data)
    if h.machine != EM_CUDA:
        raise ElfError(f"e_machine {h.machine} is not EM_CUDA ({EM_CUDA})")
    sections(data)
    # ELF ABI version >= 7 (CUDA 12.x+) keeps the SM in bits 8..15; older cubins in bits 0..7.
    sm = (h.flags >> 8) & 0xFF if (h.flags & 0xFF) == 0 or (h.flags >> 8) & 0xFF >= 50 else h.flags & 0xFF
    return f"sm_{sm}"


def check_cubin(data: bytes, arch: str | None = None) -> None:
    """Raise :class:`ElfError` unless ``data`` is a complete cubin (for ``arch`` when given). An
    arch-specific target (``sm_90a``) is checked as its SM (``sm_90``): ``e_flags`` carry the SM
    number only, the same for ``sm_90`` and ``sm_90a`` cubins."""
    got = cubin_arch(data)
    if arch is not None and arch.endswith("a") and arch[:-1] == got:
        return
    if arch is not None and got != arch:
        raise ElfError(f"cubin is for {got}, expected {arch}")


def build_id(path: Path) -> str | None:
    """The GNU build id (hex) of a shared library, read from its PT_NOTE segments; None if absent."""
    try:
        with open(path, "rb") as f:
            head = f.read(_EHDR.size)
            ident, *_rest = _EHDR.unpack_from(head)
            if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
                return None
            phoff, phentsize, phnum = _rest[4], _rest[8], _rest[9]
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            for i in range(phnum):
                p_type, _fl, off, _va, _pa, filesz, *_ = _PHDR.unpack_from(table, i * phentsize)
                if p_type != PT_NOTE:
                    continue
                f.seek(off)
                notes = f.read(filesz)
                pos = 0
                while pos + 12 <= len(notes):
                    namesz, descsz, ntype = struct.unpack_from("<III", notes, pos)
                    name_end = pos + 12 + ((namesz + 3) & ~3)
                    desc = notes[name_end:name_end + descsz]
                    if ntype == 3 and notes[pos + 12:pos + 12 + namesz].rstrip(b"\0") == b"GNU":
                        return desc.hex()
                    pos = name_end + ((descsz + 3) & ~3)
    except (OSError, struct.error):
        return None
    return None
