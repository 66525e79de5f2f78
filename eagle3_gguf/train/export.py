"""From a target GGUF to a trained head and back: read the target (a gguf_file.TargetInfo) and its frozen
token embeddings; export the head as a SafeAILab-layout checkpoint (model.safetensors + config.json, so the
same head runs in vLLM / SGLang); convert that with our converter into a GGUF for llama.cpp; and read a head
GGUF back into training's form (`read_head_gguf`: fine-tune a head whose float checkpoint is gone).

SafeAILab layout: `fc.weight`, `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`,
`lm_head.weight` (draft vocab rows), `d2t` (int64 offsets: target id = i + d2t[i]), `t2d` (bool over
the target vocab); config = a one-layer llama config with `draft_vocab_size` and `target_hidden_size`.

A head with EAGLE 3.1 norms (fc_norm, norm_output, norm_before_fc) is exported in the vLLM speculators
layout instead, the one that defines them: `layers.0.*`, `fc_norm.{i}.weight` / `input_norm.weight`,
config `Eagle3Speculator` with a nested `transformer_layer_config` and the three flags.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .. import keys
from ..errors import Eagle3Error
from ..gguf_file import HeadInfo, TargetInfo, read_gguf, read_tensor_data
from .vocab import DraftVocab

if TYPE_CHECKING:
    from .model import HeadConfig


def read_target(path: str | Path) -> TargetInfo:
    """The target as training needs it: its GGUF header read once (the fast reader: no tensor data),
    checked to carry token embeddings, head count and ffn width."""
    g = read_gguf(path)
    if g.arch == keys.ARCH_EAGLE3:
        raise Eagle3Error(f"{g.path.name} is an EAGLE-3 head: pass the target model with -m")
    tgt = TargetInfo.from_gguf(g)
    if tgt.token_embd is None:
        raise Eagle3Error(f"{g.path.name}: no {keys.T_TOKEN_EMBD} tensor")
    for value, template in ((tgt.n_head, keys.KEY_HEAD_COUNT), (tgt.n_ff, keys.KEY_FEED_FORWARD_LENGTH)):
        if value is None:
            raise Eagle3Error(f"{g.path.name}: GGUF lacks '{keys.arch_key(template, g.arch)}'")
    return tgt


def read_token_embeddings(target: str | Path | TargetInfo) -> np.ndarray:
    """The target's token embeddings, dequantized.  # [n_vocab, n_embd] float32"""
    from gguf.quants import dequantize

    tgt = target if isinstance(target, TargetInfo) else read_target(target)
    t = tgt.token_embd
    if t is None:
        raise Eagle3Error(f"{tgt.path.name}: no {keys.T_TOKEN_EMBD} tensor")
    n_embd, n_vocab = int(t.shape[0]), int(t.shape[1])
    raw = read_tensor_data(tgt.path, t)  # [n_vocab, row bytes] uint8
    return np.asarray(dequantize(raw, t.ggml_type), dtype=np.float32).reshape(n_vocab, n_embd)


# The head's parameter names (model.py) → SafeAILab checkpoint names
_NAMES = {
    "fc.weight": "fc.weight",
    "input_layernorm.weight": "midlayer.input_layernorm.weight",
    "hidden_norm.weight": "midlayer.hidden_norm.weight",
    "attn.q_proj.weight": "midlayer.self_attn.q_proj.weight",
    "attn.k_proj.weight": "midlayer.self_attn.k_proj.weight",
    "attn.v_proj.weight": "midlayer.self_attn.v_proj.weight",
    "attn.o_proj.weight": "midlayer.self_attn.o_proj.weight",
    "post_attention_layernorm.weight": "midlayer.post_attention_layernorm.weight",
    "gate_proj.weight": "midlayer.mlp.gate_proj.weight",
    "up_proj.weight": "midlayer.mlp.up_proj.weight",
    "down_proj.weight": "midlayer.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def _save_tensors(head, vocab: DraftVocab, out_dir: Path, layer_prefix: str) -> None:
    """model.safetensors (float32) with the decoder layer under `layer_prefix`; the EAGLE 3.1 norms the
    head has (input_norm, fc_norm.{i}) under their own names."""
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu().numpy() for k, v in head.state_dict().items()}
    missing = set(_NAMES) - set(state)
    if missing:
        raise Eagle3Error(f"head lacks parameters {sorted(missing)}")
    tensors = {dst.replace("midlayer.", layer_prefix): np.ascontiguousarray(state[src]) for src, dst in _NAMES.items()}
    tensors.update({k: np.ascontiguousarray(v) for k, v in state.items()
                    if k == "input_norm.weight" or k.startswith("fc_norm.")})
    tensors["d2t"] = vocab.d2t.astype(np.int64)  # [draft_vocab]
    tensors["t2d"] = vocab.t2d  # [n_vocab] bool
    save_file(tensors, str(out_dir / "model.safetensors"))


def export_safeai(head, vocab: DraftVocab, layer_ids: list[int], n_layer_target: int, out_dir: str | Path) -> Path:
    """Write model.safetensors (float32) + config.json into out_dir; returns out_dir."""
    out_dir = Path(out_dir)
    c = head.c
    if c.fc_norm or c.norm_output or c.norm_before_fc:
        raise Eagle3Error("an EAGLE 3.1 head has no SafeAILab layout: export it with export_speculators")
    _save_tensors(head, vocab, out_dir, "midlayer.")
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_llama_config(c),
        "draft_vocab_size": c.draft_vocab,
        "target_hidden_size": c.n_embd_tgt,
        "norm_before_residual": c.norm_before_residual,
    }
    if list(layer_ids) != [2, n_layer_target // 2, n_layer_target - 3]:
        config["eagle_aux_hidden_state_layer_ids"] = list(layer_ids)  # input-of-layer ids
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def export_speculators(head, vocab: DraftVocab, layer_ids: list[int], out_dir: str | Path,
                       verifier: str = "target") -> Path:
    """Write a vLLM speculators checkpoint (model.safetensors + config.json, the EAGLE 3.1 flags
    included) into out_dir; returns out_dir. The layer ids are written as given (input-of-layer)."""
    out_dir = Path(out_dir)
    c = head.c
    _save_tensors(head, vocab, out_dir, "layers.0.")
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": _llama_config(c),
        "draft_vocab_size": c.draft_vocab,
        "target_hidden_size": c.n_embd_tgt,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "eagle_aux_hidden_state_layer_ids": list(layer_ids),
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}},
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def export_checkpoint(head, vocab: DraftVocab, layer_ids: list[int], n_layer_target: int, out_dir: str | Path,
                      verifier: str = "target") -> Path:
    """The head's checkpoint in the layout it needs: vLLM speculators for an EAGLE 3.1 head (its norm flags
    have no SafeAILab form), SafeAILab otherwise; returns out_dir."""
    c = head.c
    if c.fc_norm or c.norm_output or c.norm_before_fc:
        return export_speculators(head, vocab, layer_ids, out_dir, verifier=verifier)
    return export_safeai(head, vocab, layer_ids, n_layer_target, out_dir)


def _llama_config(c) -> dict:
    """The one-layer llama config of a HeadConfig (both layouts carry it)."""
    return {
        "model_type": "llama",
        "hidden_size": c.n_embd,
        "intermediate_size": c.n_ff,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_head_kv,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position,
        "vocab_size": c.n_vocab,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


# The head's parameter names (model.py) → the tensor names our converter writes into a head GGUF
_GGUF_NAMES = {
    "fc.weight": keys.T_FC,
    "input_layernorm.weight": keys.blk(keys.T_ATTN_NORM),
    "hidden_norm.weight": keys.blk(keys.T_ATTN_NORM_2),
    "attn.q_proj.weight": keys.blk(keys.T_ATTN_Q),
    "attn.k_proj.weight": keys.blk(keys.T_ATTN_K),
    "attn.v_proj.weight": keys.blk(keys.T_ATTN_V),
    "attn.o_proj.weight": keys.blk(keys.T_ATTN_OUT),
    "post_attention_layernorm.weight": keys.blk(keys.T_FFN_NORM),
    "gate_proj.weight": keys.blk(keys.T_FFN_GATE),
    "up_proj.weight": keys.blk(keys.T_FFN_UP),
    "down_proj.weight": keys.blk(keys.T_FFN_DOWN),
    "norm.weight": keys.T_OUTPUT_NORM,
    "lm_head.weight": keys.T_OUTPUT,
}


@dataclass
class HeadWeights:
    """A head GGUF in training's form: its config, its draft vocab and its weights, dequantized."""

    config: HeadConfig
    vocab: DraftVocab  # coverage unknown (nan): the GGUF does not record its data
    state: dict[str, np.ndarray]  # model.py's parameter names → float32 in PyTorch order


def read_head_gguf(path: str | Path) -> HeadWeights:
    """The inverse of export + convert for a head of our training's shape (one decoder layer, its own
    lm_head over a draft vocab, the target's token embeddings, no RoPE scaling): quantized tensors are
    dequantized, q/k rows put back in HF's rotate-half order. Fine-tuning starts from these weights."""
    from .model import HeadConfig

    g = read_gguf(path)
    info = HeadInfo.from_gguf(g)
    name = g.path.name
    if info.draft_vocab is None or not info.own_output:
        raise Eagle3Error(f"{name}: the head drafts over the target's vocab (no d2t or no output.weight); "
                          "only a head with its own draft vocab can be fine-tuned")
    if info.own_token_embd or g.tensor(keys.T_ROPE_FREQS) is not None or g.tensor(keys.blk(keys.T_ATTN_Q, 1)):
        raise Eagle3Error(f"{name}: its token embeddings, RoPE scaling or extra layers are not a head our training "
                          "builds: fine-tune it with the framework that trained it")
    fc = g.tensor(keys.T_FC)
    if fc is None or fc.shape[0] != 3 * info.target_hidden_size:
        raise Eagle3Error(f"{name}: fc is not [3 x {info.target_hidden_size}] wide: convert the head again")
    config = HeadConfig(n_embd=info.n_embd, n_ff=info.n_ff, n_head=info.n_head, n_head_kv=info.n_head_kv,
                        n_embd_tgt=info.target_hidden_size, n_vocab=info.n_vocab, draft_vocab=info.draft_vocab,
                        rms_eps=float(g.get(keys.KEY_RMS_EPS, 1e-5)),
                        rope_theta=float(g.get(keys.KEY_ROPE_FREQ_BASE, 10000.0)),
                        norm_before_residual=info.norm_before_residual,
                        max_position=int(g.get(keys.KEY_CONTEXT_LENGTH, 0)) or 2048,
                        norm_before_fc=info.norm_before_fc, fc_norm=info.fc_norm is not None,
                        norm_output=info.norm_output)
    state = {param: tensor_f32(g, tensor, "convert the head again") for param, tensor in _GGUF_NAMES.items()}
    state["attn.q_proj.weight"] = _unpermute_rope_rows(state["attn.q_proj.weight"], config.n_head)
    state["attn.k_proj.weight"] = _unpermute_rope_rows(state["attn.k_proj.weight"], config.n_head_kv)
    if config.norm_before_fc:
        state["input_norm.weight"] = tensor_f32(g, keys.T_ENC_OUTPUT_NORM, "convert the head again")
    if config.fc_norm:
        weights = np.asarray(g.metadata[keys.KEY_FC_NORM_WEIGHT], dtype=np.float32).reshape(3, -1)
        state.update({f"fc_norm.{i}.weight": w for i, w in enumerate(weights)})
    ids = g.raw.tensor_data(keys.T_D2T).view(np.int64).reshape(-1)  # [draft_vocab]
    if np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= info.n_vocab:
        raise Eagle3Error(f"{name}: d2t is not ascending target ids below {info.n_vocab}: convert the head again")
    return HeadWeights(config, DraftVocab(ids.astype(np.int64), info.n_vocab, float("nan")), state)


def tensor_f32(g, name: str, fix: str) -> np.ndarray:
    """A tensor of a GGUF (a head's; a target's for train.torch_target) as float32 in PyTorch order; `fix` says
    what to do where it is missing.  # [rows, row length]"""
    from gguf.quants import dequantize

    t = g.raw.tensor(name)
    if t is None:
        raise Eagle3Error(f"{g.path.name}: no {name} tensor: {fix}")
    w = np.asarray(dequantize(read_tensor_data(g.path, t), t.ggml_type), dtype=np.float32)
    return w.reshape(*reversed([int(n) for n in t.shape])).copy()  # writable: torch.from_numpy shares it


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's interleaved q/k rows → HF's rotate-half order (the converter's permute_rope_rows undone)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_to_gguf(checkpoint_dir: str | Path, target: str | Path | TargetInfo, out: str | Path,
                    layer_ids: list[int], outtype: str | None = None, fc_type: str | None = None,
                    name: str | None = None):
    """Our converter on the exported checkpoint (the layer ids passed explicitly; the types convert's defaults where
    None); `target` read already is not read again."""
    from ..convert import convert_head

    return convert_head(checkpoint_dir, out, target, layer_ids=list(layer_ids), outtype=outtype, fc_type=fc_type,
                        name=name)
