"""Bounds-checked launches: an AddressSanitizer build run in a child process.

An ASan-instrumented .so cannot be loaded into a plain Python (the ASan
runtime must be the first library in the process), so the launch runs in
``python _child.py`` started with ``LD_PRELOAD=libasan.so``. Buffers travel
as .npy files; the child copies each into its own exact-size ``malloc`` so an
overflow lands in a redzone. The child imports only numpy and ctypes.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import EmulatorError, EmulatorMemoryError
from .signature import KernelSig, scalar_value
from .status import Dim3, raise_for_status
from .toolchain import asan_runtime

_ASAN_EXITCODE = 66
_CHILD = Path(__file__).with_name("_child.py")


_REGION = re.compile(r"(\d+) bytes (to the right of|to the left of|inside of) (\d+)-byte region \[(0x[0-9a-f]+),")


def _asan_report(stderr: str) -> str:
    start = stderr.find("=================================================================")
    return stderr[start:] if start >= 0 else stderr


def _blame(report: str, folder: str, sig: KernelSig) -> str:
    """Names the kernel argument whose buffer the faulting address is next to."""
    m = _REGION.search(report)
    try:
        buffers = json.loads(Path(folder, "buffers.json").read_text())
    except (OSError, ValueError):
        return ""
    if m is None:
        return ""
    for b in buffers:
        if b["addr"] == int(m.group(4), 16):
            return (f"; the access is {m.group(1)} bytes {m.group(2)} argument "
                    f"'{sig.params[b['arg']][1]}' ({b['nbytes']} bytes)")
    return f"; the access is {m.group(1)} bytes {m.group(2)} a {m.group(3)}-byte region (not an argument buffer)"


def _tensor_map_arg(value: Any, arrays: dict[int, Any], what: str) -> dict[str, Any]:
    """A tensor-map argument (:class:`fagen.tma.TensorMapFields`) for the child: its emulator bytes,
    where in them the global address lies, and the pointer argument whose buffer holds that address
    (the child moves the address into its copy of the buffer, so the map's reads are bounds-checked
    like the kernel's own)."""
    import dataclasses

    if not dataclasses.is_dataclass(value) or not hasattr(value, "emulator_bytes"):
        raise EmulatorError(f"{what}: run_sanitized takes fagen.tma.TensorMapFields for a tensor map, "
                            f"got {type(value).__name__}")
    a, b = (dataclasses.replace(value, global_address=x).emulator_bytes() for x in (0, 2**64 - 1))
    at = next(k for k in range(len(a)) if a[k] != b[k])
    address = value.global_address
    for i, arr in arrays.items():
        lo = arr.ctypes.data
        if lo <= address < lo + arr.nbytes:
            return {"code": "M", "bytes": value.emulator_bytes().hex(), "address_at": at, "base_arg": i,
                    "offset": address - lo}
    raise EmulatorError(f"{what}: the tensor map's address {address:#x} lies in no pointer argument's buffer "
                        "(a sanitized launch copies each buffer; the map must point into one of them)")


def run_in_child(so: Path, sig: KernelSig, codes: Sequence[str], grid: Dim3, block: Dim3, smem_bytes: int,
                 args: Sequence[Any], *, timeout: float | None) -> dict[str, Any]:
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="fagen-asan-") as tmp:
        job_args: list[dict[str, Any]] = []
        arrays: dict[int, Any] = {}
        maps: list[tuple[int, Any, str]] = []
        for i, ((ctype, pname), code, value) in enumerate(zip(sig.params, codes, args)):
            what = f"kernel '{sig.name}' argument '{pname}' ({ctype})"
            if code == "M":
                job_args.append({})  # after the pointers: it points into one of their copies
                maps.append((i, value, what))
            elif code != "P":
                job_args.append({"code": code, "value": scalar_value(code, value, what)})
            elif value is None:
                job_args.append({"code": "P", "file": None})
            elif isinstance(value, np.ndarray):
                np.save(os.path.join(tmp, f"in{i}.npy"), np.ascontiguousarray(value), allow_pickle=False)
                job_args.append({"code": "P", "file": f"in{i}.npy", "out": f"out{i}.npy"})
                arrays[i] = value
            else:
                raise EmulatorError(f"{what}: run_sanitized takes numpy arrays (or None) for pointers, "
                                    f"got {type(value).__name__}")
        for i, value, what in maps:
            job_args[i] = _tensor_map_arg(value, arrays, what)
        job = {"so": str(so), "kernel": sig.name, "grid": grid, "block": block, "smem": smem_bytes,
               "args": job_args}
        Path(tmp, "job.json").write_text(json.dumps(job))
        env = dict(os.environ)
        env["LD_PRELOAD"] = " ".join(filter(None, [asan_runtime(), env.get("LD_PRELOAD")]))
        env["ASAN_OPTIONS"] = (f"detect_leaks=0:verify_asan_link_order=0:halt_on_error=1:"
                               f"exitcode={_ASAN_EXITCODE}:" + env.get("ASAN_OPTIONS", ""))
        try:
            proc = subprocess.run([sys.executable, str(_CHILD), tmp], env=env, capture_output=True, text=True,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise EmulatorError(f"sanitized launch of '{sig.name}' timed out after {timeout} s") from exc
        if "ERROR: AddressSanitizer" in proc.stderr or proc.returncode == _ASAN_EXITCODE:
            report = _asan_report(proc.stderr)
            raise EmulatorMemoryError(
                f"AddressSanitizer: invalid memory access in kernel '{sig.name}' (grid {grid}, block {block})"
                f"{_blame(report, tmp, sig)}", report)
        result_path = Path(tmp, "result.json")
        if proc.returncode != 0 or not result_path.exists():
            raise EmulatorError(f"sanitized launch of '{sig.name}' failed (exit {proc.returncode}):\n"
                                f"{proc.stderr}{proc.stdout}")
        result = json.loads(result_path.read_text())
        block_idx = tuple(result["block"]) if result["status"] else None
        raise_for_status(result["status"], result["message"], sig.name, block_idx)  # type: ignore[arg-type]
        outputs: dict[str, Any] = {}
        for i, value in arrays.items():
            out = np.load(os.path.join(tmp, f"out{i}.npy"), allow_pickle=False)
            if value.flags.writeable:
                value[...] = out.reshape(value.shape)
            outputs[sig.params[i][1]] = out
        return outputs
