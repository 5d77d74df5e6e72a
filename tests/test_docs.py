"""The docs hold as written: every ```python block of README.md and docs/*.md runs (CPU, through
the emulator) and checks its own result (an ``assert`` of the values it shows: against a
reference, an invariant, a known value), relative links and repository paths they name exist, and the Algorithm 4 table is
the one fagen/algorithm4.py generates.

A block that cannot run on a CPU-only machine is preceded by the line
``<!-- no-test: <reason> -->``; the reason must be given, and such blocks are few.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fork_runner import Zygote

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NO_TEST = re.compile(r"<!--\s*no-test:\s*(\S.*?)\s*-->\s*\n\s*$")
MAX_NO_TEST = 3


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line, code, no-test reason or None) for every ```python block of a Markdown text."""
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        skip = NO_TEST.search(text[:m.start()])
        out.append((line, m.group(1), skip.group(1) if skip else None))
    return out


BLOCKS = [(doc.relative_to(REPO).as_posix(), *block)
          for doc in DOCS for block in python_blocks(doc.read_text(encoding="utf-8"))]


def test_block_parser_and_no_test_marker() -> None:
    text = ("intro\n\n```python\nx = 1\n```\n\n<!-- no-test: needs a GPU -->\n```python\ny = 2\n```\n"
            "<!-- no-test: far away -->\n\nprose\n\n```python\nz = 3\n```\n```bash\nls\n```\n")
    assert python_blocks(text) == [(3, "x = 1\n", None), (8, "y = 2\n", "needs a GPU"), (15, "z = 3\n", None)]


def test_docs_have_python_blocks() -> None:
    assert len([b for b in BLOCKS if b[0] == "README.md"]) >= 2
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("doc, line, code, skip", BLOCKS, ids=[f"{d}:{n}" for d, n, _, _ in BLOCKS])
def test_python_block_checks_its_result(doc: str, line: int, code: str, skip: str | None) -> None:
    """Running without an error proves little (an example may compute nonsense): each block
    asserts what it computes."""
    import ast

    asserts = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Assert)]
    assert asserts, f"{doc}:{line}: the example asserts nothing about its result"


def test_few_blocks_are_exempt() -> None:
    exempt = [f"{doc}:{line} ({why})" for doc, line, _, why in BLOCKS if why is not None]
    assert len(exempt) <= MAX_NO_TEST, exempt


@pytest.fixture(scope="module")
def zygote():
    """Forks each block's interpreter from one that has imported torch (tests/fork_runner.py)."""
    z = Zygote()
    yield z
    z.close()


@pytest.mark.parametrize("doc, line, code, skip", BLOCKS, ids=[f"{d}:{n}" for d, n, _, _ in BLOCKS])
def test_python_block_runs(doc: str, line: int, code: str, skip: str | None, tmp_path: Path, zygote: Zygote) -> None:
    """Each block in an interpreter of its own, as a reader would paste it: nothing imported by another
    block or by the tests helps it (a block that uses ``fagen.functional`` without importing it fails)."""
    if skip is not None:
        pytest.skip(skip)
    script = tmp_path / "block.py"
    # blank lines first: line numbers in a traceback are the document's own
    script.write_text("\n" * line + code, encoding="utf-8")
    run = zygote.run(script, tmp_path)
    assert run.returncode == 0, f"{doc}: python block at line {line} failed:\n{run.stderr[-4000:]}"


@pytest.mark.parametrize("runner", ["interpreter", "zygote"])
def test_a_block_runs_in_a_fresh_interpreter(runner: str, tmp_path: Path, zygote: Zygote) -> None:
    """The runner above does not inherit the test process's imports, nor one block another's: a block
    that uses what it did not import fails there as in a fresh ``python``, a block's ``sys.exit`` status and
    output come back, and the next block starts clean."""
    import fagen.functional  # noqa: F401 - loaded here, so fagen.functional resolves in this process

    def run(text: str) -> subprocess.CompletedProcess | object:
        script = tmp_path / "block.py"
        script.write_text(text, encoding="utf-8")
        if runner == "zygote":
            return zygote.run(script, tmp_path)
        return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)

    first = run("import fagen\nimport fagen.functional\nimport sys\nsys.modules['torch'].marker = 1\n"
                "print('ran', __name__)\nsys.exit(3)\n")
    assert first.returncode == 3 and first.stdout == "ran __main__\n"
    second = run("import fagen\nfagen.functional.SEQLEN_MAX\n")
    assert second.returncode != 0 and "functional" in second.stderr
    third = run("import sys, torch\nassert not hasattr(torch, 'marker')\nassert 'fagen' not in sys.modules\n"
                "import os\nassert os.getcwd() == sys.argv[0].rsplit('/', 1)[0] == sys.path[0]\n")
    assert third.returncode == 0, third.stderr
    fourth = run("torch.zeros(1)\n")
    assert fourth.returncode == 1 and "NameError: name 'torch' is not defined" in fourth.stderr


# --------------------------------------------------------------------------- shell blocks
SHELL_FENCE = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.S | re.M)
#: Why a shell block may be exempt: what it needs that a CPU-only, offline test run has not.
SHELL_EXEMPT = ("a GPU", "the network", "the suite itself", "root", "a browser", "a FlashAttention-2 binary",
                "the whole default matrix")


def shell_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line, commands, no-test reason or None) for every ```bash / ```sh block of a Markdown text."""
    out = []
    for m in SHELL_FENCE.finditer(text):
        skip = NO_TEST.search(text[:m.start()])
        out.append((text.count("\n", 0, m.start()) + 1, m.group(1), skip.group(1) if skip else None))
    return out


SHELL = [(doc.relative_to(REPO).as_posix(), *block)
         for doc in DOCS for block in shell_blocks(doc.read_text(encoding="utf-8"))]


def test_shell_blocks_are_found_and_exemptions_say_what_they_need() -> None:
    text = "```bash\nls\n```\n<!-- no-test: needs a GPU -->\n```sh\nnvidia-smi\n```\n```python\nx = 1\n```\n"
    assert shell_blocks(text) == [(1, "ls\n", None), (5, "nvidia-smi\n", "needs a GPU")]
    assert len(SHELL) >= 10 and any(why is None for *_, why in SHELL)
    for doc, line, _, why in SHELL:
        assert why is None or any(need in why for need in SHELL_EXEMPT), (
            f"{doc}:{line}: an exempt shell block names what it needs, one of {SHELL_EXEMPT}: {why!r}")


@pytest.mark.parametrize("doc, line, code, skip", SHELL, ids=[f"{d}:{n}" for d, n, _, _ in SHELL])
def test_shell_block_runs(doc: str, line: int, code: str, skip: str | None, tmp_path: Path) -> None:
    """Each shell block as a reader would paste it, with the package installed (its ``fagen`` and this
    interpreter's ``python`` first on PATH), in a fresh folder that holds the repository's benchmarks/
    (the blocks name it relative to a checkout), every command checked (``set -eo pipefail``)."""
    if skip is not None:
        pytest.skip(skip)
    import os

    (tmp_path / "benchmarks").symlink_to(REPO / "benchmarks")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = subprocess.run(["bash", "-c", "set -eo pipefail\n" + code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"{doc}: shell block at line {line} failed:\n{run.stderr[-4000:]}"


# --------------------------------------------------------------------------- links and paths
LINK = re.compile(r"\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"`((?:benchmarks|docs|fagen|templates|tests|generated|\.ci)/[A-Za-z0-9_./-]*[A-Za-z0-9_])`")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_links_stay_inside_the_repository(doc: Path) -> None:
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        assert path.is_relative_to(REPO), f"{doc.name}: {target} points outside the repository"
        assert path.exists(), f"{doc.name}: {target} does not exist"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_named_repository_paths_exist(doc: Path) -> None:
    for rel in REPO_PATH.findall(doc.read_text(encoding="utf-8")):
        if any(c in rel for c in "*<>{}") or rel.endswith("/"):
            continue
        assert (REPO / rel).exists(), f"{doc.name} names {rel}, which is not in the repository"


# --------------------------------------------------------------------------- Algorithm 4
def test_algorithm4_doc_is_generated_from_the_module() -> None:
    from fagen import algorithm4

    text = (REPO / "docs" / "algorithm4.md").read_text(encoding="utf-8")
    block = text.split(algorithm4.BEGIN, 1)[1].split(algorithm4.END, 1)[0]
    assert block == "\n" + algorithm4.markdown(), (
        "docs/algorithm4.md is stale: python -c 'import fagen.algorithm4 as a; a.update(\"docs/algorithm4.md\")'")
    assert "arXiv:2205.14135" in text and "Dao" in text


def test_algorithm4_is_stated_whole_and_every_line_is_placed() -> None:
    from fagen.algorithm4 import ALG4, ELSEWHERE, PAPER

    assert sorted(PAPER) == list(range(1, 27))
    assert set(ALG4) | set(ELSEWHERE) == set(PAPER) and not set(ALG4) & set(ELSEWHERE)


def test_renderer_takes_alg4_from_the_one_module() -> None:
    from fagen import algorithm4, renderer

    assert renderer.ALG4 is algorithm4.ALG4


# --------------------------------------------------------------------------- install instructions
def test_bench_extra_covers_what_the_gpu_check_needs_beyond_the_install() -> None:
    """README: `pip install -e '.[cuda13,bench]'` then `python benchmarks/gpu_check.py OUTDIR`: the
    bench extra brings pytest, the CUDA extra the one CuPy the check imports."""
    tomllib = pytest.importorskip("tomllib")
    import importlib.util

    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    bench = {re.split(r"[<>=!~ \[]", r, 1)[0].lower() for r in project["optional-dependencies"]["bench"]}
    spec = importlib.util.spec_from_file_location("gpu_check_for_docs", REPO / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpu_check  # its dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(gpu_check)
    assert set(gpu_check.TEST_REQUIRED.values()) <= bench
    cuda13 = {re.split(r"[<>=!~ \[]", r, 1)[0].lower() for r in project["optional-dependencies"]["cuda13"]}
    assert "cupy" in gpu_check.REQUIRED and "cupy-cuda13x" in cuda13
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "pip install -e '.[cuda13,bench]'" in readme and "benchmarks/gpu_check.py OUTDIR" in readme
