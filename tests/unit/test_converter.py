"""The converter: GGUF -> base.gguf + ffn/blk.<il>.bin + manifest.json.

The oracle is gguf-py's dequantization of the source: matrices rebuilt from the block files must
equal it (gate/up exactly; down within the Q8_0 bound, exactly for F16/F32 sources).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf_synth import write_tiny_model

import leanstream_convert
from leanstream_convert import blockfile, stages
from leanstream_convert import convert_gguf as cg
from leanstream_convert import ConvertError, convert
from leanstream_ggml.model import manifest as mf
from leanstream_ggml.model.checksum import crc32c

# (arch, n_embd, n_ff, types): every supported gate/up type and several ffn_down source types
CASES = {
    "llama-q4_0-q4_1-q5_0": ("llama", 64, 96, {"gate": "Q4_0", "up": "Q4_1", "down": "Q5_0"}),
    "qwen2-kquants": ("qwen2", 256, 512, {"gate": "Q4_K", "up": "Q5_K", "down": "Q6_K"}),
    "llama-q6k-q8_0-q4k": ("llama", 256, 256, {"gate": "Q6_K", "up": "Q8_0", "down": "Q4_K"}),
    "llama-f16": ("llama", 64, 96, {"ffn": "F16"}),
    "llama-f32": ("llama", 64, 96, {"ffn": "F32"}),
    "qwen2-mixed-down": ("qwen2", 64, 96, {"gate": "Q8_0", "up": "Q4_0", "down": ["Q8_0", "Q4_1"]}),
}


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    out = {}
    for name, (arch, ne, nf, types) in CASES.items():
        p = d / f"{name}.gguf"
        write_tiny_model(p, arch=arch, n_layer=2, n_embd=ne, n_ff=nf, types=types, seed=1)
        out[name] = p
    return out


# ---- the oracle: rebuild the FFN matrices from a block file ----------------------------------

def rebuild_layer(path):
    """(header, perm, gate [n_ff, n_embd], up [n_ff, n_embd], down^T [n_ff, n_embd]) as f32,
    each neuron's row placed at its id; also the raw block region [n_blocks, block_stride]."""
    h = blockfile.read_header(path)
    perm = blockfile.read_perm(path, h)
    raw = np.fromfile(path, dtype=np.uint8, offset=h.data_offset).reshape(h.n_blocks, h.block_stride)
    k, g, u, d = h.k, h.gate_row_bytes, h.up_row_bytes, h.down_col_bytes
    slots = raw[:, : h.block_payload]
    gate_b = slots[:, : k * g].reshape(-1, g)
    up_b = slots[:, k * g: k * (g + u)].reshape(-1, u)
    down_b = slots[:, k * (g + u):].reshape(-1, d)
    mats = []
    for rows, t in ((gate_b, h.gate_type), (up_b, h.up_type), (down_b, h.down_type)):
        vals = gguf.quants.dequantize(np.ascontiguousarray(rows), T(t)).reshape(len(rows), h.n_embd)
        m = np.zeros((h.n_ff, h.n_embd), np.float32)
        m[perm[perm >= 0]] = vals[perm >= 0]
        mats.append(m)
    return h, perm, mats[0], mats[1], mats[2], raw


def source_matrices(reader, il):
    t = {x.name: x for x in reader.tensors}
    deq = lambda name: gguf.quants.dequantize(t[name].data, t[name].tensor_type)  # noqa: E731
    return (deq(f"blk.{il}.ffn_gate.weight"), deq(f"blk.{il}.ffn_up.weight"),
            deq(f"blk.{il}.ffn_down.weight"), t[f"blk.{il}.ffn_down.weight"].tensor_type)


def q8_0_bound(cols):
    """Per-value error bound of Q8_0 on each 32-value block of the columns [n_ff, n_embd]:
    d = max|block| / 127 and q = round(x / d) give |x - d q| <= d / 2; the scale is stored as
    f16 (relative rounding <= 2^-11), adding <= 127 * d * 2^-11 ~ 0.062 d. So
    |err| <= max|block| / 127 * (0.5 + 127 * 2^-11) (times 1 + 1e-5 for f32 arithmetic)."""
    blocks = np.abs(cols).reshape(cols.shape[0], -1, 32).max(axis=2, keepdims=True)
    bound = blocks / 127 * (0.5 + 127 * 2.0**-11) * (1 + 1e-5) + 1e-12
    return np.broadcast_to(bound, blocks.shape[:2] + (32,)).reshape(cols.shape)


# ---- round trip ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_round_trip(models, tmp_path, case):
    src = models[case]
    before = sha256(src)
    m = convert(src, tmp_path / "out", progress=False, sketch="none")
    assert sha256(src) == before, "the source must never be modified"
    reader = gguf.GGUFReader(src)
    for il in range(m.n_layer):
        h, perm, gate, up, down_t, _ = rebuild_layer(tmp_path / "out" / m.layers[il].file)
        g_ref, u_ref, d_ref, d_src_type = source_matrices(reader, il)
        np.testing.assert_array_equal(gate, g_ref)
        np.testing.assert_array_equal(up, u_ref)
        cols = np.ascontiguousarray(d_ref.T)                 # [n_ff, n_embd]: column i = neuron i
        # the default ("auto"): Q6_K columns where every source ffn_down has at most Q6_K's bits
        # and n_embd is a multiple of 256, else Q8_0
        auto = cg.resolve_down_type("auto", {source_matrices(reader, j)[3] for j in range(m.n_layer)},
                                              h.n_embd)
        if d_src_type in (T.F16, T.F32):
            assert h.down_type == d_src_type
            np.testing.assert_array_equal(down_t, cols)
        elif auto == "q8_0":
            assert h.down_type == T.Q8_0
            err = np.abs(down_t - cols)
            bound = q8_0_bound(cols)
            assert (err <= bound).all(), f"max excess {(err - bound).max()}"
            # and the added error is far below the values themselves
            assert err.max() <= np.abs(cols).max() / 127
        else:
            assert h.down_type == T.Q6_K
            err = np.abs(down_t - cols)
            assert (err <= np.abs(cols).max(axis=1, keepdims=True) / 32).all()
        assert m.layers[il].down_type == {T.F16: "f16", T.F32: "f32"}.get(d_src_type, auto[:-1] + auto[-1].upper()
                                                                          if auto == "q6_k" else "q8_0")


def test_auto_down_type():
    """"auto" takes Q6_K columns only where the source's ffn_down has at most Q6_K's bits in every
    layer and n_embd is a multiple of 256."""
    r = cg.resolve_down_type
    assert r("auto", {T.Q6_K}, 1536) == r("auto", {T.Q4_K, T.Q6_K}, 256) == r("auto", {T.Q4_0}, 512) == "q6_k"
    assert r("auto", {T.Q6_K}, 576) == "q8_0"                 # SmolLM2's n_embd
    assert r("auto", {T.Q8_0}, 1536) == r("auto", {T.Q8_0, T.Q4_1}, 1536) == "q8_0"
    assert r("auto", {T.F16}, 1536) == r("auto", {T.BF16}, 1536) == "q8_0"
    assert r("q5_k", {T.Q8_0}, 1536) == "q5_k" and r("q8_0", {T.Q4_K}, 1536) == "q8_0"


def test_header_fields(models, tmp_path):
    src = models["qwen2-kquants"]
    m = convert(src, tmp_path / "out", k=2, align=4096, progress=False, sketch="none", down_type="q8_0")
    reader = gguf.GGUFReader(src)
    tensors = {t.name: t for t in reader.tensors}
    for il, e in enumerate(m.layers):
        path = tmp_path / "out" / e.file
        buf = path.read_bytes()
        h = blockfile.BlockHeader.unpack(buf)
        assert buf[:8] == b"LSBLOCKS" and struct.unpack_from("<I", buf, 8)[0] == 2
        assert (h.il, h.n_embd, h.n_ff, h.k) == (il, 256, 512, 2)
        assert h.n_blocks == 256 == e.n_blocks
        assert h.gate_type == T.Q4_K and h.up_type == T.Q5_K and h.down_type == T.Q8_0
        assert h.gate_row_bytes == tensors[f"blk.{il}.ffn_gate.weight"].data.shape[1] == 144
        assert h.up_row_bytes == 176 and h.down_col_bytes == 256 // 32 * 34
        assert h.align == 4096 and h.block_stride % 4096 == 0 and h.block_stride >= h.block_payload
        assert h.block_stride == blockfile.round_up(2 * (144 + 176 + 272), 4096) == e.block_stride
        assert h.perm_offset == 4096 and h.data_offset % 4096 == 0
        assert h.crc_offset == 4096 + 4 * h.n_blocks * h.k
        assert h.data_offset >= h.crc_offset + 4 * h.n_blocks and h.data_offset == e.data_offset
        assert h.file_size == len(buf) == e.file_size == h.data_offset + h.n_blocks * h.block_stride
        assert not any(buf[124:4096]), "header tail must be zero"
        assert not any(buf[h.crc_offset + 4 * h.n_blocks: h.data_offset]), "table tail must be zero"
        raw = np.frombuffer(buf, np.uint8, offset=h.data_offset).reshape(h.n_blocks, h.block_stride)
        assert not raw[:, h.block_payload:].any(), "block padding must be zero"
        # checksums: one CRC-32C per block (padding included), and one of [0, data_offset)
        crcs = np.frombuffer(buf, "<u4", count=h.n_blocks, offset=h.crc_offset)
        for b in (0, h.n_blocks // 2, h.n_blocks - 1):
            assert crcs[b] == crc32c(raw[b].tobytes())
        meta = bytearray(buf[:h.data_offset])
        meta[120:124] = bytes(4)
        assert h.meta_crc == crc32c(meta)
        # manifest type names are ggml's and map back to the header's enum values
        assert mf.GGML_TYPE_IDS[e.gate_type] == h.gate_type and mf.GGML_TYPE_IDS[e.down_type] == h.down_type


def test_permutation_k3_with_padding(tmp_path):
    src = tmp_path / "m.gguf"
    write_tiny_model(src, n_layer=2, n_embd=64, n_ff=128, types={"ffn": "Q4_0"}, seed=3)
    rng = np.random.default_rng(0)
    perms = {il: rng.permutation(128) for il in range(2)}
    m = convert(src, tmp_path / "out", k=3, permutation=perms, progress=False, sketch="none")
    reader = gguf.GGUFReader(src)
    tensors = {t.name: t for t in reader.tensors}
    assert m.layers[0].n_blocks == 43                        # ceil(128 / 3): one padding slot
    for il in range(2):
        path = tmp_path / "out" / m.layers[il].file
        h, perm, gate, up, down_t, raw = rebuild_layer(path)
        np.testing.assert_array_equal(perm[:128], perms[il])
        assert perm[128:].tolist() == [-1]
        g_src = tensors[f"blk.{il}.ffn_gate.weight"].data     # uint8 [n_ff, row_bytes]
        u_src = tensors[f"blk.{il}.ffn_up.weight"].data
        # slot j of block b holds the bytes of neuron perm[b*k+j], verbatim
        for b in (0, 17, 42):
            gb, ub, db = blockfile.read_block(path, h, b)
            for j in range(3):
                n = perm[b * 3 + j]
                if n < 0:
                    assert not gb[j].any() and not ub[j].any() and not db[j].any(), "padding slot not zero"
                else:
                    np.testing.assert_array_equal(gb[j], g_src[n])
                    np.testing.assert_array_equal(ub[j], u_src[n])
        g_ref, u_ref, d_ref, _ = source_matrices(reader, il)
        np.testing.assert_array_equal(gate, g_ref)
        cols = np.ascontiguousarray(d_ref.T)
        assert (np.abs(down_t - cols) <= q8_0_bound(cols)).all()


def test_bad_permutation(models, tmp_path):
    with pytest.raises(ConvertError, match="not a permutation"):
        convert(models["llama-f16"], tmp_path / "o", permutation=[0] * 96, progress=False, sketch="none")


# ---- base.gguf ---------------------------------------------------------------------------------

def test_base_gguf(tmp_path):
    src = tmp_path / "m.gguf"
    write_tiny_model(src, arch="qwen2", n_layer=2, types={"ffn": "Q8_0"}, alignment=64, seed=5)
    m = convert(src, tmp_path / "out", progress=False, sketch="none")
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(tmp_path / "out" / "base.gguf")
    assert b.alignment == a.alignment == 64
    assert b.data_offset % 64 == 0 and all(t.data_offset % 64 == 0 for t in b.tensors)
    bt = {t.name: t for t in b.tensors}
    assert not [n for n in bt if "ffn_gate." in n or "ffn_up." in n or "ffn_down." in n]
    kept = [t for t in a.tensors if not any(r in t.name for r in ("ffn_gate.", "ffn_up.", "ffn_down."))]
    assert sorted(bt) == sorted(t.name for t in kept) and any("ffn_norm" in n for n in bt)
    for t in kept:
        u = bt[t.name]
        assert u.tensor_type == t.tensor_type and list(u.shape) == list(t.shape)
        assert bytes(u.data) == bytes(t.data), t.name
    for name, f in a.fields.items():              # every KV pair, byte for byte (arrays included)
        if name.startswith("GGUF."):
            continue
        g = b.fields[name]
        assert b"".join(bytes(p) for p in g.parts) == b"".join(bytes(p) for p in f.parts), name
    assert len(b.fields["tokenizer.ggml.tokens"].data) == len(a.fields["tokenizer.ggml.tokens"].data)
    ext = b.fields["leanstream.ffn_external"]
    assert ext.types == [gguf.GGUFValueType.BOOL] and ext.contents() is True
    ver = b.fields["leanstream.format_version"]
    assert ver.types == [gguf.GGUFValueType.UINT32] and ver.contents() == 1
    assert b.fields["leanstream.source_sha256"].contents() == sha256(src) == m.source.sha256
    assert m.base.size == (tmp_path / "out" / "base.gguf").stat().st_size


# ---- restartability ------------------------------------------------------------------------------

def test_interrupted_then_resumed(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    write_tiny_model(src, n_layer=4, seed=7)
    out = tmp_path / "out"
    real = cg._write_layer
    written = []

    def crash_after_layer_1(path, h, slots, blocks):
        if h.il == 2:
            raise KeyboardInterrupt("simulated interruption")
        real(path, h, slots, blocks)
        written.append(h.il)

    monkeypatch.setattr(cg, "_write_layer", crash_after_layer_1)
    with pytest.raises(KeyboardInterrupt):
        convert(src, out, k=2, progress=False, sketch="none")
    assert written == [0, 1]
    assert not (out / "manifest.json").exists(), "manifest must be written last"
    assert (out / ".convert" / "state.json").exists() and (out / "base.gguf").exists()
    with pytest.raises(mf.ManifestError, match="did not finish|not a converted"):
        mf.load(out)
    done = {il: os.stat(out / f"ffn/blk.{il}.bin").st_ino for il in (0, 1)}
    (out / "ffn" / "blk.2.bin.partial").write_bytes(b"half a file")   # a write cut short

    # a different parameter set must not resume into it
    with pytest.raises(ConvertError, match="other parameters"):
        convert(src, out, k=3, progress=False, sketch="none")

    written.clear()
    monkeypatch.setattr(cg, "_write_layer", lambda *a: (real(*a), written.append(a[1].il)))
    m = convert(src, out, k=2, progress=False, sketch="none")
    assert written == [2, 3], "finished layers must be skipped"
    assert {il: os.stat(out / f"ffn/blk.{il}.bin").st_ino for il in (0, 1)} == done
    assert not (out / ".convert").exists()
    assert not list(out.rglob("*.partial"))
    assert mf.load(out) == m
    # a complete directory is refused without force, rewritten with it
    with pytest.raises(ConvertError, match="already holds a converted model"):
        convert(src, out, k=2, progress=False, sketch="none")
    written.clear()
    convert(src, out, k=2, force=True, progress=False, sketch="none")
    assert written == [0, 1, 2, 3]


def test_resume_rewrites_a_corrupt_layer(models, tmp_path, monkeypatch):
    src, out = models["llama-f16"], tmp_path / "out"
    convert(src, out, progress=False, sketch="none")
    (out / "manifest.json").unlink()
    (out / ".convert").mkdir()
    (out / ".convert" / "state.json").write_text(json.dumps({
        "source_sha256": sha256(src), "source_size": src.stat().st_size, "k": 1,
        "align": leanstream_convert.device_align(out), "permutation_sha256": hashlib.sha256(
            b"".join(np.arange(96, dtype=np.int32).tobytes() for _ in range(2))).hexdigest(),
        "block_file_version": blockfile.VERSION,
        "activations": {"tokens": stages.MAX_TOKENS, "calibration": stages._corpus_id(None)}}))
    with open(out / "ffn" / "blk.1.bin", "r+b") as f:
        f.truncate(5000)
    written = []
    real = cg._write_layer
    monkeypatch.setattr(cg, "_write_layer", lambda *a: (real(*a), written.append(a[1].il)))
    m = convert(src, out, progress=False, sketch="none")
    assert written == [1]
    mf.load(out)
    assert m.layers[1].file_size == (out / "ffn/blk.1.bin").stat().st_size


def test_non_empty_dir(models, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConvertError, match="not empty"):
        convert(models["llama-f16"], out, progress=False, sketch="none")
    convert(models["llama-f16"], out, force=True, progress=False, sketch="none")
    assert (out / "notes.txt").read_text() == "mine", "--force only replaces the converter's own files"
    mf.load(out)


# ---- malformed input -----------------------------------------------------------------------------

def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_text("hello, I am not a model\n")
    with pytest.raises(ConvertError, match="not a GGUF"):
        convert(p, tmp_path / "o", progress=False, sketch="none")
    p.write_bytes(b"")
    with pytest.raises(ConvertError, match="not a GGUF"):
        convert(p, tmp_path / "o", progress=False, sketch="none")
    with pytest.raises(ConvertError, match="no such file"):
        convert(tmp_path / "missing.gguf", tmp_path / "o", progress=False, sketch="none")


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.02, 30])
def test_truncated(models, tmp_path, keep):
    src = models["llama-q4_0-q4_1-q5_0"]
    data = src.read_bytes()
    p = tmp_path / "t.gguf"
    p.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(ConvertError, match="truncated"):
        convert(p, tmp_path / "o", progress=False, sketch="none")
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_moe_refused(tmp_path):
    """A mixture-of-experts family whose experts the op does not compute (nemotron_h_moe: ungated
    ReLU² experts) is refused; the supported ones are tests/unit/test_moe_convert.py's and
    tests/e2e/test_moe_families.py's."""
    from moe_hybrids import write_hybrid

    p = tmp_path / "moe.gguf"
    write_hybrid(p, "nemotron_h_moe")
    with pytest.raises(ConvertError, match="mixture-of-experts model .nemotron_h_moe.: its experts compute ungated"):
        convert(p, tmp_path / "o", progress=False, sketch="none")


def test_non_gated_refused(tmp_path):
    p = tmp_path / "ng.gguf"
    write_tiny_model(p, gated=False)
    with pytest.raises(ConvertError, match="non-gated"):
        convert(p, tmp_path / "o", progress=False, sketch="none")


def test_unsupported_arch(tmp_path):
    p = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(p, "gpt2")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((64, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConvertError, match="unsupported architecture 'gpt2'"):
        convert(p, tmp_path / "o", progress=False, sketch="none")


def test_a_type_ggml_cannot_dequantize_is_refused_by_name(tmp_path):
    """Every type ggml's CPU backend dots and dequantizes converts (tests/e2e/test_quant_types.py);
    one it does neither for (I32 gate rows, written over an F32 gate's type field) is refused, naming it."""
    p = tmp_path / "i32.gguf"
    write_tiny_model(p, types={"gate": "F32", "up": "Q4_0", "down": "Q4_0"})
    data = bytearray(p.read_bytes())
    name = b"blk.0.ffn_gate.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8          # past n_dims (u32) and two dims (u64)
    assert int.from_bytes(data[at:at + 4], "little") == int(gguf.GGMLQuantizationType.F32)
    data[at:at + 4] = int(gguf.GGMLQuantizationType.I32).to_bytes(4, "little")
    p.write_bytes(bytes(data))
    with pytest.raises(ConvertError, match="blk.0.ffn_gate.weight is I32, which cannot be converted: ggml cannot dequantize it"):
        convert(p, tmp_path / "o", progress=False, sketch="none")


def test_missing_ffn_tensors(models, tmp_path):
    convert(models["llama-f16"], tmp_path / "a", progress=False, sketch="none")
    with pytest.raises(ConvertError, match="missing FFN tensors"):
        convert(tmp_path / "a" / "base.gguf", tmp_path / "b", progress=False, sketch="none")


def test_bad_k_and_align(models, tmp_path):
    with pytest.raises(ConvertError, match="k"):
        convert(models["llama-f16"], tmp_path / "o", k=0, progress=False, sketch="none")
    with pytest.raises(ConvertError, match="power of two"):
        convert(models["llama-f16"], tmp_path / "o", align=1000, progress=False, sketch="none")


def test_device_align(tmp_path):
    a = leanstream_convert.device_align(tmp_path / "not" / "yet" / "there")
    assert a >= 512 and a & (a - 1) == 0


# ---- CLI -------------------------------------------------------------------------------------------

def run_cli(*argv):
    """`leanstream convert` (the converter's) or `leanstream info` (the runtime's) in this process."""
    from leanstream_convert import cli
    from leanstream_ggml.commands import info

    ap = argparse.ArgumentParser(prog="leanstream")
    sub = ap.add_subparsers()
    cli.register(sub)
    info.register(sub)
    args = ap.parse_args(argv)
    return args.func(args)


def test_cli(models, tmp_path, capsys):
    out = tmp_path / "out.lsm"
    assert run_cli("convert", str(models["llama-f16"]), str(out), "--k", "2", "--quiet", "--predictors", "none") == 0
    assert "padding waste" in capsys.readouterr().out
    assert mf.load(out).block.k == 2 and mf.load(out).predictor is None
    assert run_cli("convert", str(models["llama-f16"]), str(out), "--quiet") == 1
    err = capsys.readouterr().err
    assert "--force" in err and "Traceback" not in err
    assert run_cli("info", str(out)) == 0
    text = capsys.readouterr().out
    assert "n_embd 64" in text and "f16" in text and sha256(models["llama-f16"]) in text
    bad = tmp_path / "bad.gguf"
    bad.write_text("nope")
    assert run_cli("convert", str(bad), str(tmp_path / "x"), "--quiet") == 1
    assert "not a GGUF" in capsys.readouterr().err
    assert run_cli("info", str(tmp_path / "x")) == 1
    # default output directory: next to the source
    assert run_cli("convert", str(models["llama-f32"]), "--quiet", "--predictors", "none") == 0
    assert (models["llama-f32"].parent / "llama-f32.lsm" / "manifest.json").exists()


# ---- llama.cpp loads what we write ---------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llama_cpp_loads_source_and_base(tmp_path, arch):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed")
    from leanstream_ggml.llamacpp import _llama_cpp

    if not _llama_cpp.has_ffn_builder():
        pytest.skip("llama-cpp-python is not the patched build (python -m leanstream_ggml.build)")
    src = tmp_path / "m.gguf"
    write_tiny_model(src, arch=arch, n_embd=256, n_ff=256, types={"gate": "Q4_K", "up": "Q8_0", "down": "Q6_K"})
    convert(src, tmp_path / "out", progress=False, sketch="none")
    for path in (src, tmp_path / "out" / "base.gguf"):
        llm = llama_cpp.Llama(str(path), n_ctx=32, n_threads=1, verbose=False)
        try:
            toks = llm.tokenize(b"the cat", add_bos=False)
            assert 0 < len(toks) <= 7 and llm.n_vocab() == 267
            llm.eval(toks)
            assert np.isfinite(llm.scores[len(toks) - 1]).all()
        finally:
            llm.close()


# ---- the real model ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2(tmp_path):
    from leanstream_ggml.model import registry

    src = registry.fetch("smollm2-135m-instruct", progress=False)
    m = convert(src, tmp_path / "smol.lsm", progress=False, sketch="none")
    assert (m.architecture, m.n_layer, m.n_embd, m.n_ff) == ("llama", 30, 576, 1536)
    assert m.source.sha256 == registry.SMOLLM2.sha256
    assert {(e.gate_type, e.up_type, e.down_type) for e in m.layers} == {("q4_1", "q4_1", "q8_0")}
    assert m.totals.ffn_bytes_source == 30 * 3 * 1536 * 576 // 32 * 20
    assert 0 <= m.totals.padding_waste < 0.25
    assert mf.load(tmp_path / "smol.lsm") == m
    reader = gguf.GGUFReader(src)
    for il in (0, 29):
        _, _, gate, up, down_t, _ = rebuild_layer(tmp_path / "smol.lsm" / m.layers[il].file)
        g_ref, u_ref, d_ref, _ = source_matrices(reader, il)
        np.testing.assert_array_equal(gate, g_ref)
        np.testing.assert_array_equal(up, u_ref)
        cols = np.ascontiguousarray(d_ref.T)
        assert (np.abs(down_t - cols) <= q8_0_bound(cols)).all()


def test_cli_convert_trains_predictors(models, tmp_path, capsys):
    """convert profiles the source and trains one predictor per layer (quick setting), records
    them in the manifest, and the runtime loads them for a sparse mode; grouped blocks (k=2)
    reach the predictor as blocks."""
    pytest.importorskip("torch", reason="predictor training needs the convert extra")
    out = tmp_path / "pred.lsm"
    assert run_cli("convert", str(models["llama-f16"]), str(out), "--k", "2", "--quiet", "--predictors", "quick") == 0
    m = mf.load(out)
    assert m.predictor and len(m.predictor.files) == m.n_layer
    assert all((out / f).exists() for f in m.predictor.files)
    from leanstream_ggml import Llama

    # a budget below the whole FFN: with everything resident for good nothing is prefetched
    # (and the predictors do not run)
    budget = int(0.8 * m.totals.ffn_bytes_on_disk) + m.predictor.bytes + m.sketch.bytes
    llm = Llama(str(out), mode="leanstream", sparsity=0.5, memory_budget=budget, n_ctx=64, verbose=False)
    try:
        llm("hello", max_tokens=4, temperature=0.0)
        st = llm.stats()
        assert st["predictor_ns"] > 0
        # with the sketch (written by default), the predictors only speculate: the next layer's
        # prefetch, whose recall of the final selection is counted
        assert m.sketch and st["blocks_candidates"] > 0 and st["spec_selected"] > 0
        assert 0.0 <= st["spec_recall"] <= 1.0
    finally:
        llm.close()
    # powerinfer2: calibration frequencies recorded; the most frequent blocks are pinned
    assert (out / m.predictor.block_freq).exists()
    llm = Llama(str(out), mode="powerinfer2", sparsity=0.5, memory_budget=budget, n_ctx=64, verbose=False)
    try:
        assert llm.hot_blocks > 0
        llm("hello", max_tokens=4, temperature=0.0)
        s = llm.stats()
        assert s["cache_bytes"] <= s["cache_capacity"] <= budget
    finally:
        llm.close()
    # leanstream pins the same hot set (unless hot_fraction=0)
    for frac, pinned in ((0.5, True), (0.0, False)):
        llm = Llama(str(out), mode="leanstream", sparsity=0.5, memory_budget=budget, hot_fraction=frac, n_ctx=64,
                    verbose=False)
        try:
            assert (llm.hot_blocks > 0) == pinned
        finally:
            llm.close()


def test_usable_model_dir_check(models, tmp_path):
    """`leanstream convert` (no arguments) keeps the cached default model only if this version
    can run it: manifest, file checksums and block file headers."""
    from leanstream_convert.cli import _usable

    out = tmp_path / "m.lsm"
    convert(models["llama-f16"], out, progress=False, sketch="none")
    assert _usable(out)
    m = json.loads((out / "manifest.json").read_text())
    m.pop("checksums")                       # as written by an older leanstream-ggml
    (out / "manifest.json").write_text(json.dumps(m))
    assert not _usable(out)
    convert(models["llama-f16"], out, progress=False, sketch="none", force=True)
    with open(out / "ffn" / "blk.0.bin", "r+b") as f:   # a version-1 block file header
        f.seek(8)
        f.write((1).to_bytes(4, "little"))
    assert not _usable(out)


@pytest.mark.parametrize("down_type,bits", [("q6_k", 6.5625), ("q5_k", 5.5)])
def test_k_quant_down_columns(tmp_path, down_type, bits):
    """down_type q6_k / q5_k: the columns are ggml's quantization of the source's columns (checked
    by dequantizing with gguf-py), smaller than Q8_0 by their bits, with a larger but bounded error;
    a model whose n_embd is not a multiple of 256 is refused."""
    src = tmp_path / "tiny.gguf"
    write_tiny_model(src, arch="llama", n_layer=2, n_embd=256, n_ff=96, types={"ffn": "Q4_0"}, seed=3)
    m = convert(src, tmp_path / "out", progress=False, sketch="none", down_type=down_type)
    reader = gguf.GGUFReader(src)
    for il in range(m.n_layer):
        h, perm, gate, up, down_t, _ = rebuild_layer(tmp_path / "out" / m.layers[il].file)
        assert h.down_type == T[down_type.upper()] and m.layers[il].down_type == down_type[:-1] + "K"
        assert h.down_col_bytes * 8 == 256 * bits
        _, _, d_ref, _ = source_matrices(reader, il)
        cols = np.ascontiguousarray(d_ref.T)
        err = np.abs(down_t - cols)
        scale = np.abs(cols).max(axis=1, keepdims=True)
        assert (err <= scale / (16 if down_type == "q5_k" else 32)).all()
        assert err.max() > 0                                   # a real second quantization
    other = tmp_path / "odd.gguf"
    write_tiny_model(other, arch="llama", n_layer=1, n_embd=64, n_ff=96, types={"ffn": "Q4_0"})
    with pytest.raises(ConvertError, match="multiple of 256"):
        convert(other, tmp_path / "odd", progress=False, sketch="none", down_type=down_type)
    with pytest.raises(ConvertError, match="down_type must be one of"):
        convert(other, tmp_path / "bad", progress=False, sketch="none", down_type="q4_k")


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                                   "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "TQ2_0"])
def test_ggml_dequantizes_as_gguf_py_does(qtype):
    """The converter dequantizes rows with ggml's to_float (ggml_rows.dequantize, on 2 threads):
    bit for bit gguf-py's dequantize on rows ggml's own quantizer wrote; rows in a given order too."""
    from types import SimpleNamespace

    from leanstream_ggml.llamacpp import ggml_ctypes
    from leanstream_convert.ggml_rows import dequantize

    T = gguf.GGMLQuantizationType
    qt = T[qtype]
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    n_rows, n = 8, 512
    w = np.random.default_rng(3).standard_normal((n_rows, n)).astype(np.float32)
    raw = np.empty((n_rows, n // bs * ts), np.uint8)
    assert ggml_ctypes.base().ggml_quantize_chunk(int(qt), w.ctypes.data, raw.ctypes.data, 0, n_rows, n, None) == raw.nbytes
    data = raw.view(np.float16) if qt == T.F16 else raw
    t = SimpleNamespace(tensor_type=qt, data=data, shape=[n, n_rows])
    got = dequantize(t, n_rows)
    ref = gguf.quants.dequantize(data, qt).reshape(n_rows, n)
    assert got.dtype == np.float32 and np.array_equal(got, ref)
    order = np.array([5, 0, 7, 7, 2])
    assert np.array_equal(dequantize(t, n_rows, n_threads=3, order=order), ref[order])
