"""Outputs of the FFN op in every kept execution path, recorded once and compared after a change.

    python bench/op_identity.py record MODEL.lsm ref.npz    # before the change
    python bench/op_identity.py compare MODEL.lsm ref.npz   # after: prints one JSON object

Per configuration (dense unlimited and under a small budget, the sketch cascade resident and
streamed, the predictor-selected baselines under a budget) it runs a prompt as one prefill batch,
then teacher-forced decode tokens one at a time, and keeps every position's logits and, per decode
token and layer, the engine's last plan and candidates. `compare` says per configuration whether
logits and plans are bit-identical to the recording. The model directory must be the same one
(baselines need predictors in it: tests/support/pred_synth.py writes random ones).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

PROMPT = ("The committee reviewed the proposal in detail and asked the authors to clarify how the "
          "measurements were taken, which baselines were used, and whether the results")
N_PREFILL = 12

CONFIGS = {
    "dense": dict(mode="dense"),
    "dense-16MiB": dict(mode="dense", memory_budget="16MiB"),
    "dejavu+-3.2MB": dict(mode="dejavu+", memory_budget="3.2MB"),     # SmolLM2: prefill in chunks
    "leanstream": dict(mode="leanstream"),
    "leanstream-40MiB": dict(mode="leanstream", memory_budget="40MiB"),
    "leanstream-22MiB": dict(mode="leanstream", memory_budget="22MiB"),
    "oneshot-40MiB": dict(mode="oneshot", memory_budget="40MiB"),
    "dejavu+-40MiB": dict(mode="dejavu+", memory_budget="40MiB"),
    "powerinfer2-40MiB": dict(mode="powerinfer2", memory_budget="40MiB"),
}


def run(model_dir: Path, name: str, cfg: dict) -> dict:
    from leanstream_ggml import Llama

    llm = Llama(str(model_dir), n_ctx=256, n_threads=2, logits_all=True, verbose=False, **cfg)
    try:
        toks = llm.tokenize(PROMPT.encode())
        llm.reset()
        llm.eval(toks[:N_PREFILL])
        plans, cands = [], []
        for t in toks[N_PREFILL:]:
            llm.eval([t])
            plans.append([llm.engine.last_plan(il).tolist() for il in range(llm.engine.n_layers)])
            cands.append([llm.engine.last_candidates(il).tolist() for il in range(llm.engine.n_layers)])
        logits = np.array(llm.scores[: len(toks)], dtype=np.float32)
    finally:
        llm.close()
    return {"logits": logits, "plans": json.dumps(plans), "cands": json.dumps(cands)}


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("record", "compare"):
        print(__doc__, file=sys.stderr)
        return 2
    what, model_dir, ref = argv[0], Path(argv[1]), Path(argv[2])
    got = {name: run(model_dir, name, cfg) for name, cfg in CONFIGS.items()}
    if what == "record":
        np.savez(ref, **{f"{n}/{k}": v for n, r in got.items() for k, v in r.items()})
        print(json.dumps({"recorded": str(ref), "configs": list(got)}))
        return 0
    old = np.load(ref)
    out = {}
    for name, r in got.items():
        out[name] = {
            "logits_identical": bool(np.array_equal(old[f"{name}/logits"], r["logits"])),
            "max_abs_logit_diff": float(np.max(np.abs(old[f"{name}/logits"] - r["logits"]))),
            "plans_identical": str(old[f"{name}/plans"]) == r["plans"],
            "candidates_identical": str(old[f"{name}/cands"]) == r["cands"],
        }
    ok = all(v["logits_identical"] and v["plans_identical"] and v["candidates_identical"] for v in out.values())
    print(json.dumps({"identical": ok, "configs": out}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
