"""Texts as the model sees them: plain text files (prose, source code) and chat files (``.jsonl``,
one conversation per line: ``{"messages": [{"role", "content"}, ...]}`` or a bare list of messages)
rendered with the model's own chat template, special tokens parsed, so a chat is scored on the
tokens chat use feeds the model.

    tokens, add_bos = text_tokens(llm, "chats.jsonl")     # for scoring.windows

The converter's calibration and the tools (`leanstream perplexity --text`, bench/) read their
texts through this module, so a text is tokenized the same way wherever it is scored. Which texts
are held out for evaluation is the tools' business (leanstream_tools/texts.py), never the
library's or the converter's.
"""

from __future__ import annotations

import json
from pathlib import Path


def is_chat(path) -> bool:
    return Path(path).suffix == ".jsonl"


def read_chats(path) -> list[list[dict]]:
    """The conversations of a .jsonl chat file (ValueError naming the line that is not one)."""
    chats = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        msgs = obj.get("messages") if isinstance(obj, dict) else obj
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise ValueError(f"{path}:{n}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}}")
        chats.append(msgs)
    return chats


def render_chat(llm, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """A conversation in the model's chat template (a llama_cpp.Llama's GGUF metadata), up to the
    assistant's next answer if add_generation_prompt; "Role: content" lines when the GGUF has no
    template."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    tmpl = llm.metadata.get("tokenizer.chat_template")
    if not tmpl:
        return ("".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
                + ("Assistant: " if add_generation_prompt else ""))
    from leanstream_ggml.llamacpp import context

    eos = context.token_text(llm, llm.token_eos()) if llm.token_eos() >= 0 else ""
    bos = context.token_text(llm, llm.token_bos()) if llm.token_bos() >= 0 else ""
    f = Jinja2ChatFormatter(template=tmpl, eos_token=eos, bos_token=bos, add_generation_prompt=add_generation_prompt)
    return f(messages=messages).prompt


def tokenize_for_perplexity(llm, text: str) -> tuple[list[int], bool]:
    """(tokens, add_bos): the text's tokens with BOS first iff the vocabulary adds one."""
    with_special = llm.tokenize(text.encode("utf-8"), add_bos=True)
    plain = llm.tokenize(text.encode("utf-8"), add_bos=False)
    return with_special, len(with_special) > len(plain)


def text_tokens(llm, path) -> tuple[list[int], bool]:
    """(tokens, add_bos) of a text or chat file for perplexity windows (scoring.windows): BOS
    first iff the vocabulary adds one; chats rendered and concatenated, special tokens parsed."""
    if not is_chat(path):
        return tokenize_for_perplexity(llm, Path(path).read_text(encoding="utf-8"))
    text = "".join(render_chat(llm, c) for c in read_chats(path))
    body = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    bos = llm.tokenize(b"", add_bos=True, special=True)
    if bos and body[:1] == bos:     # the template writes BOS itself (gemma's "<bos>")
        body = body[1:]
    return bos + body, bool(bos)
