"""Mutation probes: does the test suite catch the bugs that matter?

    python benchmarks/mutations.py [--full] [--only NAME ...] [-n WORKERS] [--no-baseline] [--list]

For each mutation: copy the working tree (tracked and untracked-but-not-ignored files) to a
temporary directory, apply the mutation there (each textual replacement must match exactly
once, or the script stops with an error), and run the test files that should catch it (``--full``:
the whole suite) with ``PYTHONPATH`` at the copy and a fresh, empty cache. A mutation is
"caught" when pytest reports failing tests, "MISSED" when the run passes. First, unless
``--no-baseline``, the same test files run on the unmutated copy and must pass, so a failure
is the mutation's doing. Exit status: 0 when every mutation is caught, 1 when one is missed
(or the baseline fails), 2 when a replacement no longer matches or pytest cannot run.

The repository itself is never modified. ``tests/test_mutations.py`` checks (quickly, in the
suite) that every replacement below still matches exactly once.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Edit:
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]  # the test files that should catch it


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "fwd-q-overrun-simt",
        "SIMT forward loads one Q row past the end of the sequence",
        (Edit("templates/simt/fwd.cu.j2", "load_tile<BLOCK_R>(s.q, q_bh, i0, si.len_q, stride_q_s);",
              "load_tile<BLOCK_R>(s.q, q_bh, i0, si.len_q + 1, stride_q_s);"),),
        ("tests/test_bounds.py",),
    ),
    Mutation(
        "fwd-q-overrun-mma",
        "tensor-core forward copies one Q row past the end of the sequence",
        (Edit("templates/mma/fwd.cu.j2", "mma_copy_tile<BLOCK_R>(s.q, q_bh, i0, len_q, stride_q_s,",
              "mma_copy_tile<BLOCK_R>(s.q, q_bh, i0, len_q + 1, stride_q_s,"),),
        ("tests/test_bounds.py",),
    ),
    Mutation(
        "gpu-float-as-int32",
        "the GPU launcher packs a C float parameter as int32 (a softmax scale of 0.125 arrives as 0)",
        (Edit("fagen/runtime/gpu.py", "            out = np.float32(f)\n", "            out = np.int32(f)\n"),),
        ("tests/test_gpu_launch.py",),
    ),
    Mutation(
        "cubin-half-from-nvrtc",
        "the cubin is taken from NVRTC cut in half",
        (Edit("fagen/nvrtc.py", "    return buf.raw[: n.value]\n", "    return buf.raw[: n.value // 2]\n"),),
        ("tests/test_cubin.py",),
    ),
    Mutation(
        "cubin-half-in-cache",
        "the compile cache stores (and returns) the first half of the cubin, its recorded size halved to match",
        (Edit("fagen/compiler.py", '"cubin_size": len(res.cubin),', '"cubin_size": len(res.cubin) // 2,'),
         Edit("fagen/compiler.py", '"nvrtc_major": nvrtc.version()[0]}, res.cubin\n',
              '"nvrtc_major": nvrtc.version()[0]}, res.cubin[: len(res.cubin) // 2]\n')),
        ("tests/test_cubin.py",),
    ),
)


class MutationError(RuntimeError):
    """A replacement does not match exactly once (the source moved on: update the mutation)."""


def apply(text: str, edit: Edit) -> str:
    """``text`` with ``edit.old`` replaced by ``edit.new``; MutationError unless it occurs exactly once."""
    n = text.count(edit.old)
    if n != 1:
        raise MutationError(f"{edit.path}: expected exactly one occurrence of {edit.old!r}, found {n}")
    return text.replace(edit.old, edit.new)


def mutated_files(m: Mutation, root: Path = REPO) -> dict[str, str]:
    """path -> the mutated text of every file ``m`` edits (read from ``root``)."""
    out: dict[str, str] = {}
    for e in m.edits:
        out[e.path] = apply(out.get(e.path, (root / e.path).read_text()), e)
    return out


def tree_files(root: Path = REPO) -> list[str]:
    """The working tree's files: tracked (as they are now) and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    return sorted({p for p in out.decode().split("\0") if p and (root / p).is_file()})


def copy_tree(dest: Path, files: list[str]) -> None:
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)


def run_pytest(copy: Path, tests: list[str], workers: int, cache: Path) -> tuple[int, str, float]:
    """(pytest exit code, its output, seconds) for ``tests`` run in ``copy`` with ``copy`` first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [env.get("PYTHONPATH")])])
    env["FAGEN_CACHE_DIR"] = str(cache)
    env["FAGEN_TEST_CACHE_DIR"] = str(cache)  # tests/conftest.py: the run's shared cache
    env["COLUMNS"] = "400"  # pytest's short summary keeps the start of each failure's message
    where = subprocess.run([sys.executable, "-c", "import fagen; print(fagen.__file__)"], cwd=copy, env=env,
                           capture_output=True, text=True, check=False).stdout.strip()
    if not where.startswith(str(copy)):
        raise MutationError(f"the copy's fagen is not the one imported ({where or 'import failed'})")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    if workers > 1:
        cmd += ["-n", str(workers)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd + tests, cwd=copy, env=env, capture_output=True, text=True, check=False)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0


def _failed(output: str) -> list[str]:
    """The short summary's failing tests, each with the start of its message."""
    return [ln[:400] for ln in re.findall(r"^(?:FAILED|ERROR) (\S+.*)$", output, flags=re.M)]


def _summary(output: str) -> str:
    lines = [ln for ln in output.strip().splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", ln)]
    return lines[-1].strip("= ") if lines else "no pytest summary"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="run the whole suite for each mutation")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="these mutations only")
    ap.add_argument("-n", type=int, default=2, metavar="WORKERS", help="pytest-xdist workers (default 2)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run on the unmutated copy")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = ap.parse_args(argv)

    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = sorted(set(args.only or ()) - {m.name for m in MUTATIONS})
    if unknown:
        ap.error(f"unknown mutation(s) {unknown}; have {[m.name for m in MUTATIONS]}")
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what} [{', '.join(sorted({e.path for e in m.edits}))}] -> {' '.join(m.tests)}")
        return 0
    try:
        texts = {m.name: mutated_files(m) for m in chosen}  # every replacement checked before any run
    except MutationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    files = tree_files()
    results: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="fagen-mutations-") as tmp:
        copy, scratch = Path(tmp, "tree"), Path(tmp)
        copy_tree(copy, files)
        print(f"copied {len(files)} files of {REPO} to {copy}")
        selection = lambda m: ["tests"] if args.full else list(m.tests)  # noqa: E731
        try:
            if not args.no_baseline:
                union = sorted({t for m in chosen for t in selection(m)})
                code, out, secs = run_pytest(copy, union, args.n, scratch / "cache-baseline")
                print(f"baseline (unmutated): pytest {' '.join(union)} -> exit {code}, {_summary(out)} ({secs:.0f} s)")
                if code != 0:
                    print(out[-4000:])
                    print("baseline fails: fix the suite before judging mutations")
                    return 1
            for m in chosen:
                originals = {p: (copy / p).read_text() for p in texts[m.name]}
                for p, text in texts[m.name].items():
                    (copy / p).write_text(text)
                try:
                    code, out, secs = run_pytest(copy, selection(m), args.n, scratch / f"cache-{m.name}")
                finally:
                    for p, text in originals.items():
                        (copy / p).write_text(text)
                failed = _failed(out)
                if code != 0 and failed:  # 1: tests failed; 2: -x interrupted the xdist workers after one
                    verdict = "caught"
                elif code == 0:
                    verdict = "MISSED"
                else:
                    verdict = "ERROR"
                results.append((m.name, verdict))
                print(f"\n{m.name}: {m.what}")
                for e in m.edits:
                    print(f"  {e.path}: {e.old.strip()!r} -> {e.new.strip()!r}")
                print(f"  ran: pytest -x {' '.join(selection(m))} ({secs:.0f} s): {_summary(out)}")
                for f in failed[:3]:
                    print(f"  failed: {f}")
                if verdict == "ERROR":
                    print(out[-4000:])
                print(f"  -> {verdict}")
        except MutationError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print("\n" + "\n".join(f"{verdict:7s} {name}" for name, verdict in results))
    if any(v == "ERROR" for _, v in results):
        return 2
    return 1 if any(v == "MISSED" for _, v in results) else 0


if __name__ == "__main__":
    sys.exit(main())
