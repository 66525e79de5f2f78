"""Read a GGUF's metadata and tensor table in pure Python, before any C call can abort on it.

`read_gguf` turns every way a file can be wrong (missing, not a GGUF, truncated) into one
`Eagle3Error` line. `TargetInfo` and `HeadInfo` are what the pair check, `info` and the converter
need to know about the two kinds of file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import keys
from .errors import Eagle3Error

GGUF_MAGIC = b"GGUF"


@dataclass
class TensorEntry:
    name: str
    shape: list[int]  # GGUF order (ne[0] first: the row length)
    type: str  # ggml type name: F32, F16, Q4_0, I64, ...
    n_bytes: int


@dataclass
class GGUFFile:
    path: Path
    arch: str
    metadata: dict[str, Any]
    tensors: list[TensorEntry]
    file_size: int

    def get(self, template: str, default: Any = None) -> Any:
        """A metadata value; `{arch}` in the key is filled with this file's architecture."""
        return self.metadata.get(keys.arch_key(template, self.arch), default)

    def tensor(self, name: str) -> TensorEntry | None:
        return next((t for t in self.tensors if t.name == name), None)

    @property
    def n_vocab(self) -> int:
        tokens = self.metadata.get(keys.KEY_TOKENIZER_TOKENS)
        if tokens is not None:
            return len(tokens)
        return int(self.get(keys.KEY_VOCAB_SIZE, 0))


def _value(field) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def read_gguf(path: str | Path, *, with_tokens: bool = True) -> GGUFFile:
    """Parse a GGUF's header, metadata and tensor table; raise Eagle3Error on any defect."""
    from gguf import GGUFReader  # deferred: importing gguf costs ~0.2 s

    path = Path(path)
    if not path.exists():
        raise Eagle3Error(f"{path}: no such file")
    if not path.is_file():
        raise Eagle3Error(f"{path}: not a file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise Eagle3Error(f"{path}: not a GGUF file (expected magic 'GGUF', found {magic!r})")
    try:
        reader = GGUFReader(path)
        metadata: dict[str, Any] = {}
        for name, fld in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            if not with_tokens and name.startswith(keys.TOKENIZER_PREFIX) and name != keys.KEY_CHAT_TEMPLATE:
                metadata[name] = _LazyLen(len(fld.data)) if name == keys.KEY_TOKENIZER_TOKENS else None
                continue
            metadata[name] = _value(fld)
        tensors = []
        data_end = 0
        for t in reader.tensors:
            tensors.append(TensorEntry(t.name, [int(x) for x in t.shape], t.tensor_type.name, int(t.n_bytes)))
            data_end = max(data_end, int(t.data_offset) + int(t.n_bytes))
    except Eagle3Error:
        raise
    except Exception as e:  # GGUFReader raises ValueError/IndexError/struct errors on bad bytes
        if "cannot reshape" in str(e):  # a tensor's data runs past the end of the file
            raise Eagle3Error(f"{path}: truncated GGUF (tensor data ends early; the file has {size} bytes): "
                              "download or convert it again") from None
        raise Eagle3Error(f"{path}: not a valid GGUF (truncated or corrupt: {str(e).splitlines()[0]})") from None
    if data_end > size:
        raise Eagle3Error(f"{path}: truncated GGUF (tensor data needs {data_end} bytes, the file has {size}): "
                          "download or convert it again")
    arch = metadata.get(keys.KEY_ARCHITECTURE)
    if not isinstance(arch, str):
        raise Eagle3Error(f"{path}: GGUF has no {keys.KEY_ARCHITECTURE}")
    return GGUFFile(path, arch, metadata, tensors, size)


class _LazyLen(list):
    """Stands in for a large token list when only its length is wanted."""

    def __init__(self, n: int):
        super().__init__()
        self._n = n

    def __len__(self) -> int:
        return self._n


@dataclass
class TargetInfo:
    path: Path
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    hooked: bool  # the pinned llama.cpp can extract its layer inputs
    n_ctx_train: int = 0
    has_chat_template: bool = False

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "TargetInfo":
        if g.arch == keys.ARCH_EAGLE3:
            raise Eagle3Error(f"{g.path}: this is an EAGLE-3 head, not a target model")
        n_layer = g.get(keys.KEY_BLOCK_COUNT)
        n_embd = g.get(keys.KEY_EMBEDDING_LENGTH)
        if n_layer is None or n_embd is None:
            raise Eagle3Error(f"{g.path}: GGUF lacks {g.arch}.block_count or {g.arch}.embedding_length")
        return cls(g.path, g.arch, int(n_layer), int(n_embd), g.n_vocab, g.arch in keys.HOOKED_TARGET_ARCHS,
                   int(g.get(keys.KEY_CONTEXT_LENGTH, 0)), keys.KEY_CHAT_TEMPLATE in g.metadata)


@dataclass
class HeadInfo:
    path: Path
    target_layers: list[int]
    target_hidden_size: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int  # the target vocabulary the head's tokenizer (and logits) span
    draft_vocab: int | None  # len(d2t), None when the head drafts over the full vocab
    norm_before_residual: bool
    norm_before_fc: bool
    own_token_embd: bool
    own_output: bool
    tensors: list[TensorEntry] = field(default_factory=list)

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "HeadInfo":
        if g.arch != keys.ARCH_EAGLE3:
            raise Eagle3Error(f"{g.path}: architecture is '{g.arch}', not an EAGLE-3 head ('eagle3')")
        layers = g.get(keys.KEY_TARGET_LAYERS)
        if layers is None or len(layers) != 3:
            raise Eagle3Error(f"{g.path}: eagle3 GGUF needs exactly 3 {keys.arch_key(keys.KEY_TARGET_LAYERS, 'eagle3')}")
        hidden = g.get(keys.KEY_TARGET_HIDDEN_SIZE)
        if hidden is None:
            raise Eagle3Error(f"{g.path}: eagle3 GGUF lacks {keys.arch_key(keys.KEY_TARGET_HIDDEN_SIZE, 'eagle3')}")
        d2t = g.tensor(keys.T_D2T)
        return cls(
            g.path, [int(x) for x in layers], int(hidden), int(g.get(keys.KEY_EMBEDDING_LENGTH, 0)),
            int(g.get(keys.KEY_HEAD_COUNT, 0)), int(g.get(keys.KEY_HEAD_COUNT_KV, 0)),
            int(g.get(keys.KEY_FEED_FORWARD_LENGTH, 0)), g.n_vocab, d2t.shape[0] if d2t else None,
            bool(g.get(keys.KEY_NORM_BEFORE_RESIDUAL, False)), bool(g.get(keys.KEY_NORM_BEFORE_FC, False)),
            g.tensor(keys.T_TOKEN_EMBD) is not None, g.tensor(keys.T_OUTPUT) is not None, g.tensors,
        )


def copy_tokenizer(src: str | Path, writer) -> int:
    """Copy every `tokenizer.*` key of the GGUF at `src` into a gguf.GGUFWriter; returns the vocab size.

    A head must carry its target's tokenizer: llama.cpp loads a vocab for every model, and the eagle3
    graph scatters draft logits into `vocab.n_tokens()` slots.
    """
    from gguf import GGUFReader, GGUFValueType

    try:
        reader = GGUFReader(src)
    except Exception as e:
        raise Eagle3Error(f"{src}: not a valid GGUF ({str(e).splitlines()[0]})") from None
    n_vocab = 0
    for name, fld in reader.fields.items():
        if not name.startswith(keys.TOKENIZER_PREFIX):
            continue
        vtype = fld.types[0]
        sub = fld.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, fld.contents(), vtype, sub_type=sub)
        if name == keys.KEY_TOKENIZER_TOKENS:
            n_vocab = len(fld.data)
    if not n_vocab:
        raise Eagle3Error(f"{src}: GGUF carries no tokenizer ({keys.KEY_TOKENIZER_TOKENS})")
    return n_vocab
