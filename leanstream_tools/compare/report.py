"""compare's report: one row per setup, the Pareto front, the table and the plot. A Report is
what compare.run returns; its to_dict() is the JSON --out writes, and the table, the plot and
that JSON read the same ReportRow of each setup."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

from .. import measure
from .runner import RunRecord
from .setups import STOCK


@dataclass
class ReportRow:
    """One setup's row: a line of the table, a point of the plot, an object of the JSON's
    "setups" (to_dict / from_dict). make_rows builds them. The speculative fields are in the
    JSON where set (a report written before them has none: they read back as None)."""
    setup: str
    kind: str                          # "stock" or "plugin"
    file: str | None                   # a stock setup's GGUF (name)
    file_bytes: int | None
    sparsity: float | None             # the one a quality preset chose, or --sparsity (sparse modes)
    fits: bool | None                  # under the limit; None: no limit, or not known
    status: str                        # its run's, else its plan's ("does not fit", "not run")
    reason: str | None                 # why it has no result, or a note on it
    memory_budget_bytes: int | None
    plugin_reserve_bytes: int | None
    memory_plan: dict | None           # the plan it ran under, or the one that refused the limit
    decode_tok_s: float | None         # None unless status is "ok"
    prefill_tok_s: float | None        # None unless status is "ok"
    peak_bytes: int | None             # the cgroup's charged peak where accounted, else peak RSS; None unless "ok"
    peak_rss_bytes: int | None
    ppl: float | None                  # held-out perplexity (measure_perplexities)
    ppl_ratio: float | None            # ppl / stock's
    greedy_match_vs_stock: float | None
    speculative: str | None = None     # how it decoded: "off", "lookup" (stock), the plugin's kind
    tokens_per_pass: float | None = None   # the plugin's speculative stats of its last decode (passes with a draft)
    acceptance: float | None = None
    draft_step_ms: float | None = None

    SPECULATIVE: ClassVar[tuple[str, ...]] = ("speculative", "tokens_per_pass", "acceptance", "draft_step_ms")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in self.SPECULATIVE or getattr(self, f.name) is not None}

    @property
    def speculates(self) -> bool:
        return self.speculative not in (None, "off")

    @classmethod
    def from_dict(cls, d: dict) -> ReportRow:
        return cls(**d)


@dataclass
class Report:
    """What one `leanstream compare` measured (compare.run): to_dict() is the JSON document,
    from_dict() reads one back; format_table and plot read it."""
    benchmark: ClassVar[str] = "compare"
    model: str                         # model_doc: the GGUF and the converted directory
    model_path: str
    model_bytes: int
    model_dir: str | None
    model_dir_bytes: int | None
    memory_limit_bytes: int | None
    limit_applied: bool
    cgroup: dict                       # cgroup_doc
    setups: list[ReportRow]            # make_rows: one per setup, in the order given
    pareto_front: list[str]            # front_of(setups)
    settings: dict                     # the sizes and options every run had
    stock: str | None                  # stock llama-cpp-python as a bench child describes it
    stock_files: dict                  # runner.stock_files
    machine: dict                      # measure.machine_info()
    runs: list[RunRecord]              # every bench run, in the order run
    perplexity: dict                   # setup -> its perplexity record (measure_perplexities)

    def to_dict(self) -> dict:
        d = {"benchmark": self.benchmark}
        for f in fields(self):
            d[f.name] = getattr(self, f.name)
        d["setups"] = [r.to_dict() for r in self.setups]
        d["runs"] = [r.to_dict() for r in self.runs]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Report:
        d = dict(d)
        if d.pop("benchmark", None) != cls.benchmark:
            raise ValueError("not a compare report (its \"benchmark\" is not \"compare\")")
        return cls(**d | {"setups": [ReportRow.from_dict(r) for r in d["setups"]],
                          "runs": [RunRecord.from_dict(r) for r in d["runs"]]})


def model_doc(gguf: Path, model_dir: Path | None) -> dict:
    """The models a report ran on: the GGUF and the converted directory, with their sizes."""
    return {"model": gguf.name, "model_path": str(gguf), "model_bytes": gguf.stat().st_size,
            "model_dir": str(model_dir) if model_dir else None,
            "model_dir_bytes": measure.files_size(measure.model_files(model_dir)) if model_dir else None}


def cgroup_doc(ok: bool, where: str) -> dict:
    return {"writable": ok, ("path" if ok else "reason"): where,
            "note": "each run in its own child memory cgroup (v1) under ours; memory.limit_in_bytes "
                    "= the limit (memsw too where present), page cache included" if ok else "no limits applied"}


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


def failure_reason(run: RunRecord) -> str | None:
    """Why a run did not give a result, in a few words (its stderr's last line for an error)."""
    if run.status == "oom":
        return "OOM-killed under the limit"
    if run.status == "timeout":
        return f"past the timeout ({run.wall_s:.0f} s)"
    if run.status == "error":
        lines = [ln.strip() for ln in run.stderr_tail.splitlines() if ln.strip()]
        return f"failed: {lines[-1]}" if lines else f"failed (exit status {run.returncode})"
    return run.reason


def make_rows(systems: list[str], plans: dict, runs: dict[str, RunRecord], ppl: dict,
              accounted: bool) -> list[ReportRow]:
    """One row per setup, in the order given. plans: setup -> {"kind", "fits", "status",
    "reason", ...} (plan_setups: what was decided before running); runs: setup -> its run under
    the limit; ppl: setup -> its perplexity record, STOCK's the reference of every ratio. Peak =
    the cgroup's charged peak if ``accounted``, else peak RSS. A run skipped for its reserve or
    OOM-killed did not fit."""
    ref = (ppl.get(STOCK) or {}).get("ppl")
    rows = []
    for s in systems:
        plan, e = plans[s], runs.get(s)   # e: None where the setup did not run
        r = (e and e.result) or {}
        p = (ppl.get(s) or {}).get("ppl")
        status = e.status if e else plan["status"]
        ok = status == "ok"
        peak = (e and e.cgroup.get("max_usage_bytes")) if accounted else r.get("peak_rss_bytes")
        spec = (e and e.speculative_stats) or {}
        rows.append(ReportRow(
            setup=s, kind=plan["kind"], file=plan.get("file"), file_bytes=plan.get("file_bytes"),
            sparsity=plan.get("sparsity"), fits=False if status in ("skipped", "oom", "does not fit") else plan["fits"],
            status=status, reason=(e and failure_reason(e)) or plan.get("reason"),
            memory_budget_bytes=(e and e.memory_budget_bytes) or r.get("memory_budget_bytes"),
            plugin_reserve_bytes=e and e.plugin_reserve_bytes,
            memory_plan=r.get("memory_plan") or (e and e.memory_plan),
            decode_tok_s=r.get("decode_tok_s") if ok else None, prefill_tok_s=r.get("prefill_tok_s") if ok else None,
            peak_bytes=peak if ok else None, peak_rss_bytes=r.get("peak_rss_bytes"),
            ppl=p, ppl_ratio=p / ref if p is not None and ref else None,
            greedy_match_vs_stock=e and e.greedy_match_vs_stock,
            speculative=(e and e.speculative) or plan.get("speculative"),
            tokens_per_pass=spec.get("tokens_per_pass"), acceptance=spec.get("acceptance"),
            draft_step_ms=spec.get("draft_step_ms") or None))   # 0.0: no self-draft step (lookup proposals)
    return rows


def front_of(rows: list[ReportRow]) -> list[str]:
    """The Pareto front of the rows that have both a decode rate and a perplexity ratio."""
    return pareto_front({r.setup: (r.decode_tok_s, r.ppl_ratio) for r in rows
                         if r.decode_tok_s is not None and r.ppl_ratio is not None})


def limit_label(report: Report) -> str:
    """A few words: the limit and whether it was applied."""
    lim = report.memory_limit_bytes
    if lim is None:
        return "no memory limit"
    if report.limit_applied:
        return f"{measure.format_size(lim)} whole-process memory limit (cgroup)"
    return f"memory limit {measure.format_size(lim)} NOT APPLIED (cgroups not writable)"


def limit_line(report: Report) -> str:
    """One sentence: the limit, whether it was applied, and why not."""
    if report.memory_limit_bytes is not None and not report.limit_applied:
        return (f"{limit_label(report)}: {report.cgroup['reason']}; every setup ran without a limit and "
                f"without a plugin budget")
    return limit_label(report) + (", page cache included" if report.limit_applied else "")


def format_table(report: Report) -> str:
    """The readable report: one Markdown row per setup; * marks the Pareto front."""
    front = set(report.pareto_front)
    st = report.settings
    peak_what = "cgroup" if report.cgroup["writable"] else "RSS"
    out = [f"{report.model}: {limit_line(report)}",
           f"decode: {st['n_gen']} tokens after a {st['n_prompt']}-token prompt, median of {st['repetitions']}; "
           f"perplexity: {st['ppl_chunks'] or 'all'} window(s) of {st['ppl_ctx']} of held-out text, ratio to stock",
           "",
           f"| setup | fits? | decode tok/s | peak MB ({peak_what}) | ppl × stock | note |",
           "| --- | --- | ---: | ---: | ---: | --- |"]
    for r in report.setups:
        fits = {True: "yes", False: "no", None: "–"}[r.fits]
        dec = f"{r.decode_tok_s:.2f}" if r.decode_tok_s is not None else r.status
        peak = f"{r.peak_bytes / 1e6:.0f}" if r.peak_bytes is not None else "–"
        ratio = f"{r.ppl_ratio:.3f}" if r.ppl_ratio is not None else "–"
        notes = []
        if r.file:
            notes.append(f"{r.file} ({measure.format_size(r.file_bytes)})")
        if r.sparsity is not None:
            notes.append(f"sparsity {r.sparsity:g}")
        if r.memory_budget_bytes:
            notes.append(f"budget {measure.format_size(r.memory_budget_bytes)}")
        if r.speculates:
            spec = [f"speculative {r.speculative}"]
            if r.tokens_per_pass is not None:
                spec.append(f"{r.tokens_per_pass:.2f} tokens/pass")
            if r.acceptance is not None:
                spec.append(f"{r.acceptance:.0%} of drafts accepted")
            if r.draft_step_ms is not None:
                spec.append(f"draft step {r.draft_step_ms:.1f} ms")
            notes.append(", ".join(spec))
        if r.reason:
            notes.append(r.reason)
        mark = " *" if r.setup in front else ""
        out.append(f"| {r.setup}{mark} | {fits} | {dec} | {peak} | {ratio} | {'; '.join(notes)} |")
    out += ["", "* on the Pareto front: no other setup is both faster and lower in perplexity"]
    return "\n".join(out)


def plot_rows(report: Report) -> tuple[list[ReportRow], list[ReportRow], list[ReportRow]]:
    """(the rows plotted: those that ran and were scored, the Pareto front's among them fastest
    first, the rows not shown), each a row of report.setups."""
    shown = [r for r in report.setups if r.decode_tok_s is not None and r.ppl_ratio is not None]
    front = [r for s in report.pareto_front for r in shown if r.setup == s]
    return shown, front, [r for r in report.setups if not any(r is x for x in shown)]


def plot(report: Report, path: str) -> None:
    """ppl ratio (y) against decode tok/s (x): one labelled point per setup that ran and was
    scored (a triangle where it decoded speculatively), the Pareto front as a step line through
    its ringed points; the others listed below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, front, missing = plot_rows(report)
    fig, ax = plt.subplots(figsize=(6.4, 4.6), dpi=120)
    ax.axhline(1.0, color="0.6", lw=0.8, ls=":")
    for r in rows:
        color = "C0" if r.kind == "stock" else "C1"
        ax.plot([r.decode_tok_s], [r.ppl_ratio], "^" if r.speculates else "o", color=color)
        ax.annotate(r.setup, (r.decode_tok_s, r.ppl_ratio), textcoords="offset points", xytext=(5, 4), fontsize=8)
    if front:
        xs = [r.decode_tok_s for r in reversed(front)]   # slowest (best quality) first
        ys = [r.ppl_ratio for r in reversed(front)]
        ax.step(xs, ys, where="pre", color="C2", lw=1.2, label="Pareto front")
        ax.plot(xs, ys, "o", mfc="none", mec="C2", ms=11, mew=1.5)
    ax.plot([], [], "o", color="C0", label="stock llama-cpp-python")
    ax.plot([], [], "o", color="C1", label="leanstream plugin")
    if any(r.speculates for r in rows):
        ax.plot([], [], "^", color="0.4", label="speculative decoding")
    ax.set_xlabel("decode tokens/s")
    ax.set_ylabel("held-out perplexity / stock's")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    m = report.machine
    ax.set_title(f"{report.model}: {limit_label(report)}\n{m['cores']} cores {m['cpu']}, "
                 f"{report.settings['n_threads']} threads, {m['date']}", fontsize=8)
    if missing:
        fig.text(0.01, 0.01, "not shown: " + ", ".join(f"{r.setup} ({r.status})" for r in missing), fontsize=7,
                 ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.04 if missing else 0, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
