"""Autotuner: candidates and pruning, cost model and ranking, CLI, persistence, GPU timing."""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import warnings
from pathlib import Path

import pytest

import fagen.settings
from fagen.autotune import candidates as cand_mod
from fagen.autotune import cli as at_cli
from fagen.autotune import store
from fagen.autotune.candidates import Candidate, check_resources, enumerate_candidates, tile_sizes
from fagen.autotune.model import (Problem, device_model, hbm_bytes, lds_wavefronts, occupancy, predict, rank,
                                  seqlen_bucket, simt_pair_cost)
from fagen.autotune.timing import DeviceInfo
from fagen.autotune.tuner import gpu_check_rows, spearman, tune
from fagen.compiler import KernelResources
from fagen.errors import CompileError, InputError, NoGPUError
from fagen.families import get_family
from fagen.spec import ARCH_SMEM_OPTIN, KernelSpec

#: A small M keeps the compiled candidates few (about 27 modules at d=32).
SMALL = KernelSpec(head_dim=32, dtype="float16", arch="sm_80", sram_bytes=32768)
FAKE_DEVICE = DeviceInfo("NVIDIA A100-SXM4-80GB", (8, 0), 108, "sm_80")


def _cuda() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return bool(torch.cuda.is_available())


@pytest.fixture(scope="module")
def small_result():
    """One dry run of SMALL, shared by the tests (compiles go to the session cache)."""
    return tune(SMALL, batch=2, heads=4, seqlen=1000, dry_run=True, progress=False)


@pytest.fixture
def store_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private FAGEN_CACHE_DIR (so xdist workers never share a tuning store) whose cubin/
    folder links to the run's shared one, so compiled candidates are still cache hits."""
    shared_cubins = fagen.settings.get_settings().cache_dir / "cubin"
    shared_cubins.mkdir(parents=True, exist_ok=True)
    root = tmp_path / "cache"
    root.mkdir()
    (root / "cubin").symlink_to(shared_cubins, target_is_directory=True)
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(root))
    monkeypatch.delenv("FAGEN_AUTOTUNE_LOOKUP", raising=False)
    fagen.settings.reset()
    yield root
    fagen.settings.reset()


# --------------------------------------------------------------------------- candidates
def test_tile_sizes_of_simt() -> None:
    assert tile_sizes(get_family("simt")) == (16, 32, 64, 96, 128)


def test_enumeration_covers_grid_paper_point_and_default() -> None:
    spec = KernelSpec(head_dim=128, dtype="float16", causal=True, arch="sm_90")
    cands = enumerate_candidates(spec)
    keys = {c.key for c in cands}
    for br in (16, 32, 64, 128):
        for bc in (16, 32, 64, 128):
            for w in (2, 4, 8):
                assert ("simt", br, bc, w) in keys
    paper = [c for c in cands if c.is_paper]
    assert {(c.block_r, c.block_c) for c in paper} == {(spec.tile.block_r, spec.tile.block_c)}
    assert [c.key for c in cands if c.is_default] == [("simt", spec.tile.block_r, spec.tile.block_c, 4)]
    assert len(keys) == len(cands)  # no duplicates
    for c in cands:
        assert c.smem_bytes is not None
        if c.smem_bytes > ARCH_SMEM_OPTIN["sm_90"]:
            assert c.status == "rejected"
            assert c.reason == f"smem {c.smem_bytes} B > sm_90 per-block opt-in 232448"
        else:
            assert c.status == "pending" and c.spec is not None
            assert c.spec.smem_bytes == c.smem_bytes  # the family layout is the spec's layout


def test_small_sram_rejects_large_tiles_with_smem_reason() -> None:
    cands = enumerate_candidates(SMALL)
    by_key = {c.key: c for c in cands}
    big = by_key[("simt", 128, 128, 4)]
    assert big.status == "rejected"
    assert big.reason == f"smem {big.smem_bytes} B > sram_bytes 32768"
    assert by_key[("simt", 16, 16, 4)].status == "pending"
    for c in cands:
        assert (c.status == "rejected") == (c.smem_bytes > 32768)


def test_validation_error_is_a_rejection() -> None:
    cands = enumerate_candidates(SMALL, sizes=(16,), warps=(3,))
    bad = [c for c in cands if c.num_warps == 3]
    assert bad and all(c.status == "rejected" and "num_warps must be one of" in c.reason for c in bad)


def test_compile_error_is_a_rejection(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(spec: KernelSpec):
        raise CompileError(spec.name, "x.cu(1): error: something broke\n")

    monkeypatch.setattr(cand_mod, "compile_spec", boom)
    out = cand_mod.compile_candidates(enumerate_candidates(SMALL, sizes=(16,), warps=(4,)), progress=False)
    assert out and all(c.status == "rejected" and c.reason.startswith("compile error: ") for c in out)
    assert "something broke" in out[0].reason


class _FakeModule:
    def __init__(self, regs: int, spills: int) -> None:
        self.resources = tuple(
            KernelResources(f"k_{role}", regs, spills, 0, 0, 0, 0, 1, 0.0) for role in ("pre", "main", "post"))

    def resource(self, role: str) -> KernelResources:
        return next(r for r in self.resources if r.kernel == f"k_{role}")


def test_resource_pruning() -> None:
    c = Candidate("simt", 16, 16, 4)
    assert check_resources(c, _FakeModule(64, 0)).status == "ok"  # type: ignore[arg-type]
    spilled = check_resources(c, _FakeModule(64, 32))  # type: ignore[arg-type]
    assert spilled.status == "rejected" and spilled.reason.startswith("spills 96 B")
    wide = check_resources(Candidate("simt", 16, 16, 8), _FakeModule(256, 0))  # type: ignore[arg-type]
    assert wide.status == "rejected" and "launch bounds" in wide.reason  # > 255 per thread


def test_dry_run_result(small_result) -> None:
    r = small_result
    assert r.ok and r.rejected and r.best is not None and not r.timed
    assert r.best == r.ok[0]
    assert r.problem == Problem(2, 4, 1024, 1024)
    for c in r.ok:
        assert c.smem_bytes <= 32768 and c.spill_bytes == 0 and c.registers and c.registers <= 255
        assert c.predicted_ms is not None and c.predicted_ms > 0 and 0 < c.occupancy <= 1
    for c in r.rejected:
        assert c.reason


# --------------------------------------------------------------------------- model
def test_ranking_is_deterministic(small_result) -> None:
    cands = list(small_result.candidates)
    for seed in range(3):
        shuffled = cands[:]
        random.Random(seed).shuffle(shuffled)
        assert rank(shuffled) == cands
    ms = [c.predicted_ms for c in small_result.ok]
    assert ms == sorted(ms)


def test_model_io_and_occupancy() -> None:
    spec = KernelSpec(head_dim=64, dtype="float16", arch="sm_90")
    p = Problem(1, 1, 4096, 4096)
    # backward: Q, dO, lse, D are re-read once per K/V block, so wider B_c moves fewer bytes
    assert hbm_bytes(spec, p, 64, 128) < hbm_bytes(spec, p, 64, 64) < hbm_bytes(spec, p, 64, 16)
    causal = spec.replace(causal=True)
    assert 0.4 < hbm_bytes(causal, p, 64, 64) / hbm_bytes(spec, p, 64, 64) < 0.6
    occ = occupancy("sm_90", 4, 64, 100_000)
    assert (occ.blocks_per_sm, occ.limiter) == (2, "smem")
    occ = occupancy("sm_80", 8, 128, 1000)
    assert (occ.blocks_per_sm, occ.limiter) == (2, "registers")
    dev = device_model("sm_90", "NVIDIA H200", 132)
    assert dev.hbm_bytes_per_s == 4.8e12 and dev.fp32_flops_per_s == pytest.approx(66.9e12, rel=0.01)
    pred = predict(spec.replace(block_r=64, block_c=64), Problem(4, 16, 4096, 4096), 64, dev)
    assert math.isfinite(pred.seconds) and pred.wave_factor >= 1 and pred.bound in pred.terms


def test_bank_conflict_model() -> None:
    assert lds_wavefronts([4 * i for i in range(32)]) == 1  # consecutive words
    assert lds_wavefronts([0] * 32) == 1  # broadcast
    assert lds_wavefronts([128 * i for i in range(32)]) == 32  # same bank, distinct words
    spec = KernelSpec(head_dim=64, dtype="float16", arch="sm_90")
    small, wide = simt_pair_cost(spec, 64, 32), simt_pair_cost(spec, 64, 64)
    assert wide.lds_wavefronts == 2 * small.lds_wavefronts  # full warps: work scales with the tile
    assert small.wavefronts_per_iteration >= 8  # 4 A + 4 B loads per k step, at least 1 wavefront each


def test_seqlen_bucket() -> None:
    assert [seqlen_bucket(n) for n in (1, 16, 17, 1000, 1024, 4096, 4097)] == [16, 16, 32, 1024, 1024, 4096, 8192]


# --------------------------------------------------------------------------- CLI
def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    at_cli.add_arguments(p)
    return p.parse_args(list(argv))


def _check_json(doc: dict, sram: int) -> None:
    assert set(doc) >= {"spec", "candidates", "best"}
    assert doc["best"] is not None and doc["best"]["status"] == "ok"
    statuses = {c["status"] for c in doc["candidates"]}
    assert statuses == {"ok", "rejected"}
    for c in doc["candidates"]:
        assert set(c) >= {"block_r", "block_c", "num_warps", "impl", "smem_bytes", "registers", "spill_bytes",
                          "occupancy", "predicted_ms", "status", "reason"}
        if c["status"] == "ok":
            assert c["smem_bytes"] <= sram and c["spill_bytes"] == 0 and c["predicted_ms"] > 0
            assert c["reason"] is None
        else:
            assert c["reason"]
            if c["reason"].startswith("smem"):
                assert c["registers"] is None and c["spill_bytes"] is None and c["predicted_ms"] is None


def test_cli_dry_run_json(small_result, capsys: pytest.CaptureFixture[str]) -> None:
    rc = at_cli.run(_args("--batch", "2", "--heads", "4", "--seqlen", "1000", "--dry-run", "--json"), SMALL)
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    _check_json(doc, 32768)
    assert doc["spec"] == SMALL.model_dump()
    assert (doc["best"]["block_r"], doc["best"]["block_c"]) == (small_result.best.block_r, small_result.best.block_c)


def test_cli_dry_run_table(small_result, capsys: pytest.CaptureFixture[str]) -> None:
    assert at_cli.run(_args("--batch", "2", "--heads", "4", "--seqlen", "1000", "--dry-run"), SMALL) == 0
    out = capsys.readouterr().out
    assert "predicted ms" in out and "rejected (" in out and "> sram_bytes 32768" in out and "best:" in out


def test_cli_through_main(small_result, capsys: pytest.CaptureFixture[str]) -> None:
    main_cli = pytest.importorskip("fagen.cli")
    parser = main_cli.build_parser()
    try:
        parser.parse_args(["autotune", "--head-dim", "32", "--batch", "1", "--heads", "1", "--seqlen", "16"])
    except BaseException:  # noqa: BLE001 - the subcommand is not wired yet
        pytest.skip("fagen.cli has no autotune subcommand")
    rc = main_cli.main(["autotune", "--head-dim", "32", "--dtype", "float16", "--arch", "sm_80",
                        "--sram-bytes", "32768", "--batch", "2", "--heads", "4", "--seqlen", "1000",
                        "--dry-run", "--json"])
    assert rc == 0
    _check_json(json.loads(capsys.readouterr().out), 32768)


def test_cli_bad_options() -> None:
    with pytest.raises(InputError, match="--batch: expected a positive integer, got 0"):
        at_cli.run(_args("--batch", "0", "--heads", "4", "--seqlen", "16", "--dry-run"), SMALL)
    with pytest.raises(InputError, match="--top"):
        at_cli.run(_args("--batch", "1", "--heads", "4", "--seqlen", "16", "--top", "-1", "--dry-run"), SMALL)


@pytest.mark.skipif(_cuda(), reason="checks the no-GPU message")
def test_cli_without_gpu_needs_dry_run() -> None:
    with pytest.raises(NoGPUError, match="no CUDA GPU .* add --dry-run"):
        at_cli.run(_args("--batch", "1", "--heads", "1", "--seqlen", "16"), SMALL)


# --------------------------------------------------------------------------- persistence
def _record(spec: KernelSpec, seqlen: int, device: str = "NVIDIA H100 80GB HBM3") -> None:
    store.record(spec, seqlen_q=seqlen, seqlen_k=seqlen, device_name=device, capability=(9, 0),
                 batch=1, heads=1, measured_ms=1.0)


def _lookup(spec: KernelSpec, seqlen: int, device: str = "NVIDIA H100 80GB HBM3") -> KernelSpec | None:
    return store.lookup(spec, batch=1, heads=1, seqlen_q=seqlen, seqlen_k=seqlen, device_name=device,
                        capability=(9, 0))


BASE = KernelSpec(head_dim=64, dtype="float16", arch="sm_90")


def test_persistence_round_trip(store_dir: Path) -> None:
    assert _lookup(BASE, 4096) is None
    _record(BASE.replace(block_r=32, block_c=16, num_warps=8), 4096)
    got = _lookup(BASE, 3000)  # same bucket
    assert got == BASE.replace(block_r=32, block_c=16, num_warps=8)
    assert _lookup(BASE, 8192) is None
    assert _lookup(BASE, 4096, device="NVIDIA H200") is None
    assert _lookup(BASE.replace(causal=True), 4096) is None
    assert _lookup(BASE.replace(num_warps=2), 4096) == got  # tiles and warps are not part of the key
    doc = json.loads(store.store_path().read_text())
    (entry,) = doc["entries"].values()
    assert entry["key"]["spec"] == BASE.without_tiles() and entry["key"]["seqlen_bucket"] == [4096, 4096]
    assert entry["choice"] == {"block_r": 32, "block_c": 16, "num_warps": 8, "impl": "simt"}


def test_lookup_off_via_settings(store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _record(BASE.replace(block_r=32, block_c=16), 1024)
    assert _lookup(BASE, 1024) is not None
    fagen.settings.configure(autotune_lookup=False)
    assert _lookup(BASE, 1024) is None
    fagen.settings.reset()
    monkeypatch.setenv("FAGEN_AUTOTUNE_LOOKUP", "0")
    fagen.settings.reset()
    assert _lookup(BASE, 1024) is None


def test_tuned_or_default_on_cpu(store_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    _record(BASE.replace(block_r=32, block_c=16), 1024)
    out = store.tuned_or_default(BASE, batch=1, heads=1, seqlen_q=1024, seqlen_k=1024, device=torch.device("cpu"))
    assert out is BASE


def test_corrupt_file_is_ignored_and_rewritten(store_dir: Path) -> None:
    path = store.store_path()
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="corrupt tuning file"):
        assert _lookup(BASE, 1024) is None
    with pytest.warns(UserWarning, match="corrupt tuning file"):
        _record(BASE.replace(block_r=32, block_c=32), 1024)
    doc = json.loads(path.read_text())
    assert doc["format"] == store.FORMAT and len(doc["entries"]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _lookup(BASE, 1024) == BASE.replace(block_r=32, block_c=32)


def _record_many(cache_dir: str, tag: str, count: int) -> None:
    import os

    os.environ["FAGEN_CACHE_DIR"] = cache_dir
    fagen.settings.reset()
    for i in range(count):
        _record(BASE.replace(block_r=16, block_c=16), 1024, device=f"{tag}-{i}")


def test_concurrent_recorders(store_dir: Path) -> None:
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    procs = [ctx.Process(target=_record_many, args=(str(store_dir), tag, 25)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    doc = json.loads(store.store_path().read_text())  # valid JSON
    assert len(doc["entries"]) == 50
    for tag in ("a", "b"):
        for i in range(25):
            assert _lookup(BASE, 1024, device=f"{tag}-{i}") == BASE.replace(block_r=16, block_c=16)


# --------------------------------------------------------------------------- timing (injected timer)
def test_timed_search_with_fake_timer(store_dir: Path, small_result) -> None:
    # an injected timer: the model's prediction reversed, and one candidate that "fails to launch"
    ok = small_result.ok
    failing = ok[0].key
    calls: list[tuple] = []

    def timer(spec: KernelSpec, p: Problem) -> float:
        key = (spec.impl, spec.tile.block_r, spec.tile.block_c, spec.num_warps)
        calls.append(key)
        if key == failing:
            return math.inf
        return 100.0 - next(c.predicted_ms for c in ok if c.key == key) * 1e-3

    r = tune(SMALL, batch=2, heads=4, seqlen=1000, dry_run=False, top=3, timer=timer, device=FAKE_DEVICE,
             progress=False)
    timed = {c.key for c in r.candidates if c.measured_ms is not None}
    assert timed == {c.key for c in ok[:3]} | {c.key for c in ok if c.is_default}
    assert set(calls) == timed
    finite = [c for c in r.candidates if c.measured_ms is not None and math.isfinite(c.measured_ms)]
    assert r.best == min(finite, key=lambda c: c.measured_ms)
    got = store.lookup(SMALL, batch=2, heads=4, seqlen_q=1000, seqlen_k=1000, device_name=FAKE_DEVICE.name,
                       capability=FAKE_DEVICE.capability)
    assert got == r.best.spec
    assert r.tflops(r.best) is not None and r.tflops(r.best) > 0


def test_gpu_check_rows_with_fake_timer(store_dir: Path) -> None:
    def timer(spec: KernelSpec, p: Problem) -> float:  # proportional to the block count: a made-up device
        return 1.0 + 1.0 / (spec.tile.block_r * spec.tile.block_c)

    rows = gpu_check_rows([(2, 4, 512, 32, "float16", False)], top=2, timer=timer, device=FAKE_DEVICE,
                          sizes=(16, 32), warps=(4,))
    (row,) = rows
    assert row["spec"].startswith("fa_bwd_d32_fp16")
    assert len(row["candidates"]) >= 2
    for c in row["candidates"]:
        assert {"predicted_ms", "measured_ms", "rank_predicted", "rank_measured"} <= set(c)
    assert row["spearman"] is None or -1.0 <= row["spearman"] <= 1.0
    assert not store.store_path().exists()  # the check records nothing


def test_spearman() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)
    assert spearman([1], [1]) is None


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_tuned_not_slower_than_default(store_dir: Path) -> None:
    from fagen.autotune.timing import CudaTimer, current_device

    dev = current_device()
    if dev.arch is None:
        pytest.skip(f"unsupported device {dev.name}")
    spec = KernelSpec(head_dim=64, dtype="float16", arch=dev.arch)  # type: ignore[arg-type]
    r = tune(spec, batch=2, heads=8, seqlen=1024, dry_run=False, top=3, persist=False, progress=False)
    assert r.best is not None and r.default is not None
    p = r.problem
    timer = CudaTimer(warmup=3, reps=15)
    best_ms, default_ms = timer(r.best.spec, p), timer(spec, p)
    assert best_ms <= default_ms * 1.10
