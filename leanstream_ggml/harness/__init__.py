"""Measurement harness: the numbers the project is judged by, computed one way for every system.

    measure.py     process counters (peak RSS, disk bytes), sizes, machine description, page cache
    cgroup.py      whole-process memory limits: a child memory cgroup under our own (cgroup v1)
    systems.py     open a model as "stock" (llama-cpp-python on a GGUF) or "leanstream" (a model dir)
    bench.py       prefill / decode tokens/s, llama-bench style (`leanstream bench`)
    perplexity.py  llama-perplexity style scoring, top-1 agreement and KL vs a reference
    cli.py         the `bench` and `perplexity` subcommands
    compare.py     `leanstream compare`: stock quants and the plugin side by side under one limit

Every system runs through the same functions here, so a difference in a number is a difference
in the system, not in how it was measured. Importing this package loads no llama.cpp.
"""
