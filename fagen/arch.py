"""The one per-arch table: every hardware fact fagen uses about a target arch.

Sources (NVIDIA, CUDA C++ Programming Guide 12.9 / 13.0):

* "Technical Specifications per Compute Capability" (the table of "Feature Support per Compute
  Capability" and "Technical Specifications"): maximum shared memory per SM and per thread
  block (opt-in), resident threads / warps / blocks per SM, 32-bit registers per SM, registers
  per thread;
* the Ampere (sm_80/86/87), Ada (sm_89), Hopper (sm_90) and Blackwell (sm_100/103/110/120/121)
  tuning guides, which restate the shared-memory carve-outs ("up to 163 KB / 99 KB / 227 KB
  per thread block");
* the PTX ISA ("Release Notes" and "Target ISA notes"): ``mma.sync.aligned.m16n8k16`` with
  f16/bf16 operands needs sm_80 or newer; ``sm_90a`` is Hopper's arch-specific target whose
  cubins run on compute capability 9.0 only;
* the CUDA Toolkit release notes: the first NVRTC release that can target each arch
  (``nvrtc_min``). sm_110 (Jetson Thor) was named sm_101 before CUDA 13.0.

Nothing else in the package states these numbers: ``fagen.spec`` derives its dicts from
:data:`ARCHS`, the runtime and the autotuner read them through the spec module or here.
"""
from __future__ import annotations

from dataclasses import dataclass

KB = 1024


@dataclass(frozen=True)
class ArchInfo:
    """Facts of one compile target ``sm_XY`` (or the arch-specific ``sm_XYa``)."""

    name: str  # the spec's arch, e.g. "sm_90" or "sm_90a"
    capability: tuple[int, int]  # compute capability (major, minor) the target is for
    smem_optin_per_block: int  # bytes: maximum dynamic shared memory per block after opting in
    smem_per_sm: int  # bytes of shared memory per SM (the largest carve-out)
    max_threads_per_sm: int
    max_blocks_per_sm: int
    regs_per_sm: int = 64 * KB  # 32-bit registers per SM (every arch here: 64 K)
    max_regs_per_thread: int = 255
    mma_sync: bool = True  # mma.sync.aligned.m16n8k16 f16/bf16 -> f32 (PTX ISA: sm_80+)
    nvrtc_min: tuple[int, int] = (11, 0)  # first NVRTC (major, minor) that targets it
    arch_specific: bool = False  # "a" target: cubins run on exactly this capability, no PTX forward
    note: str = ""

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // 32

    @property
    def sm(self) -> int:
        """The SM number NVRTC's ``-arch=sm_N`` and a cubin's ELF header carry (90 for sm_90a)."""
        return self.capability[0] * 10 + self.capability[1]

    @property
    def cubin_arch(self) -> str:
        """What :func:`fagen.elf.cubin_arch` reports for this target's cubins (``sm_90`` for sm_90a)."""
        return f"sm_{self.sm}"

    @property
    def compute(self) -> str:
        """The virtual arch of this target's PTX (``compute_90`` for sm_90 and sm_90a)."""
        return f"compute_{self.sm}{'a' if self.arch_specific else ''}"


def _a(name: str, cap: tuple[int, int], optin_kb: int, sm_kb: int, threads: int, blocks: int,
       nvrtc_min: tuple[int, int], note: str, *, arch_specific: bool = False) -> ArchInfo:
    return ArchInfo(name, cap, optin_kb * KB, sm_kb * KB, threads, blocks, nvrtc_min=nvrtc_min,
                    arch_specific=arch_specific, note=note)


#: Every spec arch, ascending by capability (then the generic target before its "a" variant).
ARCHS: dict[str, ArchInfo] = {a.name: a for a in (
    _a("sm_80", (8, 0), 163, 164, 2048, 32, (11, 0), "A100 (GA100)"),
    _a("sm_86", (8, 6), 99, 100, 1536, 16, (11, 1), "GA10x (RTX 30xx, A40, A10)"),
    _a("sm_87", (8, 7), 163, 164, 1536, 16, (11, 4), "Jetson Orin (GA10B)"),
    _a("sm_89", (8, 9), 99, 100, 1536, 24, (11, 8), "Ada (RTX 40xx, L4, L40)"),
    _a("sm_90", (9, 0), 227, 228, 2048, 32, (11, 8), "Hopper (H100, H200, GH200)"),
    _a("sm_90a", (9, 0), 227, 228, 2048, 32, (12, 0), "Hopper, arch-specific (wgmma, setmaxnreg)",
       arch_specific=True),
    _a("sm_100", (10, 0), 227, 228, 2048, 32, (12, 8), "Blackwell (B200, GB200)"),
    _a("sm_103", (10, 3), 227, 228, 2048, 32, (12, 9), "Blackwell Ultra (B300, GB300)"),
    _a("sm_110", (11, 0), 227, 228, 1536, 24, (13, 0), "Jetson Thor (sm_101 before CUDA 13)"),
    _a("sm_120", (12, 0), 99, 100, 1536, 32, (12, 8), "Blackwell GeForce / workstation (RTX 50xx, RTX PRO)"),
    _a("sm_121", (12, 1), 99, 100, 1536, 32, (12, 9), "DGX Spark (GB10)"),
)}

#: Oldest compute capability fagen runs on (mma.sync m16n8k16 with bf16, cp.async).
MIN_CAPABILITY = (8, 0)

#: A device's generic arch -> the arch-specific target its capability also runs (sm_90 -> sm_90a on 9.0):
#: the default specs (fagen.functional) and the runtime autotuner consider the families of both.
ARCH_SPECIFIC = {"sm_90": "sm_90a"}


class UnknownArchError(KeyError):
    """An arch name not in :data:`ARCHS`."""


def arch_info(arch: str) -> ArchInfo:
    """The table row of ``arch`` (``sm_80`` ... ``sm_121``, ``sm_90a``)."""
    try:
        return ARCHS[arch]
    except KeyError:
        raise UnknownArchError(f"arch {arch!r} is not one of fagen's targets {list(ARCHS)}") from None


def generic_archs() -> list[str]:
    """The targets whose cubins run on every device of their major with a minor not below theirs
    (everything but the arch-specific ``a`` targets), ascending."""
    return [n for n, a in ARCHS.items() if not a.arch_specific]


def arch_for_capability(capability: tuple[int, int], available: "set[str] | None" = None, *,
                        arch_specific: bool = False) -> str | None:
    """The spec arch whose cubins run on a device of this compute capability, or None.

    A cubin for sm_XY runs on devices of compute capability X.Z with Z >= Y (CUDA C++
    Programming Guide, "Binary Compatibility"): the newest generic target of the same major
    whose minor is not above the device's (8.7 -> sm_87, 8.8 -> sm_87, 9.0 -> sm_90,
    10.3 -> sm_103, 12.1 -> sm_121). ``available`` limits the choice (e.g. to what an NVRTC
    can target). None below sm_80 or for a major the table does not have.
    ``arch_specific=True`` (a family that needs e.g. wgmma): the ``a`` target of exactly this
    capability when the table has one (9.0 -> sm_90a), else the generic choice.
    """
    major, minor = int(capability[0]), int(capability[1])
    if arch_specific:
        for name, a in ARCHS.items():
            if a.arch_specific and a.capability == (major, minor) and (available is None or name in available):
                return name
    best: str | None = None
    for name in generic_archs():
        a = ARCHS[name]
        if available is not None and name not in available:
            continue
        if a.capability[0] == major and a.capability[1] <= minor:
            best = name
    return best


def newest_at_or_below(capability: tuple[int, int], available: "set[str] | None" = None) -> str | None:
    """The newest generic target whose capability is <= ``capability`` (any major), or None:
    the compute capability whose PTX a device newer than every known target JIT-compiles."""
    best: str | None = None
    for name in generic_archs():
        if available is not None and name not in available:
            continue
        if ARCHS[name].capability <= tuple(capability):
            best = name
    return best
