"""The drop-in ``Llama``: llama_cpp.Llama over a converted model directory.

Everything llama-cpp-python does (completion, chat with the GGUF's template, streaming,
tokenize, the server) works unchanged: the base model (every non-FFN tensor and all metadata)
is loaded by the patched libllama, and each layer's FFN is handed to libleanstream through the
per-context hook ``llama_set_ffn_builder``.
"""

from __future__ import annotations

import difflib
import inspect
import time
import warnings
from pathlib import Path

import llama_cpp

from . import _llama_cpp, context, memplan, params
from . import manifest as manifest_mod
from ._native import mode_uses
from .engine import FFNEngine

def _is_gguf_file(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


# passed by llama-cpp-python's own server loader, which its Llama takes through **kwargs and ignores
_PASSED_BY_LLAMA_CPP = ("rpc_servers", "mul_mat_q")


def _llama_cpp_keywords() -> list[str]:
    ps = inspect.signature(llama_cpp.Llama.__init__).parameters
    return [n for n, p in ps.items() if n not in ("self", "model_path") and p.kind is not p.VAR_KEYWORD] + \
        list(_PASSED_BY_LLAMA_CPP)


def _refuse_unknown_keywords(kwargs: dict) -> None:
    """llama_cpp.Llama takes **kwargs and drops what it does not know: a misspelt option (or one
    that does not exist, like memory_limt=) would run with its default unnoticed. A keyword that
    neither this class nor llama_cpp.Llama names is a TypeError naming it and the nearest one."""
    known = _llama_cpp_keywords()
    unknown = [k for k in kwargs if k not in known]
    if not unknown:
        return
    ours = [n for n in inspect.signature(Llama.__init__).parameters if n not in ("self", "model_path", "kwargs")
            and not n.startswith("_")]
    k = unknown[0]
    near = difflib.get_close_matches(k, ours + known, n=1, cutoff=0.5)
    raise TypeError(f"Llama() got an unexpected keyword argument {k!r}"
                    + (f"; did you mean {near[0]!r}?" if near else "")
                    + " (neither leanstream's options nor llama_cpp.Llama's take it)")


class ClosedError(ValueError):
    """A method of a closed Llama was called."""


class Llama(llama_cpp.Llama):
    """llama_cpp.Llama whose FFN layers stream from a LeanStream model directory.

    Args:
        model_path: a directory written by ``leanstream convert``.
        memory_budget: bytes of FFN weights kept in RAM (int, or "512MiB"/"1.5GB"); None = all.
        memory_limit: instead of memory_budget, a limit for the whole process (e.g. "1000MB", what
            a memory cgroup or a small machine allows): the memory plan (memplan.py) takes from
            it what the process needs besides the FFN engine (the interpreter, the non-FFN weights
            each token reads, KV cache at n_ctx, llama.cpp's heap and compute buffers) and gives
            the rest to the engine; MemoryPlanError (a ValueError, with the plan) when that leaves
            too little. ``self.memory_plan`` is the plan (``leanstream info --memory-limit``).
        mode: "dense" (every neuron: reproduces stock llama.cpp), or a sparse decode mode that
            computes only the top (1 - sparsity) of each layer's neuron blocks: "leanstream"
            (with the converter's sketch, the default conversion: chosen from each layer's own
            input — sketch scores pick candidates, their exact gate/up values pick the blocks whose
            down columns are computed; without one, by the predictors; the predictors, if
            trained, prefetch the next layer), "oneshot" (DejaVu: one layer-ahead prediction, no
            weight cache), "dejavu+" (oneshot + LRU cache), "powerinfer2" (hot blocks pinned +
            LRU); these three need predictors. Prefill is always dense. Default: "dense", or
            "leanstream" when quality= is given.
        sparsity: fraction of blocks skipped per token in sparse modes (default 0.5).
        quality: instead of sparsity, the perplexity the user accepts to lose, e.g. "ppl+5%":
            leanstream mode (implied) at the largest sparsity whose cost the converter measured
            within that on the model's own text (``leanstream info`` shows the table).
        candidate_ratio: leanstream mode with a sketch: blocks whose gate/up rows are computed
            exactly per token, as a multiple of the kept blocks (default 1.5).
        n_io_threads: I/O worker threads (reads in flight, 1..256, default 16).
        bridge_bytes: read planning of the sparse modes: a read goes on through a gap of up to
            this many bytes of unselected blocks (read and dropped) rather than start another
            I/O; default: per-I/O time x bandwidth, measured on the block files at start; 0: never.
        hot_fraction: "powerinfer2" and "leanstream": share of the budget pinned for the blocks
            most often active in calibration (default 0.5; leanstream without predictors 0.9;
            0 pins nothing).
        controller: the streaming controller of leanstream mode's decode ops: "off" (default:
            the fixed settings above), "table" (the policy `leanstream tune` wrote into the model
            directory for this budget and sparsity: per layer, its remaining load and the disk's
            speed pick the candidate ratio and bridge), or "fixed:K" (action K of that policy's
            actions, or of control.DEFAULT_ACTIONS where none was tuned, on every layer).
        speculative: exact speculative decoding in dense mode (docs/design.md §21): "auto" (drafts
            from the engine's resident blocks and from prompt lookup, the longer one verified in
            one pass, the controller deciding how far to draft), "self" (the resident-block draft
            only), "ngram" (prompt lookup only), "off" (the default for now; sparse modes: always).
            Every emitted token is sampled from the model's own logits; ``stats()["speculative"]``
            counts passes, drafted and accepted tokens, draft and verify time.
        draft_max: the longest draft (default 8); the verify pass returns draft_max + 1 logit rows.
        draft_fraction: the self draft computes each layer's most important fraction of its blocks
            (those resident; default 1: every resident block): a cheaper, less faithful draft.
        draft_stop: how far to draft: "controller" (default: the table solved from the costs and
            acceptance this process measures), "fixed"
            (always draft_max), "p_min:X" (stop below top-1 probability X, as llama.cpp does).
        verify_checksums: check every block's CRC-32C as it is read (default True; a mismatch
            raises LeanstreamError naming the file, layer and block). The other files of the
            model directory are checked against the manifest's checksums when it is opened.
        Parameters are validated first (params.py): a bad value raises ParameterError (a
        ValueError) naming it. Defaults (None) are the engine's own (ls_engine_params_init), so
        they are written once. After close(), every method raises ClosedError.
        Every other argument is llama_cpp.Llama's, with the same meaning.
    """

    def __init__(self, model_path: str, *, memory_budget: int | str | None = None,
                 memory_limit: int | str | None = None, mode: str | None = None,
                 sparsity: float | None = None, quality: str | None = None, n_io_threads: int | None = None,
                 hot_fraction: float | None = None, verify_checksums: bool = True,
                 candidate_ratio: float | None = None, bridge_bytes: int | None = None,
                 controller: str | None = None, speculative: str | None = None, draft_max: int | None = None,
                 draft_stop: str | None = None, draft_fraction: float | None = None, _manifest=None, **kwargs):
        self._engine = self._drafter = None
        _refuse_unknown_keywords(kwargs)
        if quality is not None:
            if sparsity is not None:
                raise params.ParameterError("quality", "give quality= or sparsity=, not both")
            max_ratio = params.quality(quality)
            if mode not in (None, "leanstream"):
                raise params.ParameterError("quality", f"chooses leanstream mode's sparsity; mode={mode!r} was given")
            mode = "leanstream"
        mode = mode or "dense"
        # every parameter checked before anything is opened (ParameterError names the bad one)
        p = params.engine_params(memory_budget=memory_budget, mode=mode, sparsity=sparsity,
                                 n_io_threads=n_io_threads, hot_fraction=hot_fraction,
                                 candidate_ratio=candidate_ratio, bridge_bytes=bridge_bytes)
        mode = p["mode"]
        controller = params.controller(controller)
        if controller != "off" and mode != "leanstream":
            raise params.ParameterError("controller", f"steers leanstream mode's decode; mode={mode!r} was given")
        spec = params.speculative(speculative, mode) if kwargs.get("draft_model") is None else "off"
        k_max, spec_stop = params.draft_max(draft_max), params.draft_stop(draft_stop)
        spec_fraction = params.draft_fraction(draft_fraction)
        if spec != "off":
            # the verify pass decodes several rows at once; in llama.cpp's CPU backend only flash
            # attention computes each row as decoding it alone would (without it rows >= 5 of a
            # batch differ by up to ~0.6 in logit), so speculative decoding uses it unless told
            # otherwise: its answers are then plain decoding's token for token (docs/design.md §21)
            kwargs.setdefault("flash_attn", True)
        limit = params.size_bytes(memory_limit, "memory_limit") if memory_limit is not None else 0
        if limit and memory_budget is not None:
            raise params.ParameterError("memory_limit", "give memory_limit= (the whole process) or memory_budget= "
                                                        "(the FFN engine), not both")
        self.memory_plan = None
        path = Path(model_path)
        if path.is_file() and _is_gguf_file(path):
            raise ValueError(f"{model_path} is a plain GGUF file; convert it first:\n"
                             f"    leanstream convert {model_path} {path.with_suffix('.lsm')}\n"
                             f"then load the directory {path.with_suffix('.lsm')}")
        if not path.is_dir():
            raise ValueError(f"model directory does not exist: {model_path}")
        # _manifest: the converter's calibration runs the model before its manifest is written
        self.manifest = _manifest if _manifest is not None else manifest_mod.load(path)
        self.model_dir = path
        m = self.manifest
        # every file the model is made of: inside the directory, regular, intact (block files
        # check their own tables when opened and each block when read)
        m.check_checksums(path)
        predictor_paths = block_rank = sketch_paths = None
        if mode != "dense":
            # the files the mode reads, as the engine's mode table says (ManifestError/ValueError
            # naming what is missing)
            files = m.mode_files(path, mode_uses(mode), mode)
            predictor_paths = [m.resolve(path, f) for f in files.predictors] if files.predictors else None
            sketch_paths = [m.resolve(path, f) for f in files.sketches] if files.sketches else None
            if files.block_freq:
                block_rank = self._block_rank(path)
            if quality is not None:
                if not sketch_paths or not m.sketch.quality:
                    raise ValueError(f"quality={quality!r} needs the converter's calibration of {model_path} "
                                     f"(convert again with the sketch), or give sparsity=")
                if not all(q.get("domains") for q in m.sketch.quality):
                    warnings.warn(f"{model_path}: quality= was calibrated on prose only (an older converter); on code "
                                  f"and chat it can cost more: convert again to calibrate every domain", stacklevel=2)
                p["sparsity"] = params.sparsity_for_quality(m.sketch.quality, max_ratio)
        elif spec in ("auto", "self") and (m.block_importance_file() or m.block_freq_file()):
            # dense mode pins each layer's most important blocks (not a prefix of the scan): the
            # draft FFN; by mean |h| x ||down|| where the converter measured it, else by frequency
            block_rank = self._block_rank(path, m.block_importance_file())
        if limit:
            self.memory_plan = memplan.plan(path, m, limit, mode=mode, n_ctx=int(kwargs.get("n_ctx", 512)),
                                            n_ubatch=min(int(kwargs.get("n_batch", 512)), int(kwargs.get("n_ubatch", 512))),
                                            n_outputs=k_max + 1 if spec != "off" else 1)
            self.memory_plan.check()
            p["memory_budget"] = self.memory_plan.budget
        self._engine = FFNEngine([m.resolve(path, e.file) for e in m.layers],
                                 activation=m.activation, memory_budget=p["memory_budget"], mode=mode,
                                 predictor_paths=predictor_paths, block_rank=block_rank,
                                 verify_checksums=verify_checksums, sketch_paths=sketch_paths,
                                 **{k: p[k] for k in ("n_io_threads", "sparsity", "hot_fraction", "candidate_ratio",
                                                      "bridge_bytes")})
        self._check_layers_match_manifest()
        self.mode, self.sparsity = mode, self._engine.sparsity
        self.controller_policy = self._install_controller(controller)
        # the calibration-hot blocks the engine keeps resident (powerinfer2, leanstream)
        self.hot_blocks = self._engine.stats()["hot_blocks"] if mode != "dense" else 0
        super().__init__(str(m.resolve(path, m.base.file)), **kwargs)
        _llama_cpp.set_ffn_builder(self, FFNEngine.builder_address(), self._engine.address)
        # the op's I/O errors surface as a Python exception right after the decode that hit them
        _llama_cpp.wrap_decode(self, self._engine.raise_pending)
        self.speculative = spec
        if spec != "off":
            from .speculative import Drafter

            self._drafter = Drafter(self, spec, k_max, spec_stop, spec_fraction)
            self.draft_model = self._drafter   # llama-cpp-python's generate verifies what it proposes

    def eval(self, tokens):
        """llama_cpp.Llama.eval; a speculative verify pass (the drafter said so) gets the logits of
        every row it decodes, not only the last (sampling compares them with the draft), without
        logits_all's n_ctx x n_vocab array. Passes are timed for the draft controller."""
        rows = self.__dict__.pop("_verify_rows", None)
        d = self._drafter
        t0 = time.perf_counter()
        if rows is None or rows != len(tokens) or _llama_cpp.logits_all(self):
            super().eval(tokens)
        else:
            _llama_cpp.decode_all_rows(self, tokens)
        if d is not None and (rows is not None or len(tokens) == 1):
            d.verify_timed(len(tokens), time.perf_counter() - t0)

    def generate(self, tokens, *args, **kwargs):
        if self._drafter is not None:
            self._drafter.finish()   # the last answer's final verify, counted before the KV cache changes
        return super().generate(tokens, *args, **kwargs)

    def _check_layers_match_manifest(self) -> None:
        """The block files' headers (checksummed) agree with what the manifest says of them."""
        for e in self.manifest.layers:
            info = self._engine.layer_info(e.il)
            have = (info["n_blocks"], info["block_stride"], info["block_payload"], info["data_offset"],
                    manifest_mod.GGML_TYPE_NAMES.get(info["gate_type"]), manifest_mod.GGML_TYPE_NAMES.get(info["up_type"]),
                    manifest_mod.GGML_TYPE_NAMES.get(info["down_type"]), info["n_embd"], info["n_ff"],
                    info["neurons_per_block"])
            want = (e.n_blocks, e.block_stride, e.block_payload, e.data_offset, e.gate_type, e.up_type, e.down_type,
                    self.manifest.n_embd, self.manifest.n_ff, self.manifest.block.k)
            if have != want:
                raise manifest_mod.ManifestError(
                    f"{self.model_dir / e.file}: its header does not match the manifest's layers[{e.il}] "
                    f"(file: {have}, manifest: {want}); re-run `leanstream convert` with --force")

    def _block_rank(self, path: Path, rel: str | None = None):
        """The calibration frequencies of every block (predictor/block_freq.npy, or without
        predictors the order stage's sketch/block_freq.npy: [n_layer, n_blocks] f32), checked, or
        None: the engine pins the best-ranked ones (the hot set of powerinfer2 and leanstream).
        The predictors' per-block prior is most of what they know (README: predictors), so the
        blocks a static hot set holds are hit by almost every token; without a hot set, a budget
        below one token's reads is a cyclic scan that LRU evicts just before reuse (measured: no
        cache hit at all on Qwen2.5-1.5B at 35 and 50 % budgets)."""
        import numpy as np

        m = self.manifest
        rel = rel or m.block_freq_file()
        if not rel:
            return None
        freq_path = m.resolve(path, rel)
        try:
            freq = np.load(freq_path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise manifest_mod.ManifestError(f"{freq_path}: not a readable .npy array ({e})") from None
        n_blocks = {le.n_blocks for le in m.layers}
        if (not isinstance(freq, np.ndarray) or freq.ndim != 2 or freq.shape[0] != m.n_layer
                or len(n_blocks) != 1 or freq.shape[1] != n_blocks.pop()
                or not np.issubdtype(freq.dtype, np.floating) or not np.all(np.isfinite(freq))):
            raise manifest_mod.ManifestError(
                f"{freq_path}: block frequencies must be finite floats of shape [n_layer, n_blocks] = "
                f"[{m.n_layer}, {m.layers[0].n_blocks}], got {getattr(freq, 'dtype', '?')} {getattr(freq, 'shape', '?')}")
        return freq

    def _install_controller(self, controller: str):
        """The tuned policy in force (None: off, or fixed on the default actions)."""
        if controller == "off":
            return None
        from . import control

        policies = control.load_policies(self.model_dir, self.manifest)
        if controller == "table":
            pol = control.pick_policy(policies, self._engine.memory_budget, self.sparsity)
            self._engine.set_controller("table", actions=pol.actions, load_edges=pol.load_edges,
                                        disk_edges=pol.disk_edges, table=pol.table)
            return pol
        k = int(controller.split(":")[1])
        try:
            pol = control.pick_policy(policies, self._engine.memory_budget, self.sparsity)
        except control.ControllerError:
            pol = None
        actions = pol.actions if pol else list(control.DEFAULT_ACTIONS)
        if k >= len(actions):
            raise params.ParameterError("controller", f"fixed:{k}: there are {len(actions)} actions (0..{len(actions) - 1})")
        self._engine.set_controller("fixed", actions=actions, fixed_action=k)
        return pol

    @property
    def engine(self) -> FFNEngine:
        return self._engine

    def stats(self, layer: int | None = None) -> dict:
        """Engine counters (docs/design.md §5): blocks computed/read, bytes, miss ratio, stalls, ...
        (totals: summed over layers, except ``tokens``, the token rows the model processed);
        ``speculative``: passes, drafted, accepted, tokens per pass, draft and verify seconds."""
        s = self._live_engine().stats(layer)
        if self._drafter is not None:
            self._drafter.finish()
            s["speculative"] = self._drafter.stats.as_dict()
        return s

    def reset_stats(self) -> None:
        self._live_engine().reset_stats()
        if self._drafter is not None:
            from .speculative import SpecStats

            self._drafter.finish()
            self._drafter.stats = SpecStats()

    def perf_context(self):
        """llama.cpp's counters of this context since it was created or ``reset_perf()``
        (``llama_perf_context_data``: n_p_eval / t_p_eval_ms the prompt's tokens and
        milliseconds, n_eval / t_eval_ms the decoded ones'; ``context.perf_context``)."""
        return context.perf_context(self)

    def reset_perf(self) -> None:
        context.reset_perf(self)

    def logits(self, i: int = -1):
        """f32 [n_vocab]: the logits of row i of the last decode (-1: the last row; without
        logits_all only the rows a batch asked for have them), a view valid until the next
        decode (``context.logits``)."""
        return context.logits(self, i)

    def _live_engine(self) -> FFNEngine:
        if self._engine is None:
            raise ClosedError("this Llama is closed")
        return self._engine

    def close(self) -> None:
        # the context (whose graphs point at the engine) goes first, then the engine; every
        # handle llama-cpp-python leaves behind raises ClosedError from now on
        _llama_cpp.close(self, ClosedError)
        if getattr(self, "_drafter", None) is not None:
            self._drafter.close()
            self._drafter = self.draft_model = None
        if getattr(self, "_engine", None) is not None:
            self._engine.close()
            self._engine = None
