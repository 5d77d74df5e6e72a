"""Typed errors. Validation never uses bare asserts.

* ``pydantic.ValidationError`` (a ``ValueError``, not defined here) -- a
  :class:`~fagen.spec.KernelSpec` with an invalid field or that cannot be
  implemented (no tile fits M, no family implements it); ``errors()[0]["loc"]``
  names the field and the message says why. Every spec failure is this one type.
* :class:`SpecError` -- a valid spec that cannot be served on this machine: the
  GPU's compute capability is not a fagen target.
* :class:`InputError` / :class:`InputTypeError` -- bad user input, naming the
  argument and what was expected (they are ``ValueError`` / ``TypeError``).
* :class:`CacheDirError` -- an unusable cache directory (an ``InputError``
  naming ``FAGEN_CACHE_DIR``).
* :class:`CompileError` -- NVRTC rejected a rendered kernel; carries the log.
* :class:`NoGPUError` -- the operation needs a CUDA GPU and there is none.

:func:`check_dropout_p` is the one validator of a dropout probability (ops,
functional, philox and reference all call it).
"""
from __future__ import annotations

import math
import numbers


class FagenError(Exception):
    """Base class of every error fagen raises on purpose. Each pickles (a compile or an input check in a worker
    process reaches its parent as the same error, not a broken pool): a subclass whose constructor takes other
    arguments than its message records them in ``_init_args``."""

    _init_args: tuple = ()

    def __reduce__(self):  # noqa: ANN204 - pickle's protocol
        if self._init_args:
            return (type(self), self._init_args, self.__dict__)
        return super().__reduce__()


class SpecError(FagenError, ValueError):
    """A valid spec cannot be served here: the GPU's compute capability is not a fagen target.

    (A spec that is invalid or cannot be implemented is rejected when it is built, by
    ``KernelSpec``'s pydantic ``ValidationError``, which names the field.)"""


class _ArgumentError(FagenError):
    """Names the argument, what was expected and (optionally) what came."""

    def __init__(self, argument: str, expected: str, got: object = None) -> None:
        self._init_args = (argument, expected, got)
        self.argument = argument
        self.expected = expected
        msg = f"{argument}: expected {expected}"
        if got is not None:
            msg += f", got {got}"
        super().__init__(msg)


class InputError(_ArgumentError, ValueError):
    """A user-supplied argument has a bad value."""


class InputTypeError(_ArgumentError, TypeError):
    """A user-supplied argument has a bad type (dtype, device, Python type)."""


class CacheDirError(InputError):
    """The cache directory cannot be created or written. ``argument`` is
    ``FAGEN_CACHE_DIR`` (or ``cache_dir`` when passed to a call); ``path`` is
    the directory. Raised instead of falling back to an in-memory cache."""

    def __init__(self, path: object, reason: str, argument: str = "FAGEN_CACHE_DIR") -> None:
        self.path = path
        super().__init__(argument, "a writable directory for fagen's cache", f"{path} ({reason})")
        self._init_args = (path, reason, argument)


class NoGPUError(FagenError, RuntimeError):
    """The operation needs a CUDA GPU and there is none; the message says what to do instead."""


class CompileError(FagenError, RuntimeError):
    """NVRTC failed to compile a rendered kernel."""

    def __init__(self, spec_name: str, log: str) -> None:
        self._init_args = (spec_name, log)
        self.spec_name = spec_name
        self.log = log
        super().__init__(f"NVRTC failed to compile {spec_name}:\n{log}")


def check_dropout_p(dropout_p: object, argument: str = "dropout_p") -> float:
    """``dropout_p`` as a float in ``[0, 1)``, or :class:`InputError` naming ``argument``.

    A bool, a non-real (``"0.1"``, None), NaN, a negative value or a value >= 1
    are all rejected the same way: an ``InputError`` (a ``ValueError``).
    """
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise InputError(argument, "a float in [0, 1)", repr(dropout_p))
    p = float(dropout_p)
    if math.isnan(p) or not 0.0 <= p < 1.0:
        raise InputError(argument, "a float in [0, 1)", p)
    return p
