"""The fagen CLI: JSON outputs, cached compiles, one-line errors with exit code 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fagen.cli import main
from fagen.generate import all_specs, feature_matrix, hopper_matrix


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fagen.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_inspect_acceptance(capsys: pytest.CaptureFixture) -> None:
    rc = main(["inspect", "--head-dim", "64", "--dtype", "float16", "--sram-bytes", "65536", "--arch", "sm_90", "--json"])
    assert rc == 0
    info = json.loads(capsys.readouterr().out)
    assert info["paper_block_c"] == 128 and info["paper_block_r"] == 64
    assert info["smem_bytes"] <= 65536
    for key in ("name", "head_dim", "dtype", "arch", "sram_bytes", "block_r", "block_c", "num_warps", "smem_breakdown"):
        assert key in info
    assert sum(info["smem_breakdown"].values()) == info["smem_bytes"]


def test_inspect_table(capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", "--head-dim", "128", "--causal", "--dropout"]) == 0
    out = capsys.readouterr().out
    assert "paper_block_c" in out and "smem[k]" in out and "fa_bwd_d128_fp16_causal_dropout" in out


def test_version(capsys: pytest.CaptureFixture) -> None:
    import fagen

    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0
    assert capsys.readouterr().out.strip() == f"fagen {fagen.__version__}"


def test_compile_json_then_cached(tmp_path: Path) -> None:
    env = {"FAGEN_CACHE_DIR": str(tmp_path)}
    args = ["compile", "--head-dim", "64", "--dtype", "float16", "--causal", "--dropout", "--arch", "sm_90", "--json"]
    first = run_cli(*args, env=env)
    assert first.returncode == 0, first.stderr
    rows = json.loads(first.stdout)
    assert len(rows) == 3
    for r in rows:
        assert r["spill_bytes"] == 0 and r["cached"] is False
        for key in ("kernel", "registers", "smem_bytes", "compile_seconds"):
            assert key in r
    second = json.loads(run_cli(*args, env=env).stdout)
    assert all(r["cached"] is True for r in second)


def test_generate_one_and_all(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--head-dim", "32", "--dtype", "bfloat16", "--impl", "simt", "--out", str(tmp_path / "one")]) == 0
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["fa_bwd_d32_bf16_br32_bc128_w4_simt_sm90.cu", "manifest.json"]
    assert main(["generate", "--all", "--out", str(tmp_path / "all")]) == 0
    manifest = json.loads((tmp_path / "all" / "manifest.json").read_text())
    assert len(manifest) == len(all_specs()) == 48 + len(hopper_matrix()) + len(feature_matrix())
    (tmp_path / "all" / "hand_written.cu").write_text("// not fagen's\n")  # --all must leave it alone
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "all").iterdir()}
    assert main(["generate", "--all", "--out", str(tmp_path / "all")]) == 0
    assert "0 file(s) written" in capsys.readouterr().out.splitlines()[-1]
    assert before == {p.name: p.stat().st_mtime_ns for p in (tmp_path / "all").iterdir()}
    assert (tmp_path / "all" / "hand_written.cu").read_text() == "// not fagen's\n"


@pytest.mark.parametrize(
    "args, option",
    [
        (["inspect", "--head-dim", "65"], "--head-dim"),
        (["inspect", "--head-dim", "64", "--sram-bytes", "1000000"], "--sram-bytes"),
        (["inspect", "--head-dim", "64", "--impl", "simt", "--block-c", "128", "--block-r", "128", "--sram-bytes", "60000"],
         "--block-c"),
        (["inspect", "--head-dim", "64", "--block-r", "20"], "--block-r"),
        (["inspect", "--head-dim", "64", "--num-warps", "5"], "--num-warps"),
        (["inspect", "--head-dim", "64", "--impl", "tensorcore9000"], "--impl"),
        (["inspect", "--head-dim", "64", "--dtype", "fp8"], "--dtype"),
        (["inspect", "--head-dim", "64", "--arch", "sm_75"], "--arch"),
        (["inspect", "--head-dim", "abc"], "--head-dim"),
        (["inspect"], "--head-dim"),
        (["compile", "--head-dim", "64", "--bogus"], "--bogus"),
        (["generate", "--all"], "--out"),
        (["autotune", "--head-dim", "64", "--heads", "2", "--seqlen", "128"], "--batch"),
        (["autotune", "--head-dim", "64", "--batch", "0", "--heads", "2", "--seqlen", "128", "--dry-run"], "--batch"),
    ],
)
def test_errors_are_one_line_exit_2(args: list[str], option: str) -> None:
    res = run_cli(*args)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert option in lines[0]
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("cache_dir", ["/etc/passwd/x", "/dev/null"])
def test_unusable_cache_dir_is_one_line_exit_2(cache_dir: str) -> None:
    res = run_cli("compile", "--head-dim", "64", env={"FAGEN_CACHE_DIR": cache_dir})
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith(f"fagen: error: FAGEN_CACHE_DIR: expected a writable directory for fagen's cache, "
                               f"got {cache_dir} (")


def test_autotune_with_an_unusable_cache_dir_stops_at_once() -> None:
    res = run_cli("autotune", "--head-dim", "64", "--batch", "1", "--heads", "2", "--seqlen", "128", "--dry-run",
                  env={"FAGEN_CACHE_DIR": "/dev/null"})
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        "fagen: error: FAGEN_CACHE_DIR: expected a writable directory for fagen's cache, got /dev/null "
        "(Not a directory)"], res.stderr


def test_a_closed_stdout_pipe_is_no_traceback() -> None:
    """`fagen inspect ... | head -1`: the reader leaves before fagen writes; fagen stops quietly (exit 1,
    nothing on stderr), as a command-line tool does, instead of a BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "fagen.cli", "inspect", "--head-dim", "64", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # closed before the interpreter has even imported fagen
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and err == "", err
