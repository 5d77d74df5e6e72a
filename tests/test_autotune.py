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
from fagen import choices as store
from fagen.autotune.candidates import Candidate, check_resources, enumerate_candidates, tile_sizes
from fagen.autotune.model import (Workload, device_model, hbm_bytes, l2_hit_fraction, lds_wavefronts, occupancy, predict,
                                  rank, reread_bytes,
                                  seqlen_bucket, simt_pair_cost)
from fagen.autotune.timing import DeviceInfo
from fagen.autotune.tuner import gpu_check_rows, spearman, tune
from fagen.compiler import KernelResources
from fagen.errors import CompileError, InputError, NoGPUError
from fagen.families import FamilySpec, family_names, get_family
from fagen.spec import ARCH_SMEM_OPTIN, KernelSpec

#: A small M keeps the compiled candidates few (about 15 modules at d=32, both families).
SMALL = KernelSpec(head_dim=32, dtype="float16", arch="sm_80", sram_bytes=16384, impl="simt")
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
    """A private FAGEN_CACHE_DIR (so xdist workers never share a tuning store) whose cubin/ and
    sass/ folders link to the run's shared ones, so compiled and disassembled candidates are still
    cache hits."""
    root = tmp_path / "cache"
    root.mkdir()
    for kind in ("cubin", "sass"):
        shared = fagen.settings.get_settings().cache_dir / kind
        shared.mkdir(parents=True, exist_ok=True)
        (root / kind).symlink_to(shared, target_is_directory=True)
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(root))
    monkeypatch.delenv("FAGEN_AUTOTUNE_LOOKUP", raising=False)
    fagen.settings.reset()
    yield root
    fagen.settings.reset()


# --------------------------------------------------------------------------- candidates
def test_tile_sizes_of_simt() -> None:
    assert tile_sizes(get_family("simt")) == (16, 32, 64, 96, 128)


def test_enumeration_covers_grid_paper_point_and_default() -> None:
    spec = KernelSpec(head_dim=128, dtype="float16", causal=True, arch="sm_90", impl="simt")
    all_cands = enumerate_candidates(spec)
    keys = {c.key for c in all_cands}
    assert len(keys) == len(all_cands)  # no duplicates
    assert {c.impl for c in all_cands} == set(family_names())  # every family that supports the spec
    cands = [c for c in all_cands if c.impl == "simt"]
    for br in (16, 32, 64, 128):
        for bc in (16, 32, 64, 128):
            for w in (2, 4, 8):
                assert ("simt", br, bc, w, ()) in keys
    paper = [c for c in cands if c.is_paper]
    assert {(c.block_r, c.block_c) for c in paper} == {(spec.tile.block_r, spec.tile.block_c)}
    assert [c.key for c in all_cands if c.is_default] == [("simt", spec.tile.block_r, spec.tile.block_c, 4, ())]
    for c in cands:
        assert c.smem_bytes is not None
        if c.smem_bytes > ARCH_SMEM_OPTIN["sm_90"]:
            assert c.status == "rejected"
            assert c.reason == f"smem {c.smem_bytes} B > sm_90 per-block opt-in 232448"
        else:
            assert c.status == "pending" and c.spec is not None
            assert c.spec.smem_bytes == c.smem_bytes  # the family layout is the spec's layout


def test_small_sram_rejects_large_tiles_with_smem_reason() -> None:
    cands = [c for c in enumerate_candidates(SMALL) if c.impl == "simt"]
    by_key = {c.key: c for c in cands}
    big = by_key[("simt", 128, 128, 4, ())]
    assert big.status == "rejected"
    assert big.reason == f"smem {big.smem_bytes} B > sram_bytes {SMALL.sram_bytes}"
    assert by_key[("simt", 16, 16, 4, ())].status == "pending"
    for c in cands:
        assert (c.status == "rejected") == (c.smem_bytes > SMALL.sram_bytes)


def test_validation_error_is_a_rejection() -> None:
    cands = enumerate_candidates(SMALL, sizes=(16,), warps=(3,))
    bad = [c for c in cands if c.num_warps == 3]
    assert bad and all(c.status == "rejected" for c in bad)
    # families that take the problem's arch reject the warps by name; wgmma (sm_90a only) the arch first
    assert all("num_warps must be one of" in c.reason for c in bad if c.impl != "wgmma")
    assert all("sm_90a" in c.reason for c in bad if c.impl == "wgmma")


def test_compile_error_is_a_rejection(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(spec: KernelSpec):
        raise CompileError(spec.name, "x.cu(1): error: something broke\n")

    monkeypatch.setattr(cand_mod, "compile_spec", boom)
    before = enumerate_candidates(SMALL, sizes=(16,), warps=(4,))
    out = cand_mod.compile_candidates(before, progress=False)
    out = [c for c, b in zip(out, before) if b.status == "pending"]
    assert out and all(c.status == "rejected" and c.reason.startswith("compile error: ") for c in out)
    assert "something broke" in out[0].reason


class _FakeModule:
    spec = SMALL

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
    assert r.problem == Workload(2, 4, 1024, 1024)
    for c in r.ok:
        assert c.smem_bytes <= SMALL.sram_bytes and c.spill_bytes == 0 and c.registers and c.registers <= 255
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
    p = Workload(1, 1, 4096, 4096)
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
    pred = predict(spec.replace(block_r=64, block_c=64), Workload(4, 16, 4096, 4096), 64, dev)
    assert math.isfinite(pred.seconds) and pred.wave_factor >= 1 and pred.bound in pred.terms


def test_l2_serves_the_rereads_while_the_resident_heads_fit() -> None:
    """The forward re-reads K_j, V_j once per Q block: at 4k keys one head's K/V (1 MiB at d = 64)
    stays in the L2 and only the first read reaches HBM; at 2M keys (512 MiB) the re-reads mostly miss."""
    dev = device_model("sm_90")
    spec = KernelSpec(direction="fwd", head_dim=64, dtype="float16", arch="sm_90", impl="mma",
                      block_r=64, block_c=64, num_warps=4)
    small, big = Workload(2, 8, 4096, 4096), Workload(1, 1, 2**21, 2**21)
    for w in (small, big):
        again, working = reread_bytes(spec, w, 64, 64)
        assert working == 2 * w.seqlen_k * 64 * 2  # one head's K and V
        # the re-reads: every visited pair reads K_j, V_j; all but the first of each are repeats
        pairs = math.ceil(w.seqlen_q / 64) * math.ceil(w.seqlen_k / 64)
        assert again == w.batch * w.heads * (pairs - math.ceil(w.seqlen_k / 64)) * 64 * 64 * 2 * 2
    assert l2_hit_fraction(spec, small, dev, slots=132) == 1.0
    # 2M keys: 512 MiB for the one head, half the 50 MiB L2 holds re-read tiles
    assert l2_hit_fraction(spec, big, dev, slots=132) == pytest.approx(0.5 * 50 * 2**20 / 2**29)
    pred = predict(spec, small, 128, dev)
    again, _ = reread_bytes(spec, small, 64, 64)
    assert pred.dram_bytes == pytest.approx(pred.hbm_bytes - again)
    assert pred.terms["hbm"] == pytest.approx(pred.dram_bytes / dev.hbm_bytes_per_s)
    assert pred.terms["l2"] == pytest.approx(pred.hbm_bytes / dev.l2_bytes_per_s)
    # the backward keeps Q, dO, lse, D and the fp32 dQ accumulator of a head
    bwd = spec.replace(direction="bwd")
    assert reread_bytes(bwd, small, 64, 64)[1] == 4096 * (2 * 64 * 2 + 8) + 4096 * 64 * 4
    # GQA: the heads of a group share one K/V head's re-read set
    gqa = Workload(2, 8, 4096, 4096, heads_kv=2)
    assert reread_bytes(spec, gqa, 64, 64)[1] == reread_bytes(spec, small, 64, 64)[1] / 4


def test_occupancy_counts_the_main_kernels_block() -> None:
    """The warp-specialised backward launches its producer warpgroup beside the consumers in the
    main kernel only: the occupancy is that block's, not the pre kernel's."""
    from fagen.autotune.model import launch_warps
    from fagen.renderer import kernel_infos

    for impl, arch in (("wgmma", "sm_90a"), ("mma", "sm_90")):
        for direction in ("fwd", "bwd"):
            spec = KernelSpec(direction=direction, head_dim=64, dtype="float16", arch=arch, impl=impl)
            main = next(k for k in kernel_infos(spec) if k.role.name == "main")
            assert launch_warps(spec) == main.threads // 32
            if impl == "wgmma":
                assert launch_warps(spec) == spec.num_warps + 4  # the producer warpgroup


def test_the_exponentials_are_a_term_of_their_own() -> None:
    """One MUFU.EX2 per score of a visited pair, 16 per SM and clock; float64 has none (software exp)."""
    dev = device_model("sm_90")
    w = Workload(1, 4, 1024, 1024)
    for direction, det, per_score in (("fwd", False, 1), ("bwd", False, 1), ("bwd", True, 2)):
        spec = KernelSpec(direction=direction, head_dim=64, dtype="float16", arch="sm_90", impl="mma",
                          block_r=64, block_c=64, num_warps=4, deterministic=det)
        pred = predict(spec, w, 128, dev)
        scores = 4 * 1024 * 1024 * per_score
        assert pred.terms["exp"] == pytest.approx(scores / (132 * 16 * dev.clock_hz))
        assert pred.seconds >= pred.terms["exp"]
    f64 = KernelSpec(direction="fwd", head_dim=64, dtype="float64", arch="sm_90", impl="simt")
    assert "exp" not in predict(f64, w, 128, dev).terms


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
    _check_json(doc, SMALL.sram_bytes)
    assert doc["spec"] == SMALL.model_dump(mode="json")
    assert (doc["best"]["block_r"], doc["best"]["block_c"]) == (small_result.best.block_r, small_result.best.block_c)


def test_cli_dry_run_table(small_result, capsys: pytest.CaptureFixture[str]) -> None:
    assert at_cli.run(_args("--batch", "2", "--heads", "4", "--seqlen", "1000", "--dry-run"), SMALL) == 0
    out = capsys.readouterr().out
    assert "predicted ms" in out and "rejected (" in out and f"> sram_bytes {SMALL.sram_bytes}" in out and "best:" in out
    assert at_cli.run(_args("--batch", "2", "--heads", "4", "--heads-kv", "2", "--seqlen", "1000", "--dry-run"),
                      SMALL) == 0
    assert "heads 4 (K/V 2)" in capsys.readouterr().out


def test_cli_through_main(small_result, capsys: pytest.CaptureFixture[str]) -> None:
    import fagen.cli as main_cli

    ns = main_cli.build_parser().parse_args(["autotune", "--head-dim", "32", "--batch", "1", "--heads", "1",
                                             "--seqlen", "16"])  # a parse failure (SystemExit) fails the test
    assert (ns.command, ns.head_dim, ns.batch, ns.heads, ns.seqlen, ns.dry_run) == ("autotune", 32, 1, 1, 16, False)
    rc = main_cli.main(["autotune", "--head-dim", "32", "--dtype", "float16", "--arch", "sm_80",
                        "--sram-bytes", str(SMALL.sram_bytes), "--batch", "2", "--heads", "4", "--seqlen", "1000",
                        "--dry-run", "--json"])
    assert rc == 0
    _check_json(json.loads(capsys.readouterr().out), SMALL.sram_bytes)


def test_cli_bad_options() -> None:
    with pytest.raises(InputError, match="--batch: expected a positive integer, got 0"):
        at_cli.run(_args("--batch", "0", "--heads", "4", "--seqlen", "16", "--dry-run"), SMALL)
    with pytest.raises(InputError, match="--top"):
        at_cli.run(_args("--batch", "1", "--heads", "4", "--seqlen", "16", "--top", "-1", "--dry-run"), SMALL)
    with pytest.raises(InputError, match="--heads-kv: expected a divisor of --heads"):
        at_cli.run(_args("--batch", "1", "--heads", "4", "--heads-kv", "3", "--seqlen", "16", "--dry-run"), SMALL)
    with pytest.raises(InputError, match="--heads-kv: expected a positive integer"):
        at_cli.run(_args("--batch", "1", "--heads", "4", "--heads-kv", "0", "--seqlen", "16", "--dry-run"), SMALL)


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


BASE = KernelSpec(head_dim=64, dtype="float16", arch="sm_90", impl="simt")


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
    assert entry["choice"] == {"block_r": 32, "block_c": 16, "num_warps": 8, "impl": "simt", "knobs": {}}


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

    def timer(spec: KernelSpec, p: Workload) -> float:
        key = (spec.impl, spec.tile.block_r, spec.tile.block_c, spec.num_warps, spec.knobs)
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


def _avg_ranks(xs: list[float]) -> list[float]:
    """1 = smallest; tied values share the mean of their ranks (written here, not the tuner's)."""
    return [sum(y < x for y in xs) + (sum(y == x for y in xs) + 1) / 2 for x in xs]


def _pearson(a: list[float], b: list[float]) -> float:
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))


def _check_row(row: dict, timer) -> list[dict]:
    """The row's columns are the model's predictions, the timer's values and their ranks; its Spearman
    is the rank correlation of those columns, computed here from scratch."""
    cands = row["candidates"]
    assert 3 <= len(cands) <= 6  # 2 points correlate at +-1 whatever the order; the bound below holds to 6
    for c in cands:
        spec = KernelSpec(head_dim=32, dtype="float16", arch="sm_80", impl=c["impl"], block_r=c["block_r"],
                          block_c=c["block_c"], num_warps=c["num_warps"], knobs=tuple(sorted(c["knobs"].items())))
        assert c["measured_ms"] == timer(spec, None)
    pred, meas = [c["predicted_ms"] for c in cands], [c["measured_ms"] for c in cands]
    assert [c["rank_predicted"] for c in cands] == _avg_ranks(pred)
    assert [c["rank_measured"] for c in cands] == _avg_ranks(meas)
    # Threshold from the data: the ranks are half-integers <= n, so every sum over them is exact in
    # float64 and only the final sqrt and division round (a few ulp, ~1e-15 of a value in [-1, 1]). The
    # distinct Spearman values of n points (ties included) lie at least 3.2e-3 apart for n = 4, 7.3e-5
    # for n = 5 and 1.3e-5 for n = 6 (enumerated over all pairs of rankings), so 1e-12 admits rounding
    # and nothing but the rank correlation of these very columns.
    assert row["spearman"] == pytest.approx(_pearson(_avg_ranks(pred), _avg_ranks(meas)), abs=1e-12)
    return cands


def test_gpu_check_rows_with_fake_timer(store_dir: Path) -> None:
    shape = [(2, 4, 2048, 32, "float16", False)]  # a shape where the model tells the candidates apart
    kw = dict(top=3, device=FAKE_DEVICE, sizes=(32, 64), warps=(4,))

    def key(spec: KernelSpec) -> tuple:
        return (spec.impl, spec.tile.block_r, spec.tile.block_c, spec.num_warps, spec.knobs)

    def blocks(spec: KernelSpec, p: Workload | None) -> float:  # by the block count: a made-up device
        return 1.0 + 1.0 / (spec.tile.block_r * spec.tile.block_c)

    (row,) = gpu_check_rows(shape, timer=blocks, **kw)
    assert row["spec"].startswith("fa_bwd_d32_fp16")
    cands = _check_row(row, blocks)
    for c in cands:
        assert {"predicted_ms", "measured_ms", "rank_predicted", "rank_measured"} <= set(c)
    predicted = {(c["impl"], c["block_r"], c["block_c"], c["num_warps"], tuple(sorted(c["knobs"].items()))):
                 c["predicted_ms"] for c in cands}
    assert len(set(predicted.values())) >= 3  # a spread for the rank correlations below to measure

    # A device that runs exactly as the model predicts (up to an increasing map) ranks the candidates as
    # the model does: the rank columns are equal and Spearman is 1 exactly.
    def agrees(spec: KernelSpec, p: Workload | None) -> float:
        return 0.5 + 3.0 * predicted[key(spec)]

    (row,) = gpu_check_rows(shape, timer=agrees, **kw)
    cands = _check_row(row, agrees)
    assert [c["rank_measured"] for c in cands] == [c["rank_predicted"] for c in cands]
    assert row["spearman"] == pytest.approx(1.0, abs=1e-12)
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


# --------------------------------------------------------------------------- bounds, closed form, structure
def test_absurd_sizes_are_typed_errors() -> None:
    for kw, name in ((dict(seqlen=2**40), "seqlen"), (dict(seqlen=0), "seqlen"), (dict(batch=70000), "batch"),
                     (dict(heads=-1), "heads"), (dict(seqlen_k=2**31), "seqlen_k"),
                     (dict(seqlen=2**31 - 2**16 + 1), "seqlen")):  # fagen.spec.SEQLEN_MAX, as the functional API
        args = {"batch": 1, "heads": 1, "seqlen": 16, **kw}
        with pytest.raises(InputError, match=f"^{name}: expected an integer in 1.."):
            tune(SMALL, dry_run=True, progress=False, **args)  # type: ignore[arg-type]


def test_cli_huge_seqlen_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from fagen.cli import main

    code = main(["autotune", "--head-dim", "32", "--batch", "1", "--heads", "1", "--seqlen", "1099511627776",
                 "--dry-run"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "seqlen" in err and "1099511627776" in err


def _per_tile_hbm(spec: KernelSpec, p: Workload, br: int, bc: int) -> float:
    """hbm_bytes restated per visited tile (fagen.masking.tile_kind), for small sizes only."""
    from fagen.masking import TileKind, tile_kind

    d, e, f32, nq, nk = spec.head_dim, spec.itemsize, 4, p.seqlen_q, p.seqlen_k
    tiles = [(r, c) for r in range(0, nq, br) for c in range(0, nk, bc)
             if tile_kind(r, c, nq, nk, block_r=br, block_c=bc, causal=spec.causal,
                          key_padding=spec.key_padding) != TileKind.SKIP]
    kpm = nk if spec.key_padding else 0
    if spec.direction == "bwd":
        per = (4 * nk * d * e + sum(min(br, nq - r) for r, _ in tiles) * (2 * d * e + 2 * f32)
               + nq * d * f32 * 2 + nq * (2 * d * e + f32 + d * f32) + nq * d * (f32 + e) + kpm)
    else:
        per = 2 * nq * d * e + nq * f32 + sum(min(bc, nk - c) for _, c in tiles) * 2 * d * e + kpm
    return float(p.batch * p.heads * per)


@pytest.mark.parametrize("direction", ["bwd", "fwd"])
@pytest.mark.parametrize("causal", [False, True])
def test_model_counts_are_closed_form(direction: str, causal: bool) -> None:
    spec = KernelSpec(direction=direction, head_dim=64, causal=causal, key_padding=causal, impl="simt")
    for nq, nk in ((1000, 1000), (100, 1000), (1000, 100), (17, 33)):
        p = Workload(2, 3, nq, nk)
        assert hbm_bytes(spec, p, 64, 32) == _per_tile_hbm(spec, p, 64, 32)
    # at N = 2**31 - 1 (bucketed to 2**31) the model answers from the closed form, with no per-block lists
    big = Workload.bucketed(1, 1, 2**31 - 2**16)
    pred = predict(spec, big, 128, device_model("sm_90"))
    assert math.isfinite(pred.seconds) and pred.hbm_bytes > 0


def test_sass_mix_feeds_the_issue_term() -> None:
    from fagen.autotune.model import sass_issue_instructions
    from fagen.autotune.sassloops import LoopMix, dynamic_instructions

    # a main loop with 100 instructions once per pair and an inner loop of 16 FFMA + 8 others
    loop = LoopMix(outer=(("FFMA", 4), ("IMAD", 96)), inner=(("FFMA", 16), ("LDS", 8)))
    assert dynamic_instructions(loop, "FFMA", 4 + 16 * 10) == 100 + 24 * 10  # the inner loop ran 10 times
    assert dynamic_instructions(LoopMix((("FFMA", 10), ("IMAD", 30)), ()), "FFMA", 50) == 200  # scaled whole
    assert dynamic_instructions(LoopMix((("LDS", 3),), ()), "FFMA", 50) is None  # no math: the family's estimate
    spec = KernelSpec(head_dim=64, dtype="float16", arch="sm_90", block_r=64, block_c=64, impl="simt")
    dev, p = device_model("sm_90"), Workload(4, 16, 4096, 4096)
    ffma_per_warp = 10 * 64 * 64 * 64 / 64 / 4  # backward FLOPs of one pair / 64 per FFMA / 4 warps
    per_pair = sass_issue_instructions(spec, 64, 64, loop)
    assert per_pair == pytest.approx(4 * dynamic_instructions(loop, "FFMA", ffma_per_warp))
    with_sass = predict(spec, p, 128, dev, loop)
    n = (4096 // 64) ** 2 * 4 * 16
    assert with_sass.terms["issue"] == pytest.approx(n * per_pair / (4 * dev.sm_count * dev.clock_hz))
    assert with_sass.seconds >= with_sass.terms["issue"]  # never beats the issue ceiling the SASS implies
    heavier = predict(spec, p, 128, dev, LoopMix(loop.outer, loop.inner + (("IMAD", 40),)))
    assert heavier.terms["issue"] > with_sass.terms["issue"] and heavier.seconds >= with_sass.seconds


def test_candidates_carry_their_sass(small_result) -> None:
    """With a disassembler installed, every compiled candidate's main loop feeds the model."""
    from fagen import sass

    if sass.nvdisasm_path() is None:
        pytest.skip("nvdisasm not installed")
    from fagen.autotune.model import MATH_OPCODE

    ok = small_result.ok
    assert {c.impl for c in ok} == {f for f in family_names()
                                    if not get_family(f).unsupported_reason(SMALL.family_spec)}
    for c in ok:
        op = MATH_OPCODE[get_family(c.impl).math_unit]
        assert c.sass_loop is not None
        assert c.sass_loop.count(op, inner=True) + c.sass_loop.count(op, inner=False) > 0, c


def test_idle_warps_and_dq_atomics() -> None:
    simt = get_family("simt")
    spec = KernelSpec(head_dim=64, block_r=16, block_c=16, num_warps=8, impl="simt")
    small = simt.pair_cost(spec.family_spec)
    assert small.warp_balance(8) < 0.5  # a 16x16 tile's micro-tiles keep few of 8 warps busy
    big = simt.pair_cost(spec.replace(block_r=128, block_c=128).family_spec)
    assert big.warp_balance(8) == pytest.approx(1.0)
    assert small.atomics == 16 * 64  # one fp32 atomic per dQ element per tile pair
    dev, p = device_model("sm_90"), Workload(4, 16, 4096, 4096)
    pred8, pred4 = predict(spec, p, 64, dev), predict(spec.replace(num_warps=4), p, 64, dev)
    assert "atomics" in pred8.terms and pred8.terms["atomics"] > 0
    # as many resident warps either way, but 8-warp blocks leave more of them idle on a 16x16 tile
    assert pred8.occupancy.warps_per_sm == pred4.occupancy.warps_per_sm
    assert pred8.seconds > pred4.seconds * 1.5
    fwd = KernelSpec(direction="fwd", head_dim=64, impl="simt")
    assert "atomics" not in predict(fwd, p, 64, dev).terms


def test_tensor_family_uses_the_tensor_peak() -> None:
    dev = device_model("sm_90", "NVIDIA H200")
    assert dev.math_flops_per_s("tensor") == 989.4e12 and dev.math_flops_per_s("fp32") == dev.fp32_flops_per_s


def test_one_capability_to_arch_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import fagen.autotune.timing as timing
    from fagen.runtime import gpu
    from fagen.spec import arch_for_capability

    assert timing.arch_for_capability is arch_for_capability
    caps = ((8, 0), (8, 6), (8, 7), (8, 8), (8, 9), (9, 0), (7, 5), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1),
            (13, 0))
    assert [arch_for_capability(c) for c in caps] == \
        ["sm_80", "sm_86", "sm_87", "sm_87", "sm_89", "sm_90", None, "sm_100", "sm_103", "sm_110", "sm_120",
         "sm_121", None]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 8))
    assert gpu.device_arch(0) == "sm_87"  # the runtime agrees with the autotuner on 8.8


def _imports(module: str) -> set[str]:
    """Every fagen module ``module`` imports, at any depth of its code (lazy imports included)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin
    tree = ast.parse(Path(spec.origin).read_text())
    pkg = module if spec.submodule_search_locations else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("fagen")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.startswith("fagen"):
                out.add(base)
                for a in node.names:  # ``from fagen import cache`` imports the module fagen.cache
                    try:
                        if importlib.util.find_spec(f"{base}.{a.name}") is not None:
                            out.add(f"{base}.{a.name}")
                    except ModuleNotFoundError:  # ``base`` is a module, ``a`` a name in it
                        pass
    return out


def test_functional_never_reaches_the_autotuner() -> None:
    """The stored-choice lookup lives below the functional API (fagen.choices): no cycle."""
    seen, todo = set(), ["fagen.functional"]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += sorted(_imports(m) - seen)
    assert not [m for m in seen if m.startswith("fagen.autotune")]
    assert "fagen.choices" in seen


def test_one_problem_class() -> None:
    import fagen.autotune.model as model
    import fagen.functional as functional

    assert not hasattr(model, "Problem") and hasattr(functional, "Problem")



# --------------------------------------------------------------------------- deterministic backward
def _det_pair(impl: str) -> tuple[KernelSpec, KernelSpec]:
    """(atomic, deterministic) backward specs of one family with the same tile."""
    atomic = KernelSpec(direction="bwd", head_dim=64, dtype="float16", arch="sm_90", causal=True, impl=impl,
                        block_r=64, block_c=64, num_warps=4)
    return atomic, atomic.replace(deterministic=True)


@pytest.mark.parametrize("impl", ["simt", "mma"])
def test_deterministic_backward_counts_the_dq_kernels_flops(impl: str) -> None:
    """Main (S, dP, dV, dK) + dq kernel (S, dP, dQ): 7 tile products per pair against 5."""
    from fagen.autotune.model import kernel_gemms, nominal_flops, visited_flops

    atomic, det = _det_pair(impl)
    assert kernel_gemms(atomic) == {"main": 5} and kernel_gemms(det) == {"main": 4, "dq": 3}
    assert kernel_gemms(atomic.replace(direction="fwd")) == {"main": 2}
    dev = device_model("sm_90")
    for p in (Workload(4, 16, 4096, 4096), Workload(2, 8, 1000, 3000), Workload(1, 2, 17, 33)):
        fa, fd = visited_flops(atomic, p, 64, 64), visited_flops(det, p, 64, 64)
        assert fd * 5 == fa * 7  # exact: integers in float64
        assert fa == 4 * 2.5 * tile_pairs(atomic, p) * 64 * 64 * 64
        pa, pd = predict(atomic, p, 128, dev), predict(det, p, 128, dev)
        assert pd.flops == fd and pa.flops == fa
        assert pd.terms["math"] == pytest.approx(pa.terms["math"] * 7 / 5, rel=1e-14)
        assert pd.hbm_bytes > pa.hbm_bytes  # the dq kernel reloads K, V per visited pair
        assert "atomics" in pa.terms and "atomics" not in pd.terms
        # reported FLOPs keep the standard 2.5 convention in both modes
        assert nominal_flops(det, p) == nominal_flops(atomic, p) == 4 * 2.5 * p.batch * p.heads * 0.5 * \
            p.seqlen_q * p.seqlen_k * 64


def tile_pairs(spec: KernelSpec, p: Workload) -> int:
    from fagen.autotune.model import visited_pairs

    return visited_pairs(spec, p, spec.tile.block_r, spec.tile.block_c)


def test_deterministic_sass_issue_counts_both_kernels() -> None:
    """The main kernel's loop carries 4 GEMMs' math per pair, the dq kernel's loop 3 (its own
    mix); without either mix the model falls back to the family's pair_cost (which counts both)."""
    from fagen.autotune.model import sass_issue_instructions
    from fagen.autotune.sassloops import LoopMix, dynamic_instructions
    from fagen.renderer import kernel_infos

    atomic, det = _det_pair("simt")
    assert {k.role.name: k.threads for k in kernel_infos(det)}["dq"] == 128  # 4 warps
    main = LoopMix(outer=(("FFMA", 4), ("IMAD", 96)), inner=(("FFMA", 16), ("LDS", 8)))
    dq = LoopMix(outer=(("FFMA", 8), ("IMAD", 40), ("STG", 4)), inner=(("FFMA", 32), ("LDS", 20), ("IADD3", 6)))
    per_gemm_warp = 2 * 64 * 64 * 64 / 64 / 4  # FFMAs of one 64x64x64 product per warp (4 warps)
    want_main = 4 * dynamic_instructions(main, "FFMA", 4 * per_gemm_warp)
    want_dq = 4 * dynamic_instructions(dq, "FFMA", 3 * per_gemm_warp)
    assert sass_issue_instructions(det, 64, 64, main, dq) == pytest.approx(want_main + want_dq, rel=1e-14)
    assert sass_issue_instructions(atomic, 64, 64, main) == pytest.approx(
        4 * dynamic_instructions(main, "FFMA", 5 * per_gemm_warp), rel=1e-14)
    assert want_main < sass_issue_instructions(atomic, 64, 64, main)  # main has 4 products, not 5
    assert sass_issue_instructions(det, 64, 64, main, None) is None
    assert sass_issue_instructions(det, 64, 64, None, dq) is None
    assert sass_issue_instructions(det, 64, 64, main, LoopMix((("LDS", 3),), ())) is None  # no math in dq's loop

    dev, p = device_model("sm_90"), Workload(4, 16, 4096, 4096)
    n, clocks = tile_pairs(det, p), 4 * dev.sm_count * dev.clock_hz
    with_both = predict(det, p, 128, dev, main, dq)
    assert with_both.terms["issue"] == pytest.approx(n * (want_main + want_dq) / clocks, rel=1e-12)
    heavier = predict(det, p, 128, dev, main, LoopMix(dq.outer, dq.inner + (("IMAD", 40),)))
    assert heavier.terms["issue"] > with_both.terms["issue"]
    fallback = n * get_family("simt").pair_cost(det.family_spec.with_tile(64, 64)).warp_instructions / clocks
    for one_missing in (predict(det, p, 128, dev, main, None), predict(det, p, 128, dev, None, dq)):
        assert one_missing.terms["issue"] == pytest.approx(fallback, rel=1e-12)


@pytest.mark.parametrize("impl", ["simt", "mma"])
def test_fallback_pair_cost_includes_the_dq_kernel(impl: str) -> None:
    atomic, det = _det_pair(impl)
    fam = get_family(impl)
    ca, cd = fam.pair_cost(atomic.family_spec.with_tile(64, 64)), fam.pair_cost(det.family_spec.with_tile(64, 64))
    assert cd.warp_iterations > ca.warp_iterations  # 7 products' math against 5
    assert cd.atomics == 0 and ca.atomics == 64 * 64


def test_deterministic_waves_count_the_dq_grid() -> None:
    """Main: one block per (K/V block, batch, head); dq: one per (Q block, batch, head); the wave
    factor weighs each kernel's quantisation by its share of the GEMMs (4 and 3 of 7)."""
    from fagen.autotune.model import grid_blocks, occupancy

    _, det = _det_pair("simt")
    dev = device_model("sm_90")
    p = Workload(1, 1, 64 * 200, 64)  # 1 main block, 200 dq blocks
    assert grid_blocks(det, p, "main") == 1 and grid_blocks(det, p, "dq") == 200
    occ = occupancy("sm_90", 4, 128, det.smem_bytes)
    slots = dev.sm_count * occ.blocks_per_sm
    q_main, q_dq = slots / 1, math.ceil(200 / slots) * slots / 200
    pred = predict(det, p, 128, dev)
    assert pred.blocks == 1 and pred.wave_factor == pytest.approx((4 * q_main + 3 * q_dq) / 7, rel=1e-14)
    assert predict(det.replace(deterministic=False), p, 128, dev).wave_factor == pytest.approx(q_main)


def test_gqa_workload_shapes_the_grid_and_traffic() -> None:
    from fagen.autotune.model import grid_blocks

    spec = KernelSpec(direction="bwd", head_dim=64, impl="simt", block_r=64, block_c=64)
    full, gqa = Workload(2, 8, 1024, 1024), Workload(2, 8, 1024, 1024, heads_kv=2)
    assert grid_blocks(spec, full) == 16 * 2 * 8 and grid_blocks(spec, gqa) == 16 * 2 * 2  # one CTA per kv head
    assert hbm_bytes(spec, gqa, 64, 64) < hbm_bytes(spec, full, 64, 64)
    assert Workload.bucketed(2, 8, 1000, heads_kv=4).heads_kv == 4
    for bad in (0, 3, 16, True):
        with pytest.raises(InputError, match="heads_kv"):
            Workload(2, 8, 1024, 1024, heads_kv=bad)


def test_check_resources_reads_the_dq_kernels_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deterministic backward's candidate carries the dq kernel's main-loop mix (by its kernel
    name), and score() hands it to the model."""
    from fagen import sass
    from fagen.autotune import sassloops
    from fagen.autotune.model import score
    from fagen.autotune.sassloops import LoopMix
    from fagen.compiler import compile as compile_spec

    spec = KernelSpec(direction="bwd", head_dim=32, dtype="float16", arch="sm_80", deterministic=True, impl="simt",
                      block_r=32, block_c=32, num_warps=4)
    mod = compile_spec(spec)
    names = {k.role.name: k.name for k in mod.rendered.kernels}
    fake = {names["main"]: LoopMix((("FFMA", 16), ("IMAD", 16)), ()),
            names["dq"]: LoopMix((("FFMA", 16), ("IMAD", 48)), ())}
    asked: list[str] = []

    def fake_mix(cubin: bytes, kernel: str) -> LoopMix:
        asked.append(kernel)
        return fake[kernel]

    with monkeypatch.context() as m:
        m.setattr(sassloops, "main_loop_mix", fake_mix)
        c = check_resources(Candidate("simt", 32, 32, 4, spec=spec), mod)
    assert sorted(asked) == sorted([names["main"], names["dq"]])
    assert c.status == "ok" and c.sass_loop == fake[names["main"]] and c.dq_sass_loop == fake[names["dq"]]
    dev, p = device_model("sm_80"), Workload(2, 4, 2048, 2048)
    (scored,) = score([c], p, dev)
    assert scored.predicted_ms == round(predict(spec, p, c.registers, dev, c.sass_loop, c.dq_sass_loop).ms, 6)
    assert scored.predicted_ms != round(predict(spec, p, c.registers, dev, c.sass_loop).ms, 6)
    atomic = spec.replace(deterministic=False)
    asked.clear()
    with monkeypatch.context() as m:
        m.setattr(sassloops, "main_loop_mix", fake_mix)
        fake[next(k.name for k in compile_spec(atomic).rendered.kernels if k.role.name == "main")] = fake[names["main"]]
        a = check_resources(Candidate("simt", 32, 32, 4, spec=atomic), compile_spec(atomic))
    assert len(asked) == 1 and a.dq_sass_loop is None  # no dq kernel
    if sass.nvdisasm_path() is not None:  # the real disassembly: the dq kernel's own loop
        real = check_resources(Candidate("simt", 32, 32, 4, spec=spec), mod)
        assert real.dq_sass_loop is not None and real.dq_sass_loop != real.sass_loop
        assert real.dq_sass_loop.count("FFMA", inner=True) + real.dq_sass_loop.count("FFMA", inner=False) > 0


# --------------------------------------------------------------------------- timing inputs
#: Flags every family takes besides its ``features``; "gqa" is the Workload's heads_kv.
BASE_FLAGS = ("causal", "key_padding", "dropout", "gqa")
#: The families that take these tiny sm_90 specs at all (wgmma: sm_90a forward only, its own tests).
SM90_FAMILIES = [f for f in family_names() if not get_family(f).unsupported_reason(FamilySpec("bwd", 32, "float16", "sm_90"))]
FEATURE_CASES = [(impl, flag) for impl in SM90_FAMILIES
                 for flag in BASE_FLAGS + tuple(sorted(get_family(impl).features))]


def _feature_case(impl: str, flag: str) -> tuple[KernelSpec, Workload]:
    """A tiny backward spec with ``flag`` on (Nq != Nk, so the causal alignment matters)."""
    fields: dict = dict(direction="bwd", head_dim=32, dtype="float16", impl=impl)
    p = Workload(2, 2, 24, 40)
    if flag == "gqa":
        p = Workload(2, 2, 24, 40, heads_kv=1)
    elif flag == "top_left":
        fields.update(causal=True, causal_align="top_left")
    elif flag == "bias_grad":
        fields.update(bias=True, bias_grad=True)
    elif flag == "float64":
        fields["dtype"] = "float64"
    elif flag == "head_dim_v":
        fields["head_dim_v"] = 16
    elif flag == "sinks":
        pass  # a forward flag (the backward reads the sink through lse): the forward test below
    elif flag in {"causal", "key_padding", "dropout", "window", "softcap", "alibi", "attn_mask", "bias", "varlen",
                  "deterministic"}:
        fields[flag] = True
    else:
        raise AssertionError(f"no timing-input case for the feature {flag!r}: add one")
    return KernelSpec(**fields), p


def _oracle_check(spec: KernelSpec, p: Workload, inputs, out: tuple) -> None:
    """The timed call against the float64 oracle (tests/featref.py): it did the spec's real work."""
    import torch

    import featref
    from fagen.functional import dropout_keep_mask

    def unpack(t: torch.Tensor, n: int) -> torch.Tensor:  # packed equal-length sequences -> [B, N, h, d]
        return t.reshape(p.batch, n, *t.shape[1:]) if spec.varlen else t

    kw = inputs.kw
    t = {"q": unpack(inputs.q, p.seqlen_q), "k": unpack(inputs.k, p.seqlen_k), "v": unpack(inputs.v, p.seqlen_k)}
    grads_of = ("q", "k", "v")
    if spec.bias:
        t["bias"] = kw["attn_bias"]
        grads_of += ("bias",) if spec.bias_grad else ()
    opt = dict(causal=spec.causal, window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
               alibi=kw.get("alibi_slopes"), kpm=kw.get("key_padding_mask"), mask=kw.get("attn_mask"),
               align=spec.causal_align)
    if spec.dropout:
        opt.update(dropout_p=kw["dropout_p"],
                   keep=dropout_keep_mask(p.batch, p.heads, p.seqlen_q, p.seqlen_k, kw["dropout_p"]))
    do = unpack(inputs.do, p.seqlen_q)
    dt = getattr(torch, spec.dtype)
    _, _, g64 = featref.run_oracle(t, grads_of, do, torch.float64, **opt)
    _, _, gdt = featref.run_oracle(t, grads_of, do, dt, **opt)
    ours = {"q": unpack(out[0], p.seqlen_q), "k": unpack(out[1], p.seqlen_k), "v": unpack(out[2], p.seqlen_k)}
    if spec.bias_grad:
        ours["bias"] = out[3]
    assert set(ours) == set(grads_of)
    # float64: the kernels keep lse, D and the dQ accumulator in fp32 (as tests/test_features.py)
    atol = 2e-6 if dt == torch.float64 else featref.ATOL[dt]
    for n in grads_of:
        featref.flash_criterion(f"d{n}", ours[n], g64[n], gdt[n], atol * max(1.0, g64[n].abs().max().item()))


@pytest.mark.parametrize("impl, flag", FEATURE_CASES, ids=[f"{i}-{f}" for i, f in FEATURE_CASES])
def test_timing_inputs_carry_every_feature(impl: str, flag: str) -> None:
    """The GPU timer's inputs, built on the CPU (the emulator runs the same kernels): one timed
    call of a backward with ``flag`` runs with the flag's runtime arguments and computes the
    spec's real gradients."""
    import torch

    from fagen.autotune.timing import TimingInputs, alibi_slopes

    spec, p = _feature_case(impl, flag)
    inputs = TimingInputs(spec, p, device="cpu")
    kw = inputs.kw
    hkv = p.heads_kv or p.heads
    if spec.varlen:
        assert inputs.q.shape == (p.batch * p.seqlen_q, p.heads, 32)
        assert inputs.k.shape == (p.batch * p.seqlen_k, hkv, 32)
        assert kw["cu_seqlens_q"].dtype == torch.int32 and kw["cu_seqlens_q"].tolist() == [0, 24, 48]
        assert kw["cu_seqlens_k"].tolist() == [0, 40, 80] and (kw["max_seqlen_q"], kw["max_seqlen_k"]) == (24, 40)
    else:
        assert inputs.q.shape == (p.batch, p.seqlen_q, p.heads, 32) and inputs.k.shape == (p.batch, p.seqlen_k, hkv, 32)
    assert inputs.q.dtype == getattr(torch, spec.dtype) and inputs.q.device.type == "cpu"
    expect = {"key_padding": "key_padding_mask", "dropout": "dropout_p", "window": "window_size", "softcap": "softcap",
              "alibi": "alibi_slopes", "attn_mask": "attn_mask", "bias": "attn_bias", "varlen": "cu_seqlens_q"}
    for f, arg in expect.items():
        assert (arg in kw) == bool(getattr(spec, f)), (f, sorted(kw))
    if spec.window:
        assert kw["window_size"] == (5, 0)  # Nk / 8 keys to the left: a real band, not unbounded
    if spec.softcap:
        assert kw["softcap"] == 30.0
    if spec.alibi:
        assert kw["alibi_slopes"].dtype == torch.float32 and kw["alibi_slopes"].tolist() == alibi_slopes(2) == [
            2.0 ** -4, 2.0 ** -8]
    if spec.attn_mask:
        m = kw["attn_mask"]
        assert m.dtype == torch.bool and m.shape == (2, 1, 24, 40) and m.any() and not m.all()
    if spec.bias:
        assert kw["attn_bias"].dtype == inputs.q.dtype and kw["attn_bias"].shape == (1, 2, 24, 40)
    out = inputs.call(spec)()
    assert len(out) == (4 if spec.bias_grad else 3)
    assert all(torch.isfinite(g).all() for g in out)
    _oracle_check(spec, p, inputs, out)


@pytest.mark.parametrize("impl", SM90_FAMILIES)
def test_timing_inputs_of_a_forward_with_every_flag(impl: str) -> None:
    import torch

    from fagen.autotune.timing import TimingInputs

    spec = KernelSpec(direction="fwd", head_dim=32, dtype="float16", impl=impl, causal=True, key_padding=True,
                      window=True, softcap=True, alibi=True, attn_mask=True, bias=True, sinks=True)
    p = Workload(2, 2, 24, 40)
    inputs = TimingInputs(spec, p, device="cpu")
    assert inputs.kw["sinks"].dtype == torch.float32 and inputs.kw["sinks"].shape == (2,)
    assert not hasattr(inputs, "o")  # a forward needs no forward of its own
    o, lse = inputs.call(spec)()
    assert o.shape == inputs.q.shape and lse.shape == (2, 2, 24) and torch.isfinite(o).all()


def test_tune_takes_heads_kv() -> None:
    res = tune(SMALL.replace(direction="bwd"), batch=2, heads=8, seqlen=1000, heads_kv=2, dry_run=True,
               sizes=(32,), warps=(4,), progress=False)
    assert res.problem == Workload(2, 8, 1024, 1024, heads_kv=2)
    assert res.as_dict()["problem"]["heads_kv"] == 2
    with pytest.raises(InputError, match="heads_kv"):
        tune(SMALL, batch=2, heads=8, seqlen=1000, heads_kv=3, dry_run=True, sizes=(32,), warps=(4,))


def test_gpu_check_rows_on_a_hopper_device_take_the_hopper_family_too(store_dir: Path) -> None:
    """A capability-9.0 device runs sm_90a cubins: its rows tune the spec a CUDA tensor there defaults to
    (sm_90a, the Hopper family where it applies), with the Hopper family's candidates beside mma's."""
    hopper = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, "sm_90")
    (row,) = gpu_check_rows([(1, 16, 4096, 64, "float16", False)], top=2, timer=lambda spec, p: 1.0,
                            device=hopper, sizes=(64, 128), warps=(8,))
    assert row["spec"].endswith("_wgmma_sm90a")
    assert {c["impl"] for c in row["candidates"]} >= {"wgmma"}


def test_a_module_without_a_resource_report_rejects_its_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """ptxas's report lacks the main kernel: that candidate is rejected with the reason; the search goes on
    (it once ended a whole GPU autotune row with a bare StopIteration)."""
    from dataclasses import replace as dc_replace

    import fagen.autotune.candidates as C
    from fagen import compiler

    spec = KernelSpec(direction="fwd", head_dim=32, arch="sm_80")
    real = compiler.compile(spec)
    bare = dc_replace(real, resources=())
    with pytest.raises(LookupError, match="no ptxas resource report for .*_main"):
        bare.resource("main")
    monkeypatch.setattr(C, "compile_spec", lambda s: bare)
    cand = C._compile_one(C.Candidate(spec.impl, spec.tile.block_r, spec.tile.block_c, spec.num_warps, spec=spec))
    assert cand.status == "rejected" and "no ptxas resource report" in cand.reason
