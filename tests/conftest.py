from __future__ import annotations

import os

# One thread per worker for torch's OpenMP pool and the BLAS libraries, set before any of them is loaded: the
# suite runs one worker per core (`-n 2`), and each worker's default pool (a thread per core) spin-waits
# between the small reference ops, on the cores the other worker computes on. A warm-cache sample of the
# numerics tests took 20.1 s (34 CPU s) with the default pools and 11.0 s (18.5 CPU s) with one thread; from
# empty caches (builds included) 39.8 s and 32.0 s (two runs each).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import fagen.settings  # noqa: E402
from tiers import slow_items  # noqa: E402

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


def pytest_collection_finish(session: pytest.Session) -> None:
    """The modules every test imports (torch, numpy, fagen, the test modules) are loaded by now: moved out of
    the cyclic garbage collector's sight (gc.freeze), its full collections no longer walk them again and
    again, and young collections are made rarer (the warm sample above: 10.3 s -> 8.5 s)."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(20000, 50, 100)
