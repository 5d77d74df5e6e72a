"""SASS of a cubin through ``nvdisasm``: per-kernel instruction mix, with no GPU.

``nvdisasm`` comes from the ``nvidia-cuda-nvdisasm`` wheel (the ``test`` extra) or a
CUDA toolkit; it is found with cuda-pathfinder, then on ``PATH``. Every function
here returns ``None`` when no disassembler is installed, so callers can treat
SASS as optional evidence.

The mix maps an opcode -- the mnemonic before its first dot, ``HMMA`` for
``HMMA.16816.F32`` -- to how many times it appears in a kernel's code:

>>> from fagen import KernelSpec, compile, sass
>>> mix = sass.instruction_mix(compile(KernelSpec(head_dim=32)).cubin)
>>> mix is None or all(isinstance(n, int) for k in mix.values() for n in k.values())
True

Results -- the disassembly and the mixes -- are memoised per cubin (in process, and on disk
under the cache dir's ``sass/`` keyed by the cubin's sha256 and the disassembler's identity).
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .errors import CacheDirError, FagenError

__all__ = ["SassError", "Instruction", "nvdisasm_path", "disassemble", "parse", "instruction_mix",
           "loop_mix", "loop_spans", "mix_of", "kernel_sass"]


class SassError(FagenError, RuntimeError):
    """``nvdisasm`` is installed but rejected the cubin (message carries its stderr)."""


@dataclass(frozen=True)
class Instruction:
    address: int
    predicate: str  # "" or e.g. "@!P0"
    mnemonic: str  # full, e.g. "HMMA.16816.F32"
    operands: str

    @property
    def opcode(self) -> str:
        return self.mnemonic.split(".", 1)[0]


@functools.lru_cache(maxsize=1)
def nvdisasm_path() -> Path | None:
    """The ``nvdisasm`` executable, or None when none is installed."""
    try:
        import cuda.pathfinder as pathfinder

        found = pathfinder.find_nvidia_binary_utility("nvdisasm")
    except (ImportError, AttributeError, RuntimeError):  # older pathfinder or no CUDA layout
        found = None
    found = found or shutil.which("nvdisasm")
    return Path(found) if found else None


def _tool_id(tool: Path) -> str:
    st = tool.stat()
    return f"{tool}|{st.st_size}|{st.st_mtime_ns}"


def disassemble(cubin: bytes) -> str | None:
    """``nvdisasm -c`` output (code sections only), or None without a disassembler; remembered
    per cubin in process and on disk (gzip, under the cache dir's ``sass/``)."""
    tool = nvdisasm_path()
    if tool is None:
        return None
    return _disassembly(bytes(cubin), _tool_id(tool))


@functools.lru_cache(maxsize=32)
def _disassembly(cubin: bytes, tool_id: str) -> str:
    import gzip

    path = _sass_path("sass-text-1", cubin, tool_id, ".txt.gz")
    if path is not None:
        try:
            return gzip.decompress(path.read_bytes()).decode()
        except (OSError, ValueError, EOFError):  # absent, or a torn file: disassemble again
            pass
    tool = nvdisasm_path()
    assert tool is not None
    with tempfile.TemporaryDirectory(prefix="fagen-sass-") as d:
        src = Path(d) / "k.cubin"
        src.write_bytes(cubin)
        res = subprocess.run([str(tool), "-c", str(src)], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SassError(f"nvdisasm rejected the cubin ({len(cubin)} bytes): {res.stderr.strip() or res.returncode}")
    if path is not None:
        try:
            from .cache import atomic_write

            atomic_write(path, gzip.compress(res.stdout.encode(), compresslevel=3))
        except (OSError, CacheDirError):
            pass
    return res.stdout


def _sass_path(fmt: str, cubin: bytes, tool_id: str, suffix: str) -> Path | None:
    """Where the cache dir's ``sass/`` remembers ``fmt`` of ``cubin`` (None: nowhere to remember it)."""
    try:
        from .cache import cache_root, digest

        return cache_root("sass") / f"{digest(fmt, hashlib.sha256(cubin).digest(), tool_id)}{suffix}"
    except (OSError, CacheDirError):  # no place to remember it: disassemble every time
        return None


_SECTION = re.compile(r"^\s*\.section\s+\.text\.([A-Za-z_$][\w$]*)")
_INSTR = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+(@!?U?P[T\d]\s+)?([A-Z][A-Z0-9_]*(?:\.[\w.]+)?)\s*([^;]*);")
_TARGET = re.compile(r"`\(([.\w$]+)\)")
_LABEL = re.compile(r"^([.\w$]+):\s*$")


def parse(text: str) -> dict[str, list[Instruction]]:
    """kernel name -> its instructions, in address order, from ``nvdisasm`` output."""
    out: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    for line in text.splitlines():
        m = _SECTION.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        if current is None:
            continue
        m = _INSTR.match(line)
        if m:
            current.append(Instruction(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3),
                                       m.group(4).strip()))
    return out


def labels(text: str) -> dict[str, dict[str, int]]:
    """kernel -> label -> address of the instruction that follows it."""
    out: dict[str, dict[str, int]] = {}
    current: dict[str, int] | None = None
    pending: list[str] = []
    for line in text.splitlines():
        m = _SECTION.match(line)
        if m:
            current = out.setdefault(m.group(1), {})
            pending = []
            continue
        if current is None:
            continue
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR.match(line)
        if m:
            for name in pending:
                current[name] = int(m.group(1), 16)
            pending = []
    return out


def mix_of(instructions: list[Instruction]) -> dict[str, int]:
    """opcode -> count, most frequent first."""
    return dict(Counter(i.opcode for i in instructions).most_common())


def kernel_sass(cubin: bytes) -> dict[str, list[Instruction]] | None:
    """Parsed instructions of every kernel (None without a disassembler)."""
    text = disassemble(cubin)
    return None if text is None else parse(text)


def loop_spans(text: str) -> dict[str, list[tuple[int, int]]]:
    """kernel -> every (start, end) address span closed by a backward branch (``BRA``/``JMP``
    to a label at or before it), in address order of the branch: the kernel's loops."""
    addresses = labels(text)
    out: dict[str, list[tuple[int, int]]] = {}
    for name, instrs in parse(text).items():
        spans = out.setdefault(name, [])
        for ins in instrs:
            if ins.opcode not in ("BRA", "JMP"):
                continue
            t = _TARGET.search(ins.operands)
            start = addresses.get(name, {}).get(t.group(1)) if t else None
            if start is not None and start <= ins.address:
                spans.append((start, ins.address))
    return out


def _loops(text: str) -> dict[str, tuple[int, int] | None]:
    """kernel -> (start, end) addresses of its largest loop: the widest span closed by a
    backward branch (the main loop over tiles, with any loops nested in it)."""
    return {name: max(spans, key=lambda s: (s[1] - s[0], -s[0])) if spans else None
            for name, spans in loop_spans(text).items()}


_FORMAT = "sass-analysis-1"  # bump when what _analysis stores changes


@functools.lru_cache(maxsize=256)
def _analysis(cubin: bytes) -> dict | None:
    tool = nvdisasm_path()
    if tool is None:
        return None
    path = _sass_path(_FORMAT, cubin, _tool_id(tool), ".json")
    if path is not None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    text = disassemble(cubin)
    if text is None:  # pragma: no cover - the tool vanished in between
        return None
    kernels = parse(text)
    loops = _loops(text)
    result = {"mix": {k: mix_of(v) for k, v in kernels.items()}, "loop": {}}
    for k, span in loops.items():
        if span is not None:
            result["loop"][k] = mix_of([i for i in kernels[k] if span[0] <= i.address <= span[1]])
    if path is not None:
        try:
            from .cache import atomic_write

            atomic_write(path, json.dumps(result, sort_keys=True).encode())
        except (OSError, CacheDirError):
            pass
    return result


def instruction_mix(cubin: bytes) -> dict[str, dict[str, int]] | None:
    """kernel name -> {opcode: count} over the whole kernel; None without ``nvdisasm``.

    Raises :class:`SassError` when the disassembler rejects the cubin."""
    a = _analysis(bytes(cubin))
    return None if a is None else {k: dict(v) for k, v in a["mix"].items()}


def loop_mix(cubin: bytes) -> dict[str, dict[str, int]] | None:
    """kernel name -> {opcode: count} of its largest loop (the main loop over tiles, nested
    loops included; kernels without a loop are absent); None without ``nvdisasm``."""
    a = _analysis(bytes(cubin))
    return None if a is None else {k: dict(v) for k, v in a["loop"].items()}


def clear_memo() -> None:
    _analysis.cache_clear()
    _disassembly.cache_clear()
    nvdisasm_path.cache_clear()
