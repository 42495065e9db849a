"""leanstream_ggml.model.manifest: the model directory contract (parsing, validation, errors)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from leanstream_convert.convert_gguf import save_manifest
from leanstream_ggml.model import manifest as mf


def layer(il: int, n_blocks: int = 96, stride: int = 512) -> dict:
    data_offset = 8192
    return {"il": il, "file": f"ffn/blk.{il}.bin", "gate_type": "q4_0", "up_type": "q4_K", "down_type": "q8_0",
            "n_blocks": n_blocks, "block_stride": stride, "block_payload": 18 + 144 + 68,
            "data_offset": data_offset, "file_size": data_offset + n_blocks * stride}


def valid_dict() -> dict:
    return {
        "format": "leanstream-model", "format_version": 1,
        "source": {"filename": "m.gguf", "sha256": "ab" * 32, "size": 12345},
        "architecture": "llama", "n_layer": 2, "n_embd": 64, "n_ff": 96, "activation": "silu",
        "block": {"k": 1, "align": 512},
        "layers": [layer(0), layer(1)],
        "totals": {"ffn_bytes_source": 1000, "ffn_bytes_on_disk": 2 * (8192 + 96 * 512),
                   "padding_bytes": 2 * 96 * (512 - 230), "padding_waste": (512 - 230) / 512},
        "base": {"file": "base.gguf", "size": 100},
        "predictor": None,
    }


def make_dir(tmp_path, d: dict | None = None):
    d = valid_dict() if d is None else d
    (tmp_path / "ffn").mkdir(exist_ok=True)
    for e in d["layers"]:
        with open(tmp_path / e["file"], "wb") as f:
            f.truncate(e["file_size"])
    with open(tmp_path / d["base"]["file"], "wb") as f:
        f.truncate(d["base"]["size"])
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    return tmp_path


def test_load_valid(tmp_path):
    m = mf.load(make_dir(tmp_path))
    assert m.n_layer == 2 and m.block.k == 1 and m.layers[1].il == 1 and m.predictor is None
    assert m.layer_path(tmp_path, 1) == tmp_path / "ffn" / "blk.1.bin"
    assert m.base_path(tmp_path) == tmp_path / "base.gguf"
    assert mf.GGML_TYPE_IDS[m.layers[0].up_type] == 12


def test_json_round_trip_keeps_unknown_keys(tmp_path):
    d = valid_dict()
    d["predictor"] = {"files": ["predictor/blk.0.lspred", "predictor/blk.1.lspred"], "version": 2, "bytes": 10,
                      "block_freq": None, "summary": None, "config": {"tau": 6}, "format": "lspred"}
    d["controller"] = {"lut": "controller/lut.bin"}         # written by a later stage
    m = mf.Manifest.from_dict(d)
    assert m.extra == {"controller": {"lut": "controller/lut.bin"}}
    again = json.loads(m.to_json())
    assert again == d
    make_dir(tmp_path, d)
    (tmp_path / "predictor").mkdir()
    for f in d["predictor"]["files"]:
        (tmp_path / f).write_bytes(b"p")
    save_manifest(m, tmp_path)                               # records the files' checksums
    assert set(m.checksums) == {"base.gguf", *d["predictor"]["files"]}
    assert mf.load(tmp_path, check_files=False) == m
    assert not list(tmp_path.glob("*.partial"))


def mutate(path: str, value):
    d = valid_dict()
    *keys, last = path.split(".")
    node = d
    for k in keys:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return d


@pytest.mark.parametrize("path,value,message", [
    ("format", "gguf", "not a LeanStream model manifest"),
    ("format_version", 2, "newer than this leanstream-ggml"),
    ("format_version", 0, "no longer supported"),
    ("format_version", "1", "not an integer"),
    ("n_embd", KeyError, "missing field 'n_embd'"),
    ("n_ff", 96.0, "'n_ff' should be int"),
    ("n_layer", True, "'n_layer' should be int"),
    ("activation", "relu", "unknown activation"),
    ("block.align", 1000, "power of two"),
    ("block.k", 0, "block.k must be positive"),
    ("source.sha256", KeyError, "source: missing field 'sha256'"),
    ("layers.1.il", 0, "expected 1"),
    ("layers.0.n_blocks", 95, "ceil"),
    ("layers.0.gate_type", "q4_X", "unknown ggml type"),
    ("layers.0.down_type", "q4_0", "down_type"),
    ("layers.0.block_stride", 500, "multiple of align"),
    ("layers.0.data_offset", 4096 + 1, "multiple of 4096"),
    ("layers.0.file_size", 1, "file_size"),
    ("layers.0.file", "/etc/passwd", "relative path"),
    ("base.file", "../x.gguf", "relative path"),
    ("totals.padding_waste", 1.5, "padding_waste"),
    ("predictor", [1], "predictor: expected an object"),
    ("predictor", {"files": ["predictor/blk.0.lspred"], "version": 2, "bytes": 1}, "one file per layer \\(2\\), it lists 1"),
    ("predictor", {"files": ["/tmp/a", "b"], "version": 2, "bytes": 1}, "relative path"),
    ("predictor", {"files": ["a", "b"], "version": 2, "bytes": 1, "block_freq": "../f.npy"}, "relative path"),
    ("predictor", {"files": ["a", "b"], "version": "2", "bytes": 1}, "'version' should be int"),
    ("n_layer", 3, "3"),
])
def test_invalid(path, value, message):
    with pytest.raises(mf.ManifestError, match=message):
        mf.Manifest.from_dict(mutate(path, value), where="m.json")


def test_not_an_object():
    with pytest.raises(mf.ManifestError, match="JSON object"):
        mf.Manifest.from_dict([1, 2])


def test_directory_errors(tmp_path):
    with pytest.raises(mf.ManifestError, match="not a directory"):
        mf.load(tmp_path / "nope")
    with pytest.raises(mf.ManifestError, match="did not finish"):
        mf.load(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(mf.ManifestError, match="not valid JSON"):
        mf.load(tmp_path)


def test_file_checks(tmp_path):
    make_dir(tmp_path)
    with open(tmp_path / "ffn" / "blk.1.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(mf.ManifestError, match="blk.1.bin: 100 bytes"):
        mf.load(tmp_path)
    mf.load(tmp_path, check_files=False)
    make_dir(tmp_path)
    mf.load(tmp_path)
    (tmp_path / "base.gguf").unlink()
    with pytest.raises(mf.ManifestError, match="base.gguf: missing"):
        mf.load(tmp_path)


def test_save_validates(tmp_path):
    m = mf.Manifest.from_dict(valid_dict())
    bad = copy.deepcopy(m)
    bad.layers[0].n_blocks = 3
    with pytest.raises(mf.ManifestError):
        save_manifest(bad, tmp_path)
    assert not (tmp_path / "manifest.json").exists()


def test_import_is_light():
    code = ("import sys, leanstream_ggml.model.manifest; "
            "bad = [m for m in ('gguf', 'numpy', 'torch', 'sklearn') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_type_names_are_ggmls_own():
    """The manifest's type table names each enum ggml_type as the ggml in use does
    (ggml_type_name), and misses no type whose rows ggml's CPU backend dots."""
    from leanstream_ggml.native import capi
    from leanstream_ggml.llamacpp import ggml_ctypes

    name = ggml_ctypes.base().ggml_type_name
    for n, t in mf.GGML_TYPE_IDS.items():
        assert name(t).decode() == n
    dotted = [t for t in range(max(mf.GGML_TYPE_IDS.values()) + 1) if capi.lib.ls_ggml_type_dots(t)]
    assert {"q3_K", "q2_K", "bf16", "iq4_xs", "iq2_xxs"} <= {mf.GGML_TYPE_NAMES[t] for t in dotted}
