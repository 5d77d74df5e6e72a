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
