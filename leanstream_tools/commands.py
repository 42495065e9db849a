"""The tools' `leanstream` subcommands, as the library's command line finds them: each is an
entry point of the group ``leanstream.commands`` (pyproject.toml) naming one of the objects
below. Loading one imports only this module; the command's own module is imported when it is
registered, i.e. when that command runs.
"""

from __future__ import annotations

from leanstream_ggml.cli import Command


bench = Command("leanstream_tools.cli", "decode/prefill speed, peak memory and disk reads")
perplexity = Command("leanstream_tools.cli", "perplexity on held-out text (optionally vs stock)")
compare = Command("leanstream_tools.compare", "stock quants and the plugin side by side under a memory limit")
eval = Command("leanstream_tools.humaneval", "task quality: HumanEval pass@1 (greedy, chat template)")  # noqa: A001
tune = Command("leanstream_tools.tune", "synthesize the streaming controller's table on this machine and disk")
