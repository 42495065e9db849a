"""The mixture-of-experts part of the read and write stages (``convert_gguf.py`` calls it).

An MoE layer's routed experts (``blk.<il>.ffn_{gate,up,down}_exps``) become one expert file per
layer (docs/formats.md, "Expert file"; written by ``experts.write_expert_file``), each expert's
bytes as the GGUF stores them; everything else of the layer (the router ``ffn_gate_inp``, a shared
expert and its gate, the norms) stays in base.gguf, where stock llama.cpp computes it.

    desc = describe(arch, kv, tensors, n_layer, n_embd)   # in the read stage's child: plain data
    layout = MoELayout.from_dict(desc)                    # in the converter's process
    info, totals, kept = write_experts(layout, data, out, n_layer=..., n_embd=..., align=..., release=...)

The families converted are those whose llama.cpp graph calls ``build_moe_ffn`` with softmax
gating over separate gate, up and down experts (src/models/{qwen3moe,qwen2moe,olmoe,llama}.cpp):
qwen3moe, qwen2moe (with a shared expert), olmoe, and Mixtral's layout under "llama" (or "qwen2")
with an expert count. Any other family with experts is refused with its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from leanstream_ggml.model import manifest as mf

from ._faults import kill_point
from .fileio import fsync_dir

SUPPORTED_ARCHS = ("qwen3moe", "qwen2moe", "olmoe", "llama", "qwen2")
MOE_ONLY_ARCHS = ("qwen3moe", "qwen2moe", "olmoe")     # (llama and qwen2 are dense without an expert count)
SUPPORTED_TEXT = "qwen3moe, qwen2moe, olmoe, Mixtral-style llama/qwen2"
ROLES = ("gate", "up", "down")
SHARED = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp")   # base.gguf's
# the order of experts in a layer's slots: the router's own for now (co-activation order is the
# order stage's, once the activations pass routes MoE models)
EXPERT_ORDER = "identity"


class MoEError(Exception):
    """What makes a source's experts unconvertible (the read stage adds the file's name)."""


def is_moe(expert_count: Any, names) -> bool:
    """A mixture-of-experts source: an expert count, or a router or expert tensor in any layer."""
    return (isinstance(expert_count, int) and expert_count > 0) or any(
        "_exps." in n or ".ffn_gate_inp." in n for n in names)


def _type_name(t: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(t).name


def describe(arch: str, kv: Callable[[str], Any], tensors: dict, n_layer: int, n_embd: int) -> dict:
    """The source's experts as plain data (the read stage's child: gguf-py's ReaderTensors
    ``tensors`` by name, ``kv(key)`` a metadata value or None); raises MoEError."""
    if arch not in SUPPORTED_ARCHS:
        raise MoEError(f"a mixture-of-experts model ({arch}) that leanstream does not convert yet; "
                       f"supported: {SUPPORTED_TEXT}")
    n_expert, n_used = kv(f"{arch}.expert_count"), kv(f"{arch}.expert_used_count")
    if not isinstance(n_expert, int) or n_expert <= 0:
        raise MoEError(f"a mixture-of-experts model ({arch}) without a valid {arch}.expert_count ({n_expert!r})")
    if not isinstance(n_used, int) or not 0 < n_used <= n_expert:
        raise MoEError(f"{arch}.expert_used_count is {n_used!r}; it must be in 1..{n_expert} ({arch}.expert_count)")
    layers, names, n_ff_exp, shared = [], [], None, False
    for il in range(n_layer):
        p = f"blk.{il}."
        fused = tensors.get(p + "ffn_gate_up_exps.weight")
        if fused is not None:
            raise MoEError(f"{fused.name}: a mixture-of-experts layer whose gate and up experts are fused "
                           f"(ffn_gate_up_exps), which leanstream does not convert yet")
        got = {r: tensors.get(f"{p}ffn_{r}_exps.weight") for r in ROLES}
        missing = [f"{p}ffn_{r}_exps.weight" for r, t in got.items() if t is None]
        if missing:
            raise MoEError(f"layer {il}: missing expert tensors {', '.join(missing)} (already converted, or a model "
                           f"whose layers are not all mixture-of-experts?)")
        router = tensors.get(p + "ffn_gate_inp.weight")
        if router is None or [int(x) for x in router.shape] != [n_embd, n_expert]:
            raise MoEError(f"layer {il}: the router {p}ffn_gate_inp.weight is "
                           + ("missing" if router is None else f"of shape {[int(x) for x in router.shape]}")
                           + f", expected [{n_embd}, {n_expert}] (n_embd, {arch}.expert_count)")
        known = {p + "ffn_norm.weight", router.name, *(f"{p}{s}.weight" for s in SHARED),
                 *(t.name for t in got.values())}
        extra = [n for n in tensors if n.startswith(p + "ffn_") and n not in known]
        if extra:
            raise MoEError(f"layer {il} has FFN tensors leanstream does not handle beside its experts: "
                           f"{', '.join(extra)}")
        shared = shared or any(f"{p}{s}.weight" in tensors for s in SHARED)
        if n_ff_exp is None:
            n_ff_exp = int(got["gate"].shape[1]) if len(got["gate"].shape) == 3 else -1
        for r, want in (("gate", [n_embd, n_ff_exp, n_expert]), ("up", [n_embd, n_ff_exp, n_expert]),
                        ("down", [n_ff_exp, n_embd, n_expert])):
            t = got[r]
            if [int(x) for x in t.shape] != want:
                raise MoEError(f"{t.name} has shape {[int(x) for x in t.shape]}, expected {want} (n_embd={n_embd}, "
                               f"{n_expert} experts; every layer's experts must have the same n_ff_exp={n_ff_exp})")
        layers.append([{"name": got[r].name, "tensor_type": int(got[r].tensor_type), "n_bytes": int(got[r].n_bytes),
                        "data_offset": int(got[r].data_offset)} for r in ROLES])
        names += [got[r].name for r in ROLES]
    return {"n_expert": n_expert, "n_expert_used": n_used, "n_ff_exp": n_ff_exp, "shared_expert": shared,
            "gating": "softmax", "layers": layers, "names": names}


@dataclass
class MoELayout:
    """A source's routed experts (``describe``'s data): the geometry and where each layer's are."""
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    shared_expert: bool
    gating: str
    layers: list                   # per layer: [gate, up, down] {name, tensor_type (enum ggml_type: may differ
                                   # between layers), n_bytes, data_offset}
    names: list                    # every ffn_*_exps tensor: what base.gguf leaves out

    @classmethod
    def from_dict(cls, d: dict) -> MoELayout:
        return cls(**d)

    def types(self, il: int) -> dict:
        """Layer il's gate_type, up_type, down_type (enum ggml_type)."""
        return {f"{r}_type": sp["tensor_type"] for r, sp in zip(ROLES, self.layers[il])}

    def source_bytes(self) -> int:
        return sum(sp["n_bytes"] for specs in self.layers for sp in specs)

    def experts(self, data: np.ndarray, il: int, n_embd: int) -> Callable[[int], tuple]:
        """expert(e) -> (gate, up, down) of layer il's router expert e: uint8 [n_ff_exp, row bytes]
        twice and [n_embd, row bytes], views of the mapped source (expert e's bytes are the e-th
        n_expert-th of each tensor)."""
        E = self.n_expert
        gate, up, down = (data[sp["data_offset"]:sp["data_offset"] + sp["n_bytes"]].reshape(E, rows, -1)
                          for sp, rows in zip(self.layers[il], (self.n_ff_exp, self.n_ff_exp, n_embd)))

        def expert(e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            if not 0 <= e < E:
                raise IndexError(f"layer {il}: expert {e} of {E}")
            return gate[e], up[e], down[e]
        return expert


def geometry(layout: MoELayout, il: int, n_embd: int, align: int) -> dict:
    """Layer il's expert file header as the writer lays it out (leanstream_convert/experts.py; meta_crc 0)."""
    from .experts import expert_header   # (gguf-py: imported on use, as convert_gguf.py does)

    return expert_header(il=il, n_embd=n_embd, n_ff_exp=layout.n_ff_exp, n_expert=layout.n_expert,
                         align=align, **layout.types(il))


def moe_info(layout: MoELayout, n_layer: int, n_embd: int, align: int) -> mf.MoEInfo:
    """The manifest's moe section for these expert files."""
    layers = []
    for il in range(n_layer):
        g = geometry(layout, il, n_embd, align)
        layers.append(mf.ExpertLayer(file=mf.EXPERT_FILE.format(il=il), expert_stride=g["expert_stride"],
                                     data_offset=g["data_offset"], file_size=g["file_size"], **layout.types(il)))
    return mf.MoEInfo(layers=layers, n_expert=layout.n_expert, n_expert_used=layout.n_expert_used,
                      n_ff_exp=layout.n_ff_exp, gating=layout.gating, shared_expert=layout.shared_expert)


def totals(layout: MoELayout, n_layer: int, n_embd: int, align: int) -> mf.Totals:
    gs = [geometry(layout, il, n_embd, align) for il in range(n_layer)]
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
        for il in tqdm(range(n_layer), desc="writing expert files", unit="layer", disable=not progress):
            path = out / mf.EXPERT_FILE.format(il=il)
            if file_done(path, geometry(layout, il, n_embd, align), order):
                kept += 1
                continue
            # under a temporary name, synced and renamed (experts.py); one expert in RAM at a time
            write_expert_file(path, il=il, n_embd=n_embd, n_ff_exp=layout.n_ff_exp, **layout.types(il),
                              expert=layout.experts(data, il, n_embd), expert_of_slot=order, align=align)
            release()
            kill_point("write-layer")
        fsync_dir(out / mf.EXPERT_DIR)          # the renames above are durable before the manifest
    return moe_info(layout, n_layer, n_embd, align), totals(layout, n_layer, n_embd, align), kept


def output_bytes(layout: MoELayout, n_layer: int, n_embd: int, align: int) -> int:
    """Bytes of the expert files."""
    return sum(geometry(layout, il, n_embd, align)["file_size"] for il in range(n_layer))


def working_bytes(layout: MoELayout, n_embd: int, align: int) -> int:
    """What writing one layer holds at most: one expert's slot (the writer's), and the layer's
    source pages the kernel maps in as they are read (released after the layer)."""
    def one(il):
        g = geometry(layout, il, n_embd, align)
        return g["expert_stride"] + layout.n_expert * (g["gate_bytes"] + g["up_bytes"] + g["down_bytes"])
    return max(one(il) for il in range(len(layout.layers)))
