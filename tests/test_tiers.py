"""The tier table (tests/tiers.py) names tests that exist, and the fast tier keeps a sample of each sweep."""
from __future__ import annotations

import re
from pathlib import Path

import tiers

TESTS = Path(__file__).resolve().parent


def test_every_listed_test_exists() -> None:
    for key in tiers.listed():
        file, func = key.split("::")
        text = (TESTS / file).read_text(encoding="utf-8")
        assert re.search(rf"^def {re.escape(func)}\(", text, re.M), f"tests/tiers.py lists {key}, which does not exist"


class _Spec:
    def __init__(self, id_: str) -> None:
        self.id = id_


class _Item:
    def __init__(self, file: str, func: str, id_: str | None) -> None:
        self.path, self.originalname = Path(file), func
        if id_ is not None:
            self.callspec = _Spec(id_)


def test_a_sweep_keeps_the_first_case_of_each_family() -> None:
    sweep = "test_features.py", "test_feature_numerics"
    items = [_Item(*sweep, i) for i in ("a-wgmma", "a-mma", "a-simt", "b-wgmma", "b-mma", "b-simt")]
    items += [_Item("test_x.py", "test_y", "p1"), _Item("test_racecheck.py", "test_removing_a_barrier_is_a_race_naming_it", "s")]
    slow = tiers.slow_items(items)
    assert [i.callspec.id for i in slow] == ["b-wgmma", "b-mma", "b-simt", "s"]


def test_a_once_sampled_sweep_keeps_only_its_first_case() -> None:
    sweep = "test_bounds.py", "test_every_kernel_is_clean_under_asan"
    items = [_Item(*sweep, i) for i in ("mma-a", "simt-a", "mma-b")] + [_Item("test_x.py", "test_y", "simt-a")]
    assert [i.callspec.id for i in tiers.slow_items(items)] == ["simt-a", "mma-b"]


def test_the_tables_do_not_overlap() -> None:
    assert not (tiers.SLOW & tiers.SAMPLED) and not (tiers.SLOW & tiers.SAMPLED_ONCE)
    assert not (tiers.SAMPLED & tiers.SAMPLED_ONCE)


def test_readme_names_the_command_ci_runs() -> None:
    """.ci/run runs README's test command, word for word."""
    repo = TESTS.parent
    ci = [ln.strip() for ln in (repo / ".ci" / "run").read_text().splitlines() if ln.startswith("python -m pytest")]
    assert len(ci) == 1, ci
    assert f"the test command itself is `{ci[0]}`" in " ".join((repo / "README.md").read_text().split())
