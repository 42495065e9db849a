"""The model directory contract: ``manifest.json`` of a converted model (``model.lsm/``).

The converter (``converters/``) writes a model directory; the runtime reads it through this module
only. Importing it costs nothing: standard library only (no gguf, numpy, torch or scikit-learn).

    from leanstream_ggml.manifest import load
    m = load("model.lsm")                     # parsed and validated, files checked
    m.layer_path("model.lsm", 3)              # .../ffn/blk.3.bin
    m.layers[3].block_stride                  # bytes of one block of k neurons on disk

Layout of a model directory::

    manifest.json      this contract; written last by the converter (its presence = complete)
    base.gguf          the source GGUF without ffn_gate/ffn_up/ffn_down (+ leanstream.* keys)
    ffn/blk.<il>.bin   one block file per layer (format: native/include/leanstream.h)
    predictor/ ...     (optional, described by the ``predictor`` field)

Sizes are bytes. Type names are ggml's (``ggml_type_name``: "f32", "f16", "q4_0", "q4_K", ...);
``ggml_type_id`` maps them to ``enum ggml_type``.

Totals: ``ffn_bytes_source`` = bytes of the three FFN tensors in the source GGUF;
``ffn_bytes_on_disk`` = sum of the block files' sizes (headers included);
``padding_bytes`` = bytes of the block regions (n_blocks * block_stride per layer) that hold no
weight: alignment padding at the end of each block plus empty slots of the last block;
``padding_waste`` = padding_bytes / total bytes of the block regions, i.e. the fraction of every
streamed byte that is padding.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

FORMAT = "leanstream-model"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
HEADER_BYTES = 4096  # block file header; perm table starts here (leanstream.h)

# enum ggml_type values of ggml's type names (ggml.h); only what a model directory may hold
GGML_TYPE_IDS = {
    "f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q8_1": 9,
    "q2_K": 10, "q3_K": 11, "q4_K": 12, "q5_K": 13, "q6_K": 14, "q8_K": 15, "bf16": 30,
}
GGML_TYPE_NAMES = {v: k for k, v in GGML_TYPE_IDS.items()}
ACTIVATIONS = ("silu", "gelu")


class ManifestError(ValueError):
    """A model directory is missing, incomplete, malformed or of another format version."""


def ggml_type_id(name: str) -> int:
    try:
        return GGML_TYPE_IDS[name]
    except KeyError:
        raise ManifestError(f"unknown ggml type name {name!r}") from None


@dataclass
class SourceInfo:
    filename: str   # basename of the source GGUF
    sha256: str     # hex digest of the whole source file
    size: int       # bytes


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


@dataclass
class Manifest:
    source: SourceInfo
    architecture: str
    n_layer: int
    n_embd: int
    n_ff: int
    activation: str
    block: BlockGeometry
    layers: list[LayerEntry]
    totals: Totals
    base: BaseInfo
    predictor: dict[str, Any] | None = None   # filled by the predictor training stage
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    # top-level keys this version does not know, kept so a rewrite does not drop them
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- paths ---------------------------------------------------------------------------
    def layer_path(self, model_dir: str | os.PathLike, il: int) -> Path:
        return Path(model_dir) / self.layers[il].file

    def base_path(self, model_dir: str | os.PathLike) -> Path:
        return Path(model_dir) / self.base.file

    # ---- what the sparse modes need -------------------------------------------------------
    def sparse_modes(self, model_dir: str | os.PathLike) -> tuple[list[str], str | None]:
        """(sparse modes this directory can run, why the others cannot or None). The modes
        need one predictor file per layer; powerinfer2 also the calibration block frequencies
        (leanstream pins them when present)."""
        d = Path(model_dir)
        files = (self.predictor or {}).get("files") or []
        if not files:
            return [], "no predictors (the converter's predictor stage did not run)"
        if len(files) != self.n_layer:
            return [], f"predictors for {len(files)} of {self.n_layer} layers"
        missing = [f for f in files if not (d / f).is_file()]
        if missing:
            return [], f"predictor file {missing[0]} is missing"
        freq = (self.predictor or {}).get("block_freq")
        if freq and (d / freq).is_file():
            return ["leanstream", "oneshot", "dejavu+", "powerinfer2"], None
        return ["leanstream", "oneshot", "dejavu+"], "powerinfer2 needs the calibration block frequencies"

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": self.format,
            "format_version": self.format_version,
            "source": asdict(self.source),
            "architecture": self.architecture,
            "n_layer": self.n_layer,
            "n_embd": self.n_embd,
            "n_ff": self.n_ff,
            "activation": self.activation,
            "block": asdict(self.block),
            "layers": [asdict(e) for e in self.layers],
            "totals": asdict(self.totals),
            "base": asdict(self.base),
            "predictor": self.predictor,
        }
        d.update(self.extra)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @classmethod
    def from_dict(cls, d: Any, where: str = "manifest") -> Manifest:
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: expected a JSON object at the top level")
        fmt = d.get("format")
        if fmt != FORMAT:
            raise ManifestError(f"{where}: not a LeanStream model manifest (format={fmt!r}, expected {FORMAT!r})")
        ver = d.get("format_version")
        if not isinstance(ver, int) or isinstance(ver, bool):
            raise ManifestError(f"{where}: format_version missing or not an integer")
        if ver > FORMAT_VERSION:
            raise ManifestError(f"{where}: format_version {ver} is newer than this leanstream-ggml "
                                f"understands ({FORMAT_VERSION}); upgrade leanstream-ggml")
        if ver != FORMAT_VERSION:
            raise ManifestError(f"{where}: format_version {ver} is no longer supported; "
                                f"re-run `leanstream convert`")
        layers_raw = _get(d, "layers", list, where)
        m = cls(
            source=_dc(SourceInfo, _get(d, "source", dict, where), f"{where}: source"),
            architecture=_get(d, "architecture", str, where),
            n_layer=_get(d, "n_layer", int, where),
            n_embd=_get(d, "n_embd", int, where),
            n_ff=_get(d, "n_ff", int, where),
            activation=_get(d, "activation", str, where),
            block=_dc(BlockGeometry, _get(d, "block", dict, where), f"{where}: block"),
            layers=[_dc(LayerEntry, e, f"{where}: layers[{i}]") for i, e in enumerate(layers_raw)],
            totals=_dc(Totals, _get(d, "totals", dict, where), f"{where}: totals"),
            base=_dc(BaseInfo, _get(d, "base", dict, where), f"{where}: base"),
            predictor=d.get("predictor"),
            format=fmt,
            format_version=ver,
            extra={k: v for k, v in d.items() if k not in _KNOWN_KEYS},
        )
        if m.predictor is not None and not isinstance(m.predictor, dict):
            raise ManifestError(f"{where}: predictor must be an object or null")
        m.validate(where)
        return m

    # ---- checks --------------------------------------------------------------------------
    def validate(self, where: str = "manifest") -> None:
        """Internal consistency (no file access). Raises ManifestError."""
        def bad(msg: str) -> None:
            raise ManifestError(f"{where}: {msg}")

        for name in ("n_layer", "n_embd", "n_ff"):
            if getattr(self, name) <= 0:
                bad(f"{name} must be positive")
        if self.activation not in ACTIVATIONS:
            bad(f"unknown activation {self.activation!r} (known: {', '.join(ACTIVATIONS)})")
        k, align = self.block.k, self.block.align
        if k <= 0:
            bad("block.k must be positive")
        if align < 512 or align & (align - 1):
            bad(f"block.align {align} must be a power of two >= 512")
        if len(self.layers) != self.n_layer:
            bad(f"{len(self.layers)} layer entries for n_layer={self.n_layer}")
        n_blocks = math.ceil(self.n_ff / k)
        for i, e in enumerate(self.layers):
            w = f"layers[{i}]"
            if e.il != i:
                bad(f"{w}.il is {e.il}, expected {i} (layers must be listed in order)")
            for t in (e.gate_type, e.up_type, e.down_type):
                if t not in GGML_TYPE_IDS:
                    bad(f"{w}: unknown ggml type name {t!r}")
            if e.down_type not in ("q8_0", "f16", "f32"):
                bad(f"{w}.down_type {e.down_type!r} must be q8_0, f16 or f32")
            if e.n_blocks != n_blocks:
                bad(f"{w}.n_blocks {e.n_blocks} != ceil(n_ff / k) = {n_blocks}")
            if e.block_stride % align or e.block_stride < e.block_payload or e.block_payload <= 0:
                bad(f"{w}: block_stride {e.block_stride} must be a multiple of align {align} "
                    f"and hold block_payload {e.block_payload}")
            if e.data_offset % HEADER_BYTES or e.data_offset < HEADER_BYTES + 4 * n_blocks * k:
                bad(f"{w}.data_offset {e.data_offset} must be a multiple of 4096 past the perm table")
            if e.file_size != e.data_offset + e.n_blocks * e.block_stride:
                bad(f"{w}.file_size {e.file_size} != data_offset + n_blocks * block_stride")
            if os.path.isabs(e.file) or ".." in Path(e.file).parts:
                bad(f"{w}.file {e.file!r} must be a relative path inside the model directory")
        if os.path.isabs(self.base.file) or ".." in Path(self.base.file).parts:
            bad(f"base.file {self.base.file!r} must be a relative path inside the model directory")
        if not 0.0 <= self.totals.padding_waste < 1.0:
            bad(f"totals.padding_waste {self.totals.padding_waste} must be in [0, 1)")

    def check_files(self, model_dir: str | os.PathLike) -> None:
        """Every file the manifest names exists with the size it records. Raises ManifestError."""
        d = Path(model_dir)
        for e in self.layers:
            _check_size(d / e.file, e.file_size)
        _check_size(d / self.base.file, self.base.size)


_KNOWN_KEYS = {"format", "format_version", "source", "architecture", "n_layer", "n_embd", "n_ff",
               "activation", "block", "layers", "totals", "base", "predictor"}


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
        typ = {"int": int, "str": str, "float": float}[f.type]
        v = _get(d, f.name, typ, where)
        kw[f.name] = float(v) if typ is float else v
    return cls(**kw)


def _check_size(path: Path, size: int) -> None:
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing (the model directory is incomplete)") from None
    if actual != size:
        raise ManifestError(f"{path}: {actual} bytes, the manifest says {size} (truncated or replaced?)")


def load(model_dir: str | os.PathLike, *, check_files: bool = True) -> Manifest:
    """Read and validate ``<model_dir>/manifest.json``; with check_files, also that every file
    it names is there with the recorded size."""
    d = Path(model_dir)
    path = d / MANIFEST_NAME
    if not d.is_dir():
        raise ManifestError(f"{d}: not a directory (expected a model directory from `leanstream convert`)")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing — {d} is not a converted model, or its conversion did not "
                            f"finish (re-run `leanstream convert`)") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON ({e})") from None
    m = Manifest.from_dict(raw, where=str(path))
    if check_files:
        m.check_files(d)
    return m


def save(manifest: Manifest, model_dir: str | os.PathLike) -> Path:
    """Write ``manifest.json`` atomically (temporary name, fsync, rename)."""
    manifest.validate()
    path = Path(model_dir) / MANIFEST_NAME
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
