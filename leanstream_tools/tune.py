"""`leanstream tune MODEL`: synthesize the streaming controller's table on this machine and disk.

    leanstream tune MODEL --memory-limit 1000MB          # or --memory-budget 35% / 400MB
        [--sparsity S | --quality ppl+5%] [--tokens 192] [--no-contend] [--quality-target 1.05]

Four steps, each with a progress bar:

1. quality band: perplexity of every candidate ratio among the actions (decode-scored, held-out
   prose and code, most of the FFN cached: the selection does not depend on the budget) against
   a ratio whose perplexity exceeds --quality-target x dense in either domain is not offered.
2. profile: leanstream decode under the budget with a random action per layer and token
   (LS_CTRL_PROFILE), every op recorded: its state, action, time and bytes read. With
   contention (the default), the second half runs beside a reader streaming the model's
   base.gguf with O_DIRECT, so that the table has seen a shared disk. Samples are saved as they
   come (``<model>/controller.profile-<budget>-<sparsity>.npz``): an interrupted run resumes.
3. solve: load states at the profile's quartiles of remaining load, two disk states split
   between the quiet and the shared phase's disk speed, Bellman backward recursion over the
   layers (control.solve).
4. write: the policy into ``controller.json`` (manifest: named, checksummed).

`Llama(..., controller="table")` / `leanstream chat --controller table` use it. A mixture-of-experts
model has no controller to tune (it reads the whole experts its router picks): refused, saying so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def register(sub) -> None:
    p = sub.add_parser("tune", help="synthesize the streaming controller's table for a memory budget",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a converted model directory")
    from leanstream_ggml.options import add_flags

    add_flags(p.add_mutually_exclusive_group(required=True), "tune", ("memory_limit", "memory_budget"))
    add_flags(p, "tune", ("sparsity", "quality"))
    p.add_argument("--tokens", type=int, default=192, help="decoded tokens profiled (default 192)")
    p.add_argument("--no-contend", action="store_true", help="profile on a quiet disk only")
    p.add_argument("--quality-target", type=float, default=1.05,
                   help="largest perplexity ratio vs dense an action may cost (default 1.05)")
    p.add_argument("--quality-tokens", type=int, default=256,
                   help="tokens per quality window; its second half is decoded and scored (default 256)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--restart", action="store_true", help="discard a saved profile and start again")
    p.set_defaults(func=run)


def budget_of(model_dir: Path, manifest, args) -> dict:
    """The Llama keywords that set the budget: memory_limit, or memory_budget (a share of the FFN
    on disk when given as N%)."""
    if args.memory_limit is not None:
        return {"memory_limit": args.memory_limit}
    b = args.memory_budget.strip()
    if b.endswith("%"):
        share = float(b[:-1]) / 100.0
        if not 0 < share <= 1:
            from leanstream_ggml.native.params import ParameterError
            raise ParameterError("memory_budget", f"a share must be in (0, 100%], got {b!r}")
        ffn = sum((model_dir / e.file).stat().st_size for e in manifest.layers)
        return {"memory_budget": int(ffn * share)}
    return {"memory_budget": b}


def text_tokens(llm, path: Path, n: int) -> list[int]:
    toks = llm.tokenize(path.read_text(encoding="utf-8").encode(), add_bos=False)
    if len(toks) < n:
        toks = (toks * (n // max(1, len(toks)) + 1))
    return toks[:n]


# the held-out texts (never seen by the converter) the quality band is scored on
DOMAINS = {"prose": "heldout-technical.txt", "code": "heldout-code.txt"}


def quality_band(model_dir: Path, actions, sparsity_kw: dict, n_tokens: int, threads: int, target: float) -> dict:
    """Decode-scored perplexity of each candidate ratio and of dense, on prose and code."""
    from tqdm import tqdm

    from leanstream_ggml import Llama
    from leanstream_ggml.model import manifest as mf
    from .bench import DEFAULT_TEXT
    from leanstream_ggml.scoring import window_logits, window_nll

    ratios = sorted({c for c, _ in actions})
    # the budget: nine tenths of the FFN on disk, without a hot set. The selection then is the
    # worst case of every budget: a hot block is always a candidate (more exact candidates, never
    # fewer), and a layer resident for good is computed exactly from every block (which would
    # hide the ratio)
    m = mf.load(model_dir)
    budget = int(0.9 * sum((model_dir / e.file).stat().st_size for e in m.layers))
    out = {}
    bar = tqdm(total=len(ratios) + 1, desc="quality band", unit="setting")
    sparse = {"mode": "leanstream", "memory_budget": budget, "hot_fraction": 0.0, **sparsity_kw}
    for name, kw in [("dense", {"mode": "dense"})] + [(c, {**sparse, "candidate_ratio": c}) for c in ratios]:
        llm = Llama(str(model_dir), n_ctx=n_tokens + 8, n_batch=n_tokens + 8, logits_all=True, n_threads=threads,
                    n_threads_batch=threads, verbose=False, **kw)
        try:
            # per domain (prose, code) one window: its first half is the prompt (prefill), its
            # second half is decoded and scored
            out[name] = {}
            for domain, text in DOMAINS.items():
                toks = [llm.token_bos()] + text_tokens(llm, Path(DEFAULT_TEXT).with_name(text), n_tokens)
                out[name][domain] = float(np.exp(np.mean(window_nll(window_logits(llm, toks, decode=True), toks))))
            sparsity = llm.sparsity
        finally:
            llm.close()
        bar.update(1)
    bar.close()
    dense = out.pop("dense")
    # an action's cost: its worse domain
    ratio = {str(c): max(out[c][dm] / dense[dm] for dm in DOMAINS) for c in ratios}
    return {"dense_ppl": dense, "sparsity": sparsity, "ppl": {str(c): out[c] for c in ratios}, "ratio": ratio,
            "allowed": {c: r <= target for c, r in ratio.items()}}


def reused_band(model_dir: Path, m, actions, sparsity: float, args) -> dict | None:
    """The quality band another budget's tuning measured with the same settings (measured
    without a hot set, it is every budget's worst case), re-judged against this --quality-target;
    None if there is none."""
    from leanstream_ggml.native import control
    from leanstream_ggml.model.manifest import controller_quality_file

    try:
        policies = control.load_policies(model_dir, m)
    except control.ControllerError:
        policies = []
    saved = model_dir / controller_quality_file(sparsity)
    bands = [(p.memory_budget, p.sparsity, p.info.get("quality_band") or {}) for p in policies]
    if saved.is_file():
        try:
            bands.insert(0, (None, sparsity, json.loads(saved.read_text(encoding="utf-8"))))
        except ValueError:
            pass
    for budget, s, b in bands:
        if (isinstance(b, dict) and abs(s - sparsity) < 1e-3 and b.get("tokens") == args.quality_tokens
                and b.get("hot_fraction") == 0.0 and set(b.get("ratio", {})) >= {str(c) for c, _ in actions}):
            print("quality band: as measured " + (f"when tuning the {budget / 1e6:.0f} MB budget" if budget else
                                                  f"before ({saved.name})") + " (without a hot set: every budget's worst case)")
            return {**b, "allowed": {c: r <= args.quality_target for c, r in b["ratio"].items()}}
    return None


class DiskReader:
    """A second process streaming a file with O_DIRECT reads of 1 MiB, round and round, until
    stopped: a competing reader on the same disk (what `tune` profiles beside, and what
    bench/controller.py measures under)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.proc = None

    def __enter__(self):
        import subprocess

        self.proc = subprocess.Popen([sys.executable, "-m", "leanstream_tools.tune", "--read-forever", str(self.path)])
        time.sleep(0.3)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def read_forever(path: str) -> None:
    import mmap
    import os

    buf = mmap.mmap(-1, 1 << 20)   # page aligned, as O_DIRECT wants
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        fd = os.open(path, os.O_RDONLY)   # a file system without O_DIRECT: page cache reads
    size = os.fstat(fd).st_size // (1 << 20) * (1 << 20)
    off = 0
    while True:
        n = os.preadv(fd, [buf], off)
        off = off + (1 << 20) if n == (1 << 20) and off + (1 << 21) <= size else 0


def profile(model_dir: Path, budget_kw: dict, sparsity_kw: dict, actions, n_tokens: int, contend: bool,
            threads: int, save: Path) -> dict[str, np.ndarray]:
    """Random-action decode under the budget, samples saved after every token (resumable)."""
    from tqdm import tqdm

    from leanstream_ggml import Llama
    from leanstream_ggml.native.control import SAMPLE_FIELDS
    from .bench import DEFAULT_TEXT

    got = {f: np.zeros(0, dtype=np.int64) for f in SAMPLE_FIELDS}
    got["phase"] = np.zeros(0, dtype=np.int64)
    done = 0
    if save.exists():
        with np.load(save) as z:
            got = {k: z[k] for k in z.files if k != "done"}
            done = int(z["done"])
    if done >= n_tokens:
        return got
    text = Path(DEFAULT_TEXT).with_name("heldout-code.txt")   # profiling measures time: any text will do
    llm = Llama(str(model_dir), mode="leanstream", n_ctx=n_tokens + 64, n_threads=threads, n_threads_batch=threads,
                verbose=False, **budget_kw, **sparsity_kw)
    try:
        toks = llm.tokenize(b"def main():", add_bos=True)
        cont = text_tokens(llm, text, n_tokens)
        llm.eval(toks + cont[:done])    # (a resumed run: its context again, in one prefill)
        llm.engine.set_controller("profile", actions=actions, seed=1 + done)
        seq0 = int(got["seq"].max()) + 2 if len(got["seq"]) else 0
        reader = None
        bar = tqdm(total=n_tokens, initial=done, desc="profile", unit="tok")
        try:
            for i in range(done, n_tokens):
                phase = int(contend and i >= n_tokens // 2)
                if phase and reader is None:
                    reader = DiskReader(llm.manifest.resolve(model_dir, llm.manifest.base.file)).__enter__()
                llm.eval([cont[i]])
                s = llm.engine.controller_samples()
                s["seq"] = s["seq"] + seq0
                s["phase"] = np.full(len(s["seq"]), phase, dtype=np.int64)
                got = {k: np.concatenate([got[k], s[k]]) for k in got}
                if (i + 1) % 8 == 0 or i + 1 == n_tokens:
                    tmp = save.with_name(save.name + ".tmp.npz")
                    np.savez(tmp, done=i + 1, **got)
                    tmp.replace(save)
                bar.update(1)
        finally:
            bar.close()
            if reader is not None:
                reader.__exit__(None, None, None)
        return got
    finally:
        llm.close()


def check_tunable(model_dir: Path, m) -> None:
    """ControllerError (one line at the command line) where the model has no controller to tune."""
    from leanstream_ggml.native import control

    if m.moe is not None:
        raise control.ControllerError(
            f"{model_dir} is a mixture-of-experts model: the streaming controller steers a dense model's sparse "
            f"decode (leanstream mode); a mixture-of-experts model reads the whole experts its router picks, so "
            f"there is nothing to tune")
    if m.sketch is None:
        raise control.ControllerError(f"{model_dir}: the controller steers leanstream's cascade, which needs the "
                                      f"sketch; convert again with the sketch")


def run(args) -> int:
    from leanstream_ggml.native import control, params
    from leanstream_ggml.model import manifest as mf

    model_dir = Path(args.model)
    m = mf.load(model_dir)
    check_tunable(model_dir, m)
    budget_kw = budget_of(model_dir, m, args)
    if args.quality is not None and args.sparsity is not None:
        raise params.ParameterError("quality", "give --quality or --sparsity, not both")
    sparsity_kw = {"quality": args.quality} if args.quality else ({"sparsity": args.sparsity} if args.sparsity is not None else {})
    actions = list(control.DEFAULT_ACTIONS)
    t0 = time.perf_counter()

    from leanstream_ggml import Llama

    # the engine's budget and sparsity as a run would resolve them
    probe = Llama(str(model_dir), mode="leanstream", n_ctx=64, verbose=False, **budget_kw, **sparsity_kw)
    budget, sparsity = probe.engine.memory_budget, probe.sparsity
    probe.close()
    band = reused_band(model_dir, m, actions, sparsity, args)
    if band is None:
        band = quality_band(model_dir, actions, {"sparsity": sparsity}, args.quality_tokens, args.threads,
                            args.quality_target)
        band.update(tokens=args.quality_tokens, target=args.quality_target, hot_fraction=0.0)
        # kept apart from the policies too: an interrupted tune does not measure it again
        mf.write_atomic(model_dir / mf.controller_quality_file(sparsity), json.dumps(band, indent=1) + "\n")
    allowed = np.array([band["allowed"][str(c)] for c, _ in actions])
    if not allowed.any():
        raise control.ControllerError(
            f"no candidate ratio keeps perplexity within x{args.quality_target:g} of dense at sparsity {sparsity:g} "
            f"(measured: {', '.join(f'x{c}: x{r:.3f}' for c, r in band['ratio'].items())}): give a larger "
            f"--quality-target or a lower --sparsity")
    print(f"quality band at sparsity {sparsity:g} (perplexity vs dense, the worse of prose and code): "
          + ", ".join(f"candidates x{c}: x{r:.3f}{'' if band['allowed'][c] else ' (over the target: not offered)'}"
                      for c, r in band["ratio"].items()))
    save = model_dir / mf.controller_profile_file(budget, sparsity)
    if args.restart and save.exists():
        save.unlink()
    # (the budget as resolved: a memory plan made later in this process would count what the
    # quality band left behind)
    samples = profile(model_dir, {"memory_budget": budget}, {"sparsity": sparsity}, actions, args.tokens,
                      not args.no_contend, args.threads, save)
    if len(samples["seq"]) == 0:
        raise RuntimeError("the profile recorded no controlled op (is the whole FFN resident at this budget?)")

    load_edges = control.quantile_edges(samples["remaining_bytes"], 4)
    disk_edges = []
    ph = samples["phase"]
    disk = samples["disk_ns_per_mib"]
    if (ph == 1).any() and (ph == 0).any():
        q, s = np.median(disk[(ph == 0) & (disk > 0)]), np.median(disk[(ph == 1) & (disk > 0)])
        if s > q * 1.1:
            disk_edges = [float(np.sqrt(q * s))]
    ran = {int(a) for a in samples["action"]}
    if not any(allowed[a] for a in ran):
        raise control.ControllerError(
            f"the profile's {len(samples['seq'])} controlled ops ran none of the actions the quality band allows "
            f"(candidate ratios {', '.join(str(actions[a][0]) for a in range(len(actions)) if allowed[a])}): profile "
            f"more tokens (--tokens, now {args.tokens}), or restart it (--restart)")
    binned = control.bin_states(samples, load_edges, disk_edges)
    table, V, Q, counts = control.solve(binned, m.n_layer, len(actions), len(load_edges) + 1, len(disk_edges) + 1,
                                        allowed=allowed)
    info = {"tuned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tokens": args.tokens,
            "samples": int(len(samples["seq"])), "contended": bool((ph == 1).any()), "quality_band": band,
            "allowed": [bool(a) for a in allowed], "seconds": round(time.perf_counter() - t0, 1),
            "disk_median_ns_per_mib": {"quiet": float(np.median(disk[(ph == 0) & (disk > 0)])) if ((ph == 0) & (disk > 0)).any() else None,
                                       "shared": float(np.median(disk[(ph == 1) & (disk > 0)])) if ((ph == 1) & (disk > 0)).any() else None}}
    pol = control.Policy(memory_budget=budget, sparsity=sparsity, actions=actions, load_edges=load_edges,
                         disk_edges=disk_edges, table=table, value=V[0], info=info)
    path = control.save_policy(model_dir, m, pol)
    print(f"wrote {path} ({budget / 1e6:.0f} MB budget, sparsity {sparsity:g}, {info['samples']} samples, "
          f"{info['seconds']:.0f} s)")
    print(format_table(pol))
    return 0


def format_table(pol) -> str:
    """The table as text: one row per layer, one column per (load, disk) state, the action's
    (candidate ratio, bridge scale)."""
    cols = [f"L{l}{'/D' + str(d) if pol.n_disk > 1 else ''}" for l in range(pol.n_load) for d in range(pol.n_disk)]
    lines = ["layer " + " ".join(f"{c:>9}" for c in cols)]
    for il, row in enumerate(pol.table.reshape(len(pol.table), -1)):
        lines.append(f"{il:>5} " + " ".join(f"{pol.actions[a][0]:>4g}/{pol.actions[a][1]:<4g}" for a in row))
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--read-forever":
        read_forever(sys.argv[2])
