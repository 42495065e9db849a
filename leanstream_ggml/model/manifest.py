"""The model directory contract: ``manifest.json`` of a converted model (``model.lsm/``).

The converter (``leanstream_convert/``) writes a model directory; the runtime reads it through this module
only. Importing it costs nothing: standard library only (no gguf, numpy, torch or scikit-learn).

    from leanstream_ggml.model.manifest import load
    m = load("model.lsm")                     # parsed and validated, files checked
    m.layer_path("model.lsm", 3)              # .../ffn/blk.3.bin
    m.layers[3].block_stride                  # bytes of one block of k neurons on disk

Layout of a model directory (every name is spelled here, in the constants below, and nowhere
else; the file formats are in docs/formats.md)::

    MANIFEST_NAME         manifest.json              this contract; written last (its presence = complete)
    BASE_NAME             base.gguf                  the source without its FFN tensors (+ leanstream.* keys)
    BLOCK_FILE            ffn/blk.<il>.bin           one block file per layer
    SKETCH_FILE           sketch/blk.<il>.lssk       (``sketch``) leanstream's exact-input scorer
    SKETCH_BLOCK_FREQ     sketch/block_freq.npy      (``sketch.block_freq``) the order stage's block ranking
    SKETCH_IMPORTANCE     sketch/block_importance.npy (``sketch.block_importance``) mean |h| x ||down|| per block
    PREDICTOR_FILE        predictor/blk.<il>.lspred  (``predictor``) one predictor per layer
    PREDICTOR_BLOCK_FREQ  predictor/block_freq.npy   (``predictor.block_freq``) the training's block ranking
    PREDICTOR_SUMMARY     predictor/predictor.json   (``predictor.summary``) training settings and metrics
    CONTROLLER_FILE       controller.json            (``controller.file``) the streaming controller's policy
    DRAFT_VOCAB           draft/vocab.npy            (``draft.vocab``) int32 token ids by the model's mean
                                                     predicted probability on the calibration text: the
                                                     draft's output projection computes the first rows
    controller_quality_file(s)        controller.quality-<s>.json         tune's measured quality band
    controller_profile_file(b, s)     controller.profile-<b>-<s>.npz      tune's recorded samples

The sketch, predictor and controller files are optional; tune's quality and profile files
resume an interrupted `leanstream tune` and are neither checksummed nor read at run time. The
runtime finds every file through the paths the manifest records; the names above are what the
converter (and `leanstream tune`) write.

This module holds the names, the ``Manifest`` and ``load``; the sections' dataclasses are in
manifest_sections.py, the checks of files on disk in model_files.py, what a sparse mode reads
in mode_files.py. Every public name of those is importable from here.

Integrity: block files carry their own checksums (a CRC-32C per block and of their tables);
base.gguf, the sketch and predictor files and the block frequencies (``checksummed_files``)
have their zlib CRC-32 in ``checksums`` ({relative path: "crc32:<8 hex digits>"}), recorded by
``record_checksums`` (the converter calls it when it writes the manifest) from the files as they
are then. ``check_checksums`` verifies them (the runtime does so when it opens a model). Every
path is relative and must resolve, symlinks followed, to a regular file inside the model
directory (``resolve``).

Sizes are bytes. Type names are ggml's (``ggml_type_name``: "f32", "f16", "q4_0", "q4_K", ...);
``GGML_TYPE_IDS`` maps them to ``enum ggml_type``.

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
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from leanstream_ggml.model import moe_families
from leanstream_ggml.model.formats import HEADER_BYTES, MIN_ALIGN   # a block file's header (data_offset a multiple); block.align
# the sections, the files on disk and the modes' files, each in its module; every name is also
# this module's (the converter, the tests and the tools import them from here)
from leanstream_ggml.model.sections import (PREDICTOR_FORMAT, SKETCH_TYPES, SKETCH_WEIGHTS, BaseInfo, ExpertLayer, MoEInfo,  # noqa: F401
                                BlockGeometry, LayerEntry, ManifestError, PredictorInfo, SketchInfo, SourceInfo,
                                Totals, _dc, _get)
from leanstream_ggml.model.sparse_files import DENSE_ONLY_ARCHS, PREDICTOR_ARCHS, ModeFiles, ModeFilesError  # noqa: F401
from leanstream_ggml.model.files import check_size, file_checksum, open_regular, resolve_inside, write_atomic  # noqa: F401

FORMAT = "leanstream-model"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20

# ---- the model directory's files: their names, relative to the directory ('/'-separated, as the
# manifest records them); per-layer names take .format(il=<layer index>)
MANIFEST_NAME = "manifest.json"
BASE_NAME = "base.gguf"
FFN_DIR = "ffn"
SKETCH_DIR = "sketch"
EXPERT_DIR = "experts"
EXPERT_FILE = EXPERT_DIR + "/blk.{il}.bin"
ROUTING_FREQ = EXPERT_DIR + "/routing_freq.npy"
PREDICTOR_DIR = "predictor"
BLOCK_FILE = FFN_DIR + "/blk.{il}.bin"
SKETCH_FILE = SKETCH_DIR + "/blk.{il}.lssk"
PREDICTOR_FILE = PREDICTOR_DIR + "/blk.{il}.lspred"
BLOCK_FREQ_NAME = "block_freq.npy"
SKETCH_BLOCK_FREQ = SKETCH_DIR + "/" + BLOCK_FREQ_NAME
PREDICTOR_BLOCK_FREQ = PREDICTOR_DIR + "/" + BLOCK_FREQ_NAME
PREDICTOR_SUMMARY = PREDICTOR_DIR + "/predictor.json"
SKETCH_IMPORTANCE = SKETCH_DIR + "/block_importance.npy"
DRAFT_DIR = "draft"
DRAFT_VOCAB = DRAFT_DIR + "/vocab.npy"
CONTROLLER_FILE = "controller.json"


def controller_quality_file(sparsity: float) -> str:
    """``leanstream tune``'s quality band at one sparsity (JSON; resumes an interrupted tune)."""
    return f"controller.quality-{sparsity:g}.json"


def controller_profile_file(budget: int, sparsity: float) -> str:
    """``leanstream tune``'s recorded samples at one budget and sparsity (npz; resumes a tune)."""
    return f"controller.profile-{budget}-{sparsity:g}.npz"


# enum ggml_type values of ggml's type names (ggml.h; ggml_type_name): every type a GGUF's weights
# may hold (the op dots any whose rows ggml's CPU backend dots: ls_ggml_type_dots)
GGML_TYPE_IDS = {
    "f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q8_1": 9,
    "q2_K": 10, "q3_K": 11, "q4_K": 12, "q5_K": 13, "q6_K": 14, "q8_K": 15,
    "iq2_xxs": 16, "iq2_xs": 17, "iq3_xxs": 18, "iq1_s": 19, "iq4_nl": 20, "iq3_s": 21, "iq2_s": 22,
    "iq4_xs": 23, "iq1_m": 29, "bf16": 30, "tq1_0": 34, "tq2_0": 35, "mxfp4": 39, "nvfp4": 40,
    "q1_0": 41, "q2_0": 42,
}
# the formats the converter stores ffn_down columns in (leanstream_convert/convert_gguf.py down_columns)
DOWN_COLUMN_TYPES = ("q8_0", "q6_K", "q5_K", "f16", "f32")
GGML_TYPE_NAMES = {v: k for k, v in GGML_TYPE_IDS.items()}
ACTIVATIONS = ("silu", "gelu")
# the gated FFN's activation of each supported architecture, as its llama.cpp graph computes it
# (src/models/<arch>.cpp: build_ffn with LLM_FFN_SILU / LLM_FFN_SWIGLU or LLM_FFN_GELU, the tanh
# form); the converter writes it, the runtime checks it. Each is a dense gated FFN whose graph
# hands build_ffn the layer's FFN input and adds what it returns (scaled, or normed again, by
# the graph itself): granite scales it, olmo2 / gemma2 / gemma3 norm it after, phi3 stores gate
# and up in one tensor (the converter splits it: leanstream_convert/convert_gguf.py FUSED_GATE_UP)
ARCH_ACTIVATION = {"llama": "silu", "qwen2": "silu", "qwen3": "silu", "phi3": "silu", "granite": "silu",
                   "olmo2": "silu", "gemma2": "gelu", "gemma3": "gelu"}
# (a mixture-of-experts model's: its family's row, leanstream_ggml/model/moe_families.py)


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
    predictor: PredictorInfo | None = None    # the sparse modes' predictors, if trained
    sketch: SketchInfo | None = None          # leanstream's exact-input scorer, if written
    moe: MoEInfo | None = None                # a mixture-of-experts model's routed experts (then no layers)
    checksums: dict[str, str] = field(default_factory=dict)  # relative path -> "crc32:<hex>" (record_checksums)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    # top-level keys this version does not know, kept so a rewrite does not drop them
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- paths ---------------------------------------------------------------------------
    def layer_path(self, model_dir: str | os.PathLike, il: int) -> Path:
        return Path(model_dir) / self.layers[il].file

    def base_path(self, model_dir: str | os.PathLike) -> Path:
        return Path(model_dir) / self.base.file

    def predictor_files(self) -> list[str]:
        """Relative paths of the predictor files, one per layer ([] if none)."""
        return list(self.predictor.files) if self.predictor else []

    def sketch_files(self) -> list[str]:
        """Relative paths of the sketch files, one per layer ([] if none)."""
        return list(self.sketch.files) if self.sketch else []

    def block_freq_file(self) -> str | None:
        """The hot set's ranking: the predictors' calibration frequencies, else the sketch's."""
        if self.predictor and self.predictor.block_freq:
            return self.predictor.block_freq
        return self.sketch.block_freq if self.sketch else None

    def block_importance_file(self) -> str | None:
        """The draft's ranking (mean |h| x ||down||), else None."""
        return self.sketch.block_importance if self.sketch else None

    def draft_vocab_file(self) -> str | None:
        """The draft's vocabulary ranking (``draft.vocab``: int32 token ids, most likely first), else None."""
        d = self.extra.get("draft")
        return d.get("vocab") if isinstance(d, dict) and isinstance(d.get("vocab"), str) else None

    def controller_file(self) -> str | None:
        """The streaming controller's policy file (``leanstream tune`` writes it), if tuned."""
        c = self.extra.get("controller")
        return c.get("file") if isinstance(c, dict) and isinstance(c.get("file"), str) else None

    def checksummed_files(self) -> list[str]:
        """Every file the manifest names except the block files (which carry their own)."""
        out = [self.base.file] + self.predictor_files() + self.sketch_files()
        for info in (self.predictor, self.sketch):
            if info is not None and info.block_freq:
                out.append(info.block_freq)
        if self.block_importance_file():
            out.append(self.block_importance_file())
        if self.controller_file():
            out.append(self.controller_file())
        if self.draft_vocab_file():
            out.append(self.draft_vocab_file())
        if self.moe is not None and self.moe.routing_freq:
            out.append(self.moe.routing_freq)
        return out

    @staticmethod
    def resolve(model_dir: str | os.PathLike, rel: str) -> Path:
        """The real path of ``rel`` inside the model directory: symlinks resolved, inside the
        directory, a regular file (not a FIFO, device or directory). Raises ManifestError."""
        return resolve_inside(model_dir, rel)

    # ---- what the sparse modes need (mode_files.py) ---------------------------------------
    def mode_files(self, model_dir: str | os.PathLike, uses: frozenset[str], mode: str) -> ModeFiles:
        """The files of this directory a sparse mode reads, given what it uses (the engine's mode
        table, ``_native.mode_uses(mode)``); ModeFilesError saying what is missing."""
        from leanstream_ggml.model.sparse_files import mode_files

        return mode_files(self, model_dir, uses, mode)

    def sparse_modes(self, model_dir: str | os.PathLike) -> tuple[list[str], str | None]:
        """(sparse modes this directory can run, in the engine's order; why the others cannot, or
        None)."""
        from leanstream_ggml.model.sparse_files import sparse_modes

        return sparse_modes(self, model_dir)

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": self.format,
            "format_version": self.format_version,
            "source": {k: v for k, v in asdict(self.source).items() if k != "path" or v},
            "architecture": self.architecture,
            "n_layer": self.n_layer,
            "n_embd": self.n_embd,
            "n_ff": self.n_ff,
            "activation": self.activation,
            "block": asdict(self.block),
            "layers": [asdict(e) for e in self.layers],
            "totals": asdict(self.totals),
            "base": asdict(self.base),
            "predictor": None if self.predictor is None else self.predictor.to_dict(),
        }
        if self.sketch is not None:
            d["sketch"] = self.sketch.to_dict()
        if self.moe is not None:
            d["moe"] = self.moe.to_dict()
        if self.checksums:
            d["checksums"] = dict(self.checksums)
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
            predictor=None if d.get("predictor") is None else
            PredictorInfo.from_dict(d["predictor"], f"{where}: predictor"),
            sketch=None if d.get("sketch") is None else SketchInfo.from_dict(d["sketch"], f"{where}: sketch"),
            moe=None if d.get("moe") is None else MoEInfo.from_dict(d["moe"], f"{where}: moe"),
            checksums=d.get("checksums", {}),
            format=fmt,
            format_version=ver,
            extra={k: v for k, v in d.items() if k not in _KNOWN_KEYS},
        )
        if not isinstance(m.checksums, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in m.checksums.items()):
            raise ManifestError(f"{where}: checksums must map file names to strings")
        m.validate(where)
        return m

    # ---- checks --------------------------------------------------------------------------
    def _check_activation(self, bad) -> None:
        """The architecture is known and the activation is its own: a MoE model's experts'
        (moe_families), or a dense model's FFN's (ARCH_ACTIVATION)."""
        moe = self.moe is not None
        table = {a: f.activation for a, f in moe_families.FAMILIES.items()} if moe else ARCH_ACTIVATION
        known = moe_families.EXPERT_ACTIVATIONS if moe else ACTIVATIONS
        if self.activation not in known:
            bad(f"unknown activation {self.activation!r} (known: {', '.join(known)})")
        if self.architecture not in table:
            bad(f"unsupported architecture {self.architecture!r} (known: {', '.join(table)})")
        if self.activation != table[self.architecture] or (moe and self.moe.activation != self.activation):
            bad(f"activation {self.activation!r} does not match architecture {self.architecture!r}, whose FFN "
                f"uses {table[self.architecture]!r}")

    def validate(self, where: str = "manifest") -> None:
        """Internal consistency (no file access). Raises ManifestError."""
        def bad(msg: str) -> None:
            raise ManifestError(f"{where}: {msg}")

        for name in ("n_layer", "n_embd", "n_ff"):
            if getattr(self, name) <= 0:
                bad(f"{name} must be positive")
        self._check_activation(bad)
        k, align = self.block.k, self.block.align
        if k <= 0:
            bad("block.k must be positive")
        if align < MIN_ALIGN or align & (align - 1):
            bad(f"block.align {align} must be a power of two >= {MIN_ALIGN}")
        if self.moe is not None:
            self.moe.validate(self.n_layer, align, bad)
            for i, f in enumerate(self.moe.files):
                _check_rel(f, f"moe.layers[{i}].file", bad)
            if self.layers:
                bad("a mixture-of-experts model lists its experts (moe.files), not dense layers")
        elif len(self.layers) != self.n_layer:
            bad(f"{len(self.layers)} layer entries for n_layer={self.n_layer}")
        n_blocks = math.ceil(self.n_ff / k)
        for i, e in enumerate(self.layers):
            w = f"layers[{i}]"
            if e.il != i:
                bad(f"{w}.il is {e.il}, expected {i} (layers must be listed in order)")
            for t in (e.gate_type, e.up_type, e.down_type):
                if t not in GGML_TYPE_IDS:
                    bad(f"{w}: unknown ggml type name {t!r}")
            if e.down_type not in DOWN_COLUMN_TYPES:
                bad(f"{w}.down_type {e.down_type!r} must be one of {', '.join(DOWN_COLUMN_TYPES)}")
            if e.n_blocks != n_blocks:
                bad(f"{w}.n_blocks {e.n_blocks} != ceil(n_ff / k) = {n_blocks}")
            if e.block_stride % align or e.block_stride < e.block_payload or e.block_payload <= 0:
                bad(f"{w}: block_stride {e.block_stride} must be a multiple of align {align} "
                    f"and hold block_payload {e.block_payload}")
            if e.data_offset % HEADER_BYTES or e.data_offset < HEADER_BYTES + 4 * n_blocks * k:
                bad(f"{w}.data_offset {e.data_offset} must be a multiple of {HEADER_BYTES} past the perm table")
            if e.file_size != e.data_offset + e.n_blocks * e.block_stride:
                bad(f"{w}.file_size {e.file_size} != data_offset + n_blocks * block_stride")
            _check_rel(e.file, f"{w}.file", bad)
        _check_rel(self.base.file, "base.file", bad)
        if self.predictor is not None:
            files = self.predictor.files
            if len(files) != self.n_layer:
                bad(f"predictor.files must list one file per layer ({self.n_layer}), it lists {len(files)}")
            for i, f in enumerate(files):
                _check_rel(f, f"predictor.files[{i}]", bad)
            if len(set(files)) != len(files):
                bad("predictor.files names a file twice")
            for key in ("block_freq", "summary"):
                if getattr(self.predictor, key) is not None:
                    _check_rel(getattr(self.predictor, key), f"predictor.{key}", bad)
        if self.sketch is not None:
            files = self.sketch.files
            if len(files) != self.n_layer:
                bad(f"sketch.files must list one file per layer ({self.n_layer}), it lists {len(files)}")
            for i, f in enumerate(files):
                _check_rel(f, f"sketch.files[{i}]", bad)
            if len(set(files)) != len(files):
                bad("sketch.files names a file twice")
            if self.sketch.block_freq is not None:
                _check_rel(self.sketch.block_freq, "sketch.block_freq", bad)
            if self.sketch.block_importance is not None:
                _check_rel(self.sketch.block_importance, "sketch.block_importance", bad)
            if self.sketch.type not in SKETCH_TYPES:
                bad(f"sketch.type: unknown sketch row format {self.sketch.type!r} (known: {', '.join(SKETCH_TYPES)})")
        if self.controller_file() is not None:
            _check_rel(self.controller_file(), "controller.file", bad)
        if self.draft_vocab_file() is not None:
            _check_rel(self.draft_vocab_file(), "draft.vocab", bad)
        if not 0.0 <= self.totals.padding_waste < 1.0:
            bad(f"totals.padding_waste {self.totals.padding_waste} must be in [0, 1)")

    def check_files(self, model_dir: str | os.PathLike) -> None:
        """Every file the manifest names resolves to a regular file inside the model directory;
        block files and base.gguf have the sizes it records. Raises ManifestError."""
        for e in self.layers:
            check_size(self.resolve(model_dir, e.file), e.file_size)
        for _, e in self.moe.expert_layers() if self.moe else ():
            check_size(self.resolve(model_dir, e.file), e.file_size)
        check_size(self.resolve(model_dir, self.base.file), self.base.size)
        for rel in self.checksummed_files()[1:]:
            self.resolve(model_dir, rel)

    def check_checksums(self, model_dir: str | os.PathLike) -> None:
        """The CRC-32 of every file in ``checksummed_files`` equals the recorded one (reads them
        all: base.gguf is most of it). Raises ManifestError naming the file."""
        for rel in self.checksummed_files():
            want = self.checksums.get(rel)
            path = self.resolve(model_dir, rel)
            if want is None:
                raise ManifestError(f"{path}: the manifest records no checksum for it (converted by an older "
                                    f"leanstream-ggml?); re-run `leanstream convert` with --force")
            have = file_checksum(path)
            if have != want:
                raise ManifestError(f"{path}: corrupt (checksum {have}, the manifest records {want}); "
                                    f"re-run `leanstream convert` with --force to repair the model directory")

    def record_checksums(self, model_dir: str | os.PathLike) -> None:
        """Set ``checksums`` from the files as they are now."""
        self.checksums = {rel: file_checksum(self.resolve(model_dir, rel)) for rel in self.checksummed_files()}


_KNOWN_KEYS = {"format", "format_version", "source", "architecture", "n_layer", "n_embd", "n_ff",
               "activation", "block", "layers", "totals", "base", "predictor", "sketch", "moe", "checksums"}


def _check_rel(rel: Any, what: str, bad) -> None:
    if not isinstance(rel, str) or not rel or "\0" in rel or os.path.isabs(rel) or ".." in Path(rel).parts:
        bad(f"{what} {rel!r} must be a relative path inside the model directory")


def load(model_dir: str | os.PathLike, *, check_files: bool = True) -> Manifest:
    """Read and validate ``<model_dir>/manifest.json``; with check_files, also that every file
    it names is there with the recorded size."""
    d = Path(model_dir)
    path = d / MANIFEST_NAME
    if not d.is_dir():
        raise ManifestError(f"{d}: not a directory (expected a model directory from `leanstream convert`)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing — {d} is not a converted model, or its conversion did not "
                            f"finish (re-run `leanstream convert`)") from None
    except OSError as e:
        raise ManifestError(f"{path}: cannot open: {e.strerror} (check its permissions)") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ManifestError(f"{path}: not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise ManifestError(f"{path}: cannot read: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path}: larger than {MAX_MANIFEST_BYTES} bytes; not a manifest")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        raw = json.loads(text)
    except ValueError as e:   # JSONDecodeError, or an integer too long to convert
        raise ManifestError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ManifestError(f"{path}: JSON nested too deeply; not a manifest") from None
    m = Manifest.from_dict(raw, where=str(path))
    if check_files:
        m.check_files(d)
    return m
