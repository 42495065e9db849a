"""The converter's `leanstream` subcommands, as the library's command line finds them: each is an
entry point of the group ``leanstream.commands`` (pyproject.toml) naming one of the objects
below. Loading one imports only this module (and the library's light cli module); the command's
own module is imported when it runs.
"""

from __future__ import annotations

from leanstream_ggml.cli import Command

convert = Command("leanstream_convert.cli", "convert a GGUF model into a LeanStream model directory")
profile = Command("leanstream_convert.train.cli", "profile a GGUF with stock llama.cpp for predictor training")
train_predictor = Command("leanstream_convert.train.cli", "train and export the hashing predictors from a profile")
