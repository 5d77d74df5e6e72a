"""The one settings object. Every environment variable fagen reads is here."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import platformdirs

_ENV = {
    "cache_dir": "FAGEN_CACHE_DIR",  # where cubins, emulator builds and tuning live
    "autotune_lookup": "FAGEN_AUTOTUNE_LOOKUP",  # "0" turns tuned-choice lookups off
    "cxx": "FAGEN_CXX",  # host C++17 compiler of the emulator (default g++)
    "cuda_include": "FAGEN_CUDA_INCLUDE",  # directory with cuda_fp16.h (default: the pip wheel's)
    "emu_schedule": "FAGEN_EMU_SCHEDULE",  # "forward" or "reverse": the emulator's thread order
    "emu_opt": "FAGEN_EMU_OPT",  # g++ optimisation level of the emulator's plain builds: O0..O3
    "emu_level": "FAGEN_EMU_LEVEL",  # "source" (the CUDA source) or "ptx" (NVRTC's PTX, translated)
    "nvrtc": "FAGEN_NVRTC",  # folder of NVRTC wheels (pip install --target) to compile with
    "emulate_arch": "FAGEN_EMULATE_ARCH",  # CPU tensors take the specs a GPU of this arch takes (sm_90a, ...)
}
EMU_SCHEDULES = ("forward", "reverse")
EMU_OPT_LEVELS = ("O0", "Og", "O1", "O2", "O3")
EMU_LEVELS = ("source", "ptx")


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    autotune_lookup: bool = True
    cxx: str = "g++"
    cuda_include: Path | None = None
    emu_schedule: str = "forward"
    nvrtc: Path | None = None
    emu_opt: str = "O2"
    emu_level: str = "source"
    emulate_arch: str | None = None

    def __post_init__(self) -> None:
        if self.emu_schedule not in EMU_SCHEDULES:
            raise ValueError(f"{_ENV['emu_schedule']}: expected one of {EMU_SCHEDULES}, got {self.emu_schedule!r}")
        if self.emu_opt not in EMU_OPT_LEVELS:
            raise ValueError(f"{_ENV['emu_opt']}: expected one of {EMU_OPT_LEVELS}, got {self.emu_opt!r}")
        if self.emu_level not in EMU_LEVELS:
            raise ValueError(f"{_ENV['emu_level']}: expected one of {EMU_LEVELS}, got {self.emu_level!r}")
        if self.emulate_arch is not None:
            from .arch import ARCHS

            if self.emulate_arch not in ARCHS:
                raise ValueError(f"{_ENV['emulate_arch']}: expected one of {tuple(ARCHS)}, got {self.emulate_arch!r}")

    @classmethod
    def from_env(cls) -> "Settings":
        env = os.environ.get(_ENV["cache_dir"])
        cache = Path(env) if env else Path(platformdirs.user_cache_dir("fagen"))
        lookup = os.environ.get(_ENV["autotune_lookup"], "1").strip().lower() not in ("0", "false", "off", "no")
        inc = os.environ.get(_ENV["cuda_include"])
        return cls(cache_dir=cache, autotune_lookup=lookup, cxx=os.environ.get(_ENV["cxx"]) or "g++",
                   cuda_include=Path(inc) if inc else None,
                   emu_schedule=os.environ.get(_ENV["emu_schedule"]) or "forward",
                   emu_opt=os.environ.get(_ENV["emu_opt"]) or "O2",
                   emu_level=os.environ.get(_ENV["emu_level"]) or "source",
                   emulate_arch=os.environ.get(_ENV["emulate_arch"]) or None,
                   nvrtc=Path(os.environ[_ENV["nvrtc"]]) if os.environ.get(_ENV["nvrtc"]) else None)


_current: Settings | None = None


def get_settings() -> Settings:
    """Current settings (read from the environment on first use)."""
    global _current
    if _current is None:
        _current = Settings.from_env()
    return _current


def configure(**changes: object) -> Settings:
    """Override settings in-process, e.g. ``configure(autotune_lookup=False)``."""
    global _current
    _current = replace(get_settings(), **changes)  # type: ignore[arg-type]
    return _current


def reset() -> None:
    """Forget overrides; the environment is read again on next use."""
    global _current
    _current = None
