"""compare's runner: the model files each setup runs on, and its runs, each `leanstream bench` /
`leanstream perplexity` in a fresh child process (inside a child memory cgroup where a limit
applies). A child writes its JSON document to a file the runner names (--json-file) and, when
its memory plan refuses the limit, the plan to another (--plan-refused-file) with its own exit
status: the runner records that as a PlanRefused, never by reading the child's stderr. What a
child reports is a ChildRun; what a bench run gives the report is a RunRecord, the JSON's
"runs" (to_dict / from_dict).

bench/side_by_side.py (several limits, decode tok/s against the limit) runs through these too,
its runs as the records' JSON objects (bench_run).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from leanstream_ggml.native import modes
from leanstream_ggml.cli import command_line

from .. import cgroup, measure
from ..cli import PLAN_REFUSED_EXIT
from .setups import (STOCK, is_stock, plugin_mode, selecting_budget, sketch_bytes, speculative_kind,
                     split_speculative, stock_quant)

ROOT = Path(__file__).resolve().parents[2]   # the directory holding leanstream_tools/ (the checkout)

RESERVE_MARGIN = 32 * 2**20


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class PlanRefused(Exception):
    """A plugin run's memory plan refused the limit (MemoryPlanError in the child): ``plan`` is
    the plan as the child wrote it (MemoryPlan.to_dict), ``message`` the refusal's text."""

    def __init__(self, message: str, plan: dict | None):
        super().__init__(message)
        self.message, self.plan = message, plan

    @property
    def reason(self) -> str:
        """Its first line (the numbers): what the report gives as the setup's reason."""
        return self.message.strip().splitlines()[0] if self.message.strip() else "the memory plan refused the limit"


@dataclass
class ChildRun:
    """One child process: how it ended (cgroup.CommandResult), the JSON document it wrote (None:
    none) and the memory plan's refusal (None: it did not refuse)."""
    command: cgroup.CommandResult
    doc: dict | None
    refused: PlanRefused | None


def run_child(cmd: list[str], *, limit_bytes: int | None, timeout_s: float, env: dict, account: bool) -> ChildRun:
    """``cmd`` (a bench_command / perplexity_command) run with the files it writes its document
    and a refusal to, in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="compare-run-") as tmp:
        doc_file, refused_file = Path(tmp) / "doc.json", Path(tmp) / "refused.json"
        res = cgroup.run_command(cmd + ["--json-file", str(doc_file), "--plan-refused-file", str(refused_file)],
                                 limit_bytes=limit_bytes, timeout_s=timeout_s, env=env, cwd=str(ROOT),
                                 account=account)
        doc = read_json(doc_file) if res.status == "ok" else None
        refused = None
        if res.returncode == PLAN_REFUSED_EXIT and refused_file.is_file():
            r = read_json(refused_file) or {}
            refused = PlanRefused(r.get("message", ""), r.get("plan"))
    return ChildRun(res, doc, refused)


@dataclass
class RunRecord:
    """One setup's `leanstream bench` run at one limit (bench_record), as the report's "runs"
    hold it: to_dict() is its JSON object and from_dict() reads one back (every file written
    since the records were dicts: the same keys, the same values). A run that started no child
    (skipped) has no returncode, wall_s or stderr_tail in the JSON; reason, memory_plan, result,
    speculative and speculative_stats are there when they are set, greedy_match_vs_stock with a
    result."""
    system: str
    limit_bytes: int | None                       # its cgroup's limit; None: unlimited
    memory_budget_bytes: int | None               # a plugin run's --memory-budget; None: stock, its plan, no limit
    plugin_reserve_bytes: int | None              # limit - budget where a reserve gave the budget
    page_cache_resident_at_start_bytes: int | None   # of its model files, after the drop; None: not known
    loadavg_1min_at_start: float
    status: str                                   # cgroup.CommandResult's, "skipped", "does not fit" or "error"
    cgroup: dict = field(default_factory=dict)    # the child's MemoryCgroup.stats() at exit ({}: none)
    returncode: int | None = None
    wall_s: float | None = None                   # None: no child ran
    stderr_tail: str = ""                         # "" when the child exited ok
    reason: str | None = None                     # why it was skipped or did not fit
    memory_plan: dict | None = None               # the plan that refused the limit (MemoryPlan.to_dict)
    result: dict | None = None                    # summarize(the child's bench document)
    greedy_match_vs_stock: float | None = None    # add_greedy_match
    speculative: str | None = None                # how it decodes (speculative_kind); None: a record from before
    speculative_stats: dict | None = None         # the plugin's stats()["speculative"], its last decode (when on)

    def to_dict(self) -> dict:
        d = {"system": self.system, "limit_bytes": self.limit_bytes, "memory_budget_bytes": self.memory_budget_bytes,
             "plugin_reserve_bytes": self.plugin_reserve_bytes,
             "page_cache_resident_at_start_bytes": self.page_cache_resident_at_start_bytes,
             "loadavg_1min_at_start": self.loadavg_1min_at_start, "status": self.status}
        if self.wall_s is not None:
            d.update(returncode=self.returncode, wall_s=self.wall_s, cgroup=self.cgroup, stderr_tail=self.stderr_tail)
        else:
            d["cgroup"] = self.cgroup
        d.update({k: v for k, v in (("reason", self.reason), ("memory_plan", self.memory_plan),
                                    ("result", self.result)) if v is not None})
        if self.result is not None:
            d["greedy_match_vs_stock"] = self.greedy_match_vs_stock
        d.update({k: v for k, v in (("speculative", self.speculative), ("speculative_stats", self.speculative_stats))
                  if v is not None})
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RunRecord:
        return cls(**d)


def read_json(path: Path) -> dict | None:
    """The JSON object a child wrote to ``path`` (None: missing or not an object)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


# ---------------------------------------------------------------------------------------------
# the models each setup runs on

def resolve_model_dir(gguf: Path, model_arg: str, model_dir: str | None, sketch: bool = False,
                      calibrate: bool = False) -> Path:
    """The converted directory: --model-dir, else the converter's default location, converted on
    first use: block files alone (dense mode) unless ``sketch`` (a sparse setup), then as
    `leanstream convert` does (block files, the sketch), calibrated for quality= if ``calibrate``
    (a quality preset; minutes more)."""
    from leanstream_ggml.model import manifest, registry

    if model_dir:
        out = Path(model_dir)
    elif model_arg in registry.RECIPES:
        out = registry.lsm_dir(model_arg)
    else:
        out = gguf.with_suffix(".lsm")
    try:
        manifest.load(out)
        return out
    except Exception:
        pass
    # `leanstream convert` in a child process: the runtime never imports the converter
    cmd = [*command_line(), "convert", str(gguf), str(out), "--quiet"]
    if sketch:
        log(f"converting {gguf} -> {out} (block files, sketch" + (", calibration" if calibrate else "") + ": minutes)")
        if calibrate:
            cmd.append("--calibrate")
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
    from leanstream_ggml.model import registry

    from .. import quants

    gguf = registry.resolve(model_arg)
    if gguf.is_dir():
        from leanstream_ggml.native import params

        raise params.ParameterError("MODEL", f"{gguf} is a model directory; give the GGUF it was converted "
                                             f"from (stock runs it) and the directory as --model-dir")
    if not gguf.is_file():
        import errno

        raise FileNotFoundError(errno.ENOENT, "no such GGUF file or model name", str(gguf))
    plugin = [s for s in systems if not is_stock(s)]
    sparse = any(modes.is_sparse(plugin_mode(s)[0]) for s in plugin)
    calibrate = any(plugin_mode(s)[1] is not None for s in plugin)
    directory = resolve_model_dir(gguf, model_arg, model_dir, sketch=sparse, calibrate=calibrate) if plugin else None
    ggufs = {s: gguf if stock_quant(s) is None else quants.requantize(gguf, stock_quant(s), log=log)
             for s in systems if is_stock(s)}
    ggufs.setdefault(STOCK, gguf)
    return gguf, ggufs, directory


def stock_files(ggufs: dict, source: Path) -> dict:
    """What each stock setup's file is and how it was made (for the JSON)."""
    from .. import quants

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

def flag(name: str) -> str:
    """The command-line flag of an engine option (leanstream_ggml/options.py spells them)."""
    from leanstream_ggml.options import BY_NAME

    return BY_NAME[name].flag


def engine_args(system: str, sparsity: float | None, decode: bool = False) -> list[str]:
    """The `leanstream bench` / `perplexity` options that select a setup's system and mode, and
    where it ``decode``s (bench) its speculative suffix: stock+lookup's system, a plugin's
    --speculative (none: the library's default). Perplexity scores logits, which speculation
    does not change."""
    from ..systems import PLUGIN, STOCK as STOCK_SYSTEM, STOCK_LOOKUP

    kind = split_speculative(system)[1] if decode else None
    if is_stock(system):
        return ["--system", STOCK_LOOKUP if kind else STOCK_SYSTEM]
    mode, quality = plugin_mode(system)
    out = ["--system", PLUGIN, flag("mode"), mode] + ([flag("speculative"), kind] if kind else [])
    if quality is not None:
        return out + [flag("quality"), quality]
    return out + ([flag("sparsity"), str(sparsity)] if sparsity is not None and modes.is_sparse(mode) else [])


def bench_command(model: Path, system: str, args, budget: int | None, memory_limit: int | None = None) -> list[str]:
    """`leanstream bench --json` of one setup. args: n_prompt, n_gen, repetitions, ctx_size,
    batch_size, threads, sparsity (the same for every setup). A plugin setup gets ``budget`` as
    --memory-budget, or ``memory_limit`` as --memory-limit (its memory plan)."""
    cmd = [sys.executable, "-m", "leanstream_tools.cli", "bench", str(model), "--json",
           "-p", str(args.n_prompt), "-n", str(args.n_gen), "-r", str(args.repetitions),
           "-c", str(args.ctx_size), "-b", str(args.batch_size), "-t", str(args.threads)]
    cmd += engine_args(system, args.sparsity, decode=True)
    if budget is not None and not is_stock(system):
        cmd += [flag("memory_budget"), str(budget)]
    elif memory_limit is not None and not is_stock(system):
        cmd += [flag("memory_limit"), str(memory_limit)]
    return cmd


def perplexity_command(model: Path, system: str, args) -> list[str]:
    """`leanstream perplexity --json` of one setup. args: ppl_ctx, ppl_chunks, threads, sparsity.
    A sparse setup gets selecting_budget(): what it computes is then what it computes under the
    limit."""
    cmd = [sys.executable, "-m", "leanstream_tools.cli", "perplexity", str(model), "--json",
           "-c", str(args.ppl_ctx), "-t", str(args.threads)]
    if args.ppl_chunks is not None:
        cmd += ["--chunks", str(args.ppl_chunks)]
    if not is_stock(system) and modes.is_sparse(plugin_mode(system)[0]):
        cmd += [flag("memory_budget"), str(selecting_budget(model))]
    return cmd + engine_args(system, args.sparsity)


def child_env() -> dict:
    """The environment of the child runs: this checkout's package first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


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
                   charged_peak: int | None = None, n_ctx: int = 512) -> tuple[int, str]:
    """Bytes a LeanStream run needs besides its FFN weight cache. Measured where possible: the
    peak memory of the same mode without a limit (charged to its accounting cgroup, which is
    what a limit binds; else VmHWM) minus the bytes its cache held, plus a margin. Without such
    a run, the library's memory plan says it (memplan.py: what a process needs besides the
    engine at n_ctx), not a second model of it here."""
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
    from leanstream_ggml.model import manifest
    from leanstream_ggml import memplan

    plan = memplan.plan(model_dir, manifest.load(model_dir), 0, mode=modes.DEFAULT, n_ctx=n_ctx)
    return plan.reserve, "the memory plan's: what the process needs besides the FFN engine (memplan.py)"


def bench_record(system: str, path: Path, limit: int | None, reserve: int | None, args, *, env: dict,
                 account: bool, drop_cache: bool = True) -> tuple[RunRecord, dict | None]:
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
    record = functools.partial(
        RunRecord, system=system, limit_bytes=limit, memory_budget_bytes=budget,
        plugin_reserve_bytes=None if budget is None else reserve,
        page_cache_resident_at_start_bytes=None if any(r is None for r in resident) else sum(resident),
        loadavg_1min_at_start=round(os.getloadavg()[0], 2), speculative=speculative_kind(system))
    sketch = (0 if budget is None or is_stock(system) or not modes.is_sparse(plugin_mode(system)[0])
              else sketch_bytes(path))
    if budget == 0 or (budget is not None and budget < sketch):
        rec = record(status="skipped",
                     reason=(f"limit below the reserve ({measure.format_size(reserve)})" if budget == 0 else
                             f"the budget the reserve leaves ({measure.format_size(budget)}) cannot hold the "
                             f"sketch ({measure.format_size(sketch)})"))
        log(f"{system:>18} @ {measure.format_size(limit):>7}: skipped ({rec.reason})")
        return rec, None
    child = run_child(bench_command(path, system, args, budget, limit if planned else None),
                      limit_bytes=limit, timeout_s=args.timeout, env=env, account=account)
    res, bj = child.command, child.doc
    ran = res.to_dict()   # the cgroup module's rounding and stderr tail
    rec = record(**{k: ran[k] for k in ("status", "returncode", "wall_s", "cgroup", "stderr_tail")})
    if child.refused is not None:
        rec.status, rec.reason, rec.memory_plan = "does not fit", child.refused.reason, child.refused.plan
    if res.status == "ok" and bj is None:
        rec.status, rec.stderr_tail = "error", "no JSON document written\n" + res.stderr[-2000:]
    if bj is not None:
        rec.result = summarize(bj)
        spec = (bj.get("engine_decode") or {}).get("speculative")
        if spec is not None:   # its per-shape and per-fraction tables stay in result["engine_decode"]
            rec.speculative_stats = {k: v for k, v in spec.items() if k not in ("by_shape", "by_fraction")}
    r = rec.result or {}
    per_token = r.get("disk_read_bytes_per_decode_token")
    log(f"{system:>18} @ {measure.format_size(limit):>7}: {rec.status:>7} "
        f"decode {r.get('decode_tok_s') or 0:7.2f} tok/s  prefill {r.get('prefill_tok_s') or 0:7.1f} tok/s  "
        f"peak RSS {measure.format_size(r.get('peak_rss_bytes'))}  "
        f"cgroup peak {measure.format_size(rec.cgroup.get('max_usage_bytes'))}  "
        f"disk/decode-token {measure.format_size(int(per_token)) if per_token is not None else 'n/a'}  "
        + (f"{rec.speculative_stats.get('tokens_per_pass')} tokens/pass  " if rec.speculative_stats else "")
        + f"({rec.wall_s:.0f} s)")
    return rec, bj


def measure_perplexities(paths: dict, args, *, env: dict, account: bool) -> dict:
    """Held-out perplexity of each setup ({setup: model path}), once, without a limit: a memory
    limit changes where the weights are read from, not what is computed (the sparse setups at a
    budget that selects as every limited run does: perplexity_command). Speculation changes no
    logit: setups that differ only in it ("stock", "stock+lookup") share the first one's
    measurement, its record marked "measured_as" that setup."""
    out, first = {}, {}
    for system, path in paths.items():
        twin = first.setdefault(split_speculative(system)[0], system)
        if twin != system:
            out[system] = out[twin] | {"measured_as": twin}
            continue
        child = run_child(perplexity_command(path, system, args), limit_bytes=None,
                          timeout_s=args.timeout * 4, env=env, account=account)
        res, pj = child.command, child.doc
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


def add_greedy_match(runs: list[RunRecord] | list[dict]) -> None:
    """Correctness before speed: each run's greedy continuation against stock's (without a limit
    where there is such a run): ``greedy_match_vs_stock``. Runs given as their JSON objects
    (bench/side_by_side.py's, from bench_run) get it as a key."""
    records = [RunRecord.from_dict(e) if isinstance(e, dict) else e for e in runs]
    stock = [e for e in records if e.system == STOCK and e.result]
    ref = next((e for e in stock if e.limit_bytes is None), stock[0] if stock else None)
    for e, rec in zip(runs, records):
        if rec.result:
            rec.greedy_match_vs_stock = greedy_match(rec.result["generated"], ref and ref.result["generated"])
            if isinstance(e, dict):
                e["greedy_match_vs_stock"] = rec.greedy_match_vs_stock


def bench_run(system: str, path: Path, limit: int | None, reserve: int | None, args, *, env: dict,
              account: bool, drop_cache: bool = True) -> tuple[dict, dict | None]:
    """bench_record with the record as its JSON object (RunRecord.to_dict): bench/side_by_side.py
    keeps its runs so."""
    rec, bj = bench_record(system, path, limit, reserve, args, env=env, account=account, drop_cache=drop_cache)
    return rec.to_dict(), bj
