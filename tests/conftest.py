"""The tests, in layers: unit/ (the library's and the converter's Python, the walls), native/ (the C
code, through its binding and from C), e2e/ (Llama, chat, the server and the command line on real
models), tools/ (leanstream_tools: bench, perplexity, compare, HumanEval), bench/ (the bench/
scripts and the micro-benchmarks); support/ holds what they share (synthetic GGUFs, the numpy
references, hostile files, the fuzz worker), importable by name from every layer.

Shared fixtures: the real SmolLM2 model (docs/design.md §7) and its conversion, once per session;
and the test tiers (pyproject.toml [tool.pytest.ini_options], scripts/test.sh):

    bash scripts/test.sh                        # everything but the benchmarks (CI: .ci/run)
    bash scripts/test.sh -m "not slow"          # the fast tier, for the edit loop
    .venv/bin/python -m pytest tests/bench/test_kernel_bench.py --benchmark-only   # benchmarks

`slow` is put on every test that needs a real model (a fixture of SLOW_FIXTURES, directly or
through another fixture), on the few tests of SLOW_TESTS and on the cases of FAST_CASES' tests it
does not name, here, at collection: a new test on
SmolLM2 is slow because of the fixture it asks for, with no mark to forget. Tests that use
pytest-benchmark's `benchmark` fixture are skipped unless --benchmark-only (those alone) or
--benchmark-enable (those too) is given."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(Path(__file__).parent / "support"))   # gguf_synth, reference, ... by name

# fixtures that download or convert a real model: every test using one, however indirectly, is slow
SLOW_FIXTURES = {
    "smollm2_gguf": "downloads SmolLM2-135M",
    "smollm2_dir": "converts SmolLM2-135M",                 # here, and test_harness_smollm2's own
    "smollm2_sketch_dir": "converts SmolLM2-135M with its sketch",
    "smollm2": "downloads SmolLM2-135M",                    # test_harness_smollm2
    "gemma3_gguf": "downloads gemma3-270m",                 # test_gemma3
    "gemma3_dir": "converts gemma3-270m through the CLI",   # test_gemma3
    "cross": "builds the native library for aarch64 and runs it under qemu",   # test_cross (CI installs the tools)
    "built_wheel": "builds a wheel, compiling the native library",          # test_packaging
}
# slow for what they do in their body, not for a fixture: (file, test function) -> why
SLOW_TESTS = {
    ("test_converter.py", "test_smollm2"): "fetches and converts SmolLM2-135M in its body",
    ("test_fuzz.py", "test_fuzz_model_directory"): "400 fuzz cases x 2 configurations in a child process",
    ("test_stages.py", "test_other_parameters_refuse_to_resume"): "a killed conversion in a child, then three more",
    ("test_stages.py", "test_cli_rerun_after_interruption_resumes"): "a killed conversion in a child, then a resumed one",
    # the fast tier's budget (~90 s on 2 cores): these convert or train for 10-40 s each; the
    # fast tier keeps a cheaper test of the same property (named after the arrow)
    ("test_convert_budget.py", "test_a_model_larger_than_the_limit_converts_within_it"):
        "converts under a tight cgroup -> test_convert_budget's killed-conversion resumes",
    ("test_converter.py", "test_cli_convert_trains_predictors"): "trains predictors -> test_predictor's pipeline tests",
    ("test_converter.py", "test_interrupted_then_resumed"): "two conversions -> test_convert_budget's kill points",
    ("test_predictor.py", "test_training_beats_chance"): "trains for seconds -> test_predictor's export round trips",
    ("test_stages.py", "test_uninterrupted_conversion_is_complete"): "trains predictors -> test_convert_budget",
    ("test_stages.py", "test_killed_conversion_resumes_to_the_same_files"): "trains predictors, twice",
    ("test_compare.py", "test_compare_on_a_tiny_model"): "every setup of compare -> test_compare's typed results",
    ("test_compare.py", "test_a_refused_memory_plan_is_a_typed_result"): "runs compare's children -> test_compare's units",
    ("test_compare.py", "test_the_reserve_without_a_measured_run_is_the_memory_plan_s"): "runs compare's children",
    ("test_compare.py", "test_plot_writes_a_png"): "matplotlib's first import",
    ("test_op.py", "test_counters_answer_while_an_op_waits_for_its_reads"): "waits on injected I/O delays",
    ("test_sparse.py", "test_streamed_sparse_equals_cached_under_io_delays"): "injected I/O delays",
    ("test_cli_user.py", "test_info_shows_predictor_and_sparse_mode_readiness"): "trains predictors",
    ("test_predictor.py", "test_pipeline_tiny_c_equals_torch_on_real_inputs"): "profiles and trains",
    ("test_converter.py", "test_resume_rewrites_a_corrupt_layer"): "two conversions -> test_convert_budget's kill points",
    ("test_converter.py", "test_usable_model_dir_check"): "converts, then damages three ways",
    ("test_moe_convert.py", "test_killed_conversion_resumes_to_the_same_files"): "two MoE conversions in children",
    ("test_moe_convert.py", "test_a_damaged_expert_file_from_an_interrupted_run_is_written_again"):
        "two MoE conversions -> test_moe_llama's verify of a corrupt expert",
}
# parametrizations the fast tier keeps of a test with many cases (the full suite runs every one):
# a set of case ids, or a rule on the id; one per family of what the cases cover (every ISA at one
# row count, every type at one shape, ...)
FAST_CASES = {
    ("test_archs.py", "test_speculative_greedy_equals_plain"): {"llama3-auto", "phi3-self-fixed"},
    ("test_archs.py", "test_dense_matches_stock"): {"qwen3", "gemma2"},
    ("test_archs.py", "test_sparse_modes_run_on_every_architecture"): {"phi3"},
    ("test_gemma3.py", "test_gelu_op_matches_reference"): {"1-f16", "5-gemma3-types"},
    ("test_op.py", "test_dense_matches_reference"): lambda case: case.endswith("-2-7"),
    ("test_kernels.py", "test_kernels_match_reference"): lambda case: case.endswith("-9"),
    ("test_kernels.py", "test_a_verify_pass_row_equals_that_token_alone"): lambda case: case.endswith("-5"),
    ("test_kernels.py", "test_streamed_cascade_matches_reference"): lambda case: case.startswith("q6_k"),
    ("test_kernels.py", "test_split_layout_cascade_matches_reference"): lambda case: case.startswith("q8_0"),
    ("test_cross.py", "test_engine_on_aarch64"): {"q4_K-5"},
    ("test_cross.py", "test_engine_program_on_this_machine"): {"q4_K-5"},
    ("test_converter.py", "test_round_trip"): {"qwen2-kquants", "llama-f16"},
    ("test_converter.py", "test_llama_cpp_loads_source_and_base"): {"qwen2"},
    ("test_converter.py", "test_k_quant_down_columns"): {"q6_k-6.5625"},
    ("test_convert_budget.py", "test_killed_conversion_resumes_to_the_same_files"): {"reorder-layer:0"},
    ("test_converter_archs.py", "test_phi3_halves_of_any_type"): {"q4_K_M"},
    ("test_converter_archs.py", "test_the_moe_families_it_converts"): {"qwen2moe"},
    ("test_moe_convert.py", "test_each_layout_converts_into_base_and_expert_files"):
        {"qwen2moe", "qwen3moe-q4_K-q6_K"},   # (tests/e2e/test_moe_llama.py converts all four layouts)
    ("test_cli_user.py", "test_a_memory_limit_too_small_is_one_line_with_the_plan"): {"chat"},
    ("test_hostile.py", "test_bench_and_perplexity_bad_parameters"):
        {"--memory-budget-lots-memory_budget-bench", "--sparsity-nan-sparsity-bench", "--mode-turbo-mode-perplexity"},
    ("test_sparse.py", "test_oracle_priorities_select_the_top_blocks"): lambda case: case.startswith("0.5"),
}


def _fast_case(test: tuple[str, str], case: str | None) -> bool:
    keep = FAST_CASES[test]
    return keep(case or "") if callable(keep) else case in keep


@pytest.hookimpl(tryfirst=True)   # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    # --benchmark-only: pytest-benchmark itself skips the other tests (at collection, no fixture set up)
    with_bench = config.getoption("benchmark_only", False) or config.getoption("benchmark_enable", False)
    skip_bench = pytest.mark.skip(reason="a benchmark: --benchmark-only runs it (--benchmark-enable: with the rest)")
    for item in items:
        names = getattr(item, "fixturenames", ())     # every fixture it needs, transitively
        test = (item.path.name, getattr(item, "originalname", item.name))
        case = getattr(getattr(item, "callspec", None), "id", None)
        if (any(f in SLOW_FIXTURES for f in names) or test in SLOW_TESTS
                or (test in FAST_CASES and not _fast_case(test, case))):
            item.add_marker(pytest.mark.slow)
        if "benchmark" in names and not with_bench:
            item.add_marker(skip_bench)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from leanstream_ggml.model import registry

    return registry.fetch("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, tmp_path_factory) -> Path:
    from leanstream_convert import convert

    out = tmp_path_factory.mktemp("smollm2") / "smollm2.lsm"
    convert(smollm2_gguf, out, progress=False, sketch="none")   # dense mode only: block files, no sketch
    return out


@pytest.fixture(scope="session")
def prose() -> str:
    return (DATA / "prose.txt").read_text()


@pytest.fixture(scope="session")
def smollm2_sketch_dir(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2 converted the default way, and calibrated: block files + the 2-bit sketch
    (leanstream mode) + the quality= table."""
    from leanstream_convert.stages import convert_model

    out = tmp_path_factory.mktemp("smollm2-sketch") / "smollm2.lsm"
    convert_model(smollm2_gguf, out, progress=False, calibrate=True)
    return out


# Two tiny synthetic models, converted once a session, for the tests that run a command or the
# server on both kinds of model (seconds each: the fast tier). Each source GGUF lies beside its
# directory, as `leanstream convert` leaves it (with no budget and no limit Llama runs it in RAM).
@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> tuple[Path, Path]:
    """(source GGUF, model directory) of a qwen3moe-layout model: 2 layers of 8 experts, 2 routed
    per token, converted by the command line's defaults."""
    from gguf_synth import write_tiny_model

    from leanstream_ggml.cli import main

    d = tmp_path_factory.mktemp("tiny-moe")
    write_tiny_model(d / "qwen3moe.gguf", arch="qwen3moe", n_layer=2, moe_experts=8, moe_used=2, seed=3,
                     scales="peaked")
    assert main(["convert", str(d / "qwen3moe.gguf"), str(d / "qwen3moe.lsm"), "--quiet"]) == 0
    return d / "qwen3moe.gguf", d / "qwen3moe.lsm"


@pytest.fixture(scope="session")
def tiny_dense(tmp_path_factory) -> tuple[Path, Path]:
    """(source GGUF, model directory) of a dense llama-layout model of the same size: block files,
    no sketch, the activations pass over a few positions (dense mode is what the tests run)."""
    from gguf_synth import write_tiny_model

    from leanstream_convert import convert

    d = tmp_path_factory.mktemp("tiny-dense")
    write_tiny_model(d / "llama.gguf", arch="llama", n_layer=2, n_embd=64, n_ff=96, seed=2)
    convert(d / "llama.gguf", d / "llama.lsm", progress=False, sketch="none", profile_tokens=128)
    return d / "llama.gguf", d / "llama.lsm"
