"""Random EAGLE-3 checkpoints in each published layout, small enough for the tiny target.

`write_checkpoint(dir, layout, ...)` writes config.json + weights the way each project saves them:

- "safeai":      SafeAILab/EAGLE  — llama config + draft_vocab_size; midlayer.*, fc, norm, lm_head, d2t, t2d
- "speculators": vLLM speculators — Eagle3Speculator, nested transformer_layer_config; layers.0.*
- "modelopt":    NVIDIA ModelOpt  — LlamaForCausalLMEagle3 + eagle_config (output-of-layer ids); layers.0.*, no t2d
- "specforge":   SpecForge        — LlamaForCausalLMEagle3 + eagle_config; midlayer.*, embed_tokens, t2d

EAGLE 3.1 (`fc_norm=True`: tensors fc_norm.{i}.weight; `norm_output=True`): flags at the config's top level
(speculators) or in eagle_config (SpecForge).

Weights are in PyTorch order (Linear: [out_features, in_features]) with HF's rotate-half q/k rows.
Safetensors are written by hand here (header + raw bytes) so bf16 needs no torch.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

LAYOUTS = ("safeai", "speculators", "modelopt", "specforge")
# Layer ids each layout's config names for a 6-layer target (None: the checkpoint names none)
DEFAULT_IDS = {"safeai": None, "speculators": [2, 3, 4], "modelopt": [1, 2, 4], "specforge": [1, 3, 5]}
# ... and the input-of-layer ids the GGUF must then hold
EXPECTED_IDS = {"safeai": [2, 3, 3], "speculators": [2, 3, 4], "modelopt": [2, 3, 5], "specforge": [2, 4, 6]}


@dataclass(frozen=True)
class CkptDims:
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_embd_tgt: int = 64  # the tiny target's hidden size
    target_vocab: int = 49152  # SmolLM2's tokenizer
    draft_vocab: int | None = 512  # None: no d2t, lm_head over the full target vocab (or none at all)
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    head_dim: int | None = None  # None: n_embd // n_head (the config then names none)

    @property
    def hd(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


def _rand(rng: np.random.Generator, *shape: int, scale: float | None = None) -> np.ndarray:
    return (rng.standard_normal(shape) * (scale if scale is not None else shape[-1] ** -0.5)).astype(np.float32)


def _norm(rng: np.random.Generator, n: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # [n]


def random_weights(d: CkptDims, seed: int = 0, *, lm_head: bool = True, embed: bool = False,
                   norm_before_fc: bool = False, fc_norm: bool = False) -> dict[str, np.ndarray]:
    """Layout-neutral names: the decoder layer's tensors are prefixed 'L.'."""
    rng = np.random.default_rng(seed)
    hd = d.hd
    w = {
        "fc.weight": _rand(rng, d.n_embd, 3 * d.n_embd_tgt),  # [n_embd, 3 * n_embd_tgt]
        "norm.weight": _norm(rng, d.n_embd),
        "L.input_layernorm.weight": _norm(rng, d.n_embd),
        "L.hidden_norm.weight": _norm(rng, d.n_embd),
        "L.post_attention_layernorm.weight": _norm(rng, d.n_embd),
        "L.self_attn.q_proj.weight": _rand(rng, d.n_head * hd, 2 * d.n_embd),  # [n_head*hd, 2*n_embd]
        "L.self_attn.k_proj.weight": _rand(rng, d.n_head_kv * hd, 2 * d.n_embd),
        "L.self_attn.v_proj.weight": _rand(rng, d.n_head_kv * hd, 2 * d.n_embd),
        "L.self_attn.o_proj.weight": _rand(rng, d.n_embd, d.n_head * hd),
        "L.mlp.gate_proj.weight": _rand(rng, d.n_ff, d.n_embd),  # [n_ff, n_embd]
        "L.mlp.up_proj.weight": _rand(rng, d.n_ff, d.n_embd),
        "L.mlp.down_proj.weight": _rand(rng, d.n_embd, d.n_ff),  # [n_embd, n_ff]
    }
    if d.draft_vocab is not None:
        ids = np.sort(rng.choice(d.target_vocab, size=d.draft_vocab, replace=False)).astype(np.int64)
        w["d2t"] = ids - np.arange(d.draft_vocab, dtype=np.int64)  # [draft_vocab] offsets: target = i + d2t[i]
        t2d = np.zeros(d.target_vocab, dtype=bool)
        t2d[ids] = True
        w["t2d"] = t2d  # [target_vocab]
        w["lm_head.weight"] = _rand(rng, d.draft_vocab, d.n_embd)  # [draft_vocab, n_embd]
    elif lm_head:
        w["lm_head.weight"] = _rand(rng, d.target_vocab, d.n_embd)
    if embed:
        w["embed_tokens.weight"] = _rand(rng, d.target_vocab, d.n_embd, scale=1.0)  # [target_vocab, n_embd]
    if norm_before_fc:
        w["input_norm.weight"] = _norm(rng, 3 * d.n_embd_tgt)  # [3 * n_embd_tgt]
    if fc_norm:  # EAGLE 3.1: one RMSNorm per target feature
        for i in range(3):
            w[f"fc_norm.{i}.weight"] = _norm(rng, d.n_embd_tgt)  # [n_embd_tgt]
    return w


def _llama_config(d: CkptDims, arch: str) -> dict:
    cfg = {
        "architectures": [arch], "model_type": "llama", "hidden_act": "silu", "hidden_size": d.n_embd,
        "intermediate_size": d.n_ff, "num_attention_heads": d.n_head, "num_key_value_heads": d.n_head_kv,
        "num_hidden_layers": 1, "rms_norm_eps": d.rms_eps, "rope_theta": d.rope_theta,
        "max_position_embeddings": 2048, "vocab_size": d.target_vocab, "tie_word_embeddings": False,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }
    if d.draft_vocab is not None:
        cfg["draft_vocab_size"] = d.draft_vocab
    if d.head_dim is not None:
        cfg["head_dim"] = d.head_dim
    return cfg


def layout_config(layout: str, d: CkptDims, layer_ids: list[int] | None, *, norm_before_residual: bool = False,
                  norm_before_fc: bool = False, fc_norm: bool = False, norm_output: bool = False) -> dict:
    cfg = _layout_config(layout, d, layer_ids, norm_before_residual=norm_before_residual,
                         norm_before_fc=norm_before_fc)
    flags = {k: True for k, on in (("fc_norm", fc_norm), ("norm_output", norm_output)) if on}
    if layout == "specforge":  # EAGLE 3.1 flags: SpecForge's go in eagle_config, speculators' at the top
        cfg["eagle_config"].update(flags)
    else:
        cfg.update(flags)
    return cfg


def _layout_config(layout: str, d: CkptDims, layer_ids: list[int] | None, *, norm_before_residual: bool,
                   norm_before_fc: bool) -> dict:
    if layout == "safeai":
        cfg = _llama_config(d, "LlamaForCausalLM")
        if layer_ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = layer_ids
        return cfg
    if layout == "speculators":
        tl = {k: v for k, v in _llama_config(d, "LlamaForCausalLM").items() if k != "architectures"}
        tl.pop("draft_vocab_size", None)
        cfg = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
            "transformer_layer_config": tl, "draft_vocab_size": d.draft_vocab or d.target_vocab,
            "norm_before_residual": norm_before_residual, "target_hidden_size": d.n_embd_tgt,
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                   "verifier": {"name_or_path": "tiny-target", "architectures": ["LlamaForCausalLM"]}},
        }
        if norm_before_fc:
            cfg["norm_before_fc"] = True
        if layer_ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = layer_ids
        return cfg
    cfg = _llama_config(d, "LlamaForCausalLMEagle3")
    eagle = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
             "use_mtp_layernorm": False, "next_layer_regular": True} if layout == "modelopt" else {}
    if layer_ids is not None:
        eagle["eagle_aux_hidden_state_layer_ids"] = layer_ids
    cfg["eagle_config"] = eagle
    return cfg


def layout_names(layout: str, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    prefix = "midlayer." if layout in ("safeai", "specforge") else "layers.0."
    out = {(prefix + k[2:] if k.startswith("L.") else k): v for k, v in weights.items()}
    if layout == "modelopt":
        out.pop("t2d", None)  # ModelOpt exports no t2d
    return out


# ------------------------------------------------------------------------------------------------
# File writers
# ------------------------------------------------------------------------------------------------

_TAGS = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64",
         np.dtype(bool): "BOOL"}


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def save_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "f32") -> Path:
    """Write a .safetensors file; float tensors stored as dtype f32/f16/bf16."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        if t.dtype == np.float32 and dtype == "f16":
            t, tag = t.astype(np.float16), "F16"
        elif t.dtype == np.float32 and dtype == "bf16":
            t, tag = f32_to_bf16_bits(t), "BF16"
        else:
            tag = _TAGS[t.dtype]
        raw = np.ascontiguousarray(t).tobytes()
        header[name] = {"dtype": tag, "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for b in blobs:
            f.write(b)
    return path


def save_torch_bin(path: Path, tensors: dict[str, np.ndarray], dtype: str = "f32") -> Path:
    import torch

    tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    state = {k: (torch.from_numpy(v).to(tdt) if v.dtype == np.float32 else torch.from_numpy(v.copy()))
             for k, v in tensors.items()}
    torch.save(state, path)
    return path


def write_checkpoint(directory: str | Path, layout: str, dims: CkptDims = CkptDims(), *, seed: int = 0,
                     layer_ids: list[int] | None | str = "default", fmt: str = "safetensors", dtype: str = "f32",
                     embed: bool | None = None, lm_head: bool = True, norm_before_residual: bool = False,
                     norm_before_fc: bool = False, fc_norm: bool = False, norm_output: bool = False,
                     config_extra: dict | None = None, weights: dict[str, np.ndarray] | None = None) -> Path:
    """A checkpoint directory (config.json + weights); returns the directory.

    fmt: "safetensors" (model.safetensors), "sharded" (2 shards + index), "bin" (pytorch_model.bin).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ids = DEFAULT_IDS[layout] if layer_ids == "default" else layer_ids
    if embed is None:
        embed = layout == "specforge"
    w = weights if weights is not None else random_weights(dims, seed, lm_head=lm_head, embed=embed,
                                                           norm_before_fc=norm_before_fc, fc_norm=fc_norm)
    tensors = layout_names(layout, w)
    cfg = layout_config(layout, dims, ids, norm_before_residual=norm_before_residual, norm_before_fc=norm_before_fc,
                        fc_norm=fc_norm, norm_output=norm_output)
    cfg.update(config_extra or {})
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    if fmt == "safetensors":
        save_safetensors(directory / "model.safetensors", tensors, dtype)
    elif fmt == "bin":
        save_torch_bin(directory / "pytorch_model.bin", tensors, dtype)
    elif fmt == "sharded":
        names = sorted(tensors)
        half = len(names) // 2
        shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
        weight_map = {}
        for fname, part in shards.items():
            save_safetensors(directory / fname, {n: tensors[n] for n in part}, dtype)
            weight_map.update({n: fname for n in part})
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        raise ValueError(fmt)
    return directory


def dims_with(**kw) -> CkptDims:
    return replace(CkptDims(), **kw)
