"""Mixture-of-experts sources (leanstream_convert/moe_source.py; docs/formats.md, "Expert file"): the
synthetic layouts load and decode in stock llama.cpp, and each converts into base.gguf without the
routed experts plus one expert file per layer whose slots are the GGUF's expert bytes; the
families not done yet are refused by name; a killed conversion resumes to the same files; a
truncated expert file is caught when the model directory is loaded."""

from __future__ import annotations

import shutil
import struct

import gguf
import numpy as np
import pytest
from convert_runs import convert_in_child, digests
from gguf_synth import write_tiny_model

from leanstream_convert import ConvertError, convert
from leanstream_ggml.model import manifest as mf
from leanstream_ggml.model.checksum import crc32c, crc32c_rows

T = gguf.GGMLQuantizationType

# (name, arch, write_tiny_model keywords): the four layouts, the Mixtral layout under qwen2, and
# K-quant experts (Qwen3-30B-A3B's Q4_K_M: Q4_K gate/up, Q6_K down; and the lower K-quants)
LAYOUTS = {
    "qwen3moe": ("qwen3moe", {}),
    "qwen2moe": ("qwen2moe", {"n_ff_shexp": 128}),
    "olmoe": ("olmoe", {}),
    "mixtral": ("llama", {}),
    "qwen2-mixtral": ("qwen2", {}),
    "qwen3moe-q4_K-q6_K": ("qwen3moe", {"n_embd": 256, "n_ff": 256, "types": {"gate": "Q4_K", "up": "Q4_K",
                                                                               "down": "Q6_K"}}),
    "qwen2moe-q3_K-q2_K": ("qwen2moe", {"n_embd": 256, "n_ff": 256, "types": {"gate": "Q3_K", "up": "Q2_K",
                                                                               "down": "Q5_K"}}),
    "olmoe-f16": ("olmoe", {"types": {"ffn": "F16"}}),
    "mixtral-f32-q8_0": ("llama", {"types": {"gate": "F32", "up": "Q8_0", "down": "Q4_1"}}),
}
STOCK = ("qwen3moe", "qwen2moe", "olmoe", "mixtral")    # (stock llama.cpp's qwen2 has no experts)


def _source(tmp_path, name: str, n_layer: int = 2, seed: int = 0) -> tuple:
    arch, kw = LAYOUTS[name]
    kw = {"n_embd": 64, "n_ff": 96, **kw}
    src = tmp_path / f"{name}.gguf"
    values = write_tiny_model(src, arch=arch, n_layer=n_layer, moe_experts=8, moe_used=2, seed=seed,
                              scales="peaked", **kw)
    return src, values, kw


def _read_expert_file(path):
    """(header fields, expert_of_slot, slot CRCs, uint8 [n_expert, expert_stride]) by docs/formats.md."""
    raw = path.read_bytes()
    names = ("magic", "version", "il", "n_embd", "n_ff_exp", "n_expert", "align", "gate_type", "up_type",
             "down_type", "flags", "gate_bytes", "up_bytes", "down_bytes", "expert_stride", "table_offset",
             "data_offset", "file_size", "meta_crc")
    h = dict(zip(names, struct.unpack_from("<8sIIQQIIiiiIQQQQQQQI", raw, 0)))
    assert raw[116:4096] == bytes(3980)
    meta = bytearray(raw[:h["data_offset"]])
    meta[112:116] = bytes(4)
    assert crc32c(meta) == h["meta_crc"]
    E, t = h["n_expert"], h["table_offset"]
    order = np.frombuffer(raw, "<i4", E, t)
    crcs = np.frombuffer(raw, "<u4", E, t + 4 * E)
    assert raw[t + 8 * E:h["data_offset"]] == bytes(h["data_offset"] - t - 8 * E)
    slots = np.frombuffer(raw, np.uint8, offset=h["data_offset"]).reshape(E, h["expert_stride"])
    return h, order, crcs, slots


def _logits(path, toks) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed")
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=1, verbose=False, logits_all=True)
    try:
        assert llm.n_vocab() == 267
        llm.eval(toks)
        return np.array(llm.scores[:len(toks)])
    finally:
        llm.close()


# ---- the synthetic sources, in stock llama.cpp ---------------------------------------------------

@pytest.mark.parametrize("name", STOCK)
def test_synthetic_moe_loads_decodes_and_its_experts_decide(tmp_path, name):
    """Each layout loads, tokenizes and decodes in stock llama.cpp; the experts matter (zeroing
    every expert's down rows, or one expert's, moves the top-1 token), and the router spreads
    tokens over the experts without being uniform."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed")
    src, values, kw = _source(tmp_path, name)
    llm = llama_cpp.Llama(str(src), n_ctx=64, n_threads=1, verbose=False)
    try:
        assert 0 < len(llm.tokenize(b"the cat", add_bos=False)) <= 7
    finally:
        llm.close()
    toks = list(range(3, 51))
    ref = _logits(src, toks)
    assert np.isfinite(ref).all()
    reader = gguf.GGUFReader(src)
    for experts, most in (([0], 0.9), (range(8), 0.35)):
        z = tmp_path / "zeroed.gguf"
        shutil.copy(src, z)
        mm = np.memmap(z, np.uint8, mode="r+")
        for t in reader.tensors:
            if t.name.endswith("ffn_down_exps.weight") and t.tensor_type in (T.Q8_0, T.Q4_0, T.F16, T.F32):
                per = int(t.n_bytes) // 8
                for e in experts:   # zero bytes are zero values in these types
                    mm[t.data_offset + e * per:t.data_offset + (e + 1) * per] = 0
        mm.flush()
        del mm
        agree = (_logits(z, toks).argmax(1) == ref.argmax(1)).mean()
        assert agree < most, (experts, agree)
    router = values["blk.0.ffn_gate_inp.weight"]                       # [n_expert, n_embd]
    x = np.random.default_rng(0).standard_normal((2000, kw["n_embd"]))
    top2 = np.argsort(-(x @ router.T), axis=1)[:, :2]
    freq = np.bincount(top2.ravel(), minlength=8) / top2.size
    assert freq.min() > 0.02 and freq.max() < 0.3 and freq.std() > 0.01
    assert len({tuple(sorted(r)) for r in top2}) > 20


# ---- conversion ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_layout_converts_into_base_and_expert_files(tmp_path, name):
    src, values, kw = _source(tmp_path, name)
    out = tmp_path / "o.lsm"
    m = convert(src, out, progress=False)
    arch = LAYOUTS[name][0]
    n_embd, n_ff = kw["n_embd"], kw["n_ff"]
    assert (m.architecture, m.n_layer, m.n_embd, m.n_ff, m.activation, m.layers) == (arch, 2, n_embd, n_ff, "silu", [])
    moe = m.moe
    assert (moe.n_expert, moe.n_expert_used, moe.n_ff_exp, moe.gating) == (8, 2, n_ff, "softmax")
    assert moe.shared_expert == (arch == "qwen2moe")
    runs = arch != "qwen2"   # (llama.cpp's qwen2 has no experts: converted, not run, no routing pass)
    assert moe.routing_freq == (mf.ROUTING_FREQ if runs else None)
    if runs:
        freq = np.load(out / mf.ROUTING_FREQ)   # the routing pass: each layer's routings per token
        assert freq.shape == (2, 8) and np.allclose(freq.sum(1), 2) and (freq > 0).sum() > 8
    assert moe.files == [mf.EXPERT_FILE.format(il=il) for il in range(2)]
    assert mf.load(out) == m                              # the manifest as written, every file's size
    m.check_checksums(out)
    assert sorted(p.name for p in out.iterdir()) == ["base.gguf", "experts", "manifest.json"]
    assert sorted(p.name for p in (out / mf.EXPERT_DIR).iterdir()) == ["blk.0.bin", "blk.1.bin"] + ["routing_freq.npy"] * runs

    reader = gguf.GGUFReader(src)
    tensors = {t.name: t for t in reader.tensors}
    source_exps = 0
    for il in range(2):
        h, order, crcs, slots = _read_expert_file(out / moe.files[il])
        exps = [tensors[f"blk.{il}.ffn_{r}_exps.weight"] for r in ("gate", "up", "down")]
        assert (h["magic"], h["version"], h["il"], h["n_embd"], h["n_ff_exp"], h["n_expert"]) == \
            (b"LSEXPRTS", 1, il, n_embd, n_ff, 8)
        e_il = moe.layers[il]
        assert (h["gate_type"], h["up_type"], h["down_type"]) == tuple(int(t.tensor_type) for t in exps) == \
            (e_il.gate_type, e_il.up_type, e_il.down_type)
        assert (h["expert_stride"], h["data_offset"], h["file_size"]) == \
            (e_il.expert_stride, e_il.data_offset, e_il.file_size)
        assert h["align"] == m.block.align and h["expert_stride"] % h["align"] == 0
        assert np.array_equal(order, np.arange(8))         # the router's order (co-activation order: later)
        assert np.array_equal(crcs, crc32c_rows(slots))
        sizes = [int(t.n_bytes) // 8 for t in exps]
        assert sizes == [h["gate_bytes"], h["up_bytes"], h["down_bytes"]]
        for s, e in enumerate(order):
            at = 0
            for t, size in zip(exps, sizes):
                want = np.asarray(t.data).view(np.uint8).reshape(8, -1)[e]   # expert e's bytes as stored
                assert np.array_equal(slots[s, at:at + size], want), (il, s, t.name)
                at += size
            assert not slots[s, at:].any()                  # zero padding to the stride
        source_exps += sum(int(t.n_bytes) for t in exps)
    assert (m.totals.ffn_bytes_source, m.totals.ffn_bytes_on_disk) == (source_exps, sum(e.file_size for e in moe.layers))

    base = gguf.GGUFReader(out / mf.BASE_NAME)
    kept = {t.name: t for t in base.tensors}
    assert not [n for n in kept if "_exps" in n]
    assert set(kept) == {n for n in tensors if "_exps" not in n}
    for n, t in kept.items():                               # the router, shared expert, norms: as they were
        assert np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(tensors[n].data).view(np.uint8)), n
    assert all(f"blk.{il}.ffn_gate_inp.weight" in kept for il in range(2))
    assert (f"blk.0.ffn_gate_shexp.weight" in kept) == (arch == "qwen2moe")
    assert base.get_field("leanstream.ffn_external").contents() is True
    assert base.get_field(f"{arch}.expert_count").contents() == 8


def test_only_read_write_routing_and_manifest_run_for_moe(tmp_path):
    """The stages of dense models that run the model or order neurons (activations, order, reorder,
    sketch, vocab, calibrate; predictors) do not run for a mixture-of-experts model; its routing
    pass does."""
    src, _, _ = _source(tmp_path, "qwen3moe")
    m = convert(src, tmp_path / "o", progress=False, calibrate=True, predictors="quick")
    assert set(m.extra["conversion"]["stages"]) == {"read", "write", "routing"}
    assert m.sketch is None and m.predictor is None and "draft" not in m.extra


# ---- what is refused -----------------------------------------------------------------------------

def _moe_header(path, arch: str, n_expert: int = 4, fused: bool = False) -> None:
    """A one-layer GGUF of ``arch`` with an expert count and F32 experts (n_embd 32, n_ff_exp 64)."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(2)
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((n_expert, 32), np.float32))
    roles = (("gate_up", 128, 32),) if fused else (("gate", 64, 32), ("up", 64, 32))
    for role, rows, cols in roles + (("down", 32, 64),):
        w.add_tensor(f"blk.0.ffn_{role}_exps.weight", np.zeros((n_expert, rows, cols), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch, why", [
    ("nemotron_h_moe", r"its experts compute ungated ReLU² experts \(ffn_up_exps and ffn_down_exps, no gate\)"),
    ("grovemoe", r"its experts compute a second set of chunk experts"),
    ("kimi-k3", r"its experts compute the SITU activation"),
    ("mixtral9000", r"an architecture leanstream does not know"),
])
def test_moe_families_the_op_cannot_compute_are_refused_saying_why(tmp_path, arch, why):
    src = tmp_path / "m.gguf"
    _moe_header(src, arch)
    with pytest.raises(ConvertError, match=rf"a mixture-of-experts model \({arch}\): {why}"):
        convert(src, tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()


def test_ungated_experts_and_clamped_swiglu_are_refused_naming_what_lacks(tmp_path):
    src = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(src, "qwen3moe")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((4, 32), np.float32))
    w.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((4, 64, 32), np.float32))
    w.add_tensor("blk.0.ffn_down_exps.weight", np.zeros((4, 32, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConvertError, match=r"layer 0: its experts have no gate \(blk\.0\.ffn_gate_exps\.weight\)"):
        convert(src, tmp_path / "o", progress=False)
    w = gguf.GGUFWriter(tmp_path / "c.gguf", "step35")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_array("step35.swiglu_clamp_exp", [7.0])
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConvertError, match=r"a mixture-of-experts model \(step35\): its experts compute a clamped SwiGLU"):
        convert(tmp_path / "c.gguf", tmp_path / "o2", progress=False)


@pytest.mark.parametrize("how", ["synthetic", "header"])
def test_fused_gate_up_experts_are_split_into_gate_and_up(tmp_path, how):
    """ffn_gate_up_exps [n_embd, 2 n_ff_exp, n_expert]: each expert's first n_ff_exp rows are its
    gate, the next its up (build_moe_ffn's views); the expert file holds them apart."""
    src = tmp_path / "f.gguf"
    if how == "synthetic":
        write_tiny_model(src, arch="qwen3moe", n_layer=2, moe_experts=4, fused_gate_up_exps=True)
    else:
        _moe_header(src, "llama", fused=True)
    m = convert(src, tmp_path / "o", progress=False)
    reader = gguf.GGUFReader(src)
    for il, e in m.moe.expert_layers():
        fused = next(t for t in reader.tensors if t.name == f"blk.{il}.ffn_gate_up_exps.weight")
        raw = np.asarray(fused.data).view(np.uint8).reshape(m.moe.n_expert, 2 * m.moe.n_ff_exp, -1)
        h, order, _, slots = _read_expert_file(tmp_path / "o" / e.file)
        assert h["gate_bytes"] == h["up_bytes"] == raw[0, :m.moe.n_ff_exp].nbytes
        for s, x in enumerate(order):
            assert bytes(slots[s, :h["gate_bytes"]]) == raw[x, :m.moe.n_ff_exp].tobytes()
            assert bytes(slots[s, h["gate_bytes"]:2 * h["gate_bytes"]]) == raw[x, m.moe.n_ff_exp:].tobytes()
    base = {t.name for t in gguf.GGUFReader(tmp_path / "o" / "base.gguf").tensors}
    assert not any("_exps." in n for n in base)


def test_expert_types_that_differ_between_layers_convert(tmp_path):
    """A Q4_K_M file holds some layers' down experts in Q6_K and the others' in Q4_K (llama.cpp's
    quantizer): each layer's expert file and manifest entry keep its own types."""
    src = tmp_path / "mixed.gguf"
    write_tiny_model(src, arch="qwen3moe", n_layer=2, moe_experts=4, types={"down": ["Q8_0", "Q4_0"]})
    m = convert(src, tmp_path / "o", progress=False)
    q8, q4 = 8, 2    # enum ggml_type
    assert [e.down_type for e in m.moe.layers] == [q8, q4]
    assert m.moe.layers[0].expert_stride != m.moe.layers[1].expert_stride or q8 == q4
    for il, e in m.moe.expert_layers():
        h, _, _, _ = _read_expert_file(tmp_path / "o" / e.file)
        assert (h["down_type"], h["file_size"]) == (e.down_type, e.file_size), il


def test_a_permutation_is_refused_for_experts(tmp_path):
    src, _, _ = _source(tmp_path, "olmoe")
    with pytest.raises(ConvertError, match=r"mixture-of-experts model \(olmoe\): a permutation orders"):
        convert(src, tmp_path / "o", progress=False, permutation=np.arange(96))


def test_a_limit_below_one_layer_of_experts_is_refused_with_the_numbers(tmp_path):
    src, _, _ = _source(tmp_path, "qwen3moe")
    with pytest.raises(ConvertError, match=r"one layer's work takes .* MiB \(8 experts of n_ff_exp 96 x n_embd 64\)"):
        convert(src, tmp_path / "o", progress=False, memory_limit="10MB")


# ---- resume and damage -------------------------------------------------------------------------------

def test_killed_conversion_resumes_to_the_same_files(tmp_path):
    """SIGKILL after the second of three expert files: the rerun keeps the two complete files (the
    same inodes), removes the half-written rest and writes the same directory as an uninterrupted run."""
    src, _, _ = _source(tmp_path, "qwen2moe", n_layer=3)
    settings = {"progress": False}
    ref = tmp_path / "ref.lsm"
    r = convert_in_child(src, ref, settings)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "m.lsm"
    r = convert_in_child(src, out, settings, kill_at="write-layer:1")
    assert r.returncode == -9, (r.returncode, r.stderr[-3000:])
    assert not (out / mf.MANIFEST_NAME).exists()
    done = {il: (out / mf.EXPERT_FILE.format(il=il)).stat().st_ino for il in (0, 1)}
    assert not (out / mf.EXPERT_FILE.format(il=2)).exists()
    (out / (mf.EXPERT_FILE.format(il=2) + ".partial")).write_bytes(b"half")    # as a kill mid-file leaves it
    r = convert_in_child(src, out, settings)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {il: (out / mf.EXPERT_FILE.format(il=il)).stat().st_ino for il in (0, 1)} == done
    assert digests(out) == digests(ref)


def test_a_damaged_expert_file_from_an_interrupted_run_is_written_again(tmp_path):
    src, _, _ = _source(tmp_path, "mixtral", n_layer=3)
    ref = tmp_path / "ref.lsm"
    assert convert_in_child(src, ref, {"progress": False}).returncode == 0
    out = tmp_path / "m.lsm"
    assert convert_in_child(src, out, {"progress": False}, kill_at="write-layer:1").returncode == -9
    f = out / mf.EXPERT_FILE.format(il=0)
    raw = bytearray(f.read_bytes())
    raw[16] ^= 1                                            # n_embd: the header no longer matches
    f.write_bytes(bytes(raw))
    assert convert_in_child(src, out, {"progress": False}).returncode == 0
    assert digests(out) == digests(ref)


@pytest.mark.parametrize("cut", [1, 4096])
def test_a_truncated_expert_file_is_caught_at_load(tmp_path, cut):
    src, _, _ = _source(tmp_path, "qwen3moe")
    out = tmp_path / "o.lsm"
    m = convert(src, out, progress=False)
    f = out / m.moe.files[1]
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - cut)
    with pytest.raises(mf.ManifestError, match=r"blk\.1\.bin"):
        mf.load(out)
