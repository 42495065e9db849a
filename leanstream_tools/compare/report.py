"""compare's report: one row per setup, the Pareto front, the table and the plot (the JSON is
the document compare.run returns)."""

from __future__ import annotations

from pathlib import Path

from .. import measure
from .setups import STOCK


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
            "memory_plan": r.get("memory_plan") or (e or {}).get("memory_plan"),
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
