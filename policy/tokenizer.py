"""Byte-level tokenizer with a few special tokens and a chat template.

Ids 0..255 are the raw UTF-8 bytes; specials follow. The chat template renders::

    <|bos|> ( <|system|>|<|user|>|<|assistant|>|<|tool|>  content-bytes  <|end|> )*  [<|assistant|>]

An assistant message's tool calls are rendered after its content as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` bytes, and a tool message carries its
``tool_call_id`` as ``[id] `` before the result, so the template is lossless for everything a Step
records. Generation ends at ``<|end|>`` (or ``<|eos|>``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

BYTE_TOKENS = 256
PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, TOOL, END = range(256, 264)
SPECIALS = {"<|pad|>": PAD, "<|bos|>": BOS, "<|eos|>": EOS, "<|system|>": SYSTEM, "<|user|>": USER,
            "<|assistant|>": ASSISTANT, "<|tool|>": TOOL, "<|end|>": END}
ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}
VOCAB_SIZE = 264
STOP_TOKENS = frozenset({END, EOS})


def _get(m: Any, key: str) -> Any:
    if isinstance(m, Mapping):
        return m.get(key)
    return getattr(m, key, None)


class ByteTokenizer:
    vocab_size = VOCAB_SIZE
    pad_id, bos_id, eos_id, end_id = PAD, BOS, EOS, END
    stop_ids = STOP_TOKENS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        out = bytearray()
        names = {v: k for k, v in SPECIALS.items()}
        for i in ids:
            i = int(i)
            if i < BYTE_TOKENS:
                out.append(i)
            elif not skip_special:
                out.extend(names.get(i, f"<|{i}|>").encode())
        return out.decode("utf-8", errors="replace")

    def render_message(self, message: Any) -> list[int]:
        role = _get(message, "role")
        if role not in ROLE_TOKENS:
            raise ValueError(f"unknown chat role {role!r}; expected one of {sorted(ROLE_TOKENS)}")
        text = _get(message, "content") or ""
        if isinstance(text, list):  # OpenAI content parts: keep the text ones
            text = "".join(p.get("text", "") for p in text if isinstance(p, Mapping))
        if role == "tool" and _get(message, "tool_call_id"):
            text = f"[{_get(message, 'tool_call_id')}] {text}"
        for call in _get(message, "tool_calls") or ():
            fn = _get(call, "function") or call
            text += "<tool_call>" + json.dumps({"name": _get(fn, "name"), "arguments": _get(fn, "arguments")},
                                               separators=(",", ":")) + "</tool_call>"
        return [ROLE_TOKENS[role], *self.encode(text), END]

    def encode_chat(self, messages: Sequence[Any], *, add_generation_prompt: bool = True) -> list[int]:
        ids = [BOS]
        for m in messages:
            ids.extend(self.render_message(m))
        if add_generation_prompt:
            ids.append(ASSISTANT)
        return ids


TOKENIZER = ByteTokenizer()
