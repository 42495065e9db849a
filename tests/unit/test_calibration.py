"""The calibration corpus by domain (prose, code, chat, the user's file), the quality table per
domain that quality= reads by its worst domain, and the texts the evaluation holds out."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from leanstream_convert import calibrate
from leanstream_ggml.model import manifest as mf
from leanstream_ggml import texts
from leanstream_tools.texts import HELDOUT


def _lines(path) -> set[str]:
    if texts.is_chat(path):
        body = "\n".join(m["content"] for c in texts.read_chats(path) for m in c)
    else:
        body = path.read_text(encoding="utf-8")
    return {ln.strip() for ln in body.splitlines() if len(ln.strip()) >= 40}


def test_calibration_never_sees_the_held_out_texts():
    """No line of 40+ characters is shared between a calibration file and a held-out file (the
    held-out code is other project sources than the calibration's)."""
    held = set().union(*(_lines(p) for p in HELDOUT.values()))
    for name, path in calibrate.DOMAINS.items():
        shared = _lines(path) & held
        assert not shared, (name, sorted(shared)[:3])
    assert set(calibrate.DOMAINS) == {"prose", "code", "chat"} == set(HELDOUT)


def test_corpus_adds_the_users_file_as_a_domain(tmp_path):
    f = tmp_path / "mine.txt"
    f.write_text("my text")
    assert calibrate.corpus() == calibrate.DOMAINS
    assert calibrate.corpus(f) == {**calibrate.DOMAINS, "user": f}


def test_score_keeps_only_each_windows_nll_and_top1(monkeypatch):
    """The reference is kept as (next-token NLL, top-1) per window; the ratio and agreement are
    those of the whole log-probability rows, computed with plain loops."""
    import math

    import numpy as np

    rng = np.random.default_rng(0)
    n, vocab = calibrate.N_CTX, 50
    w = list(rng.integers(0, vocab, n))
    pos = range(n // 2, n - 1)

    def logp(scale):
        z = rng.normal(size=(len(pos), vocab)) * scale
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    ref, test = logp(1.0), logp(1.5)
    nxt = w[n // 2 + 1:]
    nll, top = calibrate.row_targets(iter(ref), nxt)
    assert [round(float(v), 9) for v in nll] == [round(float(-ref[i, w[p + 1]]), 9) for i, p in enumerate(pos)]
    assert list(top) == [int(np.argmax(ref[i])) for i in range(len(pos))]
    # unnormalized logits give the same NLL (row_targets takes the log-softmax itself)
    nll2, _ = calibrate.row_targets(iter(ref + 3.0), nxt)
    np.testing.assert_allclose(nll2, nll, rtol=1e-12, atol=1e-12)

    # _score asks _targets for the model's rows; here they are given
    monkeypatch.setattr(calibrate, "_targets", lambda llm, w_: calibrate.row_targets(iter(test), nxt))
    got = calibrate._score(None, [(w, (nll, top))])
    want_ratio = math.exp(sum(-test[i, w[p + 1]] + ref[i, w[p + 1]] for i, p in enumerate(pos)) / len(pos))
    want_agree = sum(int(np.argmax(test[i]) == np.argmax(ref[i])) for i in range(len(pos))) / len(pos)
    assert got == {"ppl_ratio": round(want_ratio, 4), "agreement": round(want_agree, 4)}


def test_read_chats_names_the_bad_line(tmp_path):
    f = tmp_path / "c.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    f.write_text(good + "\n\n" + json.dumps([{"role": "user", "content": "bare list"}]) + "\n")
    assert [c[0]["content"] for c in texts.read_chats(f)] == ["hi", "bare list"]
    f.write_text(good + "\n{oops\n")
    with pytest.raises(ValueError, match=r"c.jsonl:2: not JSON"):
        texts.read_chats(f)
    f.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(ValueError, match=r"c.jsonl:1: expected"):
        texts.read_chats(f)


def test_chats_are_tokenized_in_the_models_template(smollm2_gguf):
    """A chat file becomes the model's own chat format, special tokens as tokens: SmolLM2's
    ChatML puts one <|im_start|> before every message (and its default system message)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(smollm2_gguf), vocab_only=True, verbose=False)
    try:
        toks, add_bos = texts.text_tokens(llm, HELDOUT["chat"])
        im_start = llm.tokenize(b"<|im_start|>", add_bos=False, special=True)
        assert len(im_start) == 1
        chats = texts.read_chats(HELDOUT["chat"])
        rendered = "".join(texts.render_chat(llm, c) for c in chats)
        assert rendered.count("<|im_start|>") >= sum(len(c) for c in chats)
        assert add_bos == (len(llm.tokenize(b"", add_bos=True)) > 0)
        assert toks[int(add_bos):].count(im_start[0]) == rendered.count("<|im_start|>")
        plain, _ = texts.text_tokens(llm, HELDOUT["code"])
        assert im_start[0] not in plain
    finally:
        llm.close()


def test_convert_refuses_an_unusable_calibration_file(smollm2_gguf, tmp_path):
    """Checked before any work: a missing, empty or malformed --calibration file."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    for f, why in ((tmp_path / "missing.txt", "no such file"), (empty, "empty"), (bad, "bad.jsonl:1: not JSON")):
        r = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "convert", str(smollm2_gguf),
                            str(tmp_path / "out.lsm"), "--calibration", str(f)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and why in r.stderr, r.stderr
        assert not (tmp_path / "out.lsm").exists()


def test_the_quality_table_has_every_domain(smollm2_sketch_dir):
    """Each row holds prose, code and chat; the row's ppl_ratio is the worst domain's (what
    quality= reads) and its agreement the lowest; `leanstream info` prints the table."""
    table = mf.load(smollm2_sketch_dir).sketch.quality
    assert len(table) == len(calibrate.SPARSITIES)
    for row in table:
        doms = row["domains"]
        assert set(doms) == {"prose", "code", "chat"}
        assert row["ppl_ratio"] == max(d["ppl_ratio"] for d in doms.values())
        assert row["agreement"] == min(d["agreement"] for d in doms.values())
        assert all(0.9 < d["ppl_ratio"] < 10 and 0 < d["agreement"] <= 1 for d in doms.values())
    r = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "info", str(smollm2_sketch_dir)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    head = next(ln for ln in r.stdout.splitlines() if "prose" in ln and "code" in ln)
    assert "chat" in head and "worst" in head
    assert sum(ln.strip().startswith(f"{q['sparsity']:g} ") for q in table for ln in r.stdout.splitlines()) == len(table)


def test_old_tables_without_domains_still_load(smollm2_sketch_dir, tmp_path):
    """A directory calibrated before the corpus had domains (rows of prose only) loads, and a
    malformed domain entry is refused."""
    d = json.loads((smollm2_sketch_dir / "manifest.json").read_text())
    rows = [{k: q[k] for k in ("sparsity", "ppl_ratio", "agreement")} for q in d["sketch"]["quality"]]
    info = mf.SketchInfo.from_dict({**d["sketch"], "quality": rows}, "sketch")
    assert info.quality == rows
    with pytest.raises(mf.ManifestError, match="domains"):
        mf.SketchInfo.from_dict({**d["sketch"], "quality": [{**rows[0], "domains": {"code": 1.2}}]}, "sketch")


def test_quality_warns_on_a_prose_only_table(smollm2_sketch_dir, tmp_path):
    """quality= on a directory calibrated before the corpus had domains still chooses from its
    table, and says that code and chat were not measured."""
    import shutil

    from leanstream_ggml import Llama
    from leanstream_ggml.native import params

    d = tmp_path / "old.lsm"
    shutil.copytree(smollm2_sketch_dir, d)
    man = json.loads((d / "manifest.json").read_text())
    man["sketch"]["quality"] = [{k: q[k] for k in ("sparsity", "ppl_ratio", "agreement")}
                                for q in man["sketch"]["quality"]]
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.warns(UserWarning, match="calibrated on prose only"):
        llm = Llama(str(d), quality="ppl+8%", n_ctx=64, verbose=False)
    try:
        assert llm.sparsity == pytest.approx(params.sparsity_for_quality(man["sketch"]["quality"], 1.08), abs=1e-6)
    finally:
        llm.close()
    r = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "info", str(d)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    head = next(ln for ln in r.stdout.splitlines() if ln.rstrip().endswith("worst"))
    assert "prose" in head and "code" not in head


def test_the_users_file_is_calibrated_as_its_own_domain(smollm2_sketch_dir, smollm2_gguf, tmp_path, monkeypatch):
    """calibrate() with the user's chats: a "user" column beside the bundled domains, the row's
    ratio still the worst of them (one sparsity, to keep it short)."""
    chats = tmp_path / "mine.jsonl"
    talk = [{"role": "user", "content": "Tell me about the history of the bicycle, in detail."},
            {"role": "assistant", "content": " ".join(
                f"In {1817 + 4 * i} the design changed again: frames, wheels, brakes and gears were improved "
                f"by makers in many countries, and riding became cheaper and safer." for i in range(30))}]
    chats.write_text(json.dumps({"messages": talk}) + "\n")
    monkeypatch.setattr(calibrate, "SPARSITIES", (0.5,))
    m = mf.load(smollm2_sketch_dir)
    from leanstream_convert.activations import run_pass

    refs = run_pass(smollm2_sketch_dir, m, [], memory_limit=None, n_threads=2, n_read=None,
                    calibration_windows=calibrate.corpus(chats), progress=False).references
    table = calibrate.calibrate(smollm2_sketch_dir, m, refs, progress=False)
    assert [row["sparsity"] for row in table] == [0.5]
    doms = table[0]["domains"]
    assert set(doms) == {"prose", "code", "chat", "user"}
    assert table[0]["ppl_ratio"] == max(d["ppl_ratio"] for d in doms.values())
