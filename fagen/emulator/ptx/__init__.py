"""The PTX level of the CPU emulator: NVRTC's PTX for the spec's real target, translated to C++
(one function per ``.entry``, PTX registers as locals, branches as ``goto``) and run on the
emulator's fiber runtime. See docs/emulator.md, "Two levels: source and PTX"."""
from __future__ import annotations

from .build import PtxModule, build_ptx, build_source_ptx, ptx_of_source
from .errors import PtxHazardError, PtxUnsupportedError
from .translate import FORMS, TRANSLATOR_VERSION, forms_table, translate

__all__ = [
           "FORMS",
           "TRANSLATOR_VERSION",
           "PtxHazardError",
           "PtxModule",
           "PtxUnsupportedError",
           "build_ptx",
           "build_source_ptx",
           "forms_table",
           "ptx_of_source",
           "translate",
]
