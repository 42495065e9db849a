"""The converter as restartable stages (leanstream_convert/stages.py): a conversion killed with SIGKILL
during profiling or during training resumes when the same command is run again and produces
the same files as an uninterrupted one; the manifest appears only when everything is done."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="predictor training needs torch (pip install .[train])")
gs = pytest.importorskip("gguf_synth")
from convert_runs import convert_in_child, digests, tiny_source_and_reference  # noqa: E402

# a CI-sized profile (several chunks) and training (3 layers); no quality calibration (a stage after
# these, tested in test_calibration.py)
SETTINGS = dict(predictors="quick", progress=False, calibrate=False,
                hash_config=dict(n_hash_layers=2, tau=4, n_bits=64, n_tables=2, steps=8, batch=32),
                profile_kwargs=dict(n_prompts=3, max_tokens=20, chunk_tokens=16))


def _convert(src, out, kill_at=None):
    return convert_in_child(src, out, SETTINGS, kill_at)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_source_and_reference(tmp_path_factory.mktemp("stages"), _convert)


def test_uninterrupted_conversion_is_complete(tiny):
    from leanstream_ggml.model import manifest

    src, ref = tiny
    m = manifest.load(ref)
    assert m.predictor is not None and len(m.predictor.files) == 3 and m.predictor.block_freq
    assert not (ref / ".convert").exists()        # the state folder (and the profile in it) is gone
    names = set(digests(ref))
    assert {"manifest.json", "base.gguf", "ffn/blk.0.bin", "predictor/blk.2.lspred", "predictor/block_freq.npy"} <= names
    assert not [n for n in names if n.endswith(".partial")]


# each case is two conversions in child processes (~12 s): the fast tier keeps one kill in training,
# the full suite (CI) runs the kill in profiling and the second layer's too
@pytest.mark.parametrize("kill_at,stage", [pytest.param("profile-chunk:1", "profile", marks=pytest.mark.slow),
                                           ("train-layer:0", "train"),
                                           pytest.param("train-layer:1", "train", marks=pytest.mark.slow)])
def test_killed_conversion_resumes_to_the_same_files(tiny, tmp_path, kill_at, stage):
    src, ref = tiny
    out = tmp_path / "model.lsm"
    r = _convert(src, out, kill_at)
    assert r.returncode == -9, (r.returncode, r.stderr[-3000:])    # SIGKILL
    assert not (out / "manifest.json").exists()                   # never looks complete
    state = out / ".convert"
    assert (state / "state.json").exists()
    assert (state / "profile.done").exists() == (stage == "train")
    assert not (state / "train.done").exists()
    if stage == "train":   # the layers finished before the kill are there and kept
        n_done = int(kill_at.split(":")[1]) + 1
        assert len(list((out / "predictor").glob("blk.*.lspred"))) == n_done
        before = {p.name: p.stat().st_mtime_ns for p in (out / "predictor").glob("blk.*.lspred")}
    r = _convert(src, out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert digests(out) == digests(ref)
    if stage == "train":   # resumed, not redone
        assert all((out / "predictor" / n).stat().st_mtime_ns == t for n, t in before.items())


def test_other_parameters_refuse_to_resume(tiny, tmp_path):
    from leanstream_convert.convert_gguf import ConvertError
    from leanstream_convert.stages import convert_model

    src, _ = tiny
    out = tmp_path / "model.lsm"
    assert _convert(src, out, "train-layer:0").returncode == -9
    with pytest.raises(ConvertError, match="other parameters"):
        convert_model(src, out, predictors="none", progress=False)
    with pytest.raises(ConvertError, match="other parameters.*k"):
        convert_model(src, out, k=2, log=lambda *a: None, **SETTINGS)
    # --force starts over
    m = convert_model(src, out, predictors="none", progress=False, force=True)
    assert m.predictor is None and not (out / "predictor").exists() and not (out / ".convert").exists()


def test_cli_rerun_after_interruption_resumes(tiny, tmp_path):
    """What a user sees: the same `leanstream convert` command again finishes the job (no --force)."""
    src, _ = tiny
    out = tmp_path / "model.lsm"
    assert _convert(src, out, "train-layer:0").returncode == -9
    from leanstream_convert.stages import convert_model

    m = convert_model(src, out, log=lambda *a: None, **SETTINGS)
    assert m.predictor is not None and len(m.predictor.files) == 3
