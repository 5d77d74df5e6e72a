"""CUDA 12 and 13, Ampere to Blackwell, decided without a GPU.

* the dependency sets in pyproject.toml: one CuPy per CUDA extra, none in the base, every
  third-party import of the package declared;
* the per-arch table (fagen/arch.py) against the Programming Guide's numbers written here;
* the driver / CuPy / torch / NVRTC decision and the PTX fallback, with faked versions;
* the NVRTC wheel-set discovery (``FAGEN_NVRTC``) on a fake folder layout;
* with the CUDA 12 NVRTC set installed beside the CUDA 13 one (CI installs it with
  ``pip install --target``, see .ci/run): the standard matrix compiles with 0 spills and no
  local memory (HMMA in the mma kernels), into ELF ABI 7 cubins keyed apart from NVRTC 13's;
* with NVRTC 13.0 installed the same way (the oldest the cuda13 extra allows): a sample of the
  Hopper family's specs compiles, its plain and causal rows without spills.
"""
from __future__ import annotations

import ast
import os
import re
import sys

import typing
import warnings
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

from fagen import arch as A
from fagen import compiler, nvrtc
from fagen.errors import SpecError
from fagen.runtime import gpu
from fagen.runtime.gpu import CudaSetupError, CudaVersions, decide_nvrtc, ptx_target_for
from fagen.spec import ARCH_SMEM_OPTIN, Arch, KernelSpec

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
#: Where .ci/run installs the CUDA 12 NVRTC set (FAGEN_TEST_NVRTC12 overrides).
NVRTC12 = Path(os.environ.get("FAGEN_TEST_NVRTC12") or REPO / ".venv" / "nvrtc-cu12")


def _names(reqs: list[str]) -> list[str]:
    return [re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in reqs]


# --------------------------------------------------------------------------- dependencies
def test_one_cupy_per_cuda_extra_and_none_in_the_base() -> None:
    project = PYPROJECT["project"]
    base, extras = _names(project["dependencies"]), project["optional-dependencies"]
    assert not [n for n in base if n.startswith("cupy")]
    assert [n for n in _names(extras["cuda13"]) if n.startswith("cupy")] == ["cupy-cuda13x"]
    assert [n for n in _names(extras["cuda12"]) if n.startswith("cupy")] == ["cupy-cuda12x"]
    assert {"nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12"} <= set(_names(extras["cuda12"]))
    # the base compiles without a GPU: NVRTC 13 and the headers it includes
    assert {"nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cuda-crt", "cuda-pathfinder"} <= set(base)
    for name, reqs in extras.items():  # no other extra brings a CuPy along
        if name not in ("cuda12", "cuda13"):
            assert not [n for n in _names(reqs) if n.startswith("cupy")], name


#: top-level module -> the distribution (base dependency or extra) that provides it
_PROVIDER = {"cuda": "cuda-pathfinder", "cupy": "cuda12|cuda13", "jinja2": "jinja2", "pydantic": "pydantic",
             "pydantic_core": "pydantic-core", "numpy": "numpy", "platformdirs": "platformdirs",
             "filelock": "filelock", "rich": "rich", "torch": "torch", "transformers": "transformers"}


def test_every_import_of_the_package_is_declared() -> None:
    stdlib = set(sys.stdlib_module_names)
    seen: set[str] = set()
    for path in (REPO / "fagen").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                seen |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                seen.add(node.module.split(".")[0])
    third = sorted(seen - stdlib - {"fagen", "__future__"})
    assert set(third) <= set(_PROVIDER), f"undeclared imports: {sorted(set(third) - set(_PROVIDER))}"
    project = PYPROJECT["project"]
    declared = set(_names(project["dependencies"]))
    for extra, reqs in project["optional-dependencies"].items():
        declared |= {extra} | set(_names(reqs))
    for mod in third:
        options = _PROVIDER[mod].split("|")
        assert any(o in declared for o in options), f"import {mod}: declare {_PROVIDER[mod]}"
    assert "cuda-pathfinder" in _names(project["dependencies"])  # imported by fagen/nvrtc.py


# --------------------------------------------------------------------------- the arch table
#: CUDA C++ Programming Guide, "Technical Specifications per Compute Capability":
#: capability -> (max smem per block opt-in KB, smem per SM KB, resident threads per SM, blocks per SM)
GUIDE = {(8, 0): (163, 164, 2048, 32), (8, 6): (99, 100, 1536, 16), (8, 7): (163, 164, 1536, 16),
         (8, 9): (99, 100, 1536, 24), (9, 0): (227, 228, 2048, 32), (10, 0): (227, 228, 2048, 32),
         (10, 3): (227, 228, 2048, 32), (11, 0): (227, 228, 1536, 24), (12, 0): (99, 100, 1536, 32),
         (12, 1): (99, 100, 1536, 32)}


def test_arch_table_matches_the_programming_guide() -> None:
    assert list(typing.get_args(Arch)) == list(A.ARCHS)  # the spec's arch field is the table
    for name, a in A.ARCHS.items():
        optin, per_sm, threads, blocks = GUIDE[a.capability]
        assert (a.smem_optin_per_block, a.smem_per_sm) == (optin * 1024, per_sm * 1024), name
        assert (a.max_threads_per_sm, a.max_blocks_per_sm, a.max_warps_per_sm) == (threads, blocks, threads // 32)
        assert a.regs_per_sm == 65536 and a.max_regs_per_thread == 255 and a.mma_sync, name
        assert ARCH_SMEM_OPTIN[name] == a.smem_optin_per_block
        assert a.nvrtc_min >= (11, 0)
    assert [n for n, a in A.ARCHS.items() if a.arch_specific] == ["sm_90a"]
    assert A.ARCHS["sm_90a"].cubin_arch == "sm_90" and A.ARCHS["sm_90a"].compute == "compute_90a"
    assert A.ARCHS["sm_110"].nvrtc_min == (13, 0) and A.ARCHS["sm_120"].nvrtc_min == (12, 8)


def test_capability_9_0_keeps_sm_90_for_the_current_families() -> None:
    assert A.arch_for_capability((9, 0)) == "sm_90"  # sm_90a only where a family asks for it
    assert A.arch_for_capability((9, 0), arch_specific=True) == "sm_90a"
    assert A.arch_for_capability((10, 0), arch_specific=True) == "sm_100"  # no "a" target in the table
    spec = KernelSpec(head_dim=64, arch="sm_90a")
    assert spec.name.endswith("_sm90a") and spec.sram_bytes == 232448


def test_the_installed_nvrtc_targets_every_arch() -> None:
    if nvrtc.version() < (13, 0):
        pytest.skip(f"NVRTC {nvrtc.version()} is older than the CUDA 13 default")
    assert nvrtc.supported_archs() == frozenset(A.ARCHS)


@pytest.mark.parametrize("arch", ["sm_87", "sm_90a", "sm_100", "sm_103", "sm_110", "sm_120", "sm_121"])
def test_new_archs_compile_to_their_own_cubin(arch: str) -> None:
    from fagen import elf

    mod = compiler.compile(KernelSpec(direction="fwd", head_dim=32, dtype="float16", arch=arch))
    assert elf.cubin_arch(mod.cubin) == A.arch_info(arch).cubin_arch
    assert all(r.spill_bytes == 0 for r in mod.resources) and mod.ptx_target is None


# --------------------------------------------------------------------------- the version decision
def _v(driver=(12, 4), nvrtc_=((13, 5), (12, 9)), cupy=(12, 9), torch=(12, 8)) -> CudaVersions:
    return CudaVersions(driver, tuple(nvrtc_), cupy, torch)


def test_decision_picks_the_newest_nvrtc_the_driver_loads() -> None:
    assert decide_nvrtc(_v(driver=(12, 2))) == 12  # r535: NVRTC 13's cubins would not load
    assert decide_nvrtc(_v(driver=(12, 9))) == 12
    assert decide_nvrtc(_v(driver=(13, 0), cupy=(13, 0), torch=(13, 0))) == 13
    assert decide_nvrtc(_v(driver=(13, 1), cupy=(12, 9))) == 13  # a CUDA 12 CuPy runs on a 13 driver
    assert decide_nvrtc(_v(driver=(13, 0), nvrtc_=((12, 9),), cupy=(12, 9))) == 12
    assert decide_nvrtc(_v(driver=(12, 4), torch=None)) == 12  # torch without CUDA: nothing to check


@pytest.mark.parametrize("versions,fix", [
    (_v(nvrtc_=((13, 5),)), "no NVRTC the CUDA 12.4 driver can load is installed (found: 13.5): "
                            "pip install 'fagen[cuda12]'"),
    (_v(cupy=(13, 0)), "CuPy is built for CUDA 13.0 but the driver supports CUDA 12.4: "
                       "pip uninstall -y cupy-cuda13x && pip install 'fagen[cuda12]'"),
    (_v(cupy=None), "CuPy is not installed (the CUDA 12.4 driver wants CuPy for CUDA 12): pip install 'fagen[cuda12]'"),
    (_v(torch=(13, 0)), "torch is built for CUDA 13.0 but the driver supports CUDA 12.4: install a torch build "
                        "for CUDA 12, then pip install 'fagen[cuda12]'"),
    (_v(driver=(13, 0), nvrtc_=(), cupy=(13, 0)), "found: none): pip install 'fagen[cuda13]'"),
])
def test_decision_stops_with_one_line_naming_the_fix(versions: CudaVersions, fix: str) -> None:
    with pytest.raises(CudaSetupError) as e:
        decide_nvrtc(versions)
    assert str(e.value).endswith(fix) and "\n" not in str(e.value)


def test_two_cupy_wheels_are_named_with_the_one_to_remove() -> None:
    both = ("cupy-cuda12x", "cupy-cuda13x")
    with pytest.raises(CudaSetupError, match=r"2 CuPy wheels are installed \(cupy-cuda12x, cupy-cuda13x\), which breaks "
                                             r"import cupy; keep the one for the CUDA 12.4 driver: "
                                             r"pip uninstall -y cupy-cuda13x$"):
        decide_nvrtc(CudaVersions((12, 4), ((12, 9),), None, None, both))
    with pytest.raises(CudaSetupError, match=r"pip uninstall -y cupy-cuda12x$"):
        decide_nvrtc(CudaVersions((13, 0), ((13, 5),), None, None, both))
    assert decide_nvrtc(CudaVersions((12, 4), ((12, 9),), (12, 9), None, ("cupy-cuda12x",))) == 12


def test_a_system_nvrtc_counts_when_no_wheel_set_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvrtc, "toolkits", lambda: ())
    monkeypatch.setattr(nvrtc, "version", lambda: (12, 6))
    got = gpu.installed_versions((12, 8))
    assert got.nvrtc == ((12, 6),) and decide_nvrtc(CudaVersions((12, 8), got.nvrtc, (12, 6), None)) == 12


def test_a_pinned_nvrtc_the_driver_cannot_load_is_refused() -> None:
    assert decide_nvrtc(_v(driver=(13, 0), cupy=(13, 0)), pinned=12) == 12
    with pytest.raises(CudaSetupError, match="FAGEN_NVRTC names NVRTC 13, whose cubins a CUDA 12.4 driver cannot load"):
        decide_nvrtc(_v(), pinned=13)


@pytest.fixture
def fresh_decision(monkeypatch: pytest.MonkeyPatch):
    """gpu.ensure_toolchain decides again; nvrtc's choice is restored afterwards."""
    gpu.reset_process_state()
    before, select = nvrtc.selected(), nvrtc.select  # (a test may stand in for select)
    yield
    select(before)
    gpu.reset_process_state()
    compiler.clear_memo()


def test_first_use_selects_the_decided_nvrtc(monkeypatch: pytest.MonkeyPatch, fresh_decision) -> None:
    picked: list[int | None] = []
    monkeypatch.setattr(gpu, "driver_version", lambda: (12, 2))
    monkeypatch.setattr(gpu, "installed_versions", lambda driver: _v(driver=driver))
    sets = (nvrtc.Toolkit(13, Path("/x/libnvrtc.so.13"), Path("/x/inc"), "13.5.37"),
            nvrtc.Toolkit(12, Path("/y/libnvrtc.so.12"), Path("/y/inc"), "12.9.86"))
    monkeypatch.setattr(nvrtc, "toolkits", lambda: sets)
    monkeypatch.setattr(nvrtc, "chosen_toolkit", lambda: sets[0])  # the default: the newest
    monkeypatch.setattr(nvrtc, "select", picked.append)
    assert gpu.ensure_toolchain() == 12 and gpu.ensure_toolchain() == 12
    assert picked == [12]  # once per process, and only because the default (13) does not fit


def test_first_use_without_a_driver_decides_nothing(monkeypatch: pytest.MonkeyPatch, fresh_decision) -> None:
    monkeypatch.setattr(gpu, "driver_version", lambda: None)
    monkeypatch.setattr(nvrtc, "select", lambda m: pytest.fail("selected without a driver"))
    assert gpu.ensure_toolchain() is None


def test_first_use_with_a_broken_setup_raises_the_fix(monkeypatch: pytest.MonkeyPatch, fresh_decision) -> None:
    monkeypatch.setattr(gpu, "driver_version", lambda: (12, 2))
    monkeypatch.setattr(gpu, "installed_versions", lambda driver: _v(driver=driver, cupy=(13, 0)))
    with pytest.raises(CudaSetupError, match="pip uninstall -y cupy-cuda13x"):
        gpu.ensure_toolchain()


# --------------------------------------------------------------------------- PTX fallback, < sm_80
NVRTC_12_6 = frozenset({"sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_90a"})  # before Blackwell targets


def test_ptx_for_a_device_newer_than_the_nvrtc() -> None:
    full = frozenset(A.ARCHS)
    assert ptx_target_for("sm_120", full) is None and ptx_target_for("sm_90", NVRTC_12_6) is None
    assert ptx_target_for("sm_120", NVRTC_12_6) == "compute_90"
    assert ptx_target_for("sm_100", NVRTC_12_6, (10, 0)) == "compute_90"
    assert ptx_target_for("sm_121", full, (13, 0)) == "compute_121"  # newer than the whole table
    assert ptx_target_for("sm_87", full, (8, 7)) is None
    with pytest.raises(CudaSetupError, match="knows no arch at or below sm_80"):
        ptx_target_for("sm_80", frozenset({"sm_90"}))


def test_ptx_needs_a_driver_at_least_as_new_as_the_nvrtc() -> None:
    gpu.check_ptx_driver((12, 9), (12, 9))
    gpu.check_ptx_driver(None, (13, 5))
    with pytest.raises(CudaSetupError, match=r"PTX from NVRTC 12\.9 needs a driver for CUDA 12\.9 or newer, this one "
                                             r"supports CUDA 12\.4"):
        gpu.check_ptx_driver((12, 4), (12, 9))


def test_device_arch_refuses_below_sm80_and_takes_the_newest_above_the_table() -> None:
    for cap in ((7, 5), (6, 1), (7, 0)):
        with pytest.raises(SpecError, match=rf"compute capability {cap[0]}\.{cap[1]} is below sm_80"):
            gpu.arch_for_device_capability(cap)
    assert gpu.arch_for_device_capability((13, 0)) == "sm_121"
    assert gpu.arch_for_device_capability((10, 3)) == "sm_103"
    assert gpu.arch_for_device_capability((8, 8)) == "sm_87"


def test_module_loads_ptx_with_one_warning_when_nvrtc_lacks_the_arch(monkeypatch: pytest.MonkeyPatch,
                                                                      fresh_decision) -> None:
    from fake_cupy import FakeCupy

    fake = FakeCupy(optin=101376)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(gpu, "driver_version", lambda: None)  # the same on a GPU machine
    monkeypatch.setattr(nvrtc, "supported_archs", lambda: NVRTC_12_6)
    gpu.reset_process_state()
    spec = KernelSpec(direction="fwd", head_dim=32, dtype="float16", arch="sm_120")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mod = gpu.GpuModule(spec)
        gpu.GpuModule(spec)
    msgs = [str(w.message) for w in seen if "JIT" in str(w.message)]
    assert len(msgs) == 1 and "has no sm_120 target; the driver JIT-compiles PTX for compute_90" in msgs[0]
    assert "\n" not in msgs[0]
    assert mod.compiled.ptx_target == "compute_90" and mod.compiled.resources == ()
    text = mod.compiled.cubin.decode()
    assert ".target sm_90" in text and ".entry" in text and mod.spec.name in text
    kernels = mod._kernels(0)
    (load,) = [e for e in fake.log if e[0] == "load"]
    assert load[1].endswith(".ptx") and Path(load[1]).read_bytes() == mod.compiled.cubin
    assert set(kernels) == {k.name for k in mod.compiled.rendered.kernels}


def test_a_device_newer_than_the_table_loads_ptx(monkeypatch: pytest.MonkeyPatch, fresh_decision) -> None:
    """Compute capability 13.0: the newest table arch (sm_121) as the spec, its PTX at load (a sm_121
    cubin would not run on another major), with one warning naming why."""
    import torch

    from fake_cupy import FakeCupy

    fake = FakeCupy(optin=101376)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(gpu, "driver_version", lambda: None)  # the same on a GPU machine
    gpu.reset_process_state()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (13, 0))
    assert gpu.device_arch(0) == "sm_121"
    mod = gpu.GpuModule(KernelSpec(direction="fwd", head_dim=32, dtype="float16", arch="sm_121"))
    assert mod.compiled.ptx_target is None  # the cubin, until a device asks
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mod._kernels(0)
    (load,) = [e for e in fake.log if e[0] == "load"]
    assert load[1].endswith(".ptx") and b".target sm_121" in Path(load[1]).read_bytes()
    (msg,) = [str(w.message) for w in seen]
    assert "sm_121 cubins do not run on this compute capability 13.0 device" in msg and "compute_121" in msg


def test_nvrtc_that_cannot_target_the_arch_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvrtc, "supported_archs", lambda: NVRTC_12_6)
    monkeypatch.setattr(nvrtc, "version", lambda: (12, 6))
    with pytest.raises(nvrtc.NvrtcError, match=r"NVRTC 12\.6 cannot target sm_120 \(it needs NVRTC 12\.8 or newer\): "
                                               r"pip install -U 'nvidia-cuda-nvrtc-cu12>=12\.8'"):
        compiler.check_target(KernelSpec(head_dim=64, arch="sm_120"))
    with pytest.raises(nvrtc.NvrtcError, match=r"cannot target sm_110 \(it needs NVRTC 13\.0 or newer\): "
                                               r"pip install 'fagen\[cuda13\]'"):
        compiler.check_target(KernelSpec(head_dim=64, arch="sm_110"))


# --------------------------------------------------------------------------- wheel-set discovery
def _fake_set(root: Path, major: int, release: str) -> None:
    lib, inc = {13: ("nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cu13/include"),
                12: ("nvidia/cuda_nvrtc/lib/libnvrtc.so.12", "nvidia/cuda_runtime/include")}[major]
    (root / lib).parent.mkdir(parents=True, exist_ok=True)
    (root / lib).write_bytes(b"")
    (root / inc).mkdir(parents=True, exist_ok=True)
    (root / inc / "cuda_fp16.h").write_text("")
    suffix = "" if major == 13 else f"_cu{major}"
    (root / f"nvidia_cuda_nvrtc{suffix}-{release}.dist-info").mkdir()


def test_wheel_sets_are_found_per_major(tmp_path: Path) -> None:
    _fake_set(tmp_path / "a", 13, "13.5.37")
    _fake_set(tmp_path / "a", 12, "12.9.86")
    _fake_set(tmp_path / "b", 12, "12.4.127")
    found = nvrtc._toolkits((str(tmp_path / "b"), str(tmp_path / "a"), str(tmp_path / "missing")))
    assert [(t.major, t.release) for t in found] == [(13, "13.5.37"), (12, "12.4.127")]  # first folder wins
    assert found[1].library == tmp_path / "b/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
    assert found[1].include == tmp_path / "b/nvidia/cuda_runtime/include"


def test_fagen_nvrtc_pins_a_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fagen import settings

    _fake_set(tmp_path, 12, "12.9.86")
    monkeypatch.setenv("FAGEN_NVRTC", str(tmp_path))
    settings.reset()
    try:
        tk = nvrtc.chosen_toolkit()
        assert tk is not None and tk.major == 12 and tk.release == "12.9.86"
        assert nvrtc.selection_id() == str(tmp_path / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
        monkeypatch.setenv("FAGEN_NVRTC", str(tmp_path / "nothing"))
        settings.reset()
        with pytest.raises(nvrtc.NvrtcError, match="holds no NVRTC wheel set"):
            nvrtc.chosen_toolkit()
    finally:
        monkeypatch.delenv("FAGEN_NVRTC")
        settings.reset()
        nvrtc.clear_toolkit()
    with pytest.raises(nvrtc.NvrtcError, match=r"no NVRTC for CUDA 11 is installed .*pip install 'fagen\[cuda11\]'"):
        nvrtc.select(11)


def test_cache_keys_differ_per_nvrtc_major_and_output(monkeypatch: pytest.MonkeyPatch) -> None:
    from fagen.renderer import render

    spec = KernelSpec(direction="fwd", head_dim=32, arch="sm_90")
    rendered, opts = render(spec), compiler.options_for(spec)
    k13 = compiler.cache_key(rendered, opts)
    assert compiler.cache_key(rendered, opts, "compute_90") != k13  # PTX and cubin never share an entry
    tid = nvrtc.toolchain_id()
    monkeypatch.setattr(nvrtc, "version", lambda: (12, 9))
    monkeypatch.setattr(nvrtc, "toolchain_id", lambda: tid)  # even with an identical release string
    assert compiler.cache_key(rendered, opts) != k13
    assert compiler.options_for(spec, "compute_90")[0] == "-arch=compute_90"
    assert "-Xptxas=-v" not in compiler.options_for(spec, "compute_90")


# --------------------------------------------------------------------------- the CUDA 12 set
@pytest.fixture(scope="module")
def nvrtc12():
    """NVRTC 12 (CI: .ci/run installs it with pip install --target) selected for the module."""
    from fagen import settings

    if not nvrtc._toolkits_in(NVRTC12):
        pytest.skip(f"no CUDA 12 NVRTC set at {NVRTC12} (.ci/run installs it; FAGEN_TEST_NVRTC12 points elsewhere)")
    settings.configure(nvrtc=NVRTC12)
    nvrtc.select(12)
    compiler.clear_memo()
    try:
        yield
    finally:
        nvrtc.select(None)
        settings.reset()
        nvrtc.clear_toolkit()
        compiler.clear_memo()


def _standard_nvrtc12() -> list[KernelSpec]:
    from fagen.generate import standard_matrix

    return standard_matrix()


@pytest.mark.parametrize("spec", _standard_nvrtc12(), ids=lambda s: s.name)
def test_cuda12_nvrtc_compiles_the_standard_matrix_without_spills(nvrtc12, spec: KernelSpec) -> None:
    from fagen import elf

    assert nvrtc.version()[0] == 12 and str(NVRTC12) in str(nvrtc.include_dir())
    mod = compiler.compile(spec)
    assert mod.cubin[7] == 0x33 and mod.cubin[8] == 7  # NVRTC 12's ELF: OSABI 0x33, ABI version 7
    assert elf.cubin_arch(mod.cubin) == spec.arch
    assert mod.resources and all(r.spill_bytes == 0 and r.stack_frame_bytes == 0 for r in mod.resources), \
        [(r.kernel, r.spill_bytes, r.stack_frame_bytes) for r in mod.resources]
    assert "nvrtc 12." in nvrtc.toolchain_id()
    from fagen import sass

    # nvdisasm 13 reads NVRTC 12's cubins too; read the SASS of the d = 64 every-flag specs only
    # (ptxas's report above covers spills for all; nvdisasm costs as much as a third of a compile)
    mix = sass.instruction_mix(mod.cubin) if spec.head_dim == 64 and spec.dropout else None
    if mix is not None:
        assert all(ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0 for ops in mix.values())
        if spec.impl == "mma":
            assert mix[mod.rendered.kernel("main").name].get("HMMA", 0) > 0



#: Beyond the standard matrix: the d = 128 backward's data masks and the forward's 256-key step, whose
#: register pressure ptxas 12 and 13 place differently (fagen.families.mma.rules.bwd_chunk_unroll on
#: capability 9.x, bwd_wide_warps on 8.0, fwd_widest_step).
NVRTC12_EXTRA = [KernelSpec(direction="bwd", head_dim=128, dtype="float16", arch="sm_90", **f)
                 for f in (dict(key_padding=True), dict(attn_mask=True), dict(key_padding=True, varlen=True))] + \
                [KernelSpec(direction="bwd", head_dim=128, dtype="bfloat16", arch="sm_80", **f)  # rules.bwd_wide_warps
                 for f in (dict(key_padding=True), dict(alibi=True), dict(bias=True), dict(key_padding=True, varlen=True))] + \
                [KernelSpec(direction="fwd", head_dim=64, dtype="bfloat16", arch=a, causal=True, varlen=True)
                 for a in ("sm_80", "sm_90")]


@pytest.mark.parametrize("spec", NVRTC12_EXTRA, ids=lambda s: s.name)
def test_cuda12_nvrtc_compiles_the_register_heavy_features_without_spills(nvrtc12, spec: KernelSpec) -> None:
    assert nvrtc.version()[0] == 12
    mod = compiler.compile(spec)
    assert mod.resources and all(r.spill_bytes == 0 and r.stack_frame_bytes == 0 for r in mod.resources), \
        [(r.kernel, r.spill_bytes, r.stack_frame_bytes) for r in mod.resources]


# --------------------------------------------------------------------------- the oldest CUDA 13 NVRTC
#: NVRTC 13.0 (CI: .ci/run installs nvidia-cuda-nvrtc, -runtime and -crt 13.0 with pip install --target):
#: the oldest the cuda13 extra allows, and what a GPU machine with a CUDA 13.0 driver compiles with.
NVRTC13_0 = Path(os.environ.get("FAGEN_TEST_NVRTC13_0") or REPO / ".venv" / "nvrtc-cu13.0")

_OLDEST_13 = r'''
import json
from fagen import KernelSpec, compile as compile_spec, nvrtc
specs = [dict(direction=dn, head_dim=d, causal=c) for d in (64, 128, 256) for c in (False, True) for dn in ("fwd", "bwd")]
for feat in ({"varlen": True, "causal": True}, {"softcap": True}, {"dropout": True}, {"alibi": True},
             {"attn_mask": True}, {"bias": True}, {"window": True, "causal": True}, {"key_padding": True}):
    specs += [dict(direction="fwd", head_dim=64, **feat), dict(direction="bwd", head_dim=64, **feat)]
specs += [dict(direction="bwd", head_dim=64, deterministic=True), dict(direction="bwd", head_dim=64, bias=True, bias_grad=True)]
out = {"version": list(nvrtc.version()), "include": str(nvrtc.include_dir()), "specs": {}}
for kw in specs:
    spec = KernelSpec(impl="wgmma", arch="sm_90a", **kw)
    try:
        mod = compile_spec(spec)
        out["specs"][spec.name] = {"flags": sorted(k for k, v in kw.items() if v is True), "spills": sum(r.spill_bytes + r.stack_frame_bytes
                                                                                 for r in mod.resources)}
    except Exception as e:
        out["specs"][spec.name] = {"error": " ".join(ln for ln in str(e).splitlines() if "error" in ln)[:400]}
print(json.dumps(out))
'''


@pytest.mark.slow
def test_the_oldest_cuda13_nvrtc_compiles_the_hopper_family(tmp_path: Path) -> None:
    """Every Hopper spec of a sample (d = 64 / 128 / 256, causal or not, each feature at d = 64) compiles with
    NVRTC 13.0, and the plain and causal rows without spills: a GPU machine with a CUDA 13.0 driver compiles
    with it (its forward once failed there alone: a generic lambda nested in a lambda, which 13.0 took for a
    host function). A subprocess, so the NVRTC library already loaded by this process is not in the way."""
    import json
    import subprocess

    if not nvrtc._toolkits_in(NVRTC13_0):  # noqa: SLF001 - the discovery the settings' folder goes through
        pytest.skip(f"no NVRTC 13.0 set at {NVRTC13_0} (.ci/run installs it; FAGEN_TEST_NVRTC13_0 points elsewhere)")
    env = {**os.environ, "FAGEN_NVRTC": str(NVRTC13_0), "FAGEN_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _OLDEST_13], env=env, capture_output=True, text=True, timeout=900,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["version"] == [13, 0] and str(NVRTC13_0) in got["include"]
    assert len(got["specs"]) == 30
    failed = {n: r["error"] for n, r in got["specs"].items() if "error" in r}
    assert not failed, failed
    plain = {n: r["spills"] for n, r in got["specs"].items() if set(r["flags"]) <= {"causal"} and r["spills"]}
    assert sum(set(r["flags"]) <= {"causal"} for r in got["specs"].values()) == 12
    assert not plain, plain
