"""Encode float32 tensors as GGUF stores them: f32, f16, bf16, Q8_0, Q4_0.

Q4_0 and Q8_0 follow ggml's reference quantizers (`quantize_row_q4_0_ref` / `quantize_row_q8_0_ref`
in ggml/src/ggml-quants.c) step by step in float32, so the bytes equal ggml's bit for bit:

- Q4_0, per block of 32: `max` = the first value of largest magnitude (+0.0 in an all-zero block,
  even of -0.0s); `d = max / -8`;
  `id = 1/d` (0 when d == 0); `q = min(15, (int8)(x*id + 8.5))`, low nibbles = first 16 values,
  high nibbles = last 16; stored as {f16 d, 16 bytes}.
- Q8_0, per block of 32: `d = amax / 127`; `q = roundf(x*id)` (halves away from zero); {f16 d, 32 int8}.
- f16 and the block scales round to nearest even (numpy's cast = ggml's FP32_TO_FP16);
  bf16 rounds to nearest even with NaNs kept quiet, as ggml_compute_fp32_to_bf16 does.

Work goes in chunks of rows, so a tensor's temporaries stay a fraction of its own size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as GT

from ..errors import Eagle3Error

QK = 32  # elements per block, both Q4_0 and Q8_0
BLOCK_BYTES = {GT.Q4_0: 2 + QK // 2, GT.Q8_0: 2 + QK}
TYPE_NAMES = {"f32": GT.F32, "f16": GT.F16, "bf16": GT.BF16, "q8_0": GT.Q8_0, "q4_0": GT.Q4_0}
_CHUNK_ELEMENTS = 1 << 18  # rows per chunk are chosen so a chunk holds about this many values


@dataclass
class Encoded:
    data: np.ndarray  # what goes into the file: float32/float16/uint16 [rows, n] or uint8 [rows, n_bytes_per_row]
    ggml_type: GT
    rel_error: float  # ||x - decode(encode(x))|| / ||x||  (0.0 when exact)


def ggml_type(name: str) -> GT:
    try:
        return TYPE_NAMES[name.lower()]
    except KeyError:
        raise Eagle3Error(f"unknown tensor type '{name}' (choose from {', '.join(TYPE_NAMES)})") from None


def n_bytes(shape: tuple[int, ...], t: GT) -> int:
    """Bytes of a tensor of `shape` (numpy order, last = row length) stored as `t`."""
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if t in BLOCK_BYTES:
        return n // QK * BLOCK_BYTES[t]
    return n * {GT.F32: 4, GT.F16: 2, GT.BF16: 2, GT.I64: 8}[t]


def can_quantize(shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and shape[-1] % QK == 0


# ------------------------------------------------------------------------------------------------
# Block quantizers (one chunk of rows at a time)
# ------------------------------------------------------------------------------------------------


def _fp16_bytes(d: np.ndarray) -> np.ndarray:
    """float32 scales → their f16 bit patterns as 2 bytes each (inf past f16's range: encode() says so).
    # [nb, 2] uint8"""
    with np.errstate(over="ignore"):
        return d.astype(np.float16).view(np.uint8).reshape(-1, 2)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """[rows, n] float32 → [rows, n/32*18] uint8, as ggml's quantize_row_q4_0_ref."""
    rows, n = x.shape
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, QK)  # [nb, 32]
    first_max = np.argmax(np.abs(blocks), axis=1)  # first index of the largest |v|, as the C loop's '<'
    vmax = blocks[np.arange(len(blocks)), first_max]  # [nb] signed
    vmax = np.where(vmax != 0, vmax, np.float32(0))  # all-zero block: C keeps max = +0.0f, even for -0.0 inputs
    d = vmax / np.float32(-8)  # [nb] float32
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)  # [nb]
    scaled = blocks * inv[:, None]  # [nb, 32] float32
    q = np.minimum(np.trunc(scaled + np.float32(8.5)), 15).astype(np.uint8)  # (int8_t) cast truncates
    out = np.empty((len(blocks), BLOCK_BYTES[GT.Q4_0]), dtype=np.uint8)  # [nb, 18]
    out[:, :2] = _fp16_bytes(d)
    out[:, 2:] = q[:, : QK // 2] | (q[:, QK // 2:] << 4)
    return out.reshape(rows, n // QK * BLOCK_BYTES[GT.Q4_0])


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """[rows, n] float32 → [rows, n/32*34] uint8, as ggml's quantize_row_q8_0_ref."""
    rows, n = x.shape
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, QK)  # [nb, 32]
    d = np.abs(blocks).max(axis=1) / np.float32(127)  # [nb] float32
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)  # [nb]
    scaled = (blocks * inv[:, None]).astype(np.float64)  # [nb, 32]; float32 products, exact in f64
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)).astype(np.int8)  # roundf: halves away from 0
    out = np.empty((len(blocks), BLOCK_BYTES[GT.Q8_0]), dtype=np.uint8)  # [nb, 34]
    out[:, :2] = _fp16_bytes(d)
    out[:, 2:] = q.view(np.uint8)
    return out.reshape(rows, n // QK * BLOCK_BYTES[GT.Q8_0])


def dequantize(data: np.ndarray, t: GT, n_per_row: int) -> np.ndarray:
    """Stored rows (typed, or raw uint8 bytes as in a file) → float32 values.  # [rows, n_per_row]"""
    if t in (GT.F32, GT.F16, GT.BF16) and data.dtype == np.uint8:
        data = data.view({GT.F32: np.float32, GT.F16: np.float16, GT.BF16: np.uint16}[t])
    if t == GT.F32:
        return data.astype(np.float32)
    if t == GT.F16:
        return data.astype(np.float32)
    if t == GT.BF16:
        return (data.astype(np.uint32) << 16).view(np.float32)
    rows = data.shape[0]
    blocks = data.reshape(-1, BLOCK_BYTES[t])  # [nb, block bytes]
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [nb, 1]
    if t == GT.Q8_0:
        q = blocks[:, 2:].view(np.int8).astype(np.float32)  # [nb, 32]
    elif t == GT.Q4_0:
        qs = blocks[:, 2:]  # [nb, 16]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32) - 8  # [nb, 32]
    else:
        raise ValueError(f"no dequantizer for {t.name}")
    return (q * d).reshape(rows, n_per_row)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 → bf16 bit patterns (uint16), round to nearest even, NaNs made quiet."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u.astype(np.uint64) + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 64).astype(np.uint16), rounded)


# ------------------------------------------------------------------------------------------------
# One tensor
# ------------------------------------------------------------------------------------------------


def encode(x: np.ndarray, t: GT, name: str = "tensor") -> Encoded:
    """Encode a float32 tensor as `t`, chunk by chunk, measuring the relative error."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows2d = x.reshape(-1, x.shape[-1]) if x.ndim >= 1 else x.reshape(1, 1)  # [rows, n]
    rows, n = rows2d.shape
    if t in BLOCK_BYTES and n % QK:
        raise Eagle3Error(f"{name}: rows of {n} values cannot be {t.name} (needs a multiple of {QK})")
    if t == GT.F32:
        return Encoded(x, t, 0.0)
    if t in BLOCK_BYTES:
        out = np.empty((rows, n // QK * BLOCK_BYTES[t]), dtype=np.uint8)  # [rows, row bytes]
    else:
        out = np.empty((rows, n), dtype=np.float16 if t == GT.F16 else np.uint16)  # [rows, n]
    err2 = ref2 = 0.0
    step = max(1, _CHUNK_ELEMENTS // max(n, 1))
    for r0 in range(0, rows, step):
        chunk = rows2d[r0:r0 + step]  # [step, n]
        if t == GT.F16:
            with np.errstate(over="ignore"):
                enc = chunk.astype(np.float16)
            if not np.isfinite(enc).all() and np.isfinite(chunk).all():
                raise Eagle3Error(f"{name}: values up to {float(np.abs(chunk).max()):.4g} overflow f16 "
                                  f"(max 65504); use --outtype bf16 or f32")
        elif t == GT.BF16:
            enc = f32_to_bf16(chunk)
        elif t == GT.Q4_0:
            enc = quantize_q4_0(chunk)
        else:
            enc = quantize_q8_0(chunk)
        out[r0:r0 + len(chunk)] = enc
        with np.errstate(over="ignore", invalid="ignore"):
            back = dequantize(enc, t, n)  # [step, n]
        if t in BLOCK_BYTES and not np.isfinite(back).all() and np.isfinite(chunk).all():  # a block's f16 scale
            raise Eagle3Error(f"{name}: values up to {float(np.abs(chunk).max()):.4g} overflow {t.name}'s f16 block "
                              f"scales; use bf16 or f32 for it (--outtype, --fc-type)")
        diff = chunk.astype(np.float64) - back
        err2 += float(np.square(diff).sum())
        ref2 += float(np.square(chunk, dtype=np.float64).sum())
    rel = float(np.sqrt(err2 / ref2)) if ref2 > 0 else 0.0
    shape = x.shape[:-1] + (out.shape[-1],) if x.ndim >= 1 else (out.shape[-1],)
    return Encoded(out.reshape(shape), t, rel)
