"""The mixture-of-experts part of the read and write stages (``convert_gguf.py`` calls it).

An MoE layer's routed experts (``blk.<il>.ffn_{gate,up,down}_exps``, or ``ffn_gate_up_exps`` and
``ffn_down_exps``, with their ``.bias`` and ``.scale`` where the GGUF has them) become one expert
file per layer (docs/formats.md, "Expert file"; written by ``experts.write_expert_file``), each
expert's rows as the GGUF stores them, its biases and scales as f32; everything else of the model
(attention and recurrent layers, the router and its biases, shared experts, dense and interleaved
layers' FFNs, norms) stays in base.gguf, where stock llama.cpp computes it. MTP (next-token)
layers, which llama.cpp's graph skips, keep no experts at all.

    desc = describe(arch, kv, tensors, n_layer, n_embd)   # in the read stage's child: plain data
    layout = MoELayout.from_dict(desc)                    # in the converter's process
    info, totals, kept = write_experts(layout, data, out, n_layer=..., n_embd=..., align=..., release=...)

Which architectures convert, and what their experts compute, is a table
(leanstream_ggml/model/moe_families.py); which layers have experts, whether gate and up are fused,
and whether there are biases or scales is read from the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from leanstream_ggml.model import manifest as mf
from leanstream_ggml.model import moe_families
from leanstream_ggml.model.formats import EXPERT_BIASES, EXPERT_SCALES

from ._faults import kill_point
from .fileio import fsync_dir

SUPPORTED_ARCHS = tuple(moe_families.FAMILIES)
# families the dense converter does not take (llama, qwen2, granite: dense without an expert count)
MOE_ONLY_ARCHS = tuple(a for a in moe_families.FAMILIES if a not in mf.ARCH_ACTIVATION)
SUPPORTED_TEXT = "every llama.cpp family whose routed experts are gated (README.md, MoE families)"
ROLES = ("gate", "up", "down")
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")
# the order of experts in a layer's slots: the router's own for now (co-activation order is the
# order stage's, once the activations pass routes MoE models)
EXPERT_ORDER = "identity"


# architectures whose experts go through build_moe_ffn but compute what the op does not (yet)
REFUSED: dict[str, str] = {
    "nemotron_h": "ungated ReLU² experts (ffn_up_exps and ffn_down_exps, no gate), behind a latent projection",
    "nemotron_h_moe": "ungated ReLU² experts (ffn_up_exps and ffn_down_exps, no gate), behind a latent projection",
    "nomic-bert-moe": "ungated GELU experts (no ffn_gate_exps)",
    "bert": "ungated GELU experts (no ffn_gate_exps)",
    "jina-bert-v2": "ungated GELU experts (no ffn_gate_exps)",
    "jina-bert-v3": "ungated GELU experts (no ffn_gate_exps)",
    "nomic-bert": "ungated GELU experts (no ffn_gate_exps)",
    "grovemoe": "a second set of chunk experts (ffn_*_chexps) with its own expert indexing",
    "kimi-k3": "the SITU activation",
    "mistral4": "down experts computed with F32 activations (ggml_prec_set_src)",
    "deepseek4": "hash-routed layers and a clamped SwiGLU (swiglu_clamp_exp)",
    "maple": "a clamped SwiGLU (swiglu_clamp_exp)",
    "hy_v4": "a clamped SwiGLU (swiglu_clamp_exp)",
    "glm5-next": "a clamped SwiGLU (swiglu_clamp_exp)",
    "bailingmoe3": "a clamped SwiGLU (swiglu_clamp_exp)",
    "step35": "a clamped SwiGLU (swiglu_clamp_exp)",
    "dflash": "a speculative drafter's graph, not a model to chat with",
}


def refusal(arch: str) -> str:
    """Why a mixture-of-experts architecture is refused, in words a user can act on."""
    if arch in REFUSED:
        return f"its experts compute {REFUSED[arch]}, which leanstream's MoE op does not"
    return ("an architecture leanstream does not know; the families it converts are every llama.cpp "
            "architecture whose experts go through build_moe_ffn as gated experts (README.md, MoE families)")


class MoEError(Exception):
    """What makes a source's experts unconvertible (the read stage adds the file's name)."""


def is_moe(expert_count: Any, names) -> bool:
    """A mixture-of-experts source: an expert count, or a router or expert tensor in any layer."""
    return (isinstance(expert_count, int) and expert_count > 0) or any(
        "_exps." in n or ".ffn_gate_inp." in n for n in names)


def _type_name(t: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(t).name


def _spec(t) -> dict:
    return {"name": t.name, "tensor_type": int(t.tensor_type), "n_bytes": int(t.n_bytes),
            "data_offset": int(t.data_offset), "shape": [int(x) for x in t.shape]}


def _shape(t) -> list[int]:
    return [int(x) for x in t.shape]


def _n_layers(kv, arch: str, key: str) -> int:
    v = kv(f"{arch}.{key}")
    return v if isinstance(v, int) and v > 0 else 0


def _layer(arch: str, il: int, p: str, tensors: dict, n_embd: int, n_expert: int) -> tuple[dict, int, list[str]]:
    """Layer il's experts: (spec, n_ff_exp, the tensor names base.gguf leaves out); MoEError when
    they are not gated experts of standard names and shapes."""
    names = {n for n in tensors if n.startswith(p) and ("_exps." in n or "_chexps." in n)}
    known = {f"{p}{t}.{s}" for t in EXPERT_TENSORS for s in ("weight", "bias", "scale")}
    odd = sorted(names - known)
    if odd:
        raise MoEError(f"layer {il} has expert tensors leanstream does not handle: {', '.join(odd)}")
    got = {t: {s: tensors.get(f"{p}{t}.{s}") for s in ("weight", "bias", "scale")} for t in EXPERT_TENSORS}
    fused, down = got["ffn_gate_up_exps"]["weight"], got["ffn_down_exps"]["weight"]
    gate, up = got["ffn_gate_exps"]["weight"], got["ffn_up_exps"]["weight"]
    if fused is not None and (gate is not None or up is not None):
        raise MoEError(f"layer {il} has both {fused.name} and separate gate/up experts")
    if down is None or (fused is None and up is None):
        raise MoEError(f"layer {il}: missing expert tensors ({p}ffn_down_exps.weight and ffn_up_exps or "
                       f"ffn_gate_up_exps; already converted?)")
    if fused is None and gate is None:
        raise MoEError(f"layer {il}: its experts have no gate ({p}ffn_gate_exps.weight): ungated experts are "
                       f"not supported")
    n_ff = int(down.shape[0]) if len(down.shape) == 3 else -1
    want = {"ffn_down_exps": [n_ff, n_embd, n_expert], "ffn_gate_exps": [n_embd, n_ff, n_expert],
            "ffn_up_exps": [n_embd, n_ff, n_expert], "ffn_gate_up_exps": [n_embd, 2 * n_ff, n_expert]}
    bias_want = {"ffn_down_exps": [n_embd, n_expert], "ffn_gate_exps": [n_ff, n_expert],
                 "ffn_up_exps": [n_ff, n_expert], "ffn_gate_up_exps": [2 * n_ff, n_expert]}
    for t, parts in got.items():
        for s, x in parts.items():
            if x is None:
                continue
            w = want[t] if s == "weight" else bias_want[t] if s == "bias" else [n_expert]
            if _shape(x) != w:
                raise MoEError(f"{x.name} has shape {_shape(x)}, expected {w} (n_embd={n_embd}, {n_expert} experts, "
                               f"n_ff_exp={n_ff})")
            if s != "weight" and x.tensor_type not in (0, 1, 30):   # F32, F16, BF16
                raise MoEError(f"{x.name} is {_type_name(x.tensor_type)}: biases and scales must be F32, F16 or BF16")
    if fused is not None and any(got[t]["scale"] is not None for t in EXPERT_TENSORS if t != "ffn_down_exps"):
        # (llama.cpp scales a fused product by up's scale, and loads neither gate's nor up's then)
        raise MoEError(f"layer {il}: per-expert gate/up scales beside fused gate/up experts ({fused.name}) are not "
                       f"supported")
    spec = {"fused": fused is not None,
            "weights": [_spec(fused if fused is not None and r != "down" else got[f"ffn_{r}_exps"]["weight"])
                        for r in ROLES],
            "bias": {t: _spec(x["bias"]) for t, x in got.items() if x["bias"] is not None},
            "scale": {t: _spec(x["scale"]) for t, x in got.items() if x["scale"] is not None}}
    return spec, n_ff, sorted(names)


def describe(arch: str, kv: Callable[[str], Any], tensors: dict, n_layer: int, n_embd: int) -> dict:
    """The source's experts as plain data (the read stage's child: gguf-py's ReaderTensors
    ``tensors`` by name, ``kv(key)`` a metadata value or None); raises MoEError."""
    fam = moe_families.FAMILIES.get(arch)
    if fam is None:
        raise MoEError(f"a mixture-of-experts model ({arch}): {refusal(arch)}")
    n_expert, n_used = kv(f"{arch}.expert_count"), kv(f"{arch}.expert_used_count")
    if not isinstance(n_expert, int) or n_expert <= 0:
        raise MoEError(f"a mixture-of-experts model ({arch}) without a valid {arch}.expert_count ({n_expert!r})")
    if not isinstance(n_used, int) or not 0 < n_used <= n_expert:
        raise MoEError(f"{arch}.expert_used_count is {n_used!r}; it must be in 1..{n_expert} ({arch}.expert_count)")
    clamp = kv(f"{arch}.swiglu_clamp_exp")
    if clamp is not None and any(float(c) > 1e-6 for c in np.atleast_1d(np.asarray(clamp, dtype=np.float64))):
        raise MoEError(f"a mixture-of-experts model ({arch}) whose experts clamp their SwiGLU ({arch}.swiglu_clamp_exp), "
                       f"which leanstream's MoE op does not compute")
    n_mtp = _n_layers(kv, arch, "nextn_predict_layers")
    layers, names, n_ff_exp, mtp = [], [], None, []
    for il in range(n_layer):
        p = f"blk.{il}."
        has = any(n.startswith(p) and ("_exps." in n or "_chexps." in n) for n in tensors)
        if il >= n_layer - n_mtp:   # an MTP layer: llama.cpp's graph skips it, its experts are left out
            names += sorted(n for n in tensors if n.startswith(p) and "_exps." in n)
            layers.append(None)
            mtp.append(il)
            continue
        if not has:   # a dense layer (leading or interleaved): its FFN stays llama.cpp's
            if p + "ffn_gate_inp.weight" in tensors:
                raise MoEError(f"layer {il} has a router ({p}ffn_gate_inp.weight) but no expert tensors")
            layers.append(None)
            continue
        spec, n_ff, own = _layer(arch, il, p, tensors, n_embd, n_expert)
        if n_ff_exp is None:
            n_ff_exp = n_ff
        elif n_ff != n_ff_exp:
            raise MoEError(f"layer {il}'s experts have n_ff_exp {n_ff}, an earlier layer's {n_ff_exp}: every layer's "
                           f"experts must have the same size")
        layers.append(spec)
        names += own
    if n_ff_exp is None:
        raise MoEError(f"a {arch} model none of whose layers has expert tensors (ffn_*_exps): already converted?")
    return {"n_expert": n_expert, "n_expert_used": n_used, "n_ff_exp": n_ff_exp,
            "shared_expert": any(".ffn_up_shexp." in n for n in tensors), "gating": "softmax",
            "activation": fam.activation, "weight_before": fam.weight_before, "mtp_layers": mtp,
            "layers": layers, "names": names}


def _f32(data: np.ndarray, sp: dict) -> np.ndarray:
    """A bias or scale tensor as f32 [n_expert, n] (gguf-py dequantizes F16 / BF16)."""
    from gguf.quants import dequantize
    import gguf

    raw = data[sp["data_offset"]:sp["data_offset"] + sp["n_bytes"]]
    n_expert = sp["shape"][-1]
    return np.asarray(dequantize(raw, gguf.GGMLQuantizationType(sp["tensor_type"])), dtype=np.float32).reshape(n_expert, -1)


@dataclass
class MoELayout:
    """A source's routed experts (``describe``'s data): the geometry and where each layer's are."""
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    shared_expert: bool
    gating: str
    layers: list                   # per layer: None (no experts: dense, or MTP) or {"fused": gate and up in one
                                   # tensor, "weights": [gate, up, down] {name, tensor_type (enum ggml_type: may
                                   # differ between layers), n_bytes, data_offset, shape}, "bias" / "scale":
                                   # {tensor name: spec} of those present}
    names: list                    # every expert tensor base.gguf leaves out
    activation: str = "silu"       # moe_families' row
    weight_before: bool = False
    mtp_layers: list | None = None

    @classmethod
    def from_dict(cls, d: dict) -> MoELayout:
        return cls(**d)

    def expert_layers(self) -> list[int]:
        return [il for il, sp in enumerate(self.layers) if sp is not None]

    def types(self, il: int) -> dict:
        """Layer il's gate_type, up_type, down_type (enum ggml_type)."""
        return {f"{r}_type": sp["tensor_type"] for r, sp in zip(ROLES, self.layers[il]["weights"])}

    def flags(self, il: int) -> int:
        sp = self.layers[il]
        return (EXPERT_BIASES if sp["bias"] else 0) | (EXPERT_SCALES if sp["scale"] else 0)

    def source_bytes(self) -> int:
        total = 0
        for sp in self.layers:
            if sp is None:
                continue
            seen = {w["name"]: w["n_bytes"] for w in sp["weights"]}
            seen.update({x["name"]: x["n_bytes"] for part in ("bias", "scale") for x in sp[part].values()})
            total += sum(seen.values())
        return total

    def experts(self, data: np.ndarray, il: int, n_embd: int) -> Callable[[int], tuple]:
        """expert(e) -> (gate, up, down[, extras]) of layer il's router expert e: uint8 [n_ff_exp,
        row bytes] twice and [n_embd, row bytes], views of the mapped source (expert e's bytes are the
        e-th n_expert-th of each tensor; fused gate/up: its first n_ff_exp rows the gate, the next the
        up), and with biases or scales their f32 values (biases of gate, up, down, then the scales)."""
        E, F = self.n_expert, self.n_ff_exp
        spec = self.layers[il]
        gate_sp, up_sp, down_sp = spec["weights"]

        def rows(sp, n_rows):
            return data[sp["data_offset"]:sp["data_offset"] + sp["n_bytes"]].reshape(E, n_rows, -1)
        down = rows(down_sp, n_embd)
        if spec["fused"]:
            both = rows(gate_sp, 2 * F)
            gate, up = both[:, :F], both[:, F:]
        else:
            gate, up = rows(gate_sp, F), rows(up_sp, F)
        extras = None
        if spec["bias"] or spec["scale"]:
            b = {t: _f32(data, sp) for t, sp in spec["bias"].items()}
            if "ffn_gate_up_exps" in b:
                b["ffn_gate_exps"], b["ffn_up_exps"] = b["ffn_gate_up_exps"][:, :F], b["ffn_gate_up_exps"][:, F:]
            parts = []
            if spec["bias"]:   # (a missing one adds zeros)
                parts += [b.get(t, np.zeros((E, n), np.float32)) for t, n in
                          (("ffn_gate_exps", F), ("ffn_up_exps", F), ("ffn_down_exps", n_embd))]
            if spec["scale"]:  # (a missing one multiplies by one)
                sc = {t: _f32(data, sp) for t, sp in spec["scale"].items()}
                parts += [sc.get(t, np.ones((E, 1), np.float32)) for t in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
            extras = np.concatenate(parts, axis=1)

        def expert(e: int) -> tuple:
            if not 0 <= e < E:
                raise IndexError(f"layer {il}: expert {e} of {E}")
            return (gate[e], up[e], down[e]) if extras is None else (gate[e], up[e], down[e], extras[e])
        return expert


def geometry(layout: MoELayout, il: int, n_embd: int, align: int) -> dict:
    """Layer il's expert file header as the writer lays it out (leanstream_convert/experts.py; meta_crc 0)."""
    from .experts import expert_header   # (gguf-py: imported on use, as convert_gguf.py does)

    return expert_header(il=il, n_embd=n_embd, n_ff_exp=layout.n_ff_exp, n_expert=layout.n_expert,
                         align=align, flags=layout.flags(il), **layout.types(il))


def moe_info(layout: MoELayout, n_layer: int, n_embd: int, align: int) -> mf.MoEInfo:
    """The manifest's moe section for these expert files."""
    layers = [None] * n_layer
    for il in layout.expert_layers():
        g = geometry(layout, il, n_embd, align)
        layers[il] = mf.ExpertLayer(file=mf.EXPERT_FILE.format(il=il), expert_stride=g["expert_stride"],
                                    data_offset=g["data_offset"], file_size=g["file_size"], flags=g["flags"],
                                    **layout.types(il))
    return mf.MoEInfo(layers=layers, n_expert=layout.n_expert, n_expert_used=layout.n_expert_used,
                      n_ff_exp=layout.n_ff_exp, gating=layout.gating, shared_expert=layout.shared_expert,
                      activation=layout.activation, weight_before=layout.weight_before,
                      mtp_layers=list(layout.mtp_layers or []))


def totals(layout: MoELayout, n_layer: int, n_embd: int, align: int) -> mf.Totals:
    gs = [geometry(layout, il, n_embd, align) for il in layout.expert_layers()]
    region = sum(layout.n_expert * g["expert_stride"] for g in gs)
    pad = region - sum(layout.n_expert * (g["gate_bytes"] + g["up_bytes"] + g["down_bytes"]) for g in gs)
    return mf.Totals(ffn_bytes_source=layout.source_bytes(), ffn_bytes_on_disk=sum(g["file_size"] for g in gs),
                     padding_bytes=pad, padding_waste=pad / region)


def expert_order(layout: MoELayout) -> np.ndarray:
    """i32 [n_expert]: the router expert of each slot."""
    return np.arange(layout.n_expert, dtype="<i4")


def file_done(path: Path, want: dict, expert_of_slot: np.ndarray) -> bool:
    """An expert file from an earlier run that is complete and is what would be written: its
    header field by field (the runtime's reader checks its meta_crc and tables), its size and its
    slot order (every slot's CRC is checked whenever the engine reads it)."""
    from leanstream_ggml.model.blockfile import read_expert_header

    try:
        if path.stat().st_size != want["file_size"]:
            return False
        h = read_expert_header(path)
    except (OSError, ValueError):
        return False
    return (all(h[k] == v for k, v in want.items() if k != "meta_crc")
            and np.array_equal(h["expert_of_slot"], expert_of_slot))


def write_experts(layout: MoELayout, data: np.ndarray, out: Path, *, n_layer: int, n_embd: int, align: int,
                  release: Callable[[], None], progress: bool = True,
                  write: bool = True) -> tuple[mf.MoEInfo, mf.Totals, int]:
    """Write experts/blk.<il>.bin for every layer, one layer at a time (its experts read from the
    mapped source as the writer asks for them; the source's pages released after each layer); a
    file already complete from an interrupted run is kept. ``write=False``: the files are there,
    only the manifest's section is made. Returns (moe section, totals, files kept)."""
    from tqdm import tqdm

    from .experts import write_expert_file

    order = expert_order(layout)
    kept = 0
    if write:
        (out / mf.EXPERT_DIR).mkdir(exist_ok=True)
        for il in tqdm(layout.expert_layers(), desc="writing expert files", unit="layer", disable=not progress):
            path = out / mf.EXPERT_FILE.format(il=il)
            if file_done(path, geometry(layout, il, n_embd, align), order):
                kept += 1
                continue
            # under a temporary name, synced and renamed (experts.py); one expert in RAM at a time
            write_expert_file(path, il=il, n_embd=n_embd, n_ff_exp=layout.n_ff_exp, **layout.types(il),
                              expert=layout.experts(data, il, n_embd), expert_of_slot=order, align=align,
                              flags=layout.flags(il))
            release()
            kill_point("write-layer")
        fsync_dir(out / mf.EXPERT_DIR)          # the renames above are durable before the manifest
    return moe_info(layout, n_layer, n_embd, align), totals(layout, n_layer, n_embd, align), kept


def output_bytes(layout: MoELayout, n_layer: int, n_embd: int, align: int) -> int:
    """Bytes of the expert files."""
    return sum(geometry(layout, il, n_embd, align)["file_size"] for il in layout.expert_layers())


def working_bytes(layout: MoELayout, n_embd: int, align: int) -> int:
    """What writing one layer holds at most: one expert's slot (the writer's), and the layer's
    source pages the kernel maps in as they are read (released after the layer)."""
    def one(il):
        g = geometry(layout, il, n_embd, align)
        return g["expert_stride"] + layout.n_expert * (g["gate_bytes"] + g["up_bytes"] + g["down_bytes"])
    return max(one(il) for il in layout.expert_layers())
