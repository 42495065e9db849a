"""The manifest's sections (``manifest.json``'s objects: source, block, layers, totals, base,
predictor, sketch, moe) as dataclasses, and the typed reading of JSON fields they share with
``Manifest.from_dict`` (manifest.py, where the contract is described). Standard library only.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any


class ManifestError(ValueError):
    """A model directory is missing, incomplete, malformed or of another format version."""


# values a section may hold (the converter offers and writes these)
PREDICTOR_FORMAT = "lspred"
SKETCH_TYPES = ("ls2",)                 # sketch row formats (formats.SKETCH_LS2)
SKETCH_WEIGHTS = ("one", "down_norm")   # a sketch score: |h|, or |h| x ||down column||


@dataclass
class SourceInfo:
    filename: str   # basename of the source GGUF
    sha256: str     # hex digest of the whole source file
    size: int       # bytes
    path: str = ""  # its absolute path when converted ("": not recorded; in RAM the file runs on
                    # llama.cpp's kernels from there if it still holds these bytes, leanstream_ggml/llamacpp/stock.py)


@dataclass
class BlockGeometry:
    k: int          # neurons per block
    align: int      # O_DIRECT alignment of data_offset and block_stride (bytes, power of two >= 512)


@dataclass
class LayerEntry:
    il: int
    file: str            # relative to the model directory, "ffn/blk.<il>.bin"
    gate_type: str       # ggml type name of each gate row
    up_type: str
    down_type: str       # type of the transposed down columns (q8_0, f16 or f32)
    n_blocks: int        # ceil(n_ff / k)
    block_stride: int    # bytes per block on disk, multiple of align
    block_payload: int   # k * (gate_row + up_row + down_col) bytes; the rest of a stride is padding
    data_offset: int     # first block's offset in the file, multiple of 4096
    file_size: int       # data_offset + n_blocks * block_stride


@dataclass
class Totals:
    ffn_bytes_source: int
    ffn_bytes_on_disk: int
    padding_bytes: int
    padding_waste: float  # fraction of block bytes that are padding


@dataclass
class BaseInfo:
    file: str   # "base.gguf"
    size: int


class _FileSection:
    """A section that names one file per layer (predictor, sketch, moe): its JSON object."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def _files(d: Any, where: str) -> list[str]:
        """The object's ``files`` (checked to be an object first)."""
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: expected an object or null")
        return _paths(d, "files", where)


@dataclass
class PredictorInfo(_FileSection):
    """The sparse modes' predictors (written by the converter's train stage)."""
    files: list[str]            # one per layer, in layer order: "predictor/blk.<il>.lspred"
    version: int                # predictor file format version (docs/formats.md)
    bytes: int                  # total size of the files
    block_freq: str | None = None  # "predictor/block_freq.npy": f32 [n_layer, n_blocks], how often each
                                   # block was in the calibration top half (the hot set's ranking)
    summary: str | None = None     # "predictor/predictor.json": training settings and metrics
    config: dict[str, Any] = field(default_factory=dict)  # the hashing configuration (informational)
    format: str = PREDICTOR_FORMAT

    @classmethod
    def from_dict(cls, d: Any, where: str) -> PredictorInfo:
        files = cls._files(d, where)
        opt = {}
        for key in ("block_freq", "summary"):
            v = d.get(key)
            if v is not None and not isinstance(v, str):
                raise ManifestError(f"{where}: {key} must be a path or null")
            opt[key] = v
        config = d.get("config", {})
        if not isinstance(config, dict):
            raise ManifestError(f"{where}: config must be an object")
        fmt = d.get("format", PREDICTOR_FORMAT)
        if fmt != PREDICTOR_FORMAT:
            raise ManifestError(f"{where}: unknown predictor format {fmt!r}")
        return cls(files=files, version=_get(d, "version", int, where), bytes=_get(d, "bytes", int, where),
                   config=config, format=fmt, **opt)


@dataclass
class SketchInfo(_FileSection):
    """leanstream mode's exact-input scorer: a low-bit copy of every gate/up row (converter's
    sketch stage; file format in docs/formats.md), and the quality calibration of the sparse
    decode on the converter's corpus (``quality``: [{"sparsity", "ppl_ratio", "agreement",
    "domains": {name: {"ppl_ratio", "agreement"}}}], ppl_ratio the worst domain's; the table
    ``quality=`` chooses the sparsity from; empty if not calibrated; directories converted before
    the corpus had domains have rows without "domains", measured on prose)."""
    files: list[str]            # one per layer, in layer order: "sketch/blk.<il>.lssk"
    type: str                   # row format: "ls2" (docs/formats.md)
    weight: str                 # "one" (score |h|) or "down_norm" (score |h| * ||down column||)
    bytes: int                  # total size of the files
    quality: list[dict[str, float]] = field(default_factory=list)
    block_freq: str | None = None  # "sketch/block_freq.npy": f32 [n_layer, n_blocks], how often each block
                                   # was a candidate on the calibration text (the hot set's ranking)
    block_importance: str | None = None  # "sketch/block_importance.npy": f32 [n_layer, n_blocks], mean |h| x
                                         # ||down column|| on the calibration text (dense mode's pinned set:
                                         # the draft FFN of speculative decoding)

    @classmethod
    def from_dict(cls, d: Any, where: str) -> SketchInfo:
        files = cls._files(d, where)
        weight = _get(d, "weight", str, where)
        if weight not in SKETCH_WEIGHTS:
            raise ManifestError(f"{where}: weight must be one of {', '.join(SKETCH_WEIGHTS)}, got {weight!r}")
        quality = d.get("quality", [])
        if not isinstance(quality, list) or not all(
                isinstance(q, dict) and all(_type_ok(q.get(k), float) for k in ("sparsity", "ppl_ratio"))
                for q in quality):
            raise ManifestError(f"{where}: quality must be a list of {{sparsity, ppl_ratio, ...}} objects")
        for q in quality:
            doms = q.get("domains", {})
            if not isinstance(doms, dict) or not all(
                    isinstance(v, dict) and _type_ok(v.get("ppl_ratio"), float) for v in doms.values()):
                raise ManifestError(f"{where}: quality domains must map a name to {{ppl_ratio, ...}}")
        freq, imp = d.get("block_freq"), d.get("block_importance")
        if freq is not None and not isinstance(freq, str):
            raise ManifestError(f"{where}: block_freq must be a path or null")
        if imp is not None and not isinstance(imp, str):
            raise ManifestError(f"{where}: block_importance must be a path or null")
        return cls(files=files, type=_get(d, "type", str, where), weight=weight,
                   bytes=_get(d, "bytes", int, where), quality=list(quality), block_freq=freq, block_importance=imp)



# ---- typed JSON fields -------------------------------------------------------------------------

@dataclass
class ExpertLayer:
    """One layer's expert file (docs/formats.md): its types may differ from another layer's (a
    Q4_K_M file holds some layers' down experts in Q6_K, the others' in Q4_K)."""
    file: str                   # relative to the model directory, "experts/blk.<il>.bin"
    gate_type: int              # enum ggml_type of the experts' gate rows
    up_type: int
    down_type: int
    expert_stride: int          # bytes of one expert on disk (multiple of the block alignment)
    data_offset: int            # first slot's offset in the file, multiple of 4096
    file_size: int              # data_offset + n_expert * expert_stride
    flags: int = 0              # 1: per-expert biases, 2: per-expert scales (f32, before each slot's rows)


@dataclass
class MoEInfo:
    """A mixture-of-experts model's routed experts (docs/formats.md, expert file): one expert file
    per MoE layer, each expert's gate, up and down in the GGUF's own types, in one slot; the router,
    a shared expert and its gate, dense layers stay in base.gguf and run as stock llama.cpp runs them."""
    layers: list[ExpertLayer | None]   # one per layer, in layer order; None: a layer without experts
                                       # (dense, leading or interleaved, or an MTP layer llama.cpp skips)
    n_expert: int               # routed experts per layer
    n_expert_used: int          # experts each token is routed to (the GGUF's expert_used_count)
    n_ff_exp: int               # neurons of one expert
    gating: str = "softmax"     # the router's function (informational: llama.cpp computes it)
    shared_expert: bool = False  # a shared expert (in base.gguf) beside the routed ones
    routing_freq: str | None = None  # "experts/routing_freq.npy": f32 [n_layer, n_expert], how often each
                                     # expert was routed to on the calibration text (the hot set's ranking)
    activation: str = "silu"    # what an expert computes (leanstream_ggml/model/moe_families.py)
    weight_before: bool = False
    mtp_layers: list[int] = field(default_factory=list)   # layers llama.cpp skips (next-token prediction)

    @property
    def files(self) -> list[str]:
        return [e.file for e in self.layers if e is not None]

    def expert_layers(self) -> list[tuple[int, ExpertLayer]]:
        """(il, its expert file) of every layer that has experts."""
        return [(il, e) for il, e in enumerate(self.layers) if e is not None]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str) -> MoEInfo:
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: expected an object or null")
        layers = [None if e is None else _dc(ExpertLayer, e, f"{where}: layers[{i}]")
                  for i, e in enumerate(_get(d, "layers", list, where))]
        ints = {k: _get(d, k, int, where) for k in ("n_expert", "n_expert_used", "n_ff_exp")}
        freq = d.get("routing_freq")
        if freq is not None and not isinstance(freq, str):
            raise ManifestError(f"{where}: routing_freq must be a path or null")
        mtp = d.get("mtp_layers", [])
        if not isinstance(mtp, list) or not all(_type_ok(i, int) for i in mtp):
            raise ManifestError(f"{where}: mtp_layers must be a list of layer indices")
        return cls(layers=layers, gating=str(d.get("gating", "softmax")), shared_expert=bool(d.get("shared_expert", False)),
                   routing_freq=freq, activation=str(d.get("activation", "silu")),
                   weight_before=bool(d.get("weight_before", False)), mtp_layers=list(mtp), **ints)

    def validate(self, n_layer: int, align: int, bad) -> None:
        if len(self.layers) != n_layer or len(set(self.files)) != len(self.files) or not self.files:
            bad(f"moe.layers must list one entry per layer ({n_layer}), null or an expert file, each file once, "
                f"at least one")
        if any(not 0 <= i < n_layer or self.layers[i] is not None for i in self.mtp_layers):
            bad(f"moe.mtp_layers {self.mtp_layers} must be layers without experts")
        if not 0 < self.n_expert_used <= self.n_expert or self.n_ff_exp <= 0:
            bad(f"moe: n_expert {self.n_expert}, n_expert_used {self.n_expert_used}, n_ff_exp {self.n_ff_exp} "
                f"must be positive with n_expert_used <= n_expert")
        for i, e in self.expert_layers():
            w = f"moe.layers[{i}]"
            if e.expert_stride <= 0 or e.expert_stride % align:
                bad(f"{w}.expert_stride {e.expert_stride} must be a positive multiple of align {align}")
            if e.data_offset % 4096 or e.data_offset < 4096 + 8 * self.n_expert:
                bad(f"{w}.data_offset {e.data_offset} must be a multiple of 4096 past the slot tables")
            if e.flags & ~3:
                bad(f"{w}.flags {e.flags}: unknown bits")
            if e.file_size != e.data_offset + self.n_expert * e.expert_stride:
                bad(f"{w}.file_size {e.file_size} != data_offset + n_expert * expert_stride")


def _paths(d: dict, key: str, where: str) -> list[str]:
    files = _get(d, key, list, where)
    if not all(isinstance(f, str) for f in files):
        raise ManifestError(f"{where}: {key} must be a list of paths")
    return list(files)


def _type_ok(v: Any, typ: type) -> bool:
    if typ is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if typ is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return isinstance(v, typ)


def _get(d: dict, key: str, typ: type, where: str) -> Any:
    if key not in d:
        raise ManifestError(f"{where}: missing field {key!r}")
    v = d[key]
    if not _type_ok(v, typ):
        raise ManifestError(f"{where}: field {key!r} should be {typ.__name__}, got {type(v).__name__}")
    return v


def _dc(cls: type, d: Any, where: str) -> Any:
    """Build dataclass ``cls`` from dict ``d`` with type checks of its annotated fields."""
    if not isinstance(d, dict):
        raise ManifestError(f"{where}: expected an object")
    kw = {}
    for f in fields(cls):
        if f.name not in d and f.default is not MISSING:   # (a field added later: older manifests lack it)
            continue
        typ = {"int": int, "str": str, "float": float}[f.type]
        v = _get(d, f.name, typ, where)
        kw[f.name] = float(v) if typ is float else v
    return cls(**kw)
