"""Checkpoints shaped like the published heads the seed documents name, at test size.

Each `SeedHead` keeps its head's config fields and tensor names as published (the speculators library's
`Eagle3SpeculatorConfig` and `DraftVocabMixin`, SpecForge's `configs/*.json`; second-hand facts are
marked in `published`), with the widths cut to the tiny targets' (hidden 64, 49,152-token vocab, 8
layers) except where the quirk is the width itself: gemma-4-31B's, gpt-oss-20b's and Qwen3-30B-A3B's
heads have head_dim x heads != hidden, and so do these. Layer ids are scaled to 8 target layers in the
same convention (output-of ids keep their first id 1; input-of ids their first id 2).

`write_seed_head(dir, key, embed=...)` writes config.json + model.safetensors (bf16 like the published
files). Speculators and SpecForge both save the draft's `embed_tokens` (loaded from the verifier and
frozen), so every fixture ships that copy: `embed` is the target's token table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from checkpoints import CkptDims, layout_names, random_weights, save_safetensors

N_TARGET_LAYER = 8  # the tiny targets' depth
N_VOCAB = 49152  # SmolLM2's tokenizer, which every tiny target carries
DRAFT_VOCAB = 512  # stands in for 32,000 / 64,000


@dataclass(frozen=True)
class SeedHead:
    name: str  # as published
    layout: str  # checkpoints.py layout whose tensor names it uses
    detected: str  # the layout convert names; SafeAILab where SpecForge's config says nothing of its own
    target_arch: str  # llama.cpp architecture of its target
    dims: CkptDims
    config: dict  # config.json, tiny widths
    expected_ids: list[int]  # input-of-layer ids the GGUF must hold for an 8-layer target
    embed_copy: bool = True  # ships embed_tokens, a frozen copy of the target's (speculators and SpecForge save it)
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    published: dict = field(default_factory=dict)  # the real head's facts (docs/converting.md's table)


def _speculators(layer: dict, *, draft_vocab: int, verifier: tuple[str, str], **top) -> dict:
    """An Eagle3Speculator config as speculators saves it (llama-type transformer_layer_config)."""
    tl = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "attention_bias": False,
          "mlp_bias": False, "num_hidden_layers": 1, "vocab_size": N_VOCAB, "max_position_embeddings": 2048,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16", **layer}
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": "0.2.0", "transformer_layer_config": tl, "draft_vocab_size": draft_vocab,
            "target_hidden_size": None, "torch_dtype": "bfloat16",
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                         "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                                   "verifier": {"name_or_path": verifier[0], "architectures": [verifier[1]]}},
            **top}


def _layer(d: CkptDims, **extra) -> dict:
    cfg = {"hidden_size": d.n_embd, "intermediate_size": d.n_ff, "num_attention_heads": d.n_head,
           "num_key_value_heads": d.n_head_kv, "rms_norm_eps": d.rms_eps, "rope_theta": d.rope_theta}
    if d.head_dim is not None:
        cfg["head_dim"] = d.head_dim
    return {**cfg, **extra}


def _specforge(d: CkptDims, arch: str, **extra) -> dict:
    """A SpecForge configs/*.json draft config (top-level llama fields + draft_vocab_size)."""
    return {"architectures": [arch], "model_type": "llama", "num_hidden_layers": 1, "vocab_size": N_VOCAB,
            "draft_vocab_size": d.draft_vocab, "max_position_embeddings": 2048, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, **_layer(d), **extra}


_D = CkptDims(draft_vocab=DRAFT_VOCAB)
_WIDE_HEADS = CkptDims(draft_vocab=DRAFT_VOCAB, head_dim=32)  # 4 x 32 = 128-wide q at hidden 64
_FULL_VOCAB = CkptDims(draft_vocab=None)

SEED_HEADS: dict[str, SeedHead] = {
    "qwen3-8b": SeedHead(
        "RedHatAI/Qwen3-8B-speculator.eagle3", "speculators", "vLLM speculators", "qwen3", _D,
        _speculators(_layer(_D, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6), draft_vocab=DRAFT_VOCAB,
                     verifier=("Qwen/Qwen3-8B", "Qwen3ForCausalLM"), norm_before_residual=True),
        expected_ids=[2, 4, 5],
        published={"target": "Qwen3-8B (qwen3, 36 layers)", "hidden": "4096", "draft vocab": "32,000 (d2t)",
                   "aux ids": "none (default [2, 18, 33])", "flags": "norm_before_residual",
                   "quirk": "ships embed_tokens, a frozen copy of the target's (151,936 x 4096)"}),
    "llama4-maverick": SeedHead(
        "RedHatAI/Llama-4-Maverick-17B-128E-Instruct-speculator.eagle3", "speculators", "vLLM speculators", "llama4",
        _FULL_VOCAB,
        _speculators(_layer(_FULL_VOCAB, rope_theta=5e5), draft_vocab=N_VOCAB,
                     verifier=("meta-llama/Llama-4-Maverick-17B-128E-Instruct", "Llama4ForConditionalGeneration"),
                     norm_before_residual=False, eagle_aux_hidden_state_layer_ids=[1, 3, 4]),
        expected_ids=[2, 4, 5],
        published={"target": "Llama-4-Maverick (llama4, 48 layers)", "hidden": "5120 (second-hand)",
                   "draft vocab": "full 202,048 (no d2t; second-hand)", "aux ids": "[1, 23, 44] (output-of)",
                   "flags": "norm_before_residual false", "quirk": "full-vocabulary lm_head; target arch unhooked"}),
    "gpt-oss-20b": SeedHead(
        "RedHatAI/gpt-oss-20b-speculator.eagle3", "speculators", "vLLM speculators", "gpt-oss",
        _WIDE_HEADS,
        {**_speculators(_layer(_WIDE_HEADS), draft_vocab=DRAFT_VOCAB,
                        verifier=("openai/gpt-oss-20b", "GptOssForCausalLM"), norm_before_residual=True,
                        norm_before_fc=True, eagle_aux_hidden_state_layer_ids=None),
         "architectures": ["Eagle3DraftModel"]},
        expected_ids=[2, 4, 5], norm_before_fc=True,
        published={"target": "gpt-oss-20b (gpt-oss, 24 layers)", "hidden": "2880, q 64 x 64 = 4096",
                   "draft vocab": "64,000 (d2t; second-hand)", "aux ids": "null (default [2, 12, 21])",
                   "flags": "norm_before_fc (input_norm [8640]), norm_before_residual",
                   "quirk": "Eagle3DraftModel class; head_dim x heads != hidden"}),
    "gemma-4-31b": SeedHead(
        "RedHatAI/gemma-4-31B-it-speculator.eagle3", "speculators", "vLLM speculators", "gemma4",
        _WIDE_HEADS,
        _speculators(_layer(_WIDE_HEADS), draft_vocab=DRAFT_VOCAB,
                     verifier=("google/gemma-4-31B-it", "Gemma4ForConditionalGeneration"),
                     norm_before_residual=True, eagle_aux_hidden_state_layer_ids=[2, 4, 5]),
        expected_ids=[2, 4, 5],
        published={"target": "gemma-4-31B-it (gemma4, 60 layers)", "hidden": "5376, q 32 x 256 = 8192",
                   "draft vocab": "32,000 (d2t; second-hand)", "aux ids": "[2, 30, 57] (input-of)",
                   "flags": "norm_before_residual",
                   "quirk": "head_dim 256 != hidden / heads; gemma's embedding scale (none: see docs/converting.md)"}),
    "specforge-qwen3-30b-a3b-3.1": SeedHead(
        "SpecForge configs/qwen3-30B-A3B-eagle3.1.json", "specforge", "SpecForge", "qwen3moe",
        _WIDE_HEADS,
        _specforge(_WIDE_HEADS, "LlamaForCausalLMEagle3", fc_norm=True, norm_output=True, rope_theta=1e6,
                   rms_norm_eps=1e-6),
        expected_ids=[2, 4, 5], fc_norm=True, norm_output=True,
        published={"target": "Qwen3-30B-A3B (qwen3moe, 48 layers)", "hidden": "2048, q 32 x 128 = 4096",
                   "draft vocab": "32,000 (d2t)", "aux ids": "none (default)", "flags": "fc_norm, norm_output (top level)",
                   "quirk": "EAGLE 3.1; no eagle_config: its fc_norm tells SpecForge from SafeAILab"}),
    "specforge-gpt-oss-20b": SeedHead(
        "SpecForge configs/gpt-oss-20B-eagle3.json", "specforge", "SpecForge", "gpt-oss", _WIDE_HEADS,
        _specforge(_WIDE_HEADS, "GptOssForCausalLMEagle3", model_type="gpt_oss", num_local_experts=16,
                   experts_per_token=4, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}),
        expected_ids=[2, 4, 6],
        published={"target": "gpt-oss-20b (gpt-oss, 24 layers)", "hidden": "2880, q 64 x 64 = 4096",
                   "draft vocab": "32,000 (d2t)", "aux ids": "[1, 11, 21] (output-of, eagle_config)", "flags": "-",
                   "quirk": "GptOssForCausalLMEagle3 class, model_type gpt_oss, MoE fields the draft ignores"}),
    "specforge-llama3-8b": SeedHead(
        "SpecForge configs/llama3-8B-eagle3.json", "specforge", "SafeAILab/EAGLE", "llama", _D,
        _specforge(_D, "LlamaForCausalLMEagle3", rope_theta=5e5, hidden_act="silu"),
        expected_ids=[2, 4, 5],
        published={"target": "Llama-3.1-8B (llama, 32 layers)", "hidden": "4096", "draft vocab": "32,000 (d2t)",
                   "aux ids": "none (default)", "flags": "-",
                   "quirk": "config as SafeAILab's hub heads write it: converted the same"}),
}


def write_seed_head(directory: str | Path, key: str, *, seed: int = 0, embed: np.ndarray | None = None) -> Path:
    """The checkpoint directory of SEED_HEADS[key]; `embed` (the target's table, [N_VOCAB, 64]) is
    required when the head ships a frozen copy of it."""
    head = SEED_HEADS[key]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    w = random_weights(head.dims, seed, lm_head=True, norm_before_fc=head.norm_before_fc, fc_norm=head.fc_norm)
    if head.embed_copy:
        assert embed is not None and embed.shape == (N_VOCAB, head.dims.n_embd), "give the target's token table"
        w["embed_tokens.weight"] = embed.astype(np.float32)  # [N_VOCAB, n_embd]
    (directory / "config.json").write_text(json.dumps(head.config, indent=2))
    save_safetensors(directory / "model.safetensors", layout_names(head.layout, w), "bf16")
    return directory
