"""fagen's typed errors cross a process boundary intact: a compile or an input check in a worker process
(a ``ProcessPoolExecutor`` sweep over specs) reaches the parent as the same error with the same fields, not as a
broken pool (an exception whose constructor takes other arguments than its message fails to unpickle)."""
from __future__ import annotations

import pickle
from concurrent.futures import ProcessPoolExecutor

import pytest

from fagen.errors import CacheDirError, CompileError, InputError, InputTypeError, NoGPUError, SpecError
from fagen.runtime.gpu import CudaSetupError, LaunchError

ERRORS = [CompileError("fa_bwd_d64", "line 1: error\nline 2"), InputError("q", "a 4-D tensor", (2, 3)),
          InputTypeError("k", "float16 or bfloat16"), CacheDirError("/ro/cache", "read-only"),
          LaunchError("grid", "at most 65535 blocks in y", 70000), SpecError("sm_75 is not a target"),
          NoGPUError("no CUDA GPU"), CudaSetupError("pip install cupy-cuda12x")]


@pytest.mark.parametrize("err", ERRORS, ids=lambda e: type(e).__name__)
def test_every_error_pickles_with_its_fields(err) -> None:
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and back.args == err.args
    assert {k: v for k, v in vars(back).items()} == {k: v for k, v in vars(err).items()}


def _raise_compile_error(name: str) -> None:
    raise CompileError(name, "nvrtc: error: identifier undefined")


def test_a_compile_error_in_a_worker_process_reaches_the_parent() -> None:
    with ProcessPoolExecutor(1) as ex:
        with pytest.raises(CompileError, match="NVRTC failed to compile fa_fwd_x") as info:
            ex.submit(_raise_compile_error, "fa_fwd_x").result()
    assert info.value.spec_name == "fa_fwd_x" and "identifier undefined" in info.value.log
