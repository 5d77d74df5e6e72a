"""benchmarks/mutations.py stays runnable: each mutation's replacements match exactly once in the
current tree, change the text, and name test files that exist (the mutation runs themselves are
not part of the suite: ``python benchmarks/mutations.py``)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("fagen_mutations", REPO / "benchmarks" / "mutations.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


mutations = _load()


@pytest.mark.parametrize("m", mutations.MUTATIONS, ids=lambda m: m.name)
def test_each_replacement_matches_exactly_once(m) -> None:
    texts = mutations.mutated_files(m)
    for path, text in texts.items():
        assert text != (REPO / path).read_text(), path
    for t in m.tests:
        assert (REPO / t).is_file(), t


def test_a_replacement_that_does_not_match_once_is_an_error() -> None:
    edit = mutations.Edit("x", "a", "b")
    assert mutations.apply("xay", edit) == "xby"
    for text in ("xy", "aa"):
        with pytest.raises(mutations.MutationError, match="exactly one occurrence"):
            mutations.apply(text, edit)


def test_issue_mutations_are_all_there() -> None:
    names = {m.name for m in mutations.MUTATIONS}
    assert {"fwd-q-overrun-simt", "gpu-float-as-int32", "cubin-half-from-nvrtc"} <= names
