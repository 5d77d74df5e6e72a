from __future__ import annotations

import os
from pathlib import Path

import pytest

import fagen.settings
from tiers import slow_items

REPO = Path(__file__).resolve().parent.parent
# The emulator's builds at -Og here (plain, PTX-level, racecheck and ASan ones): g++ builds them about a
# third faster than at -O1, the suite's problems are small, and the suite then takes about a quarter less
# CPU (the default, O2, is tested by test_emulator.py's flag test; FAGEN_EMU_OPT=O2 runs the suite so).
os.environ.setdefault("FAGEN_EMU_OPT", "Og")


@pytest.fixture(scope="session", autouse=True)
def _shared_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache dir for the whole run, shared by xdist workers (builds are file-locked)."""
    if os.environ.get("FAGEN_TEST_CACHE_DIR"):
        root = Path(os.environ["FAGEN_TEST_CACHE_DIR"])
    else:
        base = tmp_path_factory.getbasetemp()
        root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "fagen-cache"
    root.mkdir(parents=True, exist_ok=True)
    os.environ["FAGEN_CACHE_DIR"] = str(root)
    fagen.settings.reset()
    return root


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private, empty cache dir for tests that count hits and misses."""
    from fagen.compiler import clear_memo

    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    fagen.settings.reset()
    clear_memo()
    yield tmp_path / "cache"
    fagen.settings.reset()
    clear_memo()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tier: tests marked ``slow`` and those tests/tiers.py lists (``-m "not slow"``: the fast tier)."""
    for item in slow_items(items):
        item.add_marker(pytest.mark.slow)
