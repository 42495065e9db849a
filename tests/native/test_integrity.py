"""Integrity of the model directory: block checksums (format version 2), verified on every read
by the I/O worker; the native CRC-32C against its references; `leanstream verify`; the
manifest's checksums of the other files; stats per decoded token."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from leanstream_convert import blockfile
from hostile_model import BUDGET, CTX, PROMPT, make_model_dir, run_model
from leanstream_ggml.model import manifest as mf
from leanstream_ggml.native._native import LeanstreamError, ffi, lib
from leanstream_ggml.model.checksum import crc32c, crc32c_rows
from leanstream_ggml.native.engine import FFNEngine
from leanstream_ggml.commands.verify import verify_dir

LEANSTREAM = [sys.executable, "-m", "leanstream_ggml.cli"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("integrity"), predictors=False)


@pytest.fixture
def model(pristine, tmp_path):
    d = tmp_path / "model.lsm"
    shutil.copytree(pristine, d)
    return d


@pytest.fixture(scope="module")
def expected(pristine):
    return run_model(pristine)


def _payload_range(path):
    h = blockfile.read_header(path)
    return h, h.data_offset, h.file_size


def _flip(path, positions):
    with open(path, "r+b") as f:
        for p in positions:
            f.seek(p)
            b = f.read(1)
            f.seek(p)
            f.write(bytes([b[0] ^ 0xFF]))


# ---- the checksum itself ----------------------------------------------------------------------

def test_crc32c_native_equals_references():
    assert crc32c(b"123456789") == 0xE3069283 == lib.ls_crc32c(0, b"123456789", 9)
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 256, 3 * 8192 * 2 + 999, dtype=np.uint8).tobytes()
    # lengths around the 3-stream thresholds (3 x 256, 3 x 8192) and every start alignment
    for n in (0, 1, 7, 8, 9, 255, 767, 768, 769, 3 * 256 + 8, 24575, 24576, 24577, 3 * 8192 * 2 + 13):
        for off in (0, 1, 3, 7):
            piece = buf[off:off + n]
            want = crc32c(piece)
            p = ffi.from_buffer(piece)
            assert lib.ls_crc32c(0, p, len(piece)) == want == lib.ls_crc32c_ref(0, p, len(piece)), (n, off)
    # chaining: crc(a + b) == crc(b, crc(a))
    a, b = buf[:1000], buf[1000:40000]
    assert lib.ls_crc32c(lib.ls_crc32c(0, a, len(a)), b, len(b)) == crc32c(a + b)
    rows = rng.integers(0, 256, (17, 1027), dtype=np.uint8)
    assert list(crc32c_rows(rows)) == [crc32c(r.tobytes()) for r in rows]


# ---- corrupted blocks -------------------------------------------------------------------------

def test_flipped_payload_bytes_raise_naming_file_layer_block(model, expected):
    """Issue case 1: 20 flipped bytes after the header of blk.1.bin used to give a different
    answer silently."""
    path = model / "ffn" / "blk.1.bin"
    h, lo, hi = _payload_range(path)
    rng = np.random.default_rng(5)
    pos = sorted(int(p) for p in rng.integers(lo, lo + h.n_blocks * h.block_payload // 2, size=20))
    _flip(path, pos)
    blocks = {(p - lo) // h.block_stride for p in pos}
    with pytest.raises(LeanstreamError, match=r"blk\.1\.bin: layer 1 block (\d+) is corrupt") as ei:
        run_model(model)
    assert int(ei.value.args[0].split("block ")[1].split()[0]) in blocks
    assert ei.value.status == lib.LS_ERR_CORRUPT
    # the check is what catches it: without it the answer silently differs
    assert run_model(model, verify_checksums=False) != expected


def test_zeroed_payload_raises(model):
    path = model / "ffn" / "blk.0.bin"
    h, lo, hi = _payload_range(path)
    with open(path, "r+b") as f:
        f.seek(lo)
        f.write(bytes(hi - lo))
    with pytest.raises(LeanstreamError, match=r"layer 0 block \d+ is corrupt"):
        run_model(model)


def test_corrupt_block_in_the_engine_every_read(model):
    """Under a budget the block is re-read every op: each read re-checks and re-reports."""
    m = mf.load(model)
    path = model / m.layers[0].file
    h, lo, _ = _payload_range(path)
    _flip(path, [lo + 3 * h.block_stride + 10])        # block 3
    e = FFNEngine([model / le.file for le in m.layers], memory_budget=h.block_stride * (h.n_blocks + 8),
                  test_hooks={"buffered_io": True})
    x = np.ones((1, h.n_embd), np.float32)
    for _ in range(2):
        with pytest.raises(LeanstreamError, match="layer 0 block 3 is corrupt"):
            e.eval_layer(0, x)
        e.eval_layer(1, x)                              # other layers still work
    assert e.stats()["checksum_ns"] > 0
    e.close()


def test_corrupt_tables_refused_at_open(model):
    """A swapped pair in the permutation table stays a permutation (the structural check passes);
    the tables' checksum catches it."""
    path = model / "ffn" / "blk.0.bin"
    h = blockfile.read_header(path)
    with open(path, "r+b") as f:
        f.seek(h.perm_offset)
        a, b = struct.unpack("<ii", f.read(8))
        f.seek(h.perm_offset)
        f.write(struct.pack("<ii", b, a))
    with pytest.raises(LeanstreamError, match="layer 0: header or tables corrupt") as ei:
        FFNEngine([path])
    assert ei.value.status == lib.LS_ERR_CORRUPT


def test_version_1_block_file_is_refused_with_the_fix(model):
    path = model / "ffn" / "blk.0.bin"
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 1))
    with pytest.raises(LeanstreamError, match=r"version 1, this build reads version 2, which adds a checksum.*"
                                              r"re-run `leanstream convert`"):
        FFNEngine([path])


def test_checksum_cost_is_counted_and_optional(pristine):
    m = mf.load(pristine)
    paths = [pristine / le.file for le in m.layers]
    x = np.ones((1, m.n_embd), np.float32)
    for verify in (True, False):
        e = FFNEngine(paths, verify_checksums=verify, test_hooks={"buffered_io": True})
        e.eval_layer(0, x)
        assert (e.stats()["checksum_ns"] > 0) == verify
        e.close()


# ---- leanstream verify ------------------------------------------------------------------------

def test_verify_intact_and_corrupt(model):
    r = subprocess.run(LEANSTREAM + ["verify", str(model)], capture_output=True, text=True)
    assert r.returncode == 0 and "intact" in r.stdout, r.stderr
    path = model / "ffn" / "blk.1.bin"
    h, lo, _ = _payload_range(path)
    _flip(path, [lo + 5 * h.block_stride + 1, lo + 9 * h.block_stride + 2])
    _flip(model / "base.gguf", [(model / "base.gguf").stat().st_size - 10])
    problems, _ = verify_dir(model)
    assert any("base.gguf: corrupt" in p for p in problems)
    assert any("layer 1 block 5 is corrupt" in p for p in problems)
    assert any("layer 1 block 9 is corrupt" in p for p in problems)
    r = subprocess.run(LEANSTREAM + ["verify", str(model)], capture_output=True, text=True)
    assert r.returncode == 1 and "block 5" in r.stderr and "Traceback" not in r.stderr


def test_corrupt_base_gguf_refused_before_llama_cpp_reads_it(model):
    base = model / "base.gguf"
    _flip(base, [base.stat().st_size // 2])
    with pytest.raises(mf.ManifestError, match="base.gguf: corrupt"):
        run_model(model)


def test_chat_reports_corruption_in_one_line(model):
    """Issue case 1 through the CLI: exit 1 and one line, not garbage with exit 0."""
    path = model / "ffn" / "blk.1.bin"
    h, lo, _ = _payload_range(path)
    _flip(path, [lo + i * 37 for i in range(20)])
    r = subprocess.run(LEANSTREAM + ["chat", str(model), "-p", "hi", "-n", "4", "--memory-budget", BUDGET],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("leanstream chat:")]
    assert len(err) == 1 and "blk.1.bin: layer 1 block" in err[0] and "Traceback" not in r.stderr


# ---- stats per decoded token (issue case 7) ---------------------------------------------------

def test_bytes_read_per_token_counts_each_token_once(pristine):
    from leanstream_ggml import Llama

    llm = Llama(str(pristine), memory_budget=BUDGET, **CTX)
    toks = llm.tokenize(PROMPT, add_bos=False)
    llm.eval(toks)
    llm.reset_stats()
    n_gen = 5
    t = 0
    for _ in range(n_gen):
        llm.eval([t])
    s = llm.stats()
    per_layer = [llm.stats(il) for il in range(llm.manifest.n_layer)]
    llm.close()
    assert s["tokens"] == n_gen                                    # not n_gen * n_layer
    assert all(p["tokens"] == n_gen for p in per_layer)
    assert s["bytes_read"] == sum(p["bytes_read"] for p in per_layer) > 0
    assert s["bytes_read_per_token"] == pytest.approx(s["bytes_read"] / n_gen)
    # under a budget of 1.5 layers each decoded token re-reads what is not pinned: at least
    # half a layer's blocks per token, at most every block of the model
    m = mf.load(pristine)
    layer_bytes = m.layers[0].n_blocks * m.layers[0].block_stride
    assert layer_bytes / 2 <= s["bytes_read_per_token"] <= m.n_layer * layer_bytes


def test_corrupt_block_keeps_failing_with_an_unlimited_budget(model):
    """With a budget covering the whole FFN blocks are read once and kept: a corrupt one must
    fail every call that needs it, not only the first (it would be skipped silently after)."""
    from leanstream_ggml import Llama

    path = model / "ffn" / "blk.0.bin"
    h, lo, _ = _payload_range(path)
    _flip(path, [lo + 2 * h.block_stride + 7])
    llm = Llama(str(model), memory_budget=None, in_ram="stream", **CTX)   # (the op: not the source on llama.cpp)
    toks = llm.tokenize(PROMPT, add_bos=False)
    for _ in range(3):
        llm.reset()
        with pytest.raises(LeanstreamError, match=r"layer 0 block 2 (is corrupt|could not be loaded)"):
            llm.eval(toks)
    llm.close()


def test_whole_file_checksum_leaves_the_page_cache_as_it_found_it(tmp_path):
    """file_crc32 (base.gguf when a model opens) drops what it read from disk, keeps what was cached."""
    import zlib

    from leanstream_ggml.model.checksum import file_crc32
    from leanstream_tools.measure import resident_bytes

    data = np.random.default_rng(0).integers(0, 256, 24 << 20, dtype=np.uint8).tobytes() + b"tail"
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    cold = resident_bytes(path)
    if cold is None or cold > len(data) // 2:
        pytest.skip(f"this file system keeps the file cached ({cold} bytes after DONTNEED): nothing to drop")
    assert file_crc32(path, chunk=5 << 20) == zlib.crc32(data)
    assert resident_bytes(path) <= cold + (1 << 20)           # read from disk, then dropped (edge pages stay)
    assert path.read_bytes() == data                          # now cached by someone else's read
    warm = resident_bytes(path)
    assert file_crc32(path, chunk=5 << 20) == zlib.crc32(data)
    assert resident_bytes(path) >= warm - (1 << 20)           # what was cached stays cached
