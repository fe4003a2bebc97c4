"""Unit tests: make tests/helpers.py importable as ``helpers`` under any import mode, and
put Triton in its CPU interpreter before anything imports it.

The suite runs with ``--import-mode=importlib`` (pyproject.toml), so that tests/ and
parity_tests/ may hold test modules of the same name (tests/test_galore.py and
parity_tests/test_galore.py); that mode leaves sys.path alone, hence this insert (as
parity_tests/conftest.py does).

Without a CUDA GPU the in-process Triton tests (tests/test_poet.py's kernels) run under
``TRITON_INTERPRET=1``, which must be set before triton is first imported: triton decorates
its own ``tl`` helpers then, and an interpreted kernel cannot call helpers decorated for the
GPU. Importing ``torch._dynamo`` (any ``torch.compile``, ``torch.compiler.disable``)
imports triton, so a test module's own setting comes too late once another module has
imported it; hence here, before any test module is collected.

On a GPU, several xdist workers share one device: JAX would otherwise take 75% of its
memory in each worker at its first array, so it allocates as it goes."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from helpers import xla_cpu_kernels_of_its_own  # noqa: E402 (needs the path above)

xla_cpu_kernels_of_its_own()

if importlib.util.find_spec("torch") is not None and "triton" not in sys.modules:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


#: The files of the default run that take longest, longest first (``--durations=0`` of the
#: README's command on a 2-core CPU, each file's tests summed: 30-150 s). Under ``--dist
#: loadfile`` a file runs on one worker from its first test to its last, and pytest-xdist
#: hands the files out in the order collected; started first, these leave short files for
#: the end of the run (longest processing time first). By their number of tests
#: (pytest-xdist's own order) several of them came last and ended it.
SLOW_FILES = (
    "tests/test_kernels_lopt.py",
    "tests/test_kernels_lopt_jax.py",
    "tests/test_doc_snippets.py",
    "tests/contract/test_optax_transforms.py",
    "parity_tests/test_learned_optimizers.py",
    "tests/contract/test_cross_backend_bf16.py",
    "tests/distributed/test_torch_matrix.py",
    "tests/test_random.py",
    "tests/test_poet.py",
    "parity_tests/test_distributed.py",
    "parity_tests/test_adamw.py",
    "tests/contract/test_torch_optimizers.py",
    "parity_tests/test_coap.py",
    "tests/distributed/test_jax_sharding.py",
    "tests/test_jax_adamw.py",
    "tests/test_bench.py",
    "tests/contract/test_optax_bad_input.py",
    "tests/test_poet_xq.py",
)


#: The slow tier (``-m slow``; the README's command deselects it): the tests that take
#: longest on a 2-core CPU (``--durations=0``; most more than ~8 s each), which keep the
#: default run to about 15 minutes there. Kept in the default run although as slow: each
#: method's golden-trace parity (the product), the torch Triton kernels against plain on a
#: few shapes (tests/test_kernels_lopt.py; on every shape in the slow tier, marked there),
#: the JAX Pallas path on the golden cases, the CLI's main job, the documentation build, the
#: getting-started page and ``import xopt``'s lightness. What is left here is a larger case
#: of a check the default run makes on a smaller one (another method, variant, shape or
#: page), a claim about compiled programs, or a benchmark, example or page run to the end.
#: An entry is a file, a test (all its parameters) or one parametrized case.
SLOW_TESTS = (
    # Triton/Pallas kernels under the interpreter: per-kernel workers and bit-level findings
    "tests/test_kernels_small_fc_fold.py",
    "tests/test_kernels_velo_fold.py::test_factored_tensors_take_the_folded_kernel",
    "tests/test_kernels_velo_fold.py::test_folded_step_matches_float64",
    "tests/test_kernels_velo_fold.py::test_state_matches_plain",
    "tests/test_kernels_velo_fold.py::test_statistics_match_float64",
    "tests/test_kernels_velo_fold.py::test_carried_sums_are_the_sums_anew",
    "tests/test_kernels_velo_fold.py::test_two_runs_give_the_same_bits",
    "tests/test_kernels_velo_fold.py::test_g2_prefetch_sums_the_same_sub_tiles",
    "tests/test_lopt_backend_bits.py",
    "tests/test_jax_lopt_pallas_breakdown.py",
    "tests/test_kernels_lopt_jax.py::test_fast_path_matches_plain_and_float64",
    "tests/test_kernels_lopt_jax.py::test_mulo_through_small_fc_lopts_kernels_matches_plain",
    "tests/test_kernels_lopt_jax.py::test_a_plain_state_resumes_on_the_packed_path",
    "tests/test_kernels_lopt_jax.py::test_packed_program_size_does_not_grow_with_the_tensor_count",
    "tests/test_kernels_lopt_jax.py::test_pallas_kernels_lower_to_triton_for_cuda",
    "tests/test_kernels_lopt_jax.py::test_impl_and_precision_are_checked",
    "tests/test_kernels_normal.py::test_compiled_kernel_has_no_contraction_or_approximation",
    "tests/test_kernels_lowrank_adam.py::"
    "test_compiled_kernel_rounds_each_operation_and_vectorises_aligned_blocks",
    "tests/test_poet.py::test_cayley_kernels_match_their_references[72]",
    "tests/test_poet.py::test_permutation_kernels_match_their_references[256-smem]",
    "tests/test_poet.py::test_permutation_kernels_match_their_references[48-smem]",
    "tests/test_poet.py::test_permutation_kernels_match_their_references[256-auto]",
    "tests/test_poet.py::test_permutation_kernels_match_their_references[48-auto]",
    # (auto takes smem at these widths: [40-smem] runs its kernel; the rule has its own test)
    "tests/test_poet.py::test_permutation_kernels_match_their_references[40-auto]",
    # (one masked column block as [40-rowloop])
    "tests/test_poet.py::test_permutation_kernels_match_their_references[48-rowloop]",
    "tests/test_poet.py::test_cayley_kernels_match_their_references[40]",
    "tests/test_poet.py::test_cayley_kernels_in_low_precision[dtype1-fused]",
    "tests/test_poet.py::test_cayley_kernels_in_low_precision[dtype1-triton]",
    "tests/test_poet_launches.py::test_batched_rotations_match_per_layer_and_save_launches",
    "tests/test_poet_launches.py::test_launch_count_sees_every_launch",
    "tests/test_poet_compile.py::test_chain_operators_pass_opcheck",
    "tests/test_poet_compile.py::test_compiled_triton_path_is_one_graph_with_the_eager_bits",
    # golden traces beyond each method's main ones, and findings explained on them
    "parity_tests/test_coap.py::test_conv_traces_agree",
    "parity_tests/test_coap.py::test_eight_bit_cpu_trace_is_byte_exact",
    "parity_tests/test_coap.py::"
    "test_eight_bit_cuda_trace_codes_are_byte_exact_and_steps_agree_off_the_restore",
    "parity_tests/test_compact.py::test_torch_against_jax_with_xopts_own_projections",
    "parity_tests/test_compact.py::test_a_linear_layer_without_bias_replays",
    "parity_tests/test_poet.py::test_triton_kernels_agree_with_the_golden_traces",
    "parity_tests/test_poet_xq.py::test_jax_merge_replays_the_authors_merges",
    "parity_tests/test_mulo.py::test_a_wrong_multiplier_is_caught",
    "tests/test_parity_findings.py::test_coap_refresh_step_is_ill_conditioned_not_a_jax_accuracy_loss",
    "tests/test_parity_findings.py::test_velo_triton_exact_mode_runs_the_lstm_step_size_head_in_float64",
    "tests/test_parity_pairs.py::test_the_published_table_is_what_the_pairs_give_here",
    "tests/test_parity_compare.py::test_report_json_and_cli_exit_codes",
    "tests/test_parity_record.py::test_cli_record_writes_a_loadable_trace",
    "tests/test_cli.py::test_against_the_live_original_is_bitwise",
    # distributed: the default run keeps AdamW's and GaLore's JAX devices, every torch DDP case
    "parity_tests/test_distributed.py::test_jax_devices_against_one_device[coap]",
    "parity_tests/test_distributed.py::test_jax_devices_against_one_device[flora]",
    "parity_tests/test_distributed.py::test_jax_devices_against_one_device[mulo]",
    "parity_tests/test_distributed.py::test_jax_devices_against_one_device[plumage]",
    "parity_tests/test_distributed.py::test_jax_devices_against_one_device[small_fc_lopt]",
    "parity_tests/test_distributed.py::test_jax_devices_against_one_device[velo]",
    "parity_tests/test_distributed.py::test_torch_ranks_against_one_process[small_fc_lopt-fsdp2]",
    "parity_tests/test_distributed.py::test_torch_ranks_against_one_process[velo-fsdp2]",
    "parity_tests/test_distributed.py::test_torch_ranks_against_one_process[mulo-fsdp2]",
    "parity_tests/test_distributed.py::test_torch_ranks_against_one_process[velo-ddp]",
    "tests/distributed/test_torch_matrix.py::test_fsdp2[velo]",
    "tests/distributed/test_jax_sharding.py::test_init_places_state_as_the_parameters[velo]",
    "tests/distributed/test_jax_sharding.py::test_init_places_state_as_the_parameters[flora]",
    "tests/distributed/test_jax_sharding.py::"
    "test_the_compiled_update_communicates_within_its_methods_bound[coap-placed]",
    "tests/distributed/test_jax_sharding.py::"
    "test_the_compiled_update_communicates_within_its_methods_bound[flora-placed]",
    "tests/distributed/test_jax_sharding.py::"
    "test_the_compiled_update_communicates_within_its_methods_bound[mulo-placed]",
    "tests/distributed/test_jax_sharding.py::"
    "test_the_compiled_update_communicates_within_its_methods_bound[plumage-placed]",
    "tests/distributed/test_jax_sharding.py::"
    "test_the_compiled_update_communicates_within_its_methods_bound[plumage-set_mesh]",
    "tests/distributed/test_jax_sharding.py::"
    "test_the_compiled_update_communicates_within_its_methods_bound[velo-placed]",
    "tests/distributed/test_jax_sharding.py::"
    "test_without_the_owner_rule_xla_gathers_every_matrix_on_every_device[plumage]",
    "tests/distributed/test_jax_layers.py::"
    "test_compact_through_the_harness_on_devices_against_one_device",
    "tests/distributed/test_jax_layers.py::"
    "test_poet_on_devices_against_one_device_and_its_closed_loop_exception",
    "tests/distributed/test_torch_fsdp2_nonfinite_coap8.py::"
    "test_a_nan_on_one_ranks_shard_is_skipped_by_every_rank[adamw]",
    "tests/distributed/test_examples.py",
    # the optax/flax contract: its costliest methods' variants (each base method stays)
    "tests/contract/test_cross_backend_bf16.py::"
    "test_jax_bf16_leaves_keep_float32_state_and_round_once[coap_8bit]",
    "tests/contract/test_cross_backend_bf16.py::"
    "test_jax_bf16_leaves_keep_float32_state_and_round_once[coap_conv]",
    "tests/contract/test_optax_flax.py::test_flax_model_trains[coap_8bit]",
    "tests/contract/test_optax_flax.py::test_flax_model_trains[flora]",
    "tests/contract/test_optax_flax.py::test_flax_model_trains[velo]",
    "tests/contract/test_optax_flax.py::test_flax_model_trains[small_fc_lopt]",
    "tests/contract/test_optax_flax.py::test_flax_model_trains[mulo]",
    "tests/contract/test_optax_flax.py::test_flax_model_trains[poet_adamw/xq]",
    "tests/contract/test_optax_flax.py::test_flax_model_trains[coap_conv]",
    "tests/contract/test_optax_flax.py::test_flax_model_trains[coap_adafactor]",
    "tests/contract/test_optax_bad_input.py::"
    "test_nonfinite_skip_changes_nothing_but_the_counter[coap_conv]",
    "tests/contract/test_optax_bad_input.py::"
    "test_nonfinite_skip_changes_nothing_but_the_counter[coap_8bit]",
    "tests/contract/test_optax_transforms.py::"
    "test_multi_steps_accumulates_then_steps[coap_adafactor]",
    "tests/contract/test_optax_transforms.py::"
    "test_chain_is_the_transformation_and_forwards_value[coap_adafactor]",
    "tests/contract/test_optax_transforms.py::test_chain_is_the_transformation_and_forwards_value[velo]",
    "tests/contract/test_optax_transforms.py::test_chain_is_the_transformation_and_forwards_value[coap_conv]",
    "tests/contract/test_optax_transforms.py::test_multi_steps_accumulates_then_steps[coap_conv]",
    "tests/contract/test_optax_transforms.py::test_bundled_meta_params_build_and_step[velo]",
    "tests/contract/test_optax_transforms.py::"
    "test_chain_is_the_transformation_and_forwards_value[coap_8bit]",
    "tests/contract/test_optax_transforms.py::"
    "test_inject_hyperparams_uses_every_injected_value[flora]",
    "tests/contract/test_optax_transforms.py::"
    "test_inject_hyperparams_uses_every_injected_value[coap]",
    "tests/contract/test_optax_transforms.py::"
    "test_inject_hyperparams_uses_every_injected_value[coap_conv]",
    "tests/contract/test_optax_transforms.py::"
    "test_inject_hyperparams_uses_every_injected_value[coap_8bit]",
    "tests/contract/test_optax_transforms.py::"
    "test_inject_hyperparams_uses_every_injected_value[coap_adafactor]",
    "tests/contract/test_optax_transforms.py::"
    "test_inject_hyperparams_uses_every_injected_value[plumage]",
    "tests/contract/test_optax_transforms.py::"
    "test_inject_hyperparams_uses_every_injected_value[poet_adamw/xq]",
    "tests/contract/test_optax_transforms.py::"
    "test_inject_hyperparams_uses_every_injected_value[compact_adamw]",
    "tests/contract/test_optax_transforms.py::"
    "test_inject_hyperparams_uses_every_injected_value[small_fc_lopt]",
    "tests/contract/test_optax_transforms.py::"
    "test_inject_hyperparams_uses_every_injected_value[mulo]",
    "tests/contract/test_optax_transforms.py::"
    "test_inject_hyperparams_uses_every_injected_value[velo]",
    "tests/contract/test_optax_transforms.py::test_multi_steps_accumulates_then_steps[coap_8bit]",
    "tests/contract/test_optax_transforms.py::test_multi_steps_accumulates_then_steps[velo]",
    # methods' own tests on more cases than the default run's
    "tests/test_coap.py::test_backends_agree_without_injection[adafactor_no_b1]",
    "tests/test_coap.py::test_backends_agree_without_injection[adafactor]",
    "tests/test_coap.py::test_backends_agree_without_injection[adamw_restore]",
    "tests/test_mulo.py::test_clipping_on_both_backends_against_the_oracle[0.01]",
    "tests/test_coap.py::test_jax_flax_kernel_layout_takes_the_same_update_as_the_spec_layout[8]",
    "tests/test_compact.py::test_jax_layer_is_exact_forward_and_carries_the_projected_gradient",
    "tests/test_flora.py::test_torch_jax_and_oracle_agree_over_five_steps[momentum]",
    "tests/test_flora.py::test_torch_jax_and_oracle_agree_over_five_steps[relative]",
    "tests/test_galore.py::test_optax_preset_matches_live_optax_contrib_galore",
    "tests/test_jax_adamw.py::test_bitwise_vs_optax_single_leaf_and_bf16[eager]",
    "tests/test_jax_flora_compile.py::test_compiled_kernels_do_not_grow_with_same_shaped_leaves",
    "tests/test_jax_lowrank_batched.py::"
    "test_grouped_updates_and_states_are_the_per_leaf_paths_bit_for_bit",
    "tests/test_jax_lowrank_param.py::test_state_is_unchanged_and_float32_takes_one_path[coap]",
    "tests/test_mulo.py::test_unit_multipliers_are_small_fc_lopt_bit_for_bit",
    "tests/test_random.py::test_div_and_sqrt_are_correctly_rounded[float32]",
    "tests/test_small_fc_lopt.py::test_accumulation_follows_prefab_by_hand",
    "tests/test_small_fc_lopt.py::test_jax_updates_are_minus_step_and_a_schedule_scales_them",
    "tests/test_small_fc_lopt.py::test_meta_init_is_the_same_bits_in_every_backend",
    "tests/test_small_fc_lopt.py::test_torch_and_jax_agree_on_random_problems",
    "tests/test_velo.py::test_jax_steps_exactly_p_minus_step",
    "tests/test_velo.py::test_meta_init_same_bits_everywhere",
    "tests/test_velo.py::test_torch_and_jax_agree_on_a_random_problem",
    "tests/test_checkpoints.py::test_jax_optax_from_pretrained_and_save",
    "tests/test_checkpoints_mulo.py::test_jax_from_pretrained_reproduces_the_golden_trace[lo]",
    # benchmarks, examples and pages run to the end (bench/train_step.py's stays)
    "tests/test_bench.py::test_distributed_tiny",
    "tests/test_bench.py::test_lopt_step_jax_tiny",
    "tests/test_bench.py::test_lopt_step_tiny",
    "tests/test_bench.py::test_poet_layer_tiny",
    "tests/test_bench.py::test_train_step_tiny_compile_mode",
    "tests/test_bench.py::test_train_step_tiny_accumulates_micro_batches",
    "tests/test_examples.py::test_lowrank_lm_trains_every_method_on_both_backends",
    "tests/test_examples.py::test_poet_llama_pretrains_with_merges[jax]",
    "tests/test_examples.py::test_velo_digits_lowers_the_loss_on_both_backends",
    "tests/test_mulo_example.py::test_mulo_lowers_every_bundled_problem_on_both_backends",
    "tests/test_doc_snippets.py::test_page_examples_run[docs/distributed.md]",
    "tests/test_doc_snippets.py::test_page_examples_run[docs/methods/coap.md]",
    "tests/test_doc_snippets.py::test_page_examples_run[docs/methods/mulo.md]",
    "tests/test_doc_snippets.py::test_page_examples_run[docs/parity/record-compare.md]",
)


def _in_slow_tier(nodeid: str) -> bool:
    path, _, name = nodeid.partition("::")
    for entry in SLOW_TESTS:
        if entry == path or entry == nodeid:
            return True
        if "::" in entry and "[" not in entry and nodeid.startswith(entry + "["):
            return True
    return False


def _share_the_cores(config) -> None:
    """Under pytest-xdist, each worker's (and its children's) torch, MKL and OpenBLAS use
    their share of the cores, not all of them (``OMP_NUM_THREADS``; a value set outside is
    kept): the tensors here are small, and threads beyond a process's share only wait for
    a core held by another worker (a VeLO golden case's torch steps took 6x the CPU time on
    two cores shared by two workers). Every comparison is between runs under one setting."""
    workers = len(config.getoption("tx", None) or [])
    if workers < 2:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (cores or 1) // workers)))


def _jax_compilation_cache(config) -> None:
    """One JAX compilation cache for the run (a temporary directory, removed at its end),
    shared by the workers and their child processes through the environment: the parity
    harness jits a new step function per trace and mode, and the same program compiled
    again is read back (a VeLO golden case's update compiles for 30 s on a CPU). XLA's
    flags are in the cache's key, so children of other flags compile their own. The size
    limit turns on JAX's file lock, so that a worker never reads an entry another is
    writing."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    path = tempfile.mkdtemp(prefix="xopt-tests-jax-cache-")
    config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))
    settings = {"JAX_COMPILATION_CACHE_DIR": path,
                "JAX_COMPILATION_CACHE_MAX_SIZE": str(8 << 30)}
    os.environ.update(settings)
    if "jax" in sys.modules:  # JAX reads its environment when imported
        import jax

        for name, value in settings.items():
            jax.config.update(name.lower(), int(value) if value.isdigit() else value)


def pytest_configure(config):
    """Files go to the workers in collection order (:func:`pytest_collection_modifyitems`),
    not re-sorted by their number of tests (pytest-xdist's default for loadfile, which put
    the slow files, each of few tests, last). In the main process (not an xdist worker,
    which inherits its environment): the cores shared among the workers and one JAX
    compilation cache for the run."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if not hasattr(config, "workerinput"):
        _share_the_cores(config)
        _jax_compilation_cache(config)


def _order_files(items) -> None:
    """:data:`SLOW_FILES` first, in their order; then the other files by their number of
    tests, most first (pytest-xdist's own order); a file's tests keep their order."""
    def path(item) -> str:
        return item.nodeid.split("::")[0]

    count = Counter(map(path, items))

    def key(item):
        if path(item) in SLOW_FILES:
            return (0, SLOW_FILES.index(path(item)))
        return (1, -count[path(item)])

    items.sort(key=key)  # stable: the order within a file and among ties is kept


@pytest.hookimpl(specname="pytest_collection_modifyitems", tryfirst=True)
def pytest_collection_modifyitems_slow_tier(items):
    """:data:`SLOW_TESTS` marked ``slow``, before ``-m`` deselects by marker (here, not per
    collected item: this file's collection hooks do not see parity_tests/)."""
    for item in items:
        if _in_slow_tier(item.nodeid):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)  # after pytest groups a module's tests by fixture parameters
def pytest_collection_modifyitems(config, items):
    """Files ordered for the workers (:func:`_order_files`). Every test may run once more
    after a native crash of one of its processes, and only then (helpers.NATIVE_CRASH says
    why); without pytest-rerunfailures, never."""
    _order_files(items)
    if not config.pluginmanager.hasplugin("rerunfailures"):
        return
    from helpers import NATIVE_CRASH

    mark = pytest.mark.flaky(reruns=1, only_rerun=list(NATIVE_CRASH))
    for item in items:
        item.add_marker(mark)
