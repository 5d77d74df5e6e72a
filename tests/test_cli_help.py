"""The command line explains itself: usage for bare `fagen`, help text with choices and defaults
for every option (taken from the spec and the family registry), the real problem when autotune
has no GPU, and one log line per compile / build when stderr is not a terminal."""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from fagen import cli
from fagen.families import family_names
from fagen.spec import NUM_WARPS_CHOICES, KernelSpec


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fagen.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_bare_fagen_prints_usage_and_the_commands() -> None:
    res = run_cli()
    assert res.returncode == 2
    assert res.stderr.startswith("usage: fagen")
    for command in ("inspect", "generate", "compile", "autotune"):
        assert command in res.stderr
    assert "--help" in res.stderr and res.stdout == ""


def test_bare_fagen_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert capsys.readouterr().err.startswith("usage: fagen")


@pytest.mark.parametrize("command", ["inspect", "generate", "compile", "autotune", "tune-codegen"])
def test_every_option_has_help_with_its_default(command: str) -> None:
    p = _subparsers()[command]
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0]
        assert action.help, f"{command} {name} has no help text"
        text = action.help % {"default": action.default}
        assert "default" in text or "required" in text, f"{command} {name}: {text!r} names no default"


def test_spec_option_choices_come_from_the_spec() -> None:
    p = _subparsers()["inspect"]
    actions = {a.option_strings[0]: a for a in p._actions if a.option_strings}
    fields = KernelSpec.model_fields
    for option, field in (("--direction", "direction"), ("--dtype", "dtype"), ("--arch", "arch")):
        assert tuple(actions[option].choices) == typing.get_args(fields[field].annotation), option
        assert actions[option].default == fields[field].default, option
    assert actions["--num-warps"].default == fields["num_warps"].default
    assert "{" + ",".join(map(str, NUM_WARPS_CHOICES)) + "}" in actions["--num-warps"].help
    assert "{" + ",".join(family_names()) + "}" in actions["--impl"].help
    assert actions["--impl"].default == fields["impl"].default  # the spec picks the family


def test_help_shows_choices_and_defaults() -> None:
    res = run_cli("autotune", "--help")
    assert res.returncode == 0, res.stderr
    out = " ".join(res.stdout.split())
    fields = KernelSpec.model_fields
    for option, field in (("--dtype", "dtype"), ("--arch", "arch")):
        choices = "{" + ",".join(typing.get_args(fields[field].annotation)) + "}"
        assert f"{option} {choices}" in out, option
    assert "(default: float16)" in out and "(default: sm_90)" in out
    assert "candidates to time on the GPU, besides the default tile (default: 4)" in out
    assert "print the result as JSON (default: a table)" in out


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda(), reason="checks the no-GPU message")
def test_autotune_without_gpu_names_the_real_problem() -> None:
    res = run_cli("autotune", "--head-dim", "64", "--batch", "1", "--heads", "2", "--seqlen", "128")
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines == ["fagen: error: no CUDA GPU to time the candidates on (torch sees none); "
                     "add --dry-run to rank them by the cost model alone"], res.stderr


# --------------------------------------------------------------------------- logging
def test_cli_logs_each_compile_on_stderr(tmp_path: Path) -> None:
    args = ("compile", "--head-dim", "16", "--direction", "fwd", "--dtype", "float32", "--json")
    first = run_cli(*args, env={"FAGEN_CACHE_DIR": str(tmp_path)})
    assert first.returncode == 0, first.stderr
    spec = KernelSpec(head_dim=16, direction="fwd", dtype="float32")
    assert f"fagen: compiling {spec.name} for sm_90 with NVRTC" in first.stderr.splitlines()
    again = run_cli(*args, env={"FAGEN_CACHE_DIR": str(tmp_path)})
    assert again.returncode == 0 and "compiling" not in again.stderr  # cached: nothing to report


def test_cli_logging_goes_to_the_current_stderr_and_is_removed(capsys: pytest.CaptureFixture[str]) -> None:
    log = logging.getLogger("fagen")
    before = list(log.handlers), log.level
    assert cli.main(["inspect", "--head-dim", "64", "--json"]) == 0
    assert (list(log.handlers), log.level) == before
    assert capsys.readouterr().err == ""


def test_emulator_build_logs_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from fagen.emulator import KernelSig, build

    source = 'extern "C" __global__ void fill(int* out) { out[threadIdx.x] = 7; }\n'
    with caplog.at_level(logging.INFO, logger="fagen"):
        build(source, [KernelSig("fill", (("int*", "out"),))], cache_dir=tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("fagen")]
    assert len(lines) == 1 and lines[0].startswith("building fill for the CPU emulator with "), lines


def test_autotune_progress_is_a_plain_line_per_candidate_off_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    from dataclasses import replace

    from fagen.autotune.candidates import compile_candidates, enumerate_candidates

    cands = enumerate_candidates(KernelSpec(head_dim=32, arch="sm_80", sram_bytes=32768, impl="simt"))
    pending = [c for c in cands if c.status == "pending"]
    assert pending
    with caplog.at_level(logging.INFO, logger="fagen"):
        compile_candidates(cands, workers=1, progress=False, compile_fn=lambda c: replace(c, status="ok"))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("fagen.autotune")]
    assert len(lines) == len(pending)
    assert lines[0].startswith(f"candidate 1/{len(pending)}: ") and lines[-1].endswith(": ok")
