"""Turning a racecheck report of the runtime (racecheck.h) into an :class:`EmulatorRaceError`.

The C side writes the message with two kinds of placeholders: ``@pc:HEX@`` for an access made
by instrumented kernel code (a return address, as an offset into the module; ``addr2line``
turns it into ``FILE:LINE`` of the kernel source) and ``@smem:OFFSET:BYTES@`` for the bytes of
dynamic shared memory concerned (named after the buffer of the layout holding them, when the
launch passed one).
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from .errors import EmulatorRaceError

_PC = re.compile(r"@pc:([0-9a-f]+)@")
_SMEM = re.compile(r"@smem:(\d+):(\d+)@")
_KINDS = {1: "read-after-write", 2: "write-after-read", 3: "write-after-write"}

#: (name, offset, nbytes) of each buffer of a launch's dynamic shared memory.
SmemBuffers = Sequence[tuple[str, int, int]]


def symbolize(so: Path, offsets: Sequence[int], source_name: str) -> dict[int, str]:
    """``FILE:LINE`` of each code offset (a return address into ``so``), preferring the innermost
    inlined frame in ``source_name`` (the kernel source). Unknown: ``pc 0x...``."""
    out = {off: f"pc {off:#x}" for off in offsets}
    tool = shutil.which(os.environ.get("FAGEN_ADDR2LINE", "addr2line"))
    if tool is None or not offsets:
        return out
    # A return address points past the call: look up the byte before it.
    proc = subprocess.run([tool, "-e", str(so), "-a", "-i", "-p", *(f"{off - 1:#x}" for off in offsets)],
                          capture_output=True, text=True, check=False)
    frames: dict[int, list[str]] = {}
    current = None
    for line in proc.stdout.splitlines():
        m = re.match(r"^0x([0-9a-f]+): (.*)$", line)
        if m:
            current = int(m.group(1), 16) + 1
            frames[current] = [m.group(2)]
        elif current is not None and line.strip().startswith("(inlined by)"):
            frames[current].append(line.strip()[len("(inlined by)"):].strip())
    for off, fs in frames.items():
        places = []
        for f in fs:
            f = re.sub(r" \(discriminator \d+\)$", "", f)
            f = f.split(" at ", 1)[-1]  # with -f: "function at file:line"
            places.append(f.rsplit("/", 1)[-1])
        mine = [p for p in places if p.startswith(f"{source_name}:")]
        pick = mine[0] if mine else next((p for p in places if not p.startswith("??")), None)
        if pick:
            out[off] = pick
    return out


def buffer_of(offset: int, buffers: SmemBuffers | None) -> tuple[str | None, str]:
    """(buffer name, description) of a shared-memory byte offset."""
    for name, start, nbytes in buffers or ():
        if start <= offset < start + nbytes:
            return name, f"shared memory buffer '{name}' (byte {offset - start} of {nbytes}; smem offset {offset})"
    if buffers:
        return None, f"shared memory offset {offset} (in no buffer of the layout)"
    return None, f"shared memory offset {offset}"


def race_error(lib: ctypes.CDLL, so: Path, message: str, kernel: str, block: tuple[int, int, int],
               buffers: SmemBuffers | None) -> EmulatorRaceError:
    fields = (ctypes.c_ulonglong * 11)()
    lib.fagen_emu_race_report(fields)
    kind, space, offset = _KINDS.get(int(fields[0]), "unknown"), ("shared", "global")[int(fields[1]) & 1], int(fields[2])
    places = symbolize(so, sorted({int(m, 16) for m in _PC.findall(message)}), so.with_suffix(".cu").name)
    message = _PC.sub(lambda m: places[int(m.group(1), 16)], message)
    name = None
    m = _SMEM.search(message)
    if m:
        name, text = buffer_of(int(m.group(1)), buffers)
        message = message[:m.start()] + text + message[m.end():]
    # the two accesses' lines: not those of a bracketed barrier history ("after ...; then ...")
    bare = re.sub(r"\[[^\]]*\]", "[]", message)
    lines = tuple(re.findall(r" at ((?:[^ \[\],;]+):\d+)(?: \[|,|;|$)", bare)[:2])
    while len(lines) < 2:
        lines = (*lines, "")
    return EmulatorRaceError(message, kernel, block, kind=kind, space=space, offset=offset, buffer=name,
                             lines=lines)  # type: ignore[arg-type]
