"""Typed errors. Validation never uses bare asserts.

* :class:`SpecError` -- a spec that cannot be implemented, and why.
* :class:`InputError` / :class:`InputTypeError` -- bad user input, naming the
  argument and what was expected (they are ``ValueError`` / ``TypeError``).
* :class:`CompileError` -- NVRTC rejected a rendered kernel; carries the log.
"""
from __future__ import annotations


class FagenError(Exception):
    """Base class of every error fagen raises on purpose."""


class SpecError(FagenError, ValueError):
    """This spec cannot be implemented (the message says why)."""


class _ArgumentError(FagenError):
    """Names the argument, what was expected and (optionally) what came."""

    def __init__(self, argument: str, expected: str, got: object = None) -> None:
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


class CompileError(FagenError, RuntimeError):
    """NVRTC failed to compile a rendered kernel."""

    def __init__(self, spec_name: str, log: str) -> None:
        self.spec_name = spec_name
        self.log = log
        super().__init__(f"NVRTC failed to compile {spec_name}:\n{log}")
