"""EAGLE 3.1's two norms, applied around the pinned eagle3 graph, which has neither.

- `fc_norm` (speculators, SpecForge): one RMSNorm per target feature, each on its own slice of the
  concatenated features, before the head's encoder (fc): concat(N0(h_a), N1(h_b), N2(h_c)).
- `norm_output`: across draft steps the head feeds back output_norm(h), the post-norm hidden state,
  instead of the pre-norm h that llama.cpp hands out (`llama_get_embeddings_nextn_ith`).

Both norms are RMSNorms with the head's own epsilon (speculators: transformer_layer_config.rms_norm_eps),
computed like ggml's `rms_norm` (sum of squares in float64, scale in float32). The converter stores the
flags and the fc_norm weights in our own metadata keys (keys.KEY_FC_NORM*, KEY_NORM_OUTPUT); the
output_norm weight is the head's `output_norm.weight` tensor. `HeadNorms.load` returns None for a head
with neither, so an EAGLE-3 head pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as GT

from . import keys
from .errors import Eagle3Error
from .gguf_file import GGUFFile, HeadInfo, read_gguf


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, as ggml computes it.  # x: [..., n], weight: [n] -> [..., n] float32"""
    mean = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    scale = (1.0 / np.sqrt(mean + eps)).astype(np.float32)
    return (x.astype(np.float32) * scale) * weight


@dataclass
class HeadNorms:
    eps: float
    fc_norm: np.ndarray | None = field(repr=False)  # [n_feat, n_embd_tgt]: per-feature norm weights, or None
    output_norm: np.ndarray | None = field(repr=False)  # [n_embd]: the head's output_norm weight (norm_output)

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "HeadNorms | None":
        """The head's EAGLE 3.1 norms, or None when it has neither (an EAGLE-3 head)."""
        info = HeadInfo.from_gguf(g)  # checks the fc_norm array's length
        if info.fc_norm is None and not info.norm_output:
            return None
        eps = float(g.get(keys.KEY_RMS_EPS, 0.0))
        if not eps > 0.0:
            raise Eagle3Error(f"{g.path}: head lacks {keys.arch_key(keys.KEY_RMS_EPS, g.arch)} (the EAGLE 3.1 norms' "
                              f"epsilon)")
        fc_norm = None
        if info.fc_norm is not None:
            fc_norm = np.asarray(g.metadata[keys.KEY_FC_NORM_WEIGHT], dtype=np.float32).reshape(info.fc_norm)
        return cls(eps, fc_norm, _output_norm(g) if info.norm_output else None)

    @classmethod
    def load(cls, path: str | Path) -> "HeadNorms | None":
        return cls.from_gguf(read_gguf(path))

    @classmethod
    def for_model(cls, model) -> "HeadNorms | None":
        """The norms of a head llama.cpp has loaded (a native.Model): two metadata lookups decide, so an
        EAGLE-3 head costs no parse of its GGUF (~0.1 s with a 49k-token vocab)."""
        if model.meta(keys.KEY_FC_NORM) is None and model.meta(keys.KEY_NORM_OUTPUT) is None:
            return None
        return cls.load(model.path)

    def apply_features(self, feats: np.ndarray) -> np.ndarray:
        """fc_norm, slice by slice, on concatenated target features (before ENCODE); unchanged without it.
        # [n, n_feat * n_embd_tgt] -> [n, n_feat * n_embd_tgt] float32"""
        if self.fc_norm is None:
            return feats
        n_feat, width = self.fc_norm.shape
        if feats.ndim != 2 or feats.shape[1] != n_feat * width:
            raise Eagle3Error(f"features are {list(feats.shape)} wide, the head's fc_norm expects "
                              f"[n, {n_feat} x {width}]")
        x = feats.reshape(feats.shape[0], n_feat, width)  # [n, n_feat, n_embd_tgt]
        return rms_norm(x, self.fc_norm, self.eps).reshape(feats.shape)

    def feedback(self, h: np.ndarray) -> np.ndarray:
        """The g of the next draft step from the head's pre-norm hidden state h: output_norm(h) with
        norm_output, h itself without.  # [..., n_embd] -> [..., n_embd] float32"""
        if self.output_norm is None:
            return h
        return rms_norm(h, self.output_norm, self.eps)


def _output_norm(g: GGUFFile) -> np.ndarray:
    """The head's output_norm.weight as float32.  # [n_embd]"""
    t = g.raw.tensor(keys.T_OUTPUT_NORM)
    if t is None:
        raise Eagle3Error(f"{g.path}: head has no {keys.T_OUTPUT_NORM}")
    dtypes = {GT.F32: np.float32, GT.F16: np.float16}
    if t.ggml_type not in dtypes or len(t.shape) != 1:
        raise Eagle3Error(f"{g.path}: {keys.T_OUTPUT_NORM} is {t.ggml_type.name} {t.shape}, expected a F32 or F16 "
                          f"vector")
    return g.raw.tensor_data(t.name).view(dtypes[t.ggml_type]).reshape(-1).astype(np.float32)
