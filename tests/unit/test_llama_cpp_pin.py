"""The pin of leanstream_ggml/llamacpp/_llama_cpp.py, the one module that uses llama-cpp-python's private
names: the installed llama-cpp-python is the version it was written against, and every private
name it lists is still there. A failure names what to re-check."""

from __future__ import annotations

import importlib
import inspect

import llama_cpp
import numpy as np
import pytest

from leanstream_ggml.llamacpp import _llama_cpp

RECHECK = ("leanstream_ggml/llamacpp/_llama_cpp.py is written against llama-cpp-python {pinned}; re-check each of its "
           "uses (RELIES_ON, LLAMA_ATTRS), then set build.LLAMA_CPP_PYTHON_VERSION")


def _resolve(where: str):
    """The module or class named by a dotted path ('llama_cpp._internals.LlamaBatch')."""
    parts = where.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(where)


def test_installed_llama_cpp_python_is_the_pinned_version():
    assert llama_cpp.__version__ == _llama_cpp.PINNED, (
        f"llama-cpp-python {llama_cpp.__version__} is installed; " + RECHECK.format(pinned=_llama_cpp.PINNED))


@pytest.mark.parametrize("where,name,used_by", _llama_cpp.RELIES_ON, ids=[f"{w}.{n}" for w, n, _ in _llama_cpp.RELIES_ON])
def test_every_private_name_relied_on_exists(where, name, used_by):
    if where.startswith("llama_cpp.server"):
        pytest.importorskip("fastapi", reason="llama-cpp-python's server extra is not installed: its names are unchecked")
    obj = _resolve(where)
    # an attribute of the object, or one its class sets on its instances (self.<name> = ...)
    present = hasattr(obj, name) or (inspect.isclass(obj) and f"self.{name} =" in inspect.getsource(obj))
    assert present, (f"{where}.{name} is gone (used by {used_by}); " + RECHECK.format(pinned=_llama_cpp.PINNED))


def test_llama_sets_the_attributes_relied_on():
    init, ev = inspect.getsource(llama_cpp.Llama.__init__), inspect.getsource(llama_cpp.Llama.eval)
    missing = [a for a in _llama_cpp.LLAMA_ATTRS if f"self.{a} =" not in init and f"self.{a}: " not in init]
    assert not missing, (f"llama_cpp.Llama.__init__ no longer sets {missing}; "
                         + RECHECK.format(pinned=_llama_cpp.PINNED))
    # decode_all_rows repeats what eval does after a decode
    for line in ("self.input_ids[n_past : n_past + n_tokens] = batch", "self.n_tokens += n_tokens",
                 "self._requires_eval = False"):
        assert line in ev, (f"llama_cpp.Llama.eval no longer does `{line}` (decode_all_rows repeats it); "
                            + RECHECK.format(pinned=_llama_cpp.PINNED))


def test_no_other_module_uses_llama_cpp_privates():
    """Only _llama_cpp.py names llama-cpp-python's private attributes: not the rest of the
    library, nor the tools, the converter or bench/."""
    import re
    from pathlib import Path

    root = Path(_llama_cpp.__file__).parents[1]
    private = re.compile(r"\._ctx\b|\._batch\b|\._model\b|\._sampler\b|\.tokenizer_\b|\._candidates\b|"
                         r"\._logits_all\b|\._requires_eval\b|\._internals\b|llama_cpp\._lib\b|server_model\.|"
                         r"\bLlamaProxy\b")
    hits = []
    for d in ("leanstream_ggml", "leanstream_tools", "leanstream_convert", "bench"):
        for path in sorted((root / d).rglob("*.py")):
            if path.name == "_llama_cpp.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if private.search(code) and not code.lstrip().startswith(('"', "'")):
                    hits.append(f"{path.relative_to(root)}:{i}: {line.strip()}")
    assert not hits, "llama-cpp-python's internals used outside leanstream_ggml/llamacpp/_llama_cpp.py:\n" + "\n".join(hits)


def test_a_live_llama_has_what_is_relied_on(tmp_path):
    """On a tiny model: a Llama holds every attribute relied on; the decode wrapper, the verify
    rows (every row's logits, equal to decoding them one by one) and closing work as written."""
    from hostile_model import CTX, make_model_dir

    from leanstream_ggml import Llama
    from leanstream_ggml.llama import ClosedError

    llm = Llama(str(make_model_dir(tmp_path, predictors=False)), in_ram="stream", **CTX)   # the op's Llama
    try:
        missing = [a for a in _llama_cpp.LLAMA_ATTRS if a not in llm.__dict__]
        assert not missing, f"a Llama has no {missing}; " + RECHECK.format(pinned=_llama_cpp.PINNED)
        assert llm._ctx.decode.__name__ == "checked"      # wrap_decode is in place
        toks = llm.tokenize(b"hello there", add_bos=False)[:3]
        llm.eval_all_rows(toks)
        rows = [llm.logits(i).copy() for i in range(len(toks))]
        assert llm.n_tokens == len(toks) and list(llm.input_ids[:len(toks)]) == toks
        llm.rewind(0)
        for i, t in enumerate(toks):
            llm.eval([t])
            # (batch rounding of a few rows is below this; a row mixed up with another is far above)
            np.testing.assert_allclose(llm.logits(), rows[i], rtol=0, atol=1e-3,
                                       err_msg=f"row {i} of the verify pass is not decoding it alone")
    finally:
        llm.close()
    assert all(isinstance(llm.__dict__[a], _llama_cpp._Closed) for a in _llama_cpp.HANDLE_ATTRS if a in llm.__dict__)
    with pytest.raises(ClosedError):
        llm.logits()
