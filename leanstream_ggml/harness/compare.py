"""`leanstream compare`: one model's setups side by side under one whole-process memory limit.

    leanstream compare qwen2.5-coder-1.5b-instruct --memory-limit 1GB --out cmp.json --plot cmp.png
    leanstream compare model.gguf --memory-limit 600MB --short     # a smoke test (CI: SmolLM2)

Setups (--setups, a comma list; default: all six below):

- "stock": stock llama-cpp-python (llama_cpp.Llama, mmap, its defaults) on the GGUF given, the
  source quant. It always runs: beyond the limit its mmap'd pages are read from disk again.
- "stock-q3_k_m", "stock-q2_k" (any "stock-<type>" of harness/quants.py): the same on a smaller
  quantization made from that GGUF with llama.cpp's quantizer (cached next to it), a stock
  user's alternative. One whose file is not smaller than the source's is not run; one whose
  file alone is larger than the limit does not fit and is not run.
- "dense", "leanstream" (any engine mode): the plugin on the converted model directory
  (--model-dir; else the converter's default place, converted on first use and kept);
  "MODE@ppl+N%", e.g. "leanstream@ppl+5%": leanstream at the sparsity quality="ppl+N%" takes
  from the converter's calibration. A mode the directory cannot run (no sketch, no
  calibration) is not run, and the reason is given.

Measured for each setup:

- decode tok/s and peak memory: `leanstream bench --json` in a fresh process inside its own
  child memory cgroup limited to --memory-limit (harness/cgroup.py: the whole process, page
  cache of its mmap'd files included). Peak = the cgroup's charged peak, what the limit binds
  (peak RSS, VmHWM, where cgroups are not writable). Before each run the page cache of its
  model files is dropped; the files are private copies no other process reads. A plugin
  setup runs with `--memory-limit` = the limit: the child's memory plan (memplan.py: the
  interpreter, the non-FFN weights each token reads, KV cache, llama.cpp's heap and compute
  buffers) gives its FFN engine the rest, and a limit the plan cannot hold does not fit (the
  plan's numbers are the reason).
- held-out perplexity ratio: `leanstream perplexity` over windows of --ppl-ctx tokens of the
  bundled held-out text (second halves scored; the sparse modes token by token, as they
  decode, because prefill is dense), measured without a limit (a limit changes where the
  weights are read from, not what is computed; the sparse modes get a budget one block short
  of their FFN + sketch, so that they select through the sketch as under every limit: a budget
  holding everything selects from exact scores and does better), divided by stock's.

Where cgroups are not writable every setup runs once without any limit (no cgroup, no plugin
budget) and the table, the JSON and the plot say so. Prints a table; --out writes every
measurement as JSON, --plot a PNG: ppl ratio against decode tok/s, one point per setup, the
Pareto front (the setups no other one beats on both) marked.

This module also holds what bench/side_by_side.py (several limits, decode tok/s against the
limit) shares with the command: the child runs, the reserve, the private copies, the perplexity
runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import cgroup, measure

ROOT = Path(__file__).resolve().parents[2]   # the directory holding leanstream_ggml/ (the checkout)

STOCK = "stock"
DEFAULT_SETUPS = ("stock", "stock-q3_k_m", "stock-q2_k", "dense", "leanstream", "leanstream@ppl+5%")
RESERVE_MARGIN = 32 * 2**20

# (n_prompt, n_gen, repetitions, perplexity windows): a measurement, and --short's smoke test
FULL = {"n_prompt": 64, "n_gen": 32, "repetitions": 3, "ppl_chunks": None}
SHORT = {"n_prompt": 16, "n_gen": 8, "repetitions": 1, "ppl_chunks": 1}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# setup names

def is_stock(system: str) -> bool:
    """stock llama-cpp-python: on the GGUF given ("stock") or a smaller quantization of it."""
    return system == STOCK or system.startswith(STOCK + "-")


def stock_quant(system: str) -> str | None:
    """"stock-q3_k_m" -> "Q3_K_M"; None for the GGUF as given."""
    return system[len(STOCK) + 1:].upper() if system.startswith(STOCK + "-") else None


def plugin_mode(system: str) -> tuple[str, str | None]:
    """A plugin setup's (engine mode, quality preset): "leanstream@ppl+5%" -> ("leanstream",
    "ppl+5%"), "dense" -> ("dense", None)."""
    mode, _, quality = system.partition("@")
    return mode, quality or None


def check_setups(systems: list[str]) -> list[str]:
    """The setups, each checked: a stock quantization llama.cpp's quantizer makes, an engine
    mode, a quality preset of leanstream mode. ParameterError naming the bad one."""
    from leanstream_ggml import params
    from leanstream_ggml._native import MODES

    from .quants import FTYPES

    for s in systems:
        if is_stock(s):
            q = stock_quant(s)
            if q is not None and q not in FTYPES:
                raise params.ParameterError("--setups", f"{s!r}: no quantization {q} (known: "
                                                        f"{', '.join(t.lower() for t in FTYPES)})")
            continue
        mode, quality = plugin_mode(s)
        if mode not in MODES:
            raise params.ParameterError("--setups", f"{s!r}: not stock[-TYPE] and no engine mode {mode!r} "
                                                    f"(modes: {', '.join(MODES)})")
        if quality is not None:
            params.quality(quality)
            if mode != "leanstream":
                raise params.ParameterError("--setups", f"{s!r}: a quality preset chooses leanstream mode's "
                                                        f"sparsity (write leanstream@{quality})")
    return systems


def parse_systems(text: str) -> list[str]:
    """"stock, dense,,stock" -> ["stock", "dense"]: the names of a comma list, once each, in order."""
    from leanstream_ggml import params

    out = [s.strip() for s in text.split(",") if s.strip()]
    if not out:
        raise params.ParameterError("--setups", "no setups given")
    return list(dict.fromkeys(out))


def parse_limit(text: str | None) -> int | None:
    """--memory-limit: bytes ("1GB" = 10^9, "600MiB" = 600 * 2^20), None for none; a bad value is
    a ParameterError naming the option."""
    from leanstream_ggml import params

    return params.size_bytes(text, "--memory-limit") or None


# ---------------------------------------------------------------------------------------------
# the models each setup runs on

def resolve_model_dir(gguf: Path, model_arg: str, model_dir: str | None, sketch: bool = False) -> Path:
    """The converted directory: --model-dir, else the converter's default location, converted on
    first use: block files alone (dense mode, seconds) unless ``sketch`` (a sparse setup), then
    as `leanstream convert` does (block files, the sketch, the quality calibration; minutes)."""
    from leanstream_ggml import manifest, models

    if model_dir:
        out = Path(model_dir)
    elif model_arg in models.RECIPES:
        out = models.lsm_dir(model_arg)
    else:
        out = gguf.with_suffix(".lsm")
    try:
        manifest.load(out)
        return out
    except Exception:
        pass
    # `leanstream convert` in a child process: the runtime never imports the converter
    cmd = [sys.executable, "-m", "leanstream_ggml.cli", "convert", str(gguf), str(out), "--quiet"]
    if sketch:
        log(f"converting {gguf} -> {out} (block files, sketch, calibration: minutes)")
    else:
        log(f"converting {gguf} -> {out} (block files alone: dense mode)")
        cmd += ["--sketch", "none"]
    r = subprocess.run(cmd, env=child_env(), cwd=str(ROOT), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"converting {gguf} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return out


def prepare_models(model_arg: str, systems: list[str], model_dir: str | None) -> tuple[Path, dict, Path | None]:
    """(source GGUF, {stock setup: its GGUF}, converted directory or None): the smaller
    quantizations made once from the source, the directory converted if a plugin setup needs it."""
    from leanstream_ggml import models

    from . import quants

    gguf = models.resolve(model_arg)
    if gguf.is_dir():
        from leanstream_ggml import params

        raise params.ParameterError("MODEL", f"{gguf} is a model directory; give the GGUF it was converted "
                                             f"from (stock runs it) and the directory as --model-dir")
    if not gguf.is_file():
        import errno

        raise FileNotFoundError(errno.ENOENT, "no such GGUF file or model name", str(gguf))
    plugin = [s for s in systems if not is_stock(s)]
    sparse = any(plugin_mode(s)[0] != "dense" for s in plugin)
    directory = resolve_model_dir(gguf, model_arg, model_dir, sketch=sparse) if plugin else None
    ggufs = {s: gguf if stock_quant(s) is None else quants.requantize(gguf, stock_quant(s), log=log)
             for s in systems if is_stock(s)}
    ggufs.setdefault(STOCK, gguf)
    return gguf, ggufs, directory


def stock_files(ggufs: dict, source: Path) -> dict:
    """What each stock setup's file is and how it was made (for the JSON)."""
    from . import quants

    return {s: {"file": p.name, "bytes": p.stat().st_size,
                "made": None if stock_quant(s) is None else
                f"llama.cpp llama_model_quantize (via llama-cpp-python) from {source.name}"
                + (", re-quantized (allow_requantize)" if quants.source_type(source) != "src" else "")}
            for s, p in ggufs.items()}


def private_copies(ggufs: dict, model_dir: Path | None, where: Path) -> tuple[dict, Path | None]:
    """Copies of the model files that no other process reads, so that dropping their page cache
    sticks (another process reading the shared GGUF would bring its pages back, charged to
    someone else, and our run would read them for free). Same filesystem as the model cache, so
    the block files keep their O_DIRECT alignment. ggufs: stock system -> GGUF."""
    where.mkdir(parents=True, exist_ok=True)
    g = {}
    for system, path in ggufs.items():
        g[system] = where / path.name
        if not g[system].exists():
            shutil.copyfile(path, g[system])
    d = None
    if model_dir is not None:
        d = where / model_dir.name
        shutil.copytree(model_dir, d)
    return g, d


@contextlib.contextmanager
def workspace(ggufs: dict, model_dir: Path | None, private: bool):
    """Yields (ggufs, model_dir) to run on: private copies in a temporary directory of the model
    cache (removed afterwards), or the files themselves if not ``private``."""
    if not private:
        yield ggufs, model_dir
        return
    from leanstream_ggml.build import cache_dir

    tmp = Path(tempfile.mkdtemp(prefix="compare-", dir=cache_dir()))
    try:
        log(f"copying the model files to {tmp} (private copies; --no-private-copy to skip)")
        yield private_copies(ggufs, model_dir, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# one run in a child process

def engine_args(system: str, sparsity: float | None) -> list[str]:
    """The `leanstream bench` / `perplexity` options that select a setup's system and mode."""
    if is_stock(system):
        return ["--system", "stock"]
    mode, quality = plugin_mode(system)
    out = ["--system", "leanstream", "--mode", mode]
    if quality is not None:
        return out + ["--quality", quality]
    return out + (["--sparsity", str(sparsity)] if sparsity is not None and mode != "dense" else [])


def bench_command(model: Path, system: str, args, budget: int | None, memory_limit: int | None = None) -> list[str]:
    """`leanstream bench --json` of one setup. args: n_prompt, n_gen, repetitions, ctx_size,
    batch_size, threads, sparsity (the same for every setup). A plugin setup gets ``budget`` as
    --memory-budget, or ``memory_limit`` as --memory-limit (its memory plan)."""
    cmd = [sys.executable, "-m", "leanstream_ggml.harness.cli", "bench", str(model), "--json",
           "-p", str(args.n_prompt), "-n", str(args.n_gen), "-r", str(args.repetitions),
           "-c", str(args.ctx_size), "-b", str(args.batch_size), "-t", str(args.threads)]
    cmd += engine_args(system, args.sparsity)
    if budget is not None and not is_stock(system):
        cmd += ["--memory-budget", str(budget)]
    elif memory_limit is not None and not is_stock(system):
        cmd += ["--memory-limit", str(memory_limit)]
    return cmd


def selecting_budget(model_dir: Path) -> int:
    """A memory budget one block short of every layer's blocks plus the sketch: every op then
    selects through the sketch's candidates, as under any smaller budget (one that holds
    everything makes the layers resident, and they select from the exact scores of every block:
    better than any limited run)."""
    from leanstream_ggml import manifest

    m = manifest.load(model_dir)
    ffn = sum(e.n_blocks * e.block_stride for e in m.layers)
    return ffn + sketch_bytes(model_dir) - max(e.block_stride for e in m.layers)


def sketch_bytes(model_dir: Path) -> int:
    """What leanstream mode's resident sketch takes of a budget (0 without one)."""
    from leanstream_ggml import manifest

    m = manifest.load(model_dir)
    return m.sketch.bytes if m.sketch else 0


def perplexity_command(model: Path, system: str, args) -> list[str]:
    """`leanstream perplexity --json` of one setup. args: ppl_ctx, ppl_chunks, threads, sparsity.
    A sparse setup gets selecting_budget(): what it computes is then what it computes under the
    limit."""
    cmd = [sys.executable, "-m", "leanstream_ggml.harness.cli", "perplexity", str(model), "--json",
           "-c", str(args.ppl_ctx), "-t", str(args.threads)]
    if args.ppl_chunks is not None:
        cmd += ["--chunks", str(args.ppl_chunks)]
    if not is_stock(system) and plugin_mode(system)[0] != "dense":
        cmd += ["--memory-budget", str(selecting_budget(model))]
    return cmd + engine_args(system, args.sparsity)


def child_env() -> dict:
    """The environment of the child runs: this checkout's package first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def extract_json(stdout: str) -> dict | None:
    """The last line of stdout that parses as a JSON object (`leanstream bench --json` prints one)."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def summarize(bench_json: dict) -> dict:
    """The fields of `leanstream bench --json` the side-by-side reports keep."""
    keep = ("prefill_tok_s", "decode_tok_s", "prefill_tok_s_best", "decode_tok_s_best", "peak_rss_bytes",
            "rss_after_load_bytes", "load_s", "disk_read_bytes_load", "disk_read_bytes_total",
            "disk_read_bytes_per_decode_token", "memory_budget_bytes", "memory_plan", "engine_decode", "generated",
            "repetitions",
            "stock", "model_bytes")
    return {k: bench_json.get(k) for k in keep}


def plugin_budget(limit: int | None, reserve: int) -> int | None:
    if limit is None:
        return None
    return max(limit - reserve, 0)


def choose_reserve(fixed: int | None, model_dir: Path, unlimited_run: dict | None,
                   charged_peak: int | None = None) -> tuple[int, str]:
    """Bytes a LeanStream run needs besides its FFN weight cache. Measured where possible: the
    peak memory of the same mode without a limit (charged to its accounting cgroup, which is
    what a limit binds; else VmHWM) minus the bytes its cache held, plus a margin."""
    if fixed is not None:
        return fixed, "--reserve"
    if unlimited_run is not None:
        eng = unlimited_run.get("engine_total") or {}
        cache = eng.get("cache_bytes")
        peak, what = (charged_peak, "cgroup peak") if charged_peak else (unlimited_run.get("peak_rss_bytes"), "peak RSS")
        if cache is not None and peak:
            # memory_budget covers the cache and what the engine keeps resident (sketch, predictors)
            held = int(cache) + int(eng.get("resident_bytes") or 0)
            return (max(peak - held, 0) + RESERVE_MARGIN,
                    f"measured: unlimited {what} - (cache_bytes + resident_bytes) + 32 MiB")
    from leanstream_ggml import manifest

    return manifest.load(model_dir).base.size + 256 * 2**20, "default: base.gguf + 256 MiB"


# what MemoryPlanError says when the limit cannot hold the model (memplan.MemoryPlan.check)
PLAN_REFUSED = "cannot hold this model"


def bench_run(system: str, path: Path, limit: int | None, reserve: int | None, args, *, env: dict,
              account: bool, drop_cache: bool = True) -> tuple[dict, dict | None]:
    """One `leanstream bench --json` of ``system`` on ``path`` in a fresh process, in its own
    child memory cgroup limited to ``limit`` (None: unlimited; a cgroup for its accounting only
    if ``account``), after dropping the page cache of its model files. A plugin run under a
    limit gets its memory plan (--memory-limit; status "does not fit" when the plan refuses),
    or with a ``reserve`` memory_budget = limit - reserve, and is skipped (status "skipped") if
    that leaves nothing, or (a sparse mode) less than its resident sketch. Returns (the run's
    record, the bench JSON or None)."""
    files = measure.model_files(path)
    if drop_cache:
        measure.drop_page_cache(files)
    resident = [measure.resident_bytes(f) for f in files]
    planned = not is_stock(system) and limit is not None and reserve is None
    budget = None if is_stock(system) or limit is None or planned else plugin_budget(limit, reserve)
    entry = {"system": system, "limit_bytes": limit, "memory_budget_bytes": budget,
             "plugin_reserve_bytes": None if is_stock(system) or limit is None or planned else reserve,
             "page_cache_resident_at_start_bytes": None if any(r is None for r in resident) else sum(resident),
             "loadavg_1min_at_start": round(os.getloadavg()[0], 2)}
    sketch = 0 if budget is None or is_stock(system) or plugin_mode(system)[0] == "dense" else sketch_bytes(path)
    if budget == 0 or (budget is not None and budget < sketch):
        entry.update(status="skipped", cgroup={},
                     reason=(f"limit below the reserve ({measure.format_size(reserve)})" if budget == 0 else
                             f"the budget the reserve leaves ({measure.format_size(budget)}) cannot hold the "
                             f"sketch ({measure.format_size(sketch)})"))
        log(f"{system:>18} @ {measure.format_size(limit):>7}: skipped ({entry['reason']})")
        return entry, None
    res = cgroup.run_command(bench_command(path, system, args, budget, limit if planned else None),
                             limit_bytes=limit, timeout_s=args.timeout, env=env, cwd=str(ROOT), account=account)
    entry.update(res.to_dict())
    if planned and res.status == "error" and PLAN_REFUSED in res.stderr:
        line = next(ln for ln in res.stderr.splitlines() if PLAN_REFUSED in ln)
        entry.update(status="does not fit", reason=line.split(": ", 1)[-1].strip())
    bj = extract_json(res.stdout) if res.status == "ok" else None
    if res.status == "ok" and bj is None:
        entry.update(status="error", stderr_tail="no JSON on stdout\n" + res.stderr[-2000:])
    if bj is not None:
        entry["result"] = summarize(bj)
    r = entry.get("result") or {}
    per_token = r.get("disk_read_bytes_per_decode_token")
    log(f"{system:>18} @ {measure.format_size(limit):>7}: {entry['status']:>7} "
        f"decode {r.get('decode_tok_s') or 0:7.2f} tok/s  prefill {r.get('prefill_tok_s') or 0:7.1f} tok/s  "
        f"peak RSS {measure.format_size(r.get('peak_rss_bytes'))}  "
        f"cgroup peak {measure.format_size(entry['cgroup'].get('max_usage_bytes'))}  "
        f"disk/decode-token {measure.format_size(int(per_token)) if per_token is not None else 'n/a'}  "
        f"({entry['wall_s']:.0f} s)")
    return entry, bj


def measure_perplexities(paths: dict, args, *, env: dict, account: bool) -> dict:
    """Held-out perplexity of each setup ({setup: model path}), once, without a limit: a memory
    limit changes where the weights are read from, not what is computed (the sparse setups at a
    budget that selects as every limited run does: perplexity_command)."""
    out = {}
    for system, path in paths.items():
        res = cgroup.run_command(perplexity_command(path, system, args), limit_bytes=None,
                                 timeout_s=args.timeout * 4, env=env, cwd=str(ROOT), account=account)
        pj = extract_json(res.stdout) if res.status == "ok" else None
        out[system] = ({k: pj.get(k) for k in ("ppl", "n_scored", "n_chunks", "decode_scored", "sparsity", "quality")}
                       if pj else {"status": res.status, "stderr_tail": res.stderr[-1000:]})
        out[system]["loadavg_1min_at_start"] = round(os.getloadavg()[0], 2)
        log(f"{system:>18} perplexity: {out[system].get('ppl')}")
    return out


def greedy_match(a: list[int] | None, b: list[int] | None) -> float | None:
    """Fraction of the greedy continuation identical to the reference before the first difference."""
    if not a or not b:
        return None
    n = min(len(a), len(b))
    k = next((i for i in range(n) if a[i] != b[i]), n)
    return k / n


def add_greedy_match(runs: list[dict]) -> None:
    """Correctness before speed: each run's greedy continuation against stock's (without a limit
    where there is such a run): ``greedy_match_vs_stock``."""
    stock = [e for e in runs if e["system"] == STOCK and e.get("result")]
    ref = next((e for e in stock if e["limit_bytes"] is None), stock[0] if stock else None)
    for e in runs:
        if e.get("result"):
            e["greedy_match_vs_stock"] = greedy_match(e["result"]["generated"], ref and ref["result"]["generated"])


def model_doc(gguf: Path, model_dir: Path | None) -> dict:
    """The models a report ran on: the GGUF and the converted directory, with their sizes."""
    return {"model": gguf.name, "model_path": str(gguf), "model_bytes": gguf.stat().st_size,
            "model_dir": str(model_dir) if model_dir else None,
            "model_dir_bytes": measure.files_size(measure.model_files(model_dir)) if model_dir else None}


def cgroup_doc(ok: bool, where: str) -> dict:
    return {"writable": ok, ("path" if ok else "reason"): where,
            "note": "each run in its own child memory cgroup (v1) under ours; memory.limit_in_bytes "
                    "= the limit (memsw too where present), page cache included" if ok else "no limits applied"}


# ---------------------------------------------------------------------------------------------
# the compare command: which setups run, the rows, the Pareto front, the table and the plot

def stock_fit(file_bytes: int, source_bytes: int, limit: int | None, source: bool) -> tuple[bool, bool | None, str | None]:
    """(runs, fits, reason) of a stock setup: fits = its file alone is within the limit (None:
    no limit). The source quant always runs (the baseline: beyond the limit llama.cpp reads its
    mmap'd pages from disk again); a smaller quantization runs only if it is smaller than the
    source and fits."""
    fits = None if limit is None else file_bytes <= limit
    if source:
        return True, fits, None if fits is not False else "its file is larger than the limit: mmap'd pages re-read from disk"
    if file_bytes >= source_bytes:
        return False, fits, (f"its file ({measure.format_size(file_bytes)}) is not smaller than the source's "
                             f"({measure.format_size(source_bytes)})")
    if fits is False:
        return False, False, (f"does not fit: its file alone ({measure.format_size(file_bytes)}) is larger than "
                              f"the limit")
    return True, fits, None


def plugin_availability(model_dir: Path, system: str) -> tuple[str | None, float | None]:
    """(why the directory cannot run this plugin setup or None, the sparsity a quality preset
    chooses or None): the engine's own checks (the mode's files, the calibration table)."""
    from leanstream_ggml import manifest, params
    from leanstream_ggml._native import mode_uses

    m = manifest.load(model_dir)
    mode, quality = plugin_mode(system)
    if mode != "dense":
        try:
            m.mode_files(model_dir, mode_uses(mode), mode)
        except manifest.ModeFilesError as e:
            return str(e), None
    if quality is None:
        return None, None
    if not m.sketch or not m.sketch.quality:
        return (f"quality={quality!r} needs the converter's calibration (convert again with the sketch: "
                f"`leanstream convert SRC {model_dir} --force`)"), None
    return None, params.sparsity_for_quality(m.sketch.quality, params.quality(quality))


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """The setups no other setup dominates, fastest first. points: setup -> (decode tok/s,
    ppl ratio); higher tok/s and lower ratio are better; a setup is dominated by one at least
    as fast and at least as good, better in one. Equal points are all on the front."""
    order = sorted(points, key=lambda s: (-points[s][0], points[s][1]))
    front, best = [], float("inf")
    for s in order:
        x, y = points[s]
        if y < best or (front and points[front[-1]] == (x, y)):
            front.append(s)
            best = min(best, y)
    return front


def failure_reason(entry: dict) -> str | None:
    """Why a run did not give a result, in a few words (its stderr's last line for an error)."""
    status = entry["status"]
    if status == "oom":
        return "OOM-killed under the limit"
    if status == "timeout":
        return f"past the timeout ({entry['wall_s']:.0f} s)"
    if status == "error":
        lines = [ln.strip() for ln in entry.get("stderr_tail", "").splitlines() if ln.strip()]
        return f"failed: {lines[-1]}" if lines else f"failed (exit status {entry.get('returncode')})"
    return entry.get("reason")


def make_rows(systems: list[str], plans: dict, runs: dict, ppl: dict, accounted: bool) -> list[dict]:
    """One row per setup, in the order given. plans: setup -> {"kind", "fits", "status",
    "reason", ...} (plan_setups: what was decided before running); runs: setup -> its run under
    the limit; ppl: setup -> its perplexity record, STOCK's the reference of every ratio. Peak =
    the cgroup's charged peak if ``accounted``, else peak RSS. A run skipped for its reserve or
    OOM-killed did not fit."""
    ref = (ppl.get(STOCK) or {}).get("ppl")
    rows = []
    for s in systems:
        plan, e = plans[s], runs.get(s)
        r = (e or {}).get("result") or {}
        p = (ppl.get(s) or {}).get("ppl")
        status = e["status"] if e is not None else plan["status"]
        fits = False if status in ("skipped", "oom", "does not fit") else plan["fits"]
        peak = (e or {}).get("cgroup", {}).get("max_usage_bytes") if accounted else r.get("peak_rss_bytes")
        rows.append({
            "setup": s, "kind": plan["kind"], "file": plan.get("file"), "file_bytes": plan.get("file_bytes"),
            "sparsity": plan.get("sparsity"), "fits": fits, "status": status,
            "reason": (failure_reason(e) if e is not None else None) or plan.get("reason"),
            "memory_budget_bytes": (e or {}).get("memory_budget_bytes") or r.get("memory_budget_bytes"),
            "plugin_reserve_bytes": (e or {}).get("plugin_reserve_bytes"),
            "memory_plan": r.get("memory_plan"),
            "decode_tok_s": r.get("decode_tok_s") if status == "ok" else None,
            "prefill_tok_s": r.get("prefill_tok_s") if status == "ok" else None,
            "peak_bytes": peak if status == "ok" else None,
            "peak_rss_bytes": r.get("peak_rss_bytes"),
            "ppl": p,
            "ppl_ratio": p / ref if p is not None and ref else None,
            "greedy_match_vs_stock": (e or {}).get("greedy_match_vs_stock"),
        })
    return rows


def front_of(rows: list[dict]) -> list[str]:
    """The Pareto front of the rows that have both a decode rate and a perplexity ratio."""
    return pareto_front({r["setup"]: (r["decode_tok_s"], r["ppl_ratio"]) for r in rows
                         if r["decode_tok_s"] is not None and r["ppl_ratio"] is not None})


def limit_label(doc: dict) -> str:
    """A few words: the limit and whether it was applied."""
    lim = doc["memory_limit_bytes"]
    if lim is None:
        return "no memory limit"
    if doc["limit_applied"]:
        return f"{measure.format_size(lim)} whole-process memory limit (cgroup)"
    return f"memory limit {measure.format_size(lim)} NOT APPLIED (cgroups not writable)"


def limit_line(doc: dict) -> str:
    """One sentence: the limit, whether it was applied, and why not."""
    if doc["memory_limit_bytes"] is not None and not doc["limit_applied"]:
        return (f"{limit_label(doc)}: {doc['cgroup']['reason']}; every setup ran without a limit and "
                f"without a plugin budget")
    return limit_label(doc) + (", page cache included" if doc["limit_applied"] else "")


def format_table(doc: dict) -> str:
    """The readable report: one Markdown row per setup; * marks the Pareto front."""
    front = set(doc["pareto_front"])
    peak_what = "cgroup" if doc["cgroup"]["writable"] else "RSS"
    out = [f"{doc['model']}: {limit_line(doc)}",
           f"decode: {doc['settings']['n_gen']} tokens after a {doc['settings']['n_prompt']}-token prompt, "
           f"median of {doc['settings']['repetitions']}; perplexity: {doc['settings']['ppl_chunks'] or 'all'} "
           f"window(s) of {doc['settings']['ppl_ctx']} of held-out text, ratio to stock",
           "",
           f"| setup | fits? | decode tok/s | peak MB ({peak_what}) | ppl × stock | note |",
           "| --- | --- | ---: | ---: | ---: | --- |"]
    for r in doc["setups"]:
        fits = {True: "yes", False: "no", None: "–"}[r["fits"]]
        dec = f"{r['decode_tok_s']:.2f}" if r["decode_tok_s"] is not None else r["status"]
        peak = f"{r['peak_bytes'] / 1e6:.0f}" if r["peak_bytes"] is not None else "–"
        ratio = f"{r['ppl_ratio']:.3f}" if r["ppl_ratio"] is not None else "–"
        notes = []
        if r["file"]:
            notes.append(f"{r['file']} ({measure.format_size(r['file_bytes'])})")
        if r["sparsity"] is not None:
            notes.append(f"sparsity {r['sparsity']:g}")
        if r["memory_budget_bytes"]:
            notes.append(f"budget {measure.format_size(r['memory_budget_bytes'])}")
        if r["reason"]:
            notes.append(r["reason"])
        mark = " *" if r["setup"] in front else ""
        out.append(f"| {r['setup']}{mark} | {fits} | {dec} | {peak} | {ratio} | {'; '.join(notes)} |")
    out += ["", "* on the Pareto front: no other setup is both faster and lower in perplexity"]
    return "\n".join(out)


def plot(doc: dict, path: str) -> None:
    """ppl ratio (y) against decode tok/s (x): one labelled point per setup that ran and was
    scored, the Pareto front as a step line through its ringed points; the others listed below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["setups"] if r["decode_tok_s"] is not None and r["ppl_ratio"] is not None]
    front = [r for s in doc["pareto_front"] for r in rows if r["setup"] == s]
    fig, ax = plt.subplots(figsize=(6.4, 4.6), dpi=120)
    ax.axhline(1.0, color="0.6", lw=0.8, ls=":")
    for r in rows:
        color = "C0" if r["kind"] == "stock" else "C1"
        ax.plot([r["decode_tok_s"]], [r["ppl_ratio"]], "o", color=color)
        ax.annotate(r["setup"], (r["decode_tok_s"], r["ppl_ratio"]), textcoords="offset points", xytext=(5, 4),
                    fontsize=8)
    if front:
        xs = [r["decode_tok_s"] for r in reversed(front)]   # slowest (best quality) first
        ys = [r["ppl_ratio"] for r in reversed(front)]
        ax.step(xs, ys, where="pre", color="C2", lw=1.2, label="Pareto front")
        ax.plot(xs, ys, "o", mfc="none", mec="C2", ms=11, mew=1.5)
    ax.plot([], [], "o", color="C0", label="stock llama-cpp-python")
    ax.plot([], [], "o", color="C1", label="leanstream plugin")
    ax.set_xlabel("decode tokens/s")
    ax.set_ylabel("held-out perplexity / stock's")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    m = doc["machine"]
    ax.set_title(f"{doc['model']}: {limit_label(doc)}\n{m['cores']} cores {m['cpu']}, {doc['settings']['n_threads']} threads, {m['date']}", fontsize=8)
    missing = [f"{r['setup']} ({r['status']})" for r in doc["setups"] if r not in rows]
    if missing:
        fig.text(0.01, 0.01, "not shown: " + ", ".join(missing), fontsize=7, ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.04 if missing else 0, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def plan_setups(systems: list[str], ggufs: dict, model_dir: Path | None, limit: int | None, enforced: bool,
                sparsity: float | None) -> dict:
    """What is decided before anything runs: for each setup its kind, its file, whether it fits
    the limit by its file alone (stock), whether the directory can run it (plugin), and its
    sparsity (the one a quality preset chooses, or --sparsity). A plugin setup fits an
    ``enforced`` limit until its reserve says otherwise. status "planned", or "does not fit" /
    "not run" with the reason."""
    plans = {}
    source = ggufs[STOCK].stat().st_size
    for s in systems:
        if is_stock(s):
            size = ggufs[s].stat().st_size
            runs, fits, reason = stock_fit(size, source, limit, stock_quant(s) is None)
            status = "planned" if runs else ("does not fit" if fits is False else "not run")
            plans[s] = {"kind": "stock", "file": ggufs[s].name, "file_bytes": size, "fits": fits,
                        "status": status, "reason": reason}
        else:
            reason, chosen = plugin_availability(model_dir, s)
            mode, quality = plugin_mode(s)
            plans[s] = {"kind": "plugin", "fits": True if enforced and limit is not None and not reason else None,
                        "sparsity": chosen if quality else sparsity if mode != "dense" else None,
                        "status": "not run" if reason else "planned", "reason": reason}
    return plans


def run(args) -> dict:
    """Measure every setup of ``args`` and return the report (see the module docstring)."""
    systems = check_setups(parse_systems(args.setups))
    limit = parse_limit(args.memory_limit)
    source, ggufs_orig, dir_orig = prepare_models(args.model, systems, args.model_dir)
    ok, where = cgroup.availability()
    applied = ok and limit is not None
    if limit is not None and not ok:
        log(f"cgroups not writable: {where}; every setup runs WITHOUT the memory limit "
            f"{measure.format_size(limit)} (no cgroup, no plugin budget)")
    run_limit = limit if applied else None
    plans = plan_setups(systems, ggufs_orig, dir_orig, limit, applied, args.sparsity)
    todo = [s for s in systems if plans[s]["status"] == "planned"]
    for s in systems:
        if s not in todo:
            log(f"{s:>18}: {plans[s]['status']} ({plans[s]['reason']})")
    env = child_env()
    runs = {}
    with workspace({s: ggufs_orig[s] for s in todo if is_stock(s)} | {STOCK: ggufs_orig[STOCK]},
                   dir_orig if any(not is_stock(s) for s in todo) else None, args.private_copy) as (ggufs, model_dir):
        def path_of(s):
            return ggufs[s] if is_stock(s) else model_dir

        # every setup under the limit, back to back (the plugin setups by their memory plan)
        for s in todo:
            runs[s], _ = bench_run(s, path_of(s), run_limit, None, args,
                                   env=env, account=ok)
        # quality: stock on the source (the reference of every ratio, a setup or not) and every setup that ran
        scored = [STOCK] + [s for s in todo if s != STOCK and runs[s]["status"] == "ok"]
        ppl = measure_perplexities({s: path_of(s) for s in scored}, args, env=env, account=ok)
    add_greedy_match(list(runs.values()))
    rows = make_rows(systems, plans, runs, ppl, accounted=ok)
    return {
        "benchmark": "compare",
        **model_doc(source, dir_orig),
        "memory_limit_bytes": limit,
        "limit_applied": applied,
        "cgroup": cgroup_doc(ok, where),
        "setups": rows,
        "pareto_front": front_of(rows),
        "settings": {"n_prompt": args.n_prompt, "n_gen": args.n_gen, "repetitions": args.repetitions,
                     "n_ctx": args.ctx_size, "n_batch": args.batch_size, "n_threads": args.threads,
                     "ppl_ctx": args.ppl_ctx, "ppl_chunks": args.ppl_chunks, "sparsity": args.sparsity,
                     "short": args.short, "timeout_s": args.timeout, "private_copy": args.private_copy,
                     "page_cache_dropped": True,
                     "plugin_budget": "each plugin setup's memory plan under the limit (memplan.py)",
                     "prompt": "bundled held-out technical text (leanstream_ggml/harness/data)"},
        "stock": next((e["result"]["stock"] for e in runs.values() if e.get("result")), None),
        "stock_files": stock_files({s: ggufs_orig[s] for s in systems if is_stock(s)}, source),
        "machine": measure.machine_info(),
        "runs": list(runs.values()),
        "perplexity": ppl,
    }


def _sized(args) -> None:
    """-p/-n/-r/--ppl-chunks given, else --short's or a measurement's sizes."""
    sizes = SHORT if args.short else FULL
    for k, v in sizes.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.threads = args.threads or len(os.sched_getaffinity(0))


def cmd_compare(args) -> int:
    _sized(args)
    doc = run(args)   # bad values and paths: one line (leanstream_ggml/errors.py, in cli.main)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot:
        plot(doc, args.plot)
    print(format_table(doc))
    if not doc["limit_applied"] and doc["memory_limit_bytes"] is not None:
        print(f"\nNOTE: {limit_line(doc)}", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("compare", help="stock quants and the plugin side by side under one memory limit",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="GGUF file (the source quant stock runs) or model recipe name")
    p.add_argument("--memory-limit", default=None,
                   help="whole-process memory limit of every run, e.g. 1GB or 900MiB (default: none)")
    p.add_argument("--model-dir", default=None,
                   help="the converted model directory (default: the converter's place, converted on first use)")
    p.add_argument("--setups", default=",".join(DEFAULT_SETUPS), help="comma list (default: %(default)s)")
    p.add_argument("--out", default=None, help="write every measurement here as JSON")
    p.add_argument("--plot", default=None, help="write the plot here (PNG; needs matplotlib)")
    p.add_argument("--short", action="store_true",
                   help=f"a smoke test: -p {SHORT['n_prompt']} -n {SHORT['n_gen']} -r {SHORT['repetitions']} and "
                        f"{SHORT['ppl_chunks']} perplexity window (default: -p {FULL['n_prompt']} -n {FULL['n_gen']} "
                        f"-r {FULL['repetitions']}, every window of the text)")
    p.add_argument("-p", "--n-prompt", type=int, default=None, help="prompt tokens of the bench runs")
    p.add_argument("-n", "--n-gen", type=int, default=None, help="decoded tokens of the bench runs")
    p.add_argument("-r", "--repetitions", type=int, default=None, help="bench repetitions (median reported)")
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="n_ctx of the bench runs")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="n_batch (= n_ubatch)")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: cores available)")
    p.add_argument("--ppl-ctx", type=int, default=512, help="perplexity window (n_ctx; second half scored)")
    p.add_argument("--ppl-chunks", type=int, default=None, help="perplexity windows (default: every one of the text)")
    p.add_argument("--sparsity", type=float, default=None,
                   help="sparse setups without a quality preset: fraction of blocks skipped (default: the engine's)")
    p.add_argument("--timeout", type=float, default=900, help="wall-clock cap per run (s); past it: 'timeout'")
    p.add_argument("--no-private-copy", dest="private_copy", action="store_false",
                   help="run on the model files in place instead of private copies")
    p.set_defaults(func=cmd_compare)
