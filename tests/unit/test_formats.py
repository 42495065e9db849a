"""The binary formats' constants, written once in leanstream_ggml/model/formats.py, are the ones the
engine's readers check (native/include/leanstream.h, native/src/) and the ones the converter
writes and the runtime reads with (no second definition)."""

from __future__ import annotations

import re
from pathlib import Path

from leanstream_ggml.model import blockfile, formats

ROOT = Path(__file__).resolve().parents[2]


def _defines(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^#define (\w+) (\S+)", path.read_text(), re.M))


def test_formats_match_the_native_readers():
    h = _defines(ROOT / "native" / "include" / "leanstream.h")
    assert int(h["LS_BLOCK_FILE_VERSION"]) == formats.BLOCK_VERSION
    assert int(h["LS_SKETCH_LS2"]) == formats.SKETCH_LS2
    assert int(h["LS_PREDICTOR_FILE_VERSION"]) == formats.PREDICTOR_VERSION
    pr = _defines(ROOT / "native" / "src" / "predictor.c")
    assert int(pr["PRED_HEADER_SIZE"]) == formats.PREDICTOR_HEADER_BYTES
    sk = _defines(ROOT / "native" / "src" / "sketch.c")
    assert sk["SKETCH_MAGIC"] == '"' + formats.SKETCH_MAGIC.decode() + '"'
    assert int(sk["SKETCH_HEADER"]) == formats.HEADER_BYTES
    assert b'"' + formats.BLOCK_MAGIC + b'"' in (ROOT / "native" / "src" / "blockfile.c").read_bytes()


def test_the_converter_and_the_runtime_share_one_definition():
    from leanstream_convert import blockfile as conv_blockfile
    from leanstream_convert import sketch

    assert sketch.HEADER_BYTES is formats.HEADER_BYTES and sketch.MAGIC is formats.SKETCH_MAGIC
    assert sketch.VERSION is formats.SKETCH_VERSION and sketch.LS2 is formats.SKETCH_LS2
    assert conv_blockfile.MAGIC is blockfile.MAGIC is formats.BLOCK_MAGIC
    assert blockfile.PERM_OFFSET == blockfile.HEADER_BYTES == formats.HEADER_BYTES
    from leanstream_convert.train import export

    assert export.MAGIC is formats.PREDICTOR_MAGIC and export.FILE_VERSION is formats.PREDICTOR_VERSION
    assert export.HEADER_SIZE is formats.PREDICTOR_HEADER_BYTES
    # a literal of these values anywhere else in the Python sources is a second definition
    defined = re.compile(r"^\s*(HEADER_BYTES|MAGIC|VERSION|LS2|PERM_OFFSET)\s*=\s*(4096|b\"LS|\d)", re.M)
    hits = [str(p.relative_to(ROOT)) for d in ("leanstream_ggml", "leanstream_convert") for p in sorted((ROOT / d).rglob("*.py"))
            if p.name != "formats.py" and defined.search(p.read_text())]
    assert not hits, f"format constants defined outside leanstream_ggml/model/formats.py: {hits}"
