"""The CuPy launch path, checked on a CPU: exact argument bytes, limits, smem opt-in, stream.

A recording stand-in for CuPy packs arguments the way CuPy does (numpy scalars by
their own itemsize, a bare ``int`` as 8 bytes, a ``float`` as float64) and takes
grid/block only as tuples, like its Cython signature.

The expected bytes come from the kernels' C signatures, parsed here from the rendered
CUDA source, and from a C type table written here (not from fagen.abi or the launcher's
own table): a launcher that packed ``float`` as an integer, or passed two parameters
in each other's places, fails.
"""
from __future__ import annotations

import re
import struct
import sys
import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fagen.errors import InputError, SpecError
from fagen.renderer import render
from fagen.runtime import gpu
from fagen.spec import KernelSpec
from fake_cupy import FakeCupy, cupy_bytes

#: C scalar type -> (struct format of its bytes in the kernel's parameter buffer, numpy type CuPy packs).
_C_TYPES = {"int": ("<i", np.int32), "unsigned int": ("<I", np.uint32), "long long": ("<q", np.int64),
            "unsigned long long": ("<Q", np.uint64), "float": ("<f", np.float32)}
#: Element types a kernel pointer may point to (pointers are 64-bit device addresses).
_POINTEES = {"__half", "__nv_bfloat16", "float", "int", "unsigned char"}
_POINTER = ("<Q", np.uint64)
_FORMAT = {t: f for t, (f, _) in _C_TYPES.items()}
_NUMPY = {t: n for t, (_, n) in _C_TYPES.items()}
_CUPY_SCALARS = {np.dtype(c).type for c in "?bhilqBHILQefdFD"}

_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^()]*\)\s+)?'
                    r'([A-Za-z_]\w*)\s*\(([^()]*)\)')
_PARAM = re.compile(r"^(const\s+)?([A-Za-z_][\w ]*?)\s*(\*?)\s*([A-Za-z_]\w*)$")


def signatures(source: str) -> dict[str, list[tuple[str, str]]]:
    """kernel name -> [(C type, parameter name)] of every ``extern "C" __global__`` entry point."""
    out = {}
    for name, params in _ENTRY.findall(source):
        parsed = []
        for p in params.split(","):
            m = _PARAM.match(" ".join(p.split()))
            assert m, (name, p)
            const, base, star, pname = m.groups()
            parsed.append((f"{const or ''}{base}{star}", pname))
        assert name not in out, name
        out[name] = parsed
    return out


def _layout(ctype: str) -> tuple[str, type]:
    """(struct format, numpy type) of a C parameter type, from the tables above."""
    if ctype.endswith("*"):
        assert ctype.removeprefix("const ").removesuffix("*") in _POINTEES, ctype
        return _POINTER
    return _C_TYPES[ctype]


def _fmt(ctype: str) -> str:
    return _layout(ctype)[0]


def _sample(ctype: str, name: str) -> int | float:
    if ctype.endswith("*"):
        return 0xFFFF_FFFF_FFFF_FF00 if "dq" in name else 0x7F00_0000_1000
    return {"int": -(2**31), "unsigned int": 2**32 - 1, "long long": -(2**62) - 3,
            "unsigned long long": 2**64 - 1, "float": 0.125}[ctype]


def _distinct(sig: list[tuple[str, str]]) -> dict[str, int | float]:
    """A different value for every parameter, each using its type's full width (a swap of any two
    parameters, or a value cut to 32 bits, changes the bytes); ``scale`` is 0.125."""
    out: dict[str, int | float] = {}
    for i, (ctype, name) in enumerate(sig):
        if ctype.endswith("*"):
            out[name] = (0xFFFF_FF00_0000_0000 if i % 2 else 0x7F00_0000_0000) + 0x100 * (i + 1)
        elif ctype == "float":
            out[name] = 0.125 if name == "scale" else 1.5 + i / 4  # exact in float32
        else:
            out[name] = {"int": -(2**30) - i, "unsigned int": 2**31 + i, "long long": -(2**40) - i,
                         "unsigned long long": 2**63 + i}[ctype]
    return out


SPECS = [KernelSpec(direction=d, head_dim=64, dtype=dt, causal=True, key_padding=True, dropout=True, arch="sm_90")
         for d in ("bwd", "fwd") for dt in ("float16", "bfloat16", "float32")]

#: Every role of every family (simt, mma; fwd, bwd, the deterministic bwd's dq), with feature flags.
_ALL_FLAGS = dict(causal=True, key_padding=True, dropout=True, window=True, softcap=True, alibi=True,
                  attn_mask=True, varlen=True)
LAUNCH_SPECS = {
    "simt-fwd-fp32": dict(direction="fwd", head_dim=16, dtype="float32", arch="sm_86", impl="simt"),
    "simt-fwd-fp16-flags": dict(direction="fwd", head_dim=64, dtype="float16", impl="simt", **_ALL_FLAGS),
    "simt-bwd-bf16-bias": dict(direction="bwd", head_dim=32, dtype="bfloat16", impl="simt", dropout=True,
                               softcap=True, bias=True, bias_grad=True, varlen=True),
    "simt-bwd-det-fp32": dict(direction="bwd", head_dim=32, dtype="float32", impl="simt", deterministic=True,
                              causal=True, key_padding=True, attn_mask=True),
    "mma-fwd-bf16-flags": dict(direction="fwd", head_dim=64, dtype="bfloat16", impl="mma", **_ALL_FLAGS),
    "mma-fwd-fp16-bias": dict(direction="fwd", head_dim=64, dtype="float16", arch="sm_80", impl="mma", bias=True),
    "mma-bwd-fp16-flags": dict(direction="bwd", head_dim=64, dtype="float16", impl="mma", causal=True, dropout=True,
                               window=True, bias=True, bias_grad=True, varlen=True),
    "mma-bwd-det-fp16": dict(direction="bwd", head_dim=64, dtype="float16", impl="mma", deterministic=True,
                             causal=True, key_padding=True),
}
#: The kernels a spec launches, by the suffix of their entry points.
_ROLES = {("fwd", False): {"main"}, ("bwd", False): {"pre", "main", "post"},
          ("bwd", True): {"pre", "main", "dq", "post"}}


def _launch_spec(case: str) -> KernelSpec:
    try:
        return KernelSpec(**LAUNCH_SPECS[case])
    except (SpecError, ValueError) as exc:
        if "do not implement deterministic" in str(exc):  # the mma family's deterministic backward is recent
            pytest.skip(f"{case}: {exc}")
        raise


def _signatures_of(spec: KernelSpec) -> dict[str, list[tuple[str, str]]]:
    sigs = signatures(render(spec).source)
    want = {f"{spec.name}_{r}" for r in _ROLES[(spec.direction, spec.deterministic)]}
    assert set(sigs) == want == {k.name for k in render(spec).kernels}
    return sigs


@pytest.mark.parametrize("spec", SPECS + [pytest.param(c, id=c) for c in LAUNCH_SPECS], ids=lambda s: s.name)
def test_every_parameter_has_its_c_width_and_bytes(spec: KernelSpec | str) -> None:
    spec = _launch_spec(spec) if isinstance(spec, str) else spec
    for kernel, sig in _signatures_of(spec).items():
        assert [p for p in render(spec).kernel(kernel.rsplit("_", 1)[1]).params] == sig  # the launcher's list
        for ctype, name in sig:
            fmt, want = _layout(ctype)
            for value in (_sample(ctype, name), _distinct(sig)[name]):
                arg = gpu.to_cuda_arg(ctype, value, name)
                assert type(arg) is want, (kernel, name, ctype)
                assert cupy_bytes(arg) == struct.pack(fmt, value), (kernel, name)
    assert cupy_bytes(gpu.to_cuda_arg("float", 0.125, "scale")) == bytes.fromhex("0000003e")  # 0x3E000000


@pytest.mark.parametrize("ctype,value,match", [
    ("int", 2**31, r"heads: expected an integer in \[-2147483648, 2147483647\]"),
    ("int", 3.0, "heads: expected an integer"),
    ("int", True, "heads: expected an integer"),
    ("unsigned int", -1, "heads: expected an integer in"),
    ("long long", 2**63, "heads: expected an integer in"),
    ("unsigned long long", 2**64, "heads: expected an integer in"),
    ("unsigned long long", -1, "heads: expected an integer in"),
    ("float", 1e39, "heads: expected a value finite in float32"),
    ("float", "0.5", "heads: expected a real number"),
    ("const __half*", -8, "heads: expected a 64-bit device address"),
    ("const float*", 2**64, "heads: expected a 64-bit device address"),
    ("const float*", 1.5, "heads: expected a device pointer"),
    ("double", 1.0, "heads: expected a parameter type"),
])
def test_values_that_do_not_fit_are_typed_errors(ctype: str, value: object, match: str) -> None:
    with pytest.raises(gpu.LaunchError, match=match) as ei:
        gpu.to_cuda_arg(ctype, value, "heads")
    assert isinstance(ei.value, InputError) and ei.value.argument == "heads"


def test_limits_of_each_c_type_pass_exactly() -> None:
    for ctype, (lo, hi) in gpu._INT_RANGE.items():
        for v in (lo, hi):
            assert cupy_bytes(gpu.to_cuda_arg(ctype, v)) == struct.pack(_FORMAT[ctype], v)
    assert cupy_bytes(gpu.to_cuda_arg("float*", 2**64 - 1)) == b"\xff" * 8
    assert np.isinf(gpu.to_cuda_arg("float", float("inf"))) and np.isnan(gpu.to_cuda_arg("float", float("nan")))
    assert gpu.to_cuda_arg("unsigned long long", np.int64(5)) == 5


KERN = render(KernelSpec(direction="fwd", head_dim=64, dtype="float16", arch="sm_90")).kernel("main")


@pytest.mark.parametrize("grid,match", [
    ((2**31, 1, 1), r"grid\.x: expected 1\.\.2147483647"),
    ((0, 1, 1), r"grid\.x"),
    ((1, 65536, 1), r"grid\.y: expected 1\.\.65535"),
    ((1, 1, 65536), r"grid\.z"),
    ((1, 1), "3 dimensions"),
    ((1.5, 1, 1), "grid: expected integers"),
])
def test_grid_limits(grid: tuple, match: str) -> None:
    with pytest.raises(gpu.LaunchError, match=match):
        gpu.check_launch(KERN, grid)


def test_grid_at_the_limits_is_plain_int_tuples() -> None:
    g, b = gpu.check_launch(KERN, (np.int64(2**31 - 1), 65535, 65535))
    assert g == (2**31 - 1, 65535, 65535) and all(type(x) is int for x in g + b) and b == KERN.block
    with pytest.raises(gpu.LaunchError, match="block"):
        gpu.check_launch(replace(KERN, block=(2048, 1, 1)), (1, 1, 1))


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch):
    def install(**kw) -> FakeCupy:
        fake = FakeCupy(**kw)
        monkeypatch.setitem(sys.modules, "cupy", fake)
        torch_stream = types.SimpleNamespace(cuda_stream=0xABC, __cuda_stream__=lambda: (0, 0xABC))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: torch_stream)
        return fake
    return install


def _args(kern) -> dict:
    return {n: _sample(t, n) for t, n in kern.params}


def _check_recorded_launches(fake: FakeCupy, mod: gpu.GpuModule, grid: tuple[int, int, int]) -> None:
    """Every kernel was launched once on (grid, its block, its smem) with, parameter by parameter in the
    order of its C signature, exactly the bytes struct.pack gives for the value passed by name."""
    log = fake.log
    loads = [e for e in log if e[0] == "load"]
    assert len(loads) == 1 and Path(loads[0][1]).read_bytes() == mod.compiled.cubin
    assert ("getattr", 97, 0) in log
    first_launch = next(i for i, e in enumerate(log) if e[0] == "launch")
    static = {r.kernel: r.static_smem_bytes for r in mod.compiled.resources}
    sigs = _signatures_of(mod.spec)
    for kern in mod.compiled.rendered.kernels:
        optin = ("attr", kern.name, "max_dynamic_shared_size_bytes", kern.smem_bytes)
        if static[kern.name] + kern.smem_bytes > 48 * 1024:
            assert log.index(optin) < first_launch  # set before any launch
        else:
            assert optin not in log
        (launch,) = [e for e in log if e[0] == "launch" and e[1] == kern.name]
        assert launch[2:4] == (grid, kern.block) and launch[6] == kern.smem_bytes
        sig, args = sigs[kern.name], _distinct(sigs[kern.name])
        assert len(launch[4]) == len(sig), kern.name
        for (ctype, name), got, kind in zip(sig, launch[4], launch[5]):
            fmt, want = _layout(ctype)
            assert (got, kind) == (struct.pack(fmt, args[name]), want), (kern.name, name, ctype)
        if "scale" in args:
            assert launch[4][[n for _, n in sig].index("scale")] == bytes.fromhex("0000003e")  # 0.125 as float32
    assert log.count(("stream", 0xABC)) == len(mod.compiled.rendered.kernels)


@pytest.mark.parametrize("case", list(LAUNCH_SPECS))
def test_launch_through_recording_cupy(fake_cupy, case: str) -> None:
    spec = _launch_spec(case)
    fake = fake_cupy()
    mod = gpu.GpuModule(spec)
    sigs = _signatures_of(spec)
    for kern in mod.compiled.rendered.kernels:
        mod.launch(kern, (3, 2, 1), _distinct(sigs[kern.name]))
    _check_recorded_launches(fake, mod, (3, 2, 1))


def test_static_smem_counts_toward_the_opt_in(fake_cupy) -> None:
    spec = KernelSpec(direction="fwd", head_dim=16, dtype="float32", arch="sm_90", block_r=16, block_c=16)
    mod = gpu.GpuModule(spec)
    kern = mod.compiled.rendered.kernel("main")
    assert 0 < kern.smem_bytes < 48 * 1024
    fake = fake_cupy()
    mod.compiled = replace(mod.compiled, resources=tuple(
        replace(r, static_smem_bytes=48 * 1024 - kern.smem_bytes + 1) for r in mod.compiled.resources))
    mod.launch(kern, (1, 1, 1), _args(kern))
    assert ("attr", kern.name, "max_dynamic_shared_size_bytes", kern.smem_bytes) in fake.log


def test_smem_beyond_the_device_opt_in_is_refused(fake_cupy) -> None:
    spec = KernelSpec(direction="fwd", head_dim=64, dtype="float16", arch="sm_90")
    mod = gpu.GpuModule(spec)
    kern = mod.compiled.rendered.kernel("main")
    limit = kern.smem_bytes - 1  # a device with one byte less than the kernel needs
    fake = fake_cupy(optin=limit)
    with pytest.raises(gpu.LaunchError, match=f"shared memory: expected at most {limit} bytes"):
        mod.launch(kern, (1, 1, 1), _args(kern))
    assert not [e for e in fake.log if e[0] == "launch"]


def test_bad_launch_is_refused_before_cupy(fake_cupy) -> None:
    fake = fake_cupy()
    mod = gpu.GpuModule(SPECS[4])
    kern = mod.compiled.rendered.kernel("main")
    with pytest.raises(gpu.LaunchError, match="grid.y"):
        mod.launch(kern, (1, 70000, 1), _args(kern))
    with pytest.raises(gpu.LaunchError, match="seqlen_q"):
        mod.launch(kern, (1, 1, 1), {**_args(kern), "seqlen_q": 2**31})
    with pytest.raises(gpu.LaunchError, match="non-null device pointer"):
        mod.launch(kern, (1, 1, 1), {**_args(kern), **{n: 0 for t, n in kern.params if t.endswith("*")}})
    assert not [e for e in fake.log if e[0] in ("launch", "load")]


def test_remembered_conversions_keep_every_check() -> None:
    args = _args(KERN)
    first = gpu.cuda_args(KERN, args)
    again = gpu.cuda_args(KERN, dict(args))
    assert [cupy_bytes(a) for a in again] == [cupy_bytes(a) for a in first]
    assert [type(a) for a in again] == [np.uint64 if t.endswith("*") else _NUMPY[t] for t, _ in KERN.params]
    for bad in (float(args["heads"]), True, np.float64(args["heads"])):  # equal to a remembered int, wrong type
        with pytest.raises(gpu.LaunchError, match="heads: expected an integer"):
            gpu.cuda_args(KERN, {**args, "heads": bad})
    assert gpu.cuda_args(KERN, {**args, "scale": 1})[[n for _, n in KERN.params].index("scale")] == np.float32(1.0)
    missing = {k: v for k, v in args.items() if k not in ("q", "scale")}
    with pytest.raises(KeyError, match=r"missing kernel arguments \['q', 'scale'\]"):
        gpu.cuda_args(KERN, missing)


def test_read_only_cache_loads_the_cubin_from_a_temp_file(monkeypatch: pytest.MonkeyPatch) -> None:
    from fagen import cache
    from fagen.errors import CacheDirError

    spec = KernelSpec(direction="fwd", head_dim=24, dtype="float32", arch="sm_90")
    compiled = gpu.compile_spec(spec)

    def refuse(path, data):
        raise CacheDirError(path.parent, "Read-only file system", "FAGEN_CACHE_DIR")
    monkeypatch.setattr(cache, "atomic_write", refuse)
    monkeypatch.setattr(Path, "exists", lambda self: False)
    path = gpu._cubin_path(compiled.cubin)
    try:
        assert path.read_bytes() == compiled.cubin and cache.cache_root("cubin") not in path.parents
    finally:
        path.unlink()


@pytest.mark.parametrize("api", ["from_external", "ExternalStream(ptr, device)", "ExternalStream(ptr)"])
def test_torch_stream_handle_reaches_cupy(api: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch runs on torch's current stream of the tensors' device, whichever CuPy API is there."""
    calls = []

    class Ext:
        def __init__(self, *a) -> None:
            if api == "ExternalStream(ptr)" and len(a) == 2:
                raise TypeError("device_id not supported")
            calls.append(("ExternalStream", a))

    torch_stream = types.SimpleNamespace(cuda_stream=0xBEEF)
    if api == "from_external":
        torch_stream.__cuda_stream__ = lambda: (0, 0xBEEF)
        stream_cls = types.SimpleNamespace(from_external=lambda s: calls.append(("from_external", s)) or "ctx")
    else:
        stream_cls = types.SimpleNamespace()
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(Stream=stream_cls, ExternalStream=Ext)))
    gpu._cupy_stream(torch_stream, 3)
    want = {"from_external": [("from_external", torch_stream)],
            "ExternalStream(ptr, device)": [("ExternalStream", (0xBEEF, 3))],
            "ExternalStream(ptr)": [("ExternalStream", (0xBEEF,))]}[api]
    assert calls == want


# -- tensor maps through the CuPy that is installed (not the recording stand-in) ------------------

def _installed_cupy_launch(args: tuple) -> BaseException:
    """Hand ``args`` to the installed CuPy's own launcher (``cupy/cuda/function.pyx``:
    ``Function.__call__`` -> ``_launch``, which packs every argument with ``_pointer`` and only
    then makes the CUDA context and calls ``cuLaunchKernel``) for a null function on a stream
    handle of 0, and return what it raised. Packing fails with ``TypeError`` / ``AssertionError``;
    an argument list CuPy packed gets as far as the driver, which refuses the context (no GPU) or
    the null function (GPU): a ``cupy_backends`` CUDA error."""
    function = pytest.importorskip("cupy.cuda.function")
    fn = function.Function.__new__(function.Function)  # no module: nothing is loaded or launched
    try:
        fn((1, 1, 1), (1, 1, 1), args, 0, types.SimpleNamespace(ptr=0))
    except BaseException as exc:  # noqa: BLE001 - the point is which one
        return exc
    raise AssertionError("CuPy launched a null function")


def _packed_by_cupy(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("cupy_backends") and not isinstance(exc, (TypeError, AssertionError))


def _fake_encoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuTensorMapEncodeTiled without a driver: the map's bytes are a checksum-like pattern of its fields."""
    import ctypes

    def encode(addr, dtype, rank, address, dims, strides, box, es, interleave, swizzle, l2, oob):
        seed = (address ^ dims[0] * 131 ^ box[0] * 7 ^ dtype) & 0xFF
        ctypes.memmove(addr, bytes((seed + 37 * i) & 0xFF for i in range(128)), 128)
        return 0

    monkeypatch.setattr(gpu, "tensor_map_encoder", lambda: encode)


def test_tensor_map_argument_is_one_element_of_its_128_bytes() -> None:
    """The form every allowed CuPy (>= 13.6) packs by value: a size-one ``numpy.ndarray``
    (CuPy's ``CNumpyArray``, data pointer = the parameter's bytes), 64-byte aligned like
    ``CUtensorMap``; a ``numpy.void`` scalar is refused by CuPy 13.x and asserts in 14.0."""
    raw = bytes(range(7, 135))
    arg = gpu.tensor_map_arg(raw)
    assert type(arg) is np.ndarray and arg.size == 1 and arg.dtype.itemsize == 128
    assert arg.flags.c_contiguous and arg.__array_interface__["data"][0] % 64 == 0
    assert arg.tobytes() == raw
    with pytest.raises(gpu.LaunchError, match="128 bytes"):
        gpu.tensor_map_arg(raw[:64])


def test_installed_cupy_packs_every_argument_of_a_wgmma_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every parameter of the wgmma forward's and backward's kernels, tensor maps included, as
    ``cuda_args`` makes them, through the installed CuPy's real packing (``_pointer``)."""
    from fagen import abi, tma

    _fake_encoder(monkeypatch)
    x = np.zeros((2, 256, 4, 64), np.float16)
    acc = np.zeros((2, 4, 256, 64), np.float32)
    seen_maps = 0
    for direction in ("fwd", "bwd"):
        spec = KernelSpec(direction=direction, head_dim=64, dtype="float16", causal=True, arch="sm_90a")
        assert spec.impl == "wgmma"
        for kernel in render(spec).kernels:
            values = {}
            for ctype, name in kernel.params:
                if abi.is_tensormap(ctype):
                    fp32 = name == "tma_dqa"
                    values[name] = tma.tensor_map_for(acc[0, 0] if fp32 else x[0, :, 0], box=(64, 64),
                                                      swizzle=0 if fp32 else 128)
                    seen_maps += 1
                else:
                    values[name] = _sample(ctype, name)
            args = gpu.cuda_args(kernel, values)
            maps = [a for a in args if isinstance(a, np.ndarray)]
            assert all(m.size == 1 and m.dtype.itemsize == 128 for m in maps)
            exc = _installed_cupy_launch(args)
            assert _packed_by_cupy(exc), (kernel.name, repr(exc))
    assert seen_maps == 8  # q, k, v (fwd); q, k, v, do, dq_accum (bwd)


def test_installed_cupy_launcher_is_reached_by_the_probe() -> None:
    """The probe above tells packing failures from the driver's refusal: arguments CuPy cannot pack
    by value fail there with ``TypeError``, before any CUDA call."""
    assert not _packed_by_cupy(_installed_cupy_launch((np.zeros(2, np.int32),)))  # a size-2 array
    assert not _packed_by_cupy(_installed_cupy_launch((object(),)))
    assert _packed_by_cupy(_installed_cupy_launch((np.int32(3), np.zeros(1, gpu.TENSOR_MAP_DTYPE))))
