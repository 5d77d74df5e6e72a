"""The package's public surface: its namespace, its logging, its error types."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import fagen


def test_dir_lists_public_names_only() -> None:
    names = dir(fagen)
    for leaked in ("Any", "annotations", "importlib", "logging"):
        assert leaked not in names
    assert not [n for n in names if n.startswith("_") and n != "__version__"]
    assert set(fagen.__all__) <= set(names)
    for name in ("flash_attn_func", "scaled_dot_product_attention", "attention_backward", "KernelSpec"):
        assert name in names


def test_library_logging_is_silent_by_default() -> None:
    handlers = logging.getLogger("fagen").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)
    # without the NullHandler, logging's last-resort handler would print a warning to stderr
    script = "import logging, fagen; logging.getLogger('fagen.compiler').warning('hello from fagen')"
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "hello from fagen" not in res.stderr


def test_unknown_attribute_is_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        fagen.no_such_name  # noqa: B018


# --------------------------------------------------------------------------- dropout_p: one validator
BAD_DROPOUT_P = [True, "0.1", None, -0.1, 1.0, 1.5, float("nan"), float("inf")]


def _entry_points():
    import torch

    from fagen import functional, ops, philox, reference

    q = torch.zeros(1, 4, 1, 8)
    return {
        "ops.flash_attn_func": lambda p: ops.flash_attn_func(q, q, q, dropout_p=p),
        "functional.attention_forward": lambda p: functional.attention_forward(q, q, q, dropout_p=p),
        "philox.drop_threshold": lambda p: philox.drop_threshold(p),
        "philox.keep_mask": lambda p: philox.keep_mask(1, 1, 4, 4, p),
        "reference.attention_forward_ref": lambda p: reference.attention_forward_ref(q, q, q, dropout_p=p),
    }


@pytest.mark.parametrize("bad", BAD_DROPOUT_P, ids=repr)
def test_dropout_p_one_validator_one_error_type(bad: object) -> None:
    from fagen.errors import InputError, check_dropout_p

    with pytest.raises(InputError) as ref:
        check_dropout_p(bad)
    assert ref.value.argument == "dropout_p" and isinstance(ref.value, ValueError)
    for where, call in _entry_points().items():
        with pytest.raises(InputError) as err:
            call(bad)
        assert str(err.value) == str(ref.value), where


def test_dropout_p_validator_defined_once() -> None:
    """No module re-implements the check: every one imports fagen.errors.check_dropout_p."""
    import ast
    from pathlib import Path

    pkg = Path(fagen.__file__).parent
    defs = []
    for path in pkg.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and "dropout_p" in node.name:
                defs.append(f"{path.relative_to(pkg)}:{node.name}")
    assert defs == ["errors.py:check_dropout_p"]


def test_check_dropout_p_accepts_the_range() -> None:
    from fagen.errors import check_dropout_p

    assert check_dropout_p(0) == 0.0 and check_dropout_p(0.25) == 0.25
    assert check_dropout_p(1 - 2**-30) < 1.0


# --------------------------------------------------------------------------- SDPA speaks [B, H, N, d]
def test_sdpa_shape_errors_quote_the_callers_layout() -> None:
    import torch

    from fagen import scaled_dot_product_attention
    from fagen.errors import InputError

    q = torch.zeros(2, 2, 40, 64)  # [B, H, Nq, d]
    k = torch.zeros(2, 2, 47, 64)
    with pytest.raises(InputError) as err:
        scaled_dot_product_attention(q, torch.zeros(2, 3, 47, 64), k)
    assert err.value.argument == "key"
    assert "[B, H, Nk, d] = [2, 2, Nk, 64]" in str(err.value) and "got (2, 3, 47, 64)" in str(err.value)
    with pytest.raises(InputError) as err:  # value may have a head dim of its own, not another length
        scaled_dot_product_attention(q, k, torch.zeros(2, 2, 46, 64))
    assert err.value.argument == "value" and "(2, 2, 47, 64)" in str(err.value)
    with pytest.raises(InputError) as err:
        scaled_dot_product_attention(q, torch.zeros(2, 2, 47, 32), torch.zeros(2, 2, 47, 32))
    assert err.value.argument == "key" and "[B, N, H, d]" not in str(err.value)


# --------------------------------------------------------------------------- one error type per failure
@pytest.mark.parametrize("fields, field", [
    ({"head_dim": 65}, "head_dim"),                                    # invalid value
    ({"head_dim": 64, "sram_bytes": 1024}, "block_c"),                 # no tile fits M: cannot be implemented
    ({"head_dim": 64, "block_r": 128, "block_c": 128, "sram_bytes": 60000, "impl": "simt"}, "block_c"),
    ({"head_dim": 64, "impl": "no-such-family"}, "impl"),
    ({"head_dim": 64, "dtype": "fp8"}, "dtype"),
])
def test_every_spec_failure_is_a_validation_error_naming_the_field(fields: dict, field: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as err:
        fagen.KernelSpec(**fields)
    assert isinstance(err.value, ValueError) and not isinstance(err.value, fagen.SpecError)
    assert err.value.errors()[0]["loc"][0] == field


def test_error_docs_match_the_error_types() -> None:
    from pathlib import Path

    api = (Path(fagen.__file__).parent.parent / "docs" / "api.md").read_text(encoding="utf-8")
    for name in ("FagenError", "SpecError", "InputError", "InputTypeError", "CacheDirError", "CompileError",
                 "NoGPUError", "ValidationError"):
        assert f"`{name}`" in api, name
    assert "cannot be implemented" not in (fagen.SpecError.__doc__ or "").split("\n")[0]
