"""The held-out evaluation texts (never calibration), in ``data/``: ``heldout-technical.txt``
(prose), ``heldout-code.txt`` (a snapshot of three of this project's sources that calibration
does not use: ``bench/replay_eviction.py``, ``leanstream_ggml/commands/server.py``, ``native/src/cache.c``;
code no model was trained on) and ``heldout-chat.jsonl`` (conversations written for this project).
They are read as the model sees them by the library's ``leanstream_ggml.texts.text_tokens``.
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
HELDOUT = {"prose": DATA / "heldout-technical.txt", "code": DATA / "heldout-code.txt",
           "chat": DATA / "heldout-chat.jsonl"}
