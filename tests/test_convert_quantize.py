"""Q4_0 / Q8_0 bytes equal ggml's own quantizer bit for bit; f16/bf16 round like ggml; errors are measured."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from eagle3_gguf.convert.quantize import (
    BLOCK_BYTES, dequantize, encode, f32_to_bf16, n_bytes, quantize_q4_0, quantize_q8_0,
)
from eagle3_gguf.errors import Eagle3Error


@pytest.fixture(scope="module")
def ggml_quantize():
    """`ggml_quantize_chunk` from the libggml shipped inside the llama_cpp package."""
    import llama_cpp

    libdir = Path(llama_cpp.__file__).parent / "lib"
    candidates = sorted(libdir.glob("libggml-base.*")) + sorted(libdir.glob("libggml.*"))
    if not candidates:
        pytest.skip(f"no libggml in {libdir}")
    lib = ctypes.CDLL(str(candidates[0]))
    # size_t ggml_quantize_chunk(enum ggml_type type, const float * src, void * dst, int64_t start,
    #                            int64_t nrows, int64_t n_per_row, const float * imatrix);
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]

    def quantize(x: np.ndarray, t: GT) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)  # [rows, n]
        rows, n = x.shape
        out = np.zeros((rows, n // 32 * BLOCK_BYTES[t]), dtype=np.uint8)
        lib.ggml_quantize_init(int(t))
        written = fn(int(t), x.ctypes.data, out.ctypes.data, 0, rows, n, None)
        assert written == out.nbytes
        return out

    return quantize


def _hard_cases(rng: np.random.Generator) -> np.ndarray:
    """Blocks built to hit ties, zeros, sign of the max, exact .5 after scaling, tiny and huge scales."""
    x = (rng.standard_normal((24, 256)) * 0.05).astype(np.float32)  # [24, 256]
    x[0, :32] = 0.0  # all-zero block (d = -0.0 for Q4_0)
    x[1, :32] = 1.0
    x[2, :32] = -1.0
    x[3, :16], x[3, 16:32] = 5.0, -5.0  # two values of equal magnitude: the first one sets the sign
    x[4, :32] = np.linspace(-8, 8, 32)  # Q4_0 with d = -1: x*id + 8.5 lands on .5 boundaries
    x[5, :32] = np.arange(-15.5, 16.5)  # .5 steps: Q4_0 nibble boundaries
    x[6, :32] = np.concatenate([[127.0], np.arange(-15.5, 15.5)])  # d = 1 exactly: q = roundf(k + .5)
    x[7, :32] = rng.integers(-3, 4, 32) * 0.25
    x[8] *= 1e-30  # subnormal-ish scales
    x[9] *= 3e4  # large values (scale near f16 max)
    x[10, :32] = -0.0
    x[11, 5] = 1e-8
    return x


@pytest.mark.parametrize("t", [GT.Q4_0, GT.Q8_0])
def test_bit_exact_with_ggml(ggml_quantize, t):
    rng = np.random.default_rng(42)
    ours = quantize_q4_0 if t == GT.Q4_0 else quantize_q8_0
    for scale in (1e-3, 0.02, 1.0, 37.0):
        x = (rng.standard_normal((64, 512)) * scale).astype(np.float32)
        assert np.array_equal(ours(x), ggml_quantize(x, t)), f"{t.name} differs at scale {scale}"
    hard = _hard_cases(rng)
    assert np.array_equal(ours(hard), ggml_quantize(hard, t)), f"{t.name} differs on the hard cases"


def test_encode_chunks_match_whole_tensor(ggml_quantize, monkeypatch):
    """Row chunking (used to bound memory) does not change a byte."""
    import eagle3_gguf.convert.quantize as q

    monkeypatch.setattr(q, "_CHUNK_ELEMENTS", 1000)  # force several chunks of 3 rows
    x = np.random.default_rng(1).standard_normal((20, 320)).astype(np.float32)
    enc = encode(x, GT.Q4_0, "fc.weight")
    assert np.array_equal(enc.data, ggml_quantize(x, GT.Q4_0))
    assert enc.data.nbytes == n_bytes(x.shape, GT.Q4_0)


@pytest.mark.parametrize("t,bound", [(GT.Q4_0, 0.15), (GT.Q8_0, 0.01), (GT.F16, 1e-3), (GT.BF16, 5e-3)])
def test_relative_error_is_measured(t, bound):
    x = np.random.default_rng(2).standard_normal((32, 256)).astype(np.float32)
    enc = encode(x, t, "w")
    back = dequantize(enc.data.reshape(32, -1), t, 256)
    want = float(np.linalg.norm(x - back) / np.linalg.norm(x))
    assert enc.rel_error == pytest.approx(want, rel=1e-6)
    assert 0 < enc.rel_error < bound


def test_f32_is_exact_and_f16_is_numpys_rounding():
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    assert encode(x, GT.F32).rel_error == 0.0
    assert np.array_equal(encode(x, GT.F16).data, x.astype(np.float16))


def test_bf16_rounds_to_nearest_even_like_torch():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(4).standard_normal(4096).astype(np.float32)
    x[:4] = [1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 65504.0]  # exact ties both ways
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(f32_to_bf16(x), want)
    nan = f32_to_bf16(np.array([np.nan], dtype=np.float32))
    assert (nan[0] & 0x7F80) == 0x7F80 and (nan[0] & 0x7F) != 0


def test_f16_overflow_is_one_line():
    with pytest.raises(Eagle3Error,
                       match=r"^w: values up to 1e\+05 overflow f16 \(max 65504\); use --outtype bf16 or f32$"):
        encode(np.array([[1e5] * 32], dtype=np.float32), GT.F16, "w")


def test_quantizing_ragged_rows_is_refused():
    with pytest.raises(Eagle3Error, match="rows of 33 values cannot be Q4_0"):
        encode(np.zeros((2, 33), dtype=np.float32), GT.Q4_0, "fc.weight")
