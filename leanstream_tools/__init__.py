"""The tools on top of the library: the numbers the project is judged by, computed one way for
every system, and the commands that compute them (`leanstream bench|perplexity|compare|eval|tune`).

    measure.py     process counters (peak RSS, disk bytes), sizes, machine description, page cache
    cgroup.py      whole-process memory limits: a child memory cgroup under our own (cgroup v1)
    systems.py     open a model as "stock" (llama-cpp-python on a GGUF) or the plugin (a model dir)
    bench.py       prefill / decode tokens/s, llama-bench style (`leanstream bench`)
    perplexity.py  llama-perplexity style scoring, top-1 agreement and KL vs a reference
    texts.py       the held-out texts and chats (read through leanstream_ggml.texts)
    quants.py      stock's smaller quantizations, made with llama.cpp's quantizer
    cli.py         the `bench` and `perplexity` subcommands
    compare/       `leanstream compare`: setups -> runner (typed results) -> report
    humaneval.py   `leanstream eval humaneval`: task quality
    tune.py        `leanstream tune`: the streaming controller's table for this machine and disk

Like llama.cpp's tools over `llama.h`, these use only the library's public API (`leanstream_ggml`
and its modules without a leading underscore; tests/unit/test_walls.py checks it), and the library
never imports them: the `leanstream` command finds them through the `leanstream.commands` entry
points (pyproject.toml). Every system runs through the same functions here, so a difference in a
number is a difference in the system, not in how it was measured. Importing this package loads
no llama.cpp.
"""
