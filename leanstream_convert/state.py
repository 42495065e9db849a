"""A conversion's state while it is unfinished, in OUT/.convert/: ``state.json`` (the source's
sha256 and every parameter the outputs depend on), one ``<stage>.done`` marker per finished stage
(the stage table in stages.py names them; a marker may keep the stage's small result) and
``stages.json`` (what each stage measured). The only marker mechanism of the converter: the
predictors' profile and training stages are markers here like every other stage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from leanstream_ggml.model import manifest as mf

from .convert_gguf import ConvertError
from .fileio import PARTIAL, atomic_write_json

STATE_DIR = ".convert"     # the converter's own state while a conversion is unfinished
STATE_NAME = "state.json"


class State:
    """OUT/.convert/: the parameters of an unfinished conversion and its stage markers."""

    def __init__(self, out: Path):
        self.dir = out / STATE_DIR

    def load(self) -> dict | None:
        try:
            return json.loads((self.dir / STATE_NAME).read_text())
        except (OSError, ValueError):
            return None

    def start(self, params: dict) -> None:
        self.dir.mkdir(exist_ok=True)
        atomic_write_json(self.dir / STATE_NAME, params)

    def done(self, stage: str) -> bool:
        return (self.dir / f"{stage}.done").exists()

    def mark(self, stage: str, result: Any = None) -> None:
        atomic_write_json(self.dir / f"{stage}.done", {"stage": stage, "result": result})

    def result(self, stage: str) -> Any:
        try:
            return json.loads((self.dir / f"{stage}.done").read_text()).get("result")
        except (OSError, ValueError):
            return None

    def load_records(self) -> dict:
        """What the finished stages of an interrupted run measured (StageMeter.records)."""
        try:
            return json.loads((self.dir / "stages.json").read_text())
        except (OSError, ValueError):
            return {}

    def save_records(self, records: dict) -> None:
        atomic_write_json(self.dir / "stages.json", records)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def clean_outputs(out: Path) -> None:
    """Remove what a conversion writes (and nothing else); the manifest first, so the directory
    never looks complete while it is being rewritten."""
    (out / mf.MANIFEST_NAME).unlink(missing_ok=True)
    shutil.rmtree(out / STATE_DIR, ignore_errors=True)
    shutil.rmtree(out / mf.PREDICTOR_DIR, ignore_errors=True)
    shutil.rmtree(out / mf.SKETCH_DIR, ignore_errors=True)
    shutil.rmtree(out / mf.DRAFT_DIR, ignore_errors=True)
    for name in (mf.BASE_NAME, mf.BASE_NAME + PARTIAL, mf.MANIFEST_NAME + PARTIAL, ".convert-state.json"):
        (out / name).unlink(missing_ok=True)
    if (out / mf.FFN_DIR).is_dir():
        for p in out.glob(mf.BLOCK_FILE.format(il="*") + "*"):
            p.unlink()


def prepare_out_dir(out: Path, params: dict, force: bool) -> bool:
    """Create/check OUT_DIR for a conversion with these parameters. Returns True when resuming an
    interrupted run of the same conversion."""
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    state = State(out)
    resume = False
    if any(out.iterdir()):
        old = state.load()
        if force:
            clean_outputs(out)
        elif (out / mf.MANIFEST_NAME).exists():
            raise ConvertError(f"{out}: already holds a converted model (manifest.json); "
                               f"use --force to overwrite it")
        elif old is None:
            raise ConvertError(f"{out}: directory is not empty and holds no interrupted conversion; "
                               f"choose an empty or new directory, or use --force")
        elif old != params:
            changed = sorted(k for k in set(old) | set(params) if old.get(k) != params.get(k))
            raise ConvertError(f"{out}: holds an interrupted conversion of another source or with other "
                               f"parameters ({', '.join(changed)}); re-run it as it was, or use --force to start over")
        else:
            resume = True
    if not resume:
        state.start(params)
    for folder in (out, out / mf.FFN_DIR, out / mf.PREDICTOR_DIR, out / mf.SKETCH_DIR):
        if folder.is_dir():
            for p in folder.glob("*" + PARTIAL):
                p.unlink()   # left by an interrupted write
    return resume
