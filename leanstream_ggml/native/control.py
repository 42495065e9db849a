"""The streaming controller's policy: states, actions, the offline solver and the policy file.

LeanStream steers each layer with a lookup table synthesized offline (paper §3.2.3). Here a
cascade decode op's state at its layer boundary is (load, disk):

- load: R, the bytes of the layer's candidates (at the default candidate ratio) that are not
  resident, binned by ``load_edges``;
- disk: an EWMA of the I/O workers' read time per MiB over the last ops, binned by
  ``disk_edges`` (it moves when another process shares the disk).

An action is (candidate ratio, bridge scale): how many candidates the op reads and computes
exactly, and how far a read goes through gaps (a multiple of the bridge the engine measured at
start; 0 skips every gap). The native side (native/src/control.c) measures, looks up and records;
this module estimates the transitions from recorded samples and solves the finite-horizon
problem over a token's layers by Bellman backward recursion:

    V_L(q) = 0
    V_n(q) = min_a  T(n, q, a) + sum_q' P(q' | n, q, a) V_{n+1}(q')

T and P are the samples' means and frequencies per (layer, state, action), shrunk towards the
same action's pooled estimate over all layers where a cell has few samples (``prior`` samples'
weight), so that every cell has an estimate.

The policy file (``controller.json`` in the model directory, named and checksummed in the
manifest) holds one policy per memory budget it was tuned at, and the conversion it was made for:
a policy made for another model or conversion is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from leanstream_ggml.native._native import ffi, lib
from leanstream_ggml.model.manifest import CONTROLLER_FILE

FORMAT = "leanstream-controller"
FORMAT_VERSION = 1

# (candidate ratio, bridge scale): the knobs the op exposes. The candidate ratios are the band
# whose quality `leanstream tune` measures (only those within the quality target are kept);
# bridge scales are quality-neutral.
DEFAULT_ACTIONS: tuple[tuple[float, float], ...] = (
    (1.5, 1.0),    # today's fixed default
    (1.5, 0.5), (1.5, 2.0), (1.5, 4.0),
    (1.25, 1.0), (1.25, 2.0),
    (2.0, 1.0), (2.0, 2.0),
    (3.0, 1.0),
)

CONTROLLER_MODES = {"off": lib.LS_CTRL_OFF, "fixed": lib.LS_CTRL_FIXED, "table": lib.LS_CTRL_TABLE,
                    "profile": lib.LS_CTRL_PROFILE}

SAMPLE_FIELDS = ("seq", "layer", "load_state", "disk_state", "action", "remaining_bytes", "disk_ns_per_mib",
                 "op_ns", "bytes_read")


class ControllerError(ValueError):
    """A policy file is missing, malformed, or made for another model, conversion or budget."""


@dataclass
class Policy:
    """One tuned policy: the table [n_layers, n_load, n_disk] of action indices into ``actions``."""
    memory_budget: int
    sparsity: float
    actions: list[tuple[float, float]]
    load_edges: list[float]
    disk_edges: list[float]
    table: np.ndarray
    value: np.ndarray | None = None        # V_0 per state (expected ns per token of FFN ops)
    info: dict = field(default_factory=dict)

    @property
    def n_load(self) -> int:
        return len(self.load_edges) + 1

    @property
    def n_disk(self) -> int:
        return len(self.disk_edges) + 1

    def state_of(self, remaining: float, disk_ns_per_mib: float) -> tuple[int, int]:
        """The native binning (control.c bin_of): the first bin whose upper edge exceeds v."""
        return (int(np.searchsorted(self.load_edges, remaining, side="right")),
                int(np.searchsorted(self.disk_edges, disk_ns_per_mib, side="right")))

    def to_dict(self) -> dict:
        d = {"memory_budget": int(self.memory_budget), "sparsity": float(self.sparsity),
             "actions": [[float(c), float(b)] for c, b in self.actions],
             "load_edges": [float(x) for x in self.load_edges], "disk_edges": [float(x) for x in self.disk_edges],
             "table": self.table.astype(int).tolist(), "info": self.info}
        if self.value is not None:
            d["value_ns"] = [[float(v) for v in row] for row in self.value.reshape(self.n_load, self.n_disk)]
        return d

    @classmethod
    def from_dict(cls, d: dict, n_layers: int, where: str) -> Policy:
        try:
            actions = [(float(c), float(b)) for c, b in d["actions"]]
            table = np.asarray(d["table"], dtype=np.int64)
            p = cls(memory_budget=int(d["memory_budget"]), sparsity=float(d["sparsity"]), actions=actions,
                    load_edges=[float(x) for x in d["load_edges"]], disk_edges=[float(x) for x in d["disk_edges"]],
                    table=table, info=dict(d.get("info", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise ControllerError(f"{where}: malformed policy ({e})") from None
        if not 1 <= len(actions) <= lib.LS_CTRL_MAX_ACTIONS:
            raise ControllerError(f"{where}: {len(actions)} actions (1..{lib.LS_CTRL_MAX_ACTIONS})")
        if table.shape != (n_layers, p.n_load, p.n_disk):
            raise ControllerError(f"{where}: table of shape {table.shape}, expected "
                                  f"({n_layers}, {p.n_load}, {p.n_disk})")
        if table.min() < 0 or table.max() >= len(actions):
            raise ControllerError(f"{where}: table names an action outside 0..{len(actions) - 1}")
        return p


def native_policy(mode: str, *, actions=DEFAULT_ACTIONS, fixed_action: int = 0, load_edges=(), disk_edges=(),
                  table: np.ndarray | None = None, seed: int = 1, record: bool = False):
    """An ls_ctrl_policy (cffi) and the buffers it points into (keep both alive until installed)."""
    if mode not in CONTROLLER_MODES:
        raise ValueError(f"unknown controller mode {mode!r}; choose one of {', '.join(CONTROLLER_MODES)}")
    p = ffi.new("ls_ctrl_policy *")
    p.mode = CONTROLLER_MODES[mode]
    p.n_actions = len(actions)
    for i, (c, b) in enumerate(actions[:lib.LS_CTRL_MAX_ACTIONS]):
        p.actions[i].candidate_ratio = c
        p.actions[i].bridge_scale = b
    p.fixed_action = fixed_action
    p.n_load = len(load_edges) + 1
    p.n_disk = len(disk_edges) + 1
    for i, x in enumerate(list(load_edges)[:lib.LS_CTRL_MAX_LOAD - 1]):
        p.load_edges[i] = x
    for i, x in enumerate(list(disk_edges)[:lib.LS_CTRL_MAX_DISK - 1]):
        p.disk_edges[i] = x
    keep = None
    if table is not None:
        keep = np.ascontiguousarray(table, dtype=np.uint8).reshape(-1)
        p.table = ffi.cast("const uint8_t *", keep.ctypes.data)
    p.seed = seed
    p.record = 1 if record else 0
    return p, keep


# ---- the solver -------------------------------------------------------------------------------

def transitions(samples: dict[str, np.ndarray], n_layers: int):
    """Pairs each sample with the next layer's sample of the same token (consecutive seq, layer
    + 1): returns the sample arrays and, per sample, the next sample's index (-1: last layer or
    no successor recorded)."""
    seq, layer = samples["seq"].astype(np.int64), samples["layer"].astype(np.int64)
    nxt = np.full(len(seq), -1, dtype=np.int64)
    if len(seq) > 1:
        ok = (seq[1:] == seq[:-1] + 1) & (layer[1:] == layer[:-1] + 1)
        nxt[:-1][ok] = np.arange(1, len(seq))[ok]
    return nxt


def solve(samples: dict[str, np.ndarray], n_layers: int, n_actions: int, n_load: int, n_disk: int,
          allowed: np.ndarray | None = None, prior: float = 5.0):
    """Bellman backward recursion over the layers of one token. samples: the recorded fields
    (SAMPLE_FIELDS) with load_state and disk_state binned as the policy will bin them. Returns
    (table [n_layers, n_load, n_disk] int, V [n_layers + 1, n_states], Q [n_layers, n_states,
    n_actions], counts [n_layers, n_states, n_actions]). allowed [n_actions] bool: actions the table
    may choose (the quality band). An action never profiled anywhere is not chosen."""
    S = n_load * n_disk
    state = samples["load_state"].astype(np.int64) * n_disk + samples["disk_state"].astype(np.int64)
    layer, act = samples["layer"].astype(np.int64), samples["action"].astype(np.int64)
    cost = samples["op_ns"].astype(np.float64)
    nxt = transitions(samples, n_layers)
    has_next = nxt >= 0
    next_state = np.where(has_next, state[np.maximum(nxt, 0)], 0)

    # per (layer, state, action): count, cost sum, next-state counts (where a successor was seen)
    cnt = np.zeros((n_layers, S, n_actions))
    csum = np.zeros((n_layers, S, n_actions))
    tcnt = np.zeros((n_layers, S, n_actions, S))
    np.add.at(cnt, (layer, state, act), 1.0)
    np.add.at(csum, (layer, state, act), cost)
    np.add.at(tcnt, (layer[has_next], state[has_next], act[has_next], next_state[has_next]), 1.0)

    # pooled over layers (same state and action), then over states too: the estimates a sparse
    # cell is shrunk towards
    def shrink(c, s, parent_mean, k):
        return (s + k * parent_mean) / (c + k)

    a_cnt, a_sum = cnt.sum(axis=(0, 1)), csum.sum(axis=(0, 1))
    a_mean = np.where(a_cnt > 0, a_sum / np.maximum(a_cnt, 1), np.inf)
    sa_cnt, sa_sum = cnt.sum(axis=0), csum.sum(axis=0)
    sa_mean = shrink(sa_cnt, sa_sum, np.where(np.isfinite(a_mean), a_mean, 0.0)[None, :], prior)
    T = shrink(cnt, csum, sa_mean[None], prior)
    # transitions: per (layer, state, action) shrunk to the layer's pooled (over actions) next-state
    # distribution, which is shrunk to uniform
    l_t = tcnt.sum(axis=2)                                           # [L, S, S']
    l_n = l_t.sum(axis=2, keepdims=True)
    l_p = (l_t + prior / S) / (l_n + prior)
    t_n = tcnt.sum(axis=3, keepdims=True)
    P = (tcnt + prior * l_p[:, :, None, :]) / (t_n + prior)         # [L, S, A, S']

    ok = np.isfinite(a_mean) if allowed is None else (np.asarray(allowed, bool) & np.isfinite(a_mean))
    if not ok.any():
        raise ControllerError("no allowed action was profiled")
    V = np.zeros((n_layers + 1, S))
    Q = np.zeros((n_layers, S, n_actions))
    table = np.zeros((n_layers, S), dtype=np.int64)
    for n in range(n_layers - 1, -1, -1):
        future = P[n] @ V[n + 1] if n + 1 < n_layers else np.zeros((S, n_actions))
        Q[n] = T[n] + future
        Qm = np.where(ok[None, :], Q[n], np.inf)
        table[n] = np.argmin(Qm, axis=1)
        V[n] = Qm[np.arange(S), table[n]]
    return table.reshape(n_layers, n_load, n_disk), V, Q, cnt


def quantile_edges(values: np.ndarray, n_bins: int) -> list[float]:
    """n_bins - 1 ascending, distinct edges at the values' quantiles (fewer if values repeat)."""
    if n_bins <= 1 or len(values) == 0:
        return []
    v = np.asarray(values, dtype=np.float64)
    qs = np.quantile(v, np.linspace(0, 1, n_bins + 1)[1:-1])
    out: list[float] = []
    for q in qs:
        if q > v.min() and (not out or q > out[-1]):   # an edge at the minimum leaves its bin empty
            out.append(float(q))
    return out


def bin_states(samples: dict[str, np.ndarray], load_edges, disk_edges) -> dict[str, np.ndarray]:
    """The samples with load_state / disk_state recomputed from their measurements and these edges
    (the native binning: v >= edge moves up a bin)."""
    out = dict(samples)
    out["load_state"] = np.searchsorted(np.asarray(load_edges, dtype=np.float64),
                                        samples["remaining_bytes"].astype(np.float64), side="right")
    out["disk_state"] = np.searchsorted(np.asarray(disk_edges, dtype=np.float64),
                                        samples["disk_ns_per_mib"].astype(np.float64), side="right")
    return out


# ---- the policy file ------------------------------------------------------------------------

def conversion_id(manifest) -> str:
    """What a policy is made for: the source model and the conversion's layout (block files and
    sketches as the manifest records them); not where the source lay (``source.path``)."""
    d = manifest.to_dict()
    source = {k: v for k, v in d["source"].items() if k != "path"}
    key = {"source": source, "block": d["block"], "layers": d["layers"], "sketch": d.get("sketch")}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def load_policies(model_dir, manifest) -> list[Policy]:
    """The policies of a model directory ([] if it has none). ControllerError if the file the
    manifest names is corrupt, malformed, or made for another model or conversion."""
    rel = manifest.controller_file()
    if rel is None:
        return []
    path = manifest.resolve(model_dir, rel)
    from leanstream_ggml.model.manifest import file_checksum

    want = manifest.checksums.get(rel)
    if want is not None and file_checksum(path) != want:
        raise ControllerError(f"{path}: corrupt (its checksum differs from the manifest's); run `leanstream tune` again")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ControllerError(f"{path}: cannot read ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("format_version") != FORMAT_VERSION:
        raise ControllerError(f"{path}: not a leanstream controller file of version {FORMAT_VERSION}")
    if d.get("conversion") != conversion_id(manifest):
        raise ControllerError(f"{path}: made for another model or conversion of it; run `leanstream tune "
                              f"{model_dir}` again")
    return [Policy.from_dict(p, manifest.n_layer, f"{path}: policies[{i}]") for i, p in enumerate(d.get("policies", []))]


# how far the budget a policy was tuned at may be from the run's: under a whole-process limit the
# engine's budget moves with what the process holds when the memory plan is made (a few %)
BUDGET_TOLERANCE = 0.10
# a policy tuned again within this of an existing one's budget (same sparsity) replaces it
REPLACE_TOLERANCE = 0.02


def _tuned_for(p: Policy, memory_budget: int, sparsity: float, tolerance: float) -> bool:
    return abs(p.sparsity - sparsity) < 1e-3 and abs(p.memory_budget - memory_budget) <= tolerance * max(memory_budget, 1)


def pick_policy(policies: list[Policy], memory_budget: int, sparsity: float) -> Policy:
    """The policy tuned at this sparsity whose budget is nearest this one, within
    BUDGET_TOLERANCE; ControllerError naming what was tuned otherwise."""
    near = [p for p in policies if _tuned_for(p, memory_budget, sparsity, BUDGET_TOLERANCE)]
    if near:
        return min(near, key=lambda p: abs(p.memory_budget - memory_budget))
    have = ", ".join(f"{p.memory_budget / 1e6:.0f} MB at sparsity {p.sparsity:g}" for p in policies) or "none"
    raise ControllerError(f"no controller table for a {memory_budget / 1e6:.0f} MB budget at sparsity {sparsity:g} "
                          f"(tuned: {have}); run `leanstream tune` with this budget")


def save_policy(model_dir, manifest, policy: Policy) -> Path:
    """Adds (or replaces: the same sparsity, the budget within 2 %) a policy in the model directory's controller
    file and names it, with its checksum, in the manifest. Both files are replaced atomically."""
    from leanstream_ggml.model.manifest import MANIFEST_NAME, file_checksum, write_atomic

    d = Path(model_dir)
    try:
        policies = load_policies(d, manifest)
    except ControllerError:
        policies = []   # another conversion's or a corrupt file: replaced
    # a policy tuned again at (nearly) the same budget replaces the old one
    policies = [p for p in policies if not _tuned_for(p, policy.memory_budget, policy.sparsity, REPLACE_TOLERANCE)]
    policies.append(policy)
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "conversion": conversion_id(manifest),
           "policies": [p.to_dict() for p in sorted(policies, key=lambda p: (p.memory_budget, p.sparsity))]}
    path = d / CONTROLLER_FILE
    write_atomic(path, json.dumps(doc, indent=1) + "\n")
    manifest.extra["controller"] = {"file": CONTROLLER_FILE}
    manifest.checksums[CONTROLLER_FILE] = file_checksum(path)
    write_atomic(d / MANIFEST_NAME, manifest.to_json())
    return path
