"""The two tiers of the suite, stated in one place.

* The **full suite** (README's test command, what CI runs): every test.
* The **fast tier** (``python -m pytest -m "not slow" -n 2 -q``): every test module, with the long
  sweeps cut to a covering sample, for the edit-test loop.

A test is in the slow tier when it carries ``@pytest.mark.slow`` itself, or when this table puts it
there (tests/conftest.py applies it at collection):

* :data:`SLOW` -- whole tests (``file::function``) that take long and repeat what a sampled
  test of the fast tier already shows (a sanitizer or race-check sweep, a demonstration run
  twice, a compile of a whole matrix);
* :data:`SAMPLED` -- parametrized sweeps of which the fast tier keeps a covering sample: for each
  kernel family named in the parameter id (``simt``, ``mma``, ``wgmma``; or none), the first
  parametrization collected; the rest are slow;
* :data:`SAMPLED_ONCE` -- parametrized sweeps of which the fast tier keeps only the first
  parametrization collected, whatever its family: a property (sanitizer or race-check cleanliness, a
  schedule's independence, an accuracy criterion) that holds per family and whose other families
  the fast tier's numerics of each family already reach.

Beyond the full suite, rows marked :data:`EXHAUSTIVE` run only with ``FAGEN_TEST_SLOW=1``.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable

import pytest

#: Marks of an exhaustive row: a sweep's rows past what the full suite's 15-minute budget holds (the
#: new archs' whole standard matrix, a heavy PTX-level dtype); the full suite skips them, and
#: ``FAGEN_TEST_SLOW=1`` runs them too (before a release, or when the code they cover changes).
EXHAUSTIVE = (pytest.mark.slow, pytest.mark.skipif(not os.environ.get("FAGEN_TEST_SLOW"),
                                                  reason="exhaustive row: set FAGEN_TEST_SLOW=1"))

SLOW: frozenset[str] = frozenset({
    # heavy, and what a fast-tier sample of the same family already shows (a compile of every flag,
    # a browser, a second sinks or determinism probe, every wgmma shape's SASS)
    "test_features.py::test_every_flag_compiles_without_spills",
    "test_features.py::test_deterministic_sass_has_no_atomics",
    "test_sinks.py::test_wgmma_forward_with_sinks",
    "test_sinks.py::test_varlen_sinks_match_per_sequence_calls",
    "test_explain.py::test_page_in_headless_chromium",
    "test_wgmma_sass.py::test_every_wgmma_shape_compiles_to_hgmma",
    "test_mma_family.py::test_deterministic_dq_is_bitwise_independent_of_the_pipeline_and_dk_dv_of_the_mode",
    "test_racecheck.py::test_removing_a_barrier_is_a_race_naming_it",
    "test_racecheck_wgmma.py::test_demonstration_gemm_runs_clean_and_identical_under_racecheck",
    "test_masking.py::test_cxx_and_python_agree",
    "test_autotune.py::test_gpu_check_rows_with_fake_timer",
    "test_autotune.py::test_tuned_not_slower_than_default",
    "test_gpu_check.py::test_gpu_path_end_to_end_with_fake_device",
    "test_gpu_check.py::test_outputs_are_at_most_eight_files_in_one_folder",
    "test_host_path.py::test_the_host_cost_benchmark_runs",
    "test_emulator.py::test_ucontext_fallback",
    "test_cuda_env.py::test_cuda12_nvrtc_compiles_the_register_heavy_features_without_spills",
    "test_cubin.py::test_nvdisasm_disassembles_every_kernel_of_the_standard_matrix",
    "test_racecheck.py::test_wgmma_forward_runs_clean_and_bit_identical_under_racecheck",
    "test_wgmma_bwd.py::test_backward_is_clean_under_asan_and_an_overrun_is_caught",
    "test_wgmma_family.py::test_forward_is_clean_under_asan_and_an_overrun_is_caught",
    "test_emulator.py::test_the_prelude_is_precompiled_once_and_shared",
    "test_head_dim_v.py::test_head_dim_v_kernels_run_clean_under_racecheck_and_asan",
    "test_ring_sinks.py::test_ring_sinks_match_single_process",
    "test_distributed.py::test_ring_matches_single_process",
    "test_sinks.py::test_sinks_and_dlse_kernels_run_clean_under_racecheck_and_asan",
    "test_wgmma_family.py::test_removing_a_wait_breaks_the_run",
    # the autotuner's dry run over a small space (one module-scoped search, about a minute) and its readers
    "test_autotune.py::test_dry_run_result",
    "test_autotune.py::test_ranking_is_deterministic",
    "test_autotune.py::test_cli_dry_run_json",
    "test_autotune.py::test_cli_dry_run_table",
    "test_autotune.py::test_cli_through_main",
    "test_autotune.py::test_timed_search_with_fake_timer",
    "test_autotune.py::test_candidates_carry_their_sass",
    # an NVRTC compile and a SASS count of their own, or a schedule probe; the fast tier keeps the
    # family's numerics and its ordering test (test_dq_is_the_k_v_blocks_tiles_added_in_ascending_order)
    "test_wgmma_pingpong.py::test_sass_has_the_turns_in_the_tile_loop_with_the_knob_only",
    "test_wgmma_deterministic.py::test_a_turn_taken_out_of_order_is_reported_not_spun_on",
    "test_wgmma_deterministic.py::test_sass_the_tile_loop_as_the_plain_backwards_no_spills",
    "test_wgmma_dropout.py::test_the_keep_pattern_is_the_mma_familys",  # test_dropout.py's bits in the fast tier
    "test_wgmma_bwd.py::test_racecheck_clean",  # test_racecheck_wgmma.py's in the fast tier
    "test_wgmma_bwd.py::test_removing_a_synchronisation_is_reported",
    # the split tile's numerics: test_wgmma_bwd_wide.py's first case; masks and biases: test_wgmma_mask_bias.py's
    "test_wgmma_mask_bias_wide.py::test_forward_and_backward_match_float64",
})

SAMPLED: frozenset[str] = frozenset({
    "test_numerics.py::test_mma_explicit_tiles_and_warps",
    "test_numerics.py::test_explicit_tiles_and_warps",
    "test_ptx_levels.py::test_every_form_of_the_shipped_kernels_translates",
    "test_head_dim_v.py::test_head_dim_v_flash_criterion",
    "test_wgmma_family.py::test_sass_hgmma_in_the_tile_loop_tma_no_ldmatrix_no_spills",
    "test_jit.py::test_a_stale_or_broken_index_falls_back_to_the_full_path",
    "test_lse_grad.py::test_lse_gradient_flash_criterion",
    "test_wgmma_register_a.py::test_backward_stores_ds_before_the_register_a_wgmma",
    "test_ops.py::test_torch_compile_fullgraph_matches_eager",  # aot_eager in the fast tier, inductor slow
    "test_races.py::test_reverse_schedule_agrees",
    "test_sinks.py::test_sinks_forward_backward_flash_criterion",
    "test_large_values.py::test_torch_large_value_case",
    "test_racecheck.py::test_widest_forward_step_runs_clean_and_bit_identical_under_racecheck",
    "test_docs.py::test_shell_block_runs",  # NVRTC compiles and a SASS count: the full suite runs them
    "test_mma_sass.py::test_tensor_cores_no_spills_no_local_memory",
    "test_mma_sass.py::test_deterministic_dq_kernel_is_tensor_core_without_spills_or_atomics",
    "test_cuda_env.py::test_cuda12_nvrtc_compiles_the_standard_matrix_without_spills",
    "test_cuda_env.py::test_new_archs_compile_to_their_own_cubin",
    "test_features.py::test_feature_numerics",
    "test_mma_family.py::test_features_through_the_mma_kernels",
    "test_mma_family.py::test_deterministic_backward_through_the_mma_kernels",
    "test_mma_family.py::test_forward_widest_step",
    "test_mma_family.py::test_two_dimensional_backward_layout",
    "test_mma_family.py::test_pinned_backward_lane_offsets",
    "test_mma_family.py::test_forward_softmax_scale_of_any_sign_and_32_row_warps",
    "test_mma_family.py::test_smem_rows_are_ldmatrix_conflict_free",
    "test_mma_grad_accuracy.py::test_backward_meets_torch_criterion",
    "test_api_features.py::test_outputs_and_gradients_match_the_float64_oracle",
    "test_wgmma_primitives.py::test_wgmma_selects_every_element",
    "test_wgmma_primitives.py::test_wgmma_every_swizzle_pair_exact",
    "test_wgmma_primitives.py::test_tma_load_box_placement_and_oob_fill",
    "test_wgmma_primitives.py::test_demonstration_gemm_equals_torch_matmul",
    "test_transformers.py::test_greedy_generate_matches_sdpa",
    "test_autotune.py::test_timing_inputs_carry_every_feature",
    "test_docs.py::test_python_block_runs",
    "test_gpu_launch.py::test_launch_through_recording_cupy",
    "test_races.py::test_reverse_schedule_agrees_mma_pipeline",
    "test_mma_sass.py::test_single_features_at_their_default_tiles_do_not_spill",
    "test_mma_sass.py::test_wide_head_dims_compile_without_spills",
    "test_numerics.py::test_matrix",
    "test_numerics.py::test_random_sweep",
    "test_numerics.py::test_other_head_dims",
    "test_compile.py::test_compiles_without_spills",
    "test_wgmma_family.py::test_forward_matches_float64",
    "test_nan.py::test_nan_input_poisons_the_rows_that_touch_it",
    "test_masking.py::test_loop_bounds_visit_exactly_the_non_skip_tiles",
    "test_cubin.py::test_damaged_cache_entry_is_rebuilt",
    "test_cubin.py::test_cubin_is_a_complete_cuda_elf",
    "test_wgmma_bwd.py::test_backward_matches_float64",
    "test_wgmma_bwd.py::test_sass_hgmma_in_the_tile_loop_no_ldmatrix_no_spills",
    "test_transformers.py::test_logits_match_sdpa_padded",
    "test_transformers.py::test_training_steps_match_sdpa",
    "test_transformers.py::test_torch_compile_fullgraph",
    "test_transformers.py::test_packed_sequences_match_sdpa",
    "test_large_values.py::test_magnitude_sweep",
    "test_large_values.py::test_features_at_large_scores",
    "test_large_values.py::test_equal_huge_scores_are_a_uniform_softmax",
})

SAMPLED_ONCE: frozenset[str] = frozenset({
    "test_features.py::test_deterministic_backward_is_schedule_independent",
    "test_mma_grad_accuracy.py::test_forward_and_backward_meet_torch_criterion",
    "test_mma_grad_accuracy.py::test_mem_efficient_cases_meet_torch_criterion",
    "test_numerics.py::test_padding_only_and_dropout_only",
    "test_racecheck.py::test_sample_runs_clean_and_bit_identical_under_racecheck",
    "test_bounds.py::test_every_kernel_is_clean_under_asan",
})

_FAMILY = re.compile(r"(?<![a-z])(simt|mma|wgmma)(?![a-z])")


def _key(item: pytest.Item) -> str:
    return f"{item.path.name}::{item.originalname}"


def slow_items(items: Iterable[pytest.Item]) -> list[pytest.Item]:
    """The items the table puts in the slow tier (in collection order)."""
    out, kept = [], set()
    for item in items:
        key = _key(item)
        if key in SLOW:
            out.append(item)
        elif key in SAMPLED_ONCE:
            if key in kept:
                out.append(item)
            else:
                kept.add(key)
        elif key in SAMPLED:
            callspec = getattr(item, "callspec", None)
            family = _FAMILY.search(callspec.id) if callspec is not None else None
            sample = (key, family.group(1) if family else None)
            if sample in kept:
                out.append(item)
            else:
                kept.add(sample)
    return out


def listed() -> frozenset[str]:
    return SLOW | SAMPLED | SAMPLED_ONCE
