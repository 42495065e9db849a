"""What a user sees from the `leanstream` command: --version, `info`'s predictor and sparse-mode
lines, `chat`'s load time and --verbose per-token stats, the exact convert command when a plain
GGUF is given to `chat` or `serve`, and every command on a mixture-of-experts model."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from importlib import metadata

import pytest

from gguf_synth import write_tiny_model


def _cli(*argv, timeout=300):
    return subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)


def test_version():
    import leanstream_ggml

    r = _cli("--version", timeout=60)
    assert r.returncode == 0
    assert f"leanstream-ggml {leanstream_ggml.__version__}" in r.stdout
    assert f"llama-cpp-python {metadata.version('llama_cpp_python')}" in r.stdout


_PLUGGED = r"""
import json, sys
from leanstream_ggml import cli
listing = cli.build_parser().format_help()
before = set(sys.modules)
cli.build_parser("compare")
print(json.dumps({"listing": listing, "commands": {k: v[0] for k, v in cli.COMMANDS.items()},
                  "loaded": sorted(m for m in set(sys.modules) - before if m.startswith("leanstream_tools"))}))
"""


def test_the_tools_commands_are_plugged_in_by_entry_points():
    """The library's command table names no tool: `leanstream --help` lists bench, perplexity,
    compare, eval and tune from the leanstream.commands entry points, and building one command's
    parser imports that tool's modules only."""
    import json

    r = subprocess.run([sys.executable, "-c", _PLUGGED], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert not any(m.startswith("leanstream_tools") for m in doc["commands"].values())
    for name in ("bench", "perplexity", "compare", "eval", "tune"):
        assert f"    {name} " in doc["listing"], doc["listing"]
    assert "leanstream_tools.compare" in doc["loaded"]
    assert not {"leanstream_tools.tune", "leanstream_tools.humaneval"} & set(doc["loaded"])


def _field(info: str, name: str) -> str:
    """The value of one `leanstream info` line (labels padded to 17 characters)."""
    line = next(line for line in info.splitlines() if line.startswith(name + " "))
    return line[len(name):].strip()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    src = tmp_path_factory.mktemp("tiny") / "tiny model.gguf"   # a space: the command must be quoted
    write_tiny_model(src, arch="llama", n_layer=2, n_embd=64, n_ff=96, types={"ffn": "F16"}, seed=2)
    return src


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_plain_gguf_gets_the_exact_convert_command(tiny_gguf, command):
    r = _cli(command, str(tiny_gguf), timeout=120)
    assert r.returncode == 1
    out = tiny_gguf.with_suffix(".lsm")
    assert f"leanstream convert {shlex.quote(str(tiny_gguf))} {shlex.quote(str(out))}" in r.stderr
    assert f"leanstream {command} {shlex.quote(str(out))}" in r.stderr
    assert "Traceback" not in r.stderr


def test_info_shows_predictor_and_sparse_mode_readiness(tiny_gguf, tmp_path):
    from leanstream_convert import convert

    d = tmp_path / "tiny.lsm"
    convert(tiny_gguf, d, progress=False, sketch="none")
    r = _cli("info", str(d), timeout=60)
    assert r.returncode == 0, r.stderr
    assert _field(r.stdout, "predictor") == "none"
    sparse = _field(r.stdout, "sparse modes")
    assert sparse.startswith("not ready: no sketch and no predictors")
    assert "leanstream convert tiny model.gguf" in sparse
    assert _field(r.stdout, "sketch") == "none"

    pytest.importorskip("torch", reason="predictor files are made with torch (convert extra)")
    from pred_synth import write_random_predictors

    write_random_predictors(d)
    r = _cli("info", str(d), timeout=60)
    assert _field(r.stdout, "predictor").startswith("lspred v2, 2 layer files, ")
    sparse = _field(r.stdout, "sparse modes")
    assert "ready: oneshot, dejavu+, leanstream" in sparse and "powerinfer2: needs" in sparse
    (d / "predictor" / "blk.1.lspred").unlink()
    r = _cli("info", str(d), timeout=60)      # a file the manifest names is gone: one clear line
    assert r.returncode == 1 and "blk.1.lspred" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_chat_prints_load_time_and_verbose_per_token_stats(smollm2_dir, tmp_path):
    r = _cli("chat", str(smollm2_dir), "-p", "Say hello.", "-n", "12", "--temp", "0", "-t", "2",
             "--memory-budget", "32MiB")
    assert r.returncode == 0, r.stderr
    assert f"loaded {smollm2_dir} in " in r.stderr and "FFN budget 32.0 MiB" in r.stderr
    assert "per decoded token" not in r.stderr
    r = _cli("chat", str(smollm2_dir), "-p", "Say hello.", "-n", "12", "--temp", "0", "-t", "2",
             "--memory-budget", "32MiB", "--verbose")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    print(r.stderr)
    assert "prefill " in r.stderr and "decode " in r.stderr and "tok/s" in r.stderr
    # the answer's decoded tokens (with speculation: counted from the passes, not llama.cpp's
    # counters, which take a verify pass for a prompt)
    assert 1 <= int(re.search(r"decode (\d+) tokens", r.stderr).group(1)) <= 12
    stats = next(line for line in r.stderr.splitlines() if "per decoded token" in line)
    # under a budget of about half the FFN, dense decoding reads blocks from disk every token
    assert "blocks computed" in stats and "MB read" in stats and "miss ratio" in stats


def test_chat_without_c_takes_the_largest_context_the_limit_holds(smollm2_dir, monkeypatch, capsys):
    """Without -c, chat's context is 2048, or under --memory-limit the largest of 2048/1024/512
    that leaves the engine its least cache (said on stderr); with -c it is the user's."""
    from leanstream_ggml.commands import chat
    from leanstream_ggml import memplan
    from leanstream_ggml.llama import memory_plan

    monkeypatch.setattr(memplan, "process_bytes", lambda: 50 * 10**6)   # the test session's size aside
    assert chat._context_that_fits(smollm2_dir, {}) == 2048
    assert chat._context_that_fits(smollm2_dir, {"memory_limit": 10**10}) == 2048
    # the least limit 512 tokens fit in, everything else given way: 2048 does not fit there
    small = memory_plan(smollm2_dir, 10**10, n_ctx=512, n_batch=64, speculative="off")
    least = small.reserve + small.min_cache
    tight = least + 10**6
    assert memory_plan(smollm2_dir, tight, n_ctx=2048).cache < small.min_cache
    assert chat._context_that_fits(smollm2_dir, {"memory_limit": tight}) == 512
    assert "context 512 tokens: 2048 does not fit the memory limit (-c to choose)" in capsys.readouterr().err
    memory_plan(smollm2_dir, tight, n_ctx=512).check()
    # nothing fits: 2048, which Llama refuses with its plan
    assert chat._context_that_fits(smollm2_dir, {"memory_limit": least - 2 * 10**6}) == 2048


@pytest.mark.parametrize("command", ["chat", "serve", "bench"])
def test_a_memory_limit_too_small_is_one_line_with_the_plan(tiny_dense, command):
    """--memory-limit below what the process needs besides the engine: refused before the model
    runs, with the plan's numbers, no traceback (chat, serve and bench alike)."""
    _, d = tiny_dense
    extra = ["-p", "hi"] if command == "chat" else ["-p", "4", "-n", "2", "-r", "1"] if command == "bench" else []
    r = _cli(command, str(d), "--memory-limit", "20MB", *extra, timeout=120)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "memory_limit 20 MB cannot hold this model in dense mode" in r.stderr
    assert "memory_budget = limit - the above" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_memory_limit_on_stock_is_refused(tiny_gguf):
    r = _cli("bench", str(tiny_gguf), "--memory-limit", "1GB", "-p", "4", "-n", "2", "-r", "1", timeout=120)
    assert r.returncode == 1 and "memory_limit" in r.stderr and "stock" in r.stderr
    assert "Traceback" not in r.stderr


# ---- every command on a mixture-of-experts model (in this process: the fast tier) -----------

def _moe_budget(model) -> int:
    """5 experts' bytes: fewer than a layer's 8, so every command's passes read experts."""
    from leanstream_ggml.model import manifest

    return 5 * manifest.load(model).moe.layers[0].expert_stride


def _moe_args(command: str, src, budget: int) -> list[str]:
    run = ["-t", "2", "--memory-budget", str(budget)]
    return {"info": [], "verify": [],
            "chat": ["-p", "Say hello.", "-n", "6", "--temp", "0", "-v", *run],
            "bench": ["-p", "16", "-n", "4", "-r", "1", "--json", *run],
            "perplexity": ["-c", "64", "--chunks", "1", "--reference", str(src), "--json", *run],
            "tune": ["--memory-budget", "50%"]}[command]


@pytest.mark.parametrize("command", ["info", "verify", "chat", "bench", "perplexity", "tune"])
def test_every_command_runs_on_a_moe_model(tiny_moe, command, capsys):
    """Each command answers on a MoE model as on a dense one (tune: saying it does not apply)."""
    import json

    from leanstream_ggml.cli import main
    from leanstream_ggml.native.engine import COMMON_STATS

    src, model = tiny_moe
    budget = _moe_budget(model)
    rc = main([command, str(model), *_moe_args(command, src, budget)])
    out, err = capsys.readouterr()
    if command == "tune":
        assert rc == 1 and "is a mixture-of-experts model" in err and "nothing to tune" in err
        return
    assert rc == 0, err
    if command == "info":
        assert _field(out, "experts").startswith("8 per layer, 2 routed per token")
        assert _field(out, "sparse modes").startswith("none: a mixture-of-experts model")
        assert "counted from the routing pass's frequencies" in _field(out, "expert cache")
    elif command == "verify":
        assert "intact" in out
    elif command == "chat":
        assert f"loaded {model} in " in err and f"(mode dense, FFN budget {budget / 1024:.1f} KiB)" in err
        assert "answer " in err
    elif command == "bench":
        doc = json.loads(out.strip().splitlines()[-1])
        assert doc["decode_tok_s"] > 0 and doc["memory_budget_bytes"] == budget
        assert set(COMMON_STATS) <= set(doc["engine_decode"]) and doc["engine_decode"]["blocks_computed"] > 0
    else:
        doc = json.loads(out.strip().splitlines()[-1])
        assert doc["mode"] == "dense" and doc["n_scored"] > 0
        assert doc["top1_agreement"] >= 0.8 and doc["kl_mean"] < 0.05, doc


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_chat_verbose_per_token_stats_on_both_kinds(tiny_dense, tiny_moe, kind):
    """chat -v's per-token line, from the counters both engines have (a MoE model's experts are
    its blocks; the predictor's time where the engine has one)."""
    from leanstream_ggml import Llama
    from leanstream_ggml.commands import chat

    _, model = tiny_dense if kind == "dense" else tiny_moe
    llm = Llama(str(model), n_ctx=128, n_threads=2, verbose=False, speculative="off",
                memory_budget=_moe_budget(tiny_moe[1]))
    try:
        llm.eval(llm.tokenize(b"Say hello, say hello."))
        before = llm.stats()
        for t in (260, 111, 111, 114):
            llm.eval([t])
        after = llm.stats()
        assert chat._decoded(llm, before, after) == (4, 4)
        line = chat._per_token_stats(llm, before, after)
    finally:
        llm.close()
    assert line.startswith("per decoded token: ") and "blocks computed" in line and "miss ratio" in line
    assert ("predictor" in line) == (kind == "dense")
