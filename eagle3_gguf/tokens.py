"""Text ↔ tokens through the model's own vocab (llama.cpp's tokenizer and chat templates)."""

from __future__ import annotations

import codecs
import ctypes
from dataclasses import dataclass
from typing import Callable

from llama_cpp import llama_cpp as C

from .errors import Eagle3Error
from .native import Model


def tokenize(model: Model, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
    data = text.encode("utf-8")
    n_max = len(data) + 16
    buf = (C.llama_token * n_max)()
    n = C.llama_tokenize(model.vocab, data, len(data), buf, n_max, add_special, parse_special)
    if n < 0:  # buffer too small: -n is the size needed
        buf = (C.llama_token * -n)()
        n = C.llama_tokenize(model.vocab, data, len(data), buf, -n, add_special, parse_special)
    if n < 0:
        raise Eagle3Error("the prompt could not be tokenized")
    return list(buf[:n])


def token_bytes(model: Model, token: int, *, special: bool = False) -> bytes:
    buf = ctypes.create_string_buffer(128)
    n = C.llama_token_to_piece(model.vocab, token, buf, len(buf), 0, special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = C.llama_token_to_piece(model.vocab, token, buf, len(buf), 0, special)
    return buf.raw[:max(n, 0)]


def detokenize(model: Model, tokens: list[int]) -> str:
    return b"".join(token_bytes(model, t) for t in tokens).decode("utf-8", errors="replace")


class Detokenizer:
    """Streams text token by token, holding back bytes of an incomplete UTF-8 character."""

    def __init__(self, model: Model):
        self.model = model
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tokens: list[int]) -> str:
        return self._decoder.decode(b"".join(token_bytes(self.model, t) for t in tokens))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def is_eog(model: Model, token: int) -> bool:
    return bool(C.llama_vocab_is_eog(model.vocab, token))


def eog_check(model: Model) -> Callable[[int], bool]:
    """is_eog for one model, remembered per token: a decoding loop asks once per emitted token, right after
    a decode, when a call into llama.cpp runs cache-cold (~3 us) and a dict look-up does not."""
    seen: dict[int, bool] = {}

    def check(token: int) -> bool:
        end = seen.get(token)
        if end is None:
            end = seen[token] = is_eog(model, token)
        return end

    return check


@dataclass
class Message:
    role: str
    content: str


def apply_chat_template(model: Model, messages: list[Message], *, add_assistant: bool = True) -> str:
    """Render messages with the chat template stored in the model's GGUF (llama.cpp's built-in engine)."""
    tmpl = C.llama_model_chat_template(model._live(), None)
    if not tmpl:
        raise Eagle3Error(f"{model.path.name} has no chat template: drop --chat and pass the raw prompt")
    keep = [(m.role.encode(), m.content.encode()) for m in messages]
    chat = (C.llama_chat_message * len(keep))(*[C.llama_chat_message(r, c) for r, c in keep])
    size = sum(len(r) + len(c) for r, c in keep) * 2 + 256
    buf = ctypes.create_string_buffer(size)
    n = C.llama_chat_apply_template(tmpl, chat, len(keep), add_assistant, buf, size)
    if n > size:
        buf = ctypes.create_string_buffer(n)
        n = C.llama_chat_apply_template(tmpl, chat, len(keep), add_assistant, buf, n)
    if n < 0:
        raise Eagle3Error(f"llama.cpp does not support the chat template of {model.path.name}: drop --chat")
    return buf.raw[:n].decode("utf-8")


def chat_tokens(model: Model, prompt: str) -> list[int]:
    """One user turn as `generate --chat` and the benchmark send it: the model's chat template, then
    tokenize without adding BOS (a template writes its own)."""
    return tokenize(model, apply_chat_template(model, [Message("user", prompt)]), add_special=False)
