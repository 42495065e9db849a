"""Shared fixtures: the real SmolLM2 model (docs/design.md §7) and its conversion, once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from leanstream_ggml import models

    return models.fetch("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, tmp_path_factory) -> Path:
    from converters import convert

    out = tmp_path_factory.mktemp("smollm2") / "smollm2.lsm"
    convert(smollm2_gguf, out, progress=False)
    return out


@pytest.fixture(scope="session")
def prose() -> str:
    return (DATA / "prose.txt").read_text()


@pytest.fixture(scope="session")
def smollm2_sketch_dir(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2 converted the default way: block files + the 2-bit sketch (leanstream mode)."""
    from converters.stages import convert_model

    out = tmp_path_factory.mktemp("smollm2-sketch") / "smollm2.lsm"
    convert_model(smollm2_gguf, out, progress=False)
    return out
