"""EAGLE-3 checkpoint → GGUF converter (shipped as `eagle3_gguf.convert`).

One module per step, data flowing one way:
`readers` (open a checkpoint, tensor by tensor) → `layouts` (which of the four published layouts,
normalized to a `HeadSpec`) → `quantize` (Q4_0 / Q8_0 / f16 / bf16 / f32 encoders, bit-exact with
ggml) → `writer` (streams a GGUF of arch `eagle3`) ; `convert.convert_head` ties them together.
"""

from __future__ import annotations

from .convert import ConvertResult, TensorRow, convert_head, default_out_path
from .layouts import HeadSpec, LayerIds, detect_layout, resolve_layer_ids
from .readers import Checkpoint, open_checkpoint

__all__ = [
    "Checkpoint",
    "ConvertResult",
    "HeadSpec",
    "LayerIds",
    "TensorRow",
    "convert_head",
    "default_out_path",
    "detect_layout",
    "open_checkpoint",
    "resolve_layer_ids",
]
