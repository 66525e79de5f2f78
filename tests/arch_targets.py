"""Tiny random targets of llama.cpp architectures other than `llama`, for testing EAGLE-3 heads on them.

`write_arch_target(path, arch)` writes a GGUF that the pinned llama.cpp (the one inside llama-cpp-python)
loads and decodes, with the tensors and metadata its `load_arch_hparams` / `load_arch_tensors`
(vendor/llama.cpp/src/models/<arch>.cpp) ask for, and the quirks the real models have:

  qwen3     Q/K RMSNorm per head, own lm_head (as Qwen3-8B; `tied=True` for the small ones).
  qwen3moe  Q/K norm, softmax-routed experts (norm_topk_prob), own lm_head.
  gpt-oss   llama.cpp's openai-moe graph: Q/K/V and output biases, attention sinks, alternating
            sliding-window / full layers (ISWA cache), routed experts with biases (SwiGLU-OAI),
            YaRN RoPE, post-attention norm, own lm_head.
  gemma4    dense Gemma-4-31B layout: head_dim != n_embd / n_head, sliding layers with `head_dim` and
            full layers with `global_head_dim` (and fewer KV heads, V = K: no attn_v), proportional RoPE
            on full layers (rope_freqs), Q/K/post norms, GELU FFN, per-layer output scale, final logit
            soft-capping, tied embeddings; no per-layer embeddings, no MoE.
  llama4    interleaved dense / MoE layers (sigmoid router + shared expert), chunked attention with
            no-RoPE every 4th layer, own lm_head. Not hidden-state hooked at the pin (no EAGLE-3).

All carry SmolLM2's tokenizer (49,152 tokens). Matrices, MoE routers included (see ArchDims.f32_router),
are Q8_0 where the row length is a multiple of 32 (as in model_factory: a row's logits are then the same
alone or in a batch); norms, biases, sinks and rope_freqs are F32. `hf_config(arch)` is the matching HF
config.json, whose `architectures` class maps to the GGUF's arch in eagle3_gguf.hf_archs.

Hooks at the pin: the final state (layer id n_layer) is pre-output-norm for gpt-oss but post-output-norm
for gemma4 (its graph exposes the lm_head input), and zeros for qwen3/qwen3moe (not exposed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from eagle3_gguf.assets import smollm2_path
from eagle3_gguf.gguf_file import copy_tokenizer
from model_factory import _norm, _q8, _rand, _write

ARCHS = ("qwen3", "qwen3moe", "gpt-oss", "gemma4", "llama4")

HF_CLASS = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",
    "llama4": "Llama4ForConditionalGeneration",
}

N_VOCAB = 49152  # SmolLM2's tokenizer


@dataclass(frozen=True)
class ArchDims:
    n_layer: int = 6
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int | None = None  # None: n_embd // n_head (gemma4: twice that, 32, as Gemma-4-31B's differ)
    n_ff: int = 128  # dense FFN (llama4: its dense layers and intermediate_size_mlp)
    n_expert: int = 4
    n_expert_used: int = 2
    n_ff_exp: int = 64  # per expert (llama4: also the shared expert)
    n_swa: int = 128  # sliding window (gpt-oss, gemma4)
    n_ctx: int = 2048
    rope_base: float = 10000.0
    rms_eps: float = 1e-6
    # gemma4: every `global_every`-th layer (1-based) is full attention (Gemma-4-31B: 6 of 60, 5:1)
    global_every: int = 3
    global_head_dim: int | None = None  # None: 2 * head_dim (31B: 512 vs 256)
    n_head_kv_global: int = 1  # full layers' KV heads (31B: 4 vs 16)
    softcap: float = 30.0  # gemma4 final logit soft-capping
    moe_every: int = 2  # llama4: interleave_moe_layer_step (Maverick 2, Scout 1)
    tied: bool | None = None  # lm_head = token_embd; None: as the real model (gemma4 tied; gpt-oss never)
    # MoE routers in F32, as llama-quantize leaves them in real GGUFs. Off by default: ggml-cpu runs an
    # F32 matmul of one row through ggml_vec_dot_f32 but of 2+ rows through llamafile's sgemm (which
    # declines n < 2), so router logits of a row differ in the last bits between a lone decode and a
    # verify batch; at a near-tie the top-k experts flip and speculative output parts from target-only
    # (seen with 2 threads: "def fib(n):" parts at token 143 on qwen3moe, at 104 on gpt-oss with n_swa=16,
    # the logits first differing at 118 / 92). Q8_0 routers keep every row bit-exact.
    f32_router: bool = False

    def is_tied(self, arch: str) -> bool:
        return arch != "gpt-oss" and (self.tied if self.tied is not None else arch == "gemma4")

    def hd(self, arch: str) -> int:
        if self.head_dim is not None:
            return self.head_dim
        return (2 if arch == "gemma4" else 1) * self.n_embd // self.n_head

    def ghd(self, arch: str) -> int:
        return self.global_head_dim if self.global_head_dim is not None else 2 * self.hd(arch)

    def gemma4_is_swa(self) -> list[bool]:
        return [(i + 1) % self.global_every != 0 and i < self.n_layer - 1 for i in range(self.n_layer)]  # last: full

    def gpt_oss_is_swa(self) -> list[bool]:
        return [i % 2 == 0 for i in range(self.n_layer)]  # llama.cpp's default pattern 2: sliding first


class _Writer:
    """A gguf.GGUFWriter with the arch prefix filled and Q8_0 / F32 tensor helpers."""

    def __init__(self, path: Path, arch: str, rng: np.random.Generator):
        self.w = gguf.GGUFWriter(str(path), arch)
        self.arch, self.rng = arch, rng

    def u32(self, key: str, v: int) -> None:
        self.w.add_uint32(key.format(arch=self.arch), int(v))

    def f32(self, key: str, v: float) -> None:
        self.w.add_float32(key.format(arch=self.arch), float(v))

    def arr(self, key: str, v: list) -> None:
        self.w.add_array(key.format(arch=self.arch), v)

    def mat(self, name: str, *shape: int, scale: float | None = None) -> None:
        """Random weights in numpy order (rows = outputs): Q8_0 if rows allow, else F32."""
        w = _rand(self.rng, *shape, scale=scale)
        if shape[-1] % 32 == 0:
            data, qtype = _q8(w)
            self.w.add_tensor(name, data, raw_dtype=qtype)
        else:
            self.w.add_tensor(name, w)

    def vec(self, name: str, *shape: int, scale: float = 0.1) -> None:
        """F32 small random values (biases, sinks, F32 routers)."""
        self.w.add_tensor(name, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def norm(self, name: str, n: int) -> None:
        self.w.add_tensor(name, _norm(self.rng, n))  # [n]


def _hparams(o: _Writer, d: ArchDims, *, n_ff: int, head_dim: int, n_head_kv: int | list[int]) -> None:
    o.u32("{arch}.context_length", d.n_ctx)
    o.u32("{arch}.embedding_length", d.n_embd)
    o.u32("{arch}.block_count", d.n_layer)
    o.u32("{arch}.feed_forward_length", n_ff)
    o.u32("{arch}.attention.head_count", d.n_head)
    if isinstance(n_head_kv, list):
        o.arr("{arch}.attention.head_count_kv", n_head_kv)
    else:
        o.u32("{arch}.attention.head_count_kv", n_head_kv)
    o.u32("{arch}.attention.key_length", head_dim)
    o.u32("{arch}.attention.value_length", head_dim)
    o.u32("{arch}.rope.dimension_count", head_dim)
    o.f32("{arch}.attention.layer_norm_rms_epsilon", d.rms_eps)
    o.u32("{arch}.vocab_size", N_VOCAB)


def _moe_hparams(o: _Writer, d: ArchDims) -> None:
    o.u32("{arch}.expert_count", d.n_expert)
    o.u32("{arch}.expert_used_count", d.n_expert_used)
    o.u32("{arch}.expert_feed_forward_length", d.n_ff_exp)


def _experts(o: _Writer, i: int, d: ArchDims, *, bias: bool = False) -> None:
    e, f, n = d.n_expert, d.n_ff_exp, d.n_embd
    if d.f32_router:
        o.vec(f"blk.{i}.ffn_gate_inp.weight", e, n, scale=n ** -0.5)  # [n_expert, n_embd] router
    else:
        o.mat(f"blk.{i}.ffn_gate_inp.weight", e, n)  # [n_expert, n_embd] router
    o.mat(f"blk.{i}.ffn_gate_exps.weight", e, f, n)  # [n_expert, n_ff_exp, n_embd]
    o.mat(f"blk.{i}.ffn_up_exps.weight", e, f, n)  # [n_expert, n_ff_exp, n_embd]
    o.mat(f"blk.{i}.ffn_down_exps.weight", e, n, f)  # [n_expert, n_embd, n_ff_exp]
    if bias:
        o.vec(f"blk.{i}.ffn_gate_inp.bias", e)  # [n_expert]
        o.vec(f"blk.{i}.ffn_gate_exps.bias", e, f)  # [n_expert, n_ff_exp]
        o.vec(f"blk.{i}.ffn_up_exps.bias", e, f)
        o.vec(f"blk.{i}.ffn_down_exps.bias", e, n)  # [n_expert, n_embd]


def _dense_ffn(o: _Writer, i: int, n_embd: int, n_ff: int, suffix: str = "") -> None:
    o.mat(f"blk.{i}.ffn_gate{suffix}.weight", n_ff, n_embd)  # [n_ff, n_embd]
    o.mat(f"blk.{i}.ffn_up{suffix}.weight", n_ff, n_embd)
    o.mat(f"blk.{i}.ffn_down{suffix}.weight", n_embd, n_ff)  # [n_embd, n_ff]


def _attn(o: _Writer, i: int, n_embd: int, n_head: int, n_head_kv: int, hd: int, *, v: bool = True,
          bias: bool = False) -> None:
    o.mat(f"blk.{i}.attn_q.weight", n_head * hd, n_embd)  # [n_head*hd, n_embd]
    o.mat(f"blk.{i}.attn_k.weight", n_head_kv * hd, n_embd)  # [n_head_kv*hd, n_embd]
    if v:
        o.mat(f"blk.{i}.attn_v.weight", n_head_kv * hd, n_embd)
    o.mat(f"blk.{i}.attn_output.weight", n_embd, n_head * hd)  # [n_embd, n_head*hd]
    if bias:
        o.vec(f"blk.{i}.attn_q.bias", n_head * hd)
        o.vec(f"blk.{i}.attn_k.bias", n_head_kv * hd)
        o.vec(f"blk.{i}.attn_v.bias", n_head_kv * hd)
        o.vec(f"blk.{i}.attn_output.bias", n_embd)


def write_arch_target(path: str | Path, arch: str, dims: ArchDims | None = None, *, seed: int = 0,
                      tokenizer_from: Path | None = None) -> Path:
    """A random `arch` target (one of ARCHS) with SmolLM2's tokenizer; returns `path`."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r} (one of {', '.join(ARCHS)})")
    path, d = Path(path), dims or ArchDims()
    o = _Writer(path, arch, np.random.default_rng(seed))
    o.w.add_name(f"tiny-random-{arch}")
    n_vocab = copy_tokenizer(tokenizer_from or smollm2_path(), o.w)
    assert n_vocab == N_VOCAB, n_vocab
    n, hd = d.n_embd, d.hd(arch)

    # gemma4 multiplies the embeddings by sqrt(n_embd): its rows are that much smaller, and its
    # output_norm that much larger, so that inputs and logits are of the others' size (a tied random
    # model whose embeddings dominate the residual stream repeats one token forever)
    emb_scale = n ** 0.5 if arch == "gemma4" else 1.0
    o.mat("token_embd.weight", n_vocab, n, scale=0.5 / emb_scale)  # [n_vocab, n_embd]
    o.w.add_tensor("output_norm.weight", _norm(o.rng, n) * emb_scale)  # [n_embd]
    if not d.is_tied(arch):
        o.mat("output.weight", n_vocab, n)  # [n_vocab, n_embd]

    if arch == "qwen3":
        _hparams(o, d, n_ff=d.n_ff, head_dim=hd, n_head_kv=d.n_head_kv)
        o.f32("{arch}.rope.freq_base", d.rope_base)
    elif arch == "qwen3moe":
        _hparams(o, d, n_ff=d.n_ff, head_dim=hd, n_head_kv=d.n_head_kv)
        o.f32("{arch}.rope.freq_base", d.rope_base)
        _moe_hparams(o, d)
    elif arch == "gpt-oss":
        _hparams(o, d, n_ff=d.n_ff_exp, head_dim=hd, n_head_kv=d.n_head_kv)
        o.f32("{arch}.rope.freq_base", d.rope_base)
        _moe_hparams(o, d)
        o.u32("{arch}.attention.sliding_window", d.n_swa)
        o.w.add_string(f"{arch}.rope.scaling.type", "yarn")  # as gpt-oss: factor 32 over its original context
        o.f32("{arch}.rope.scaling.factor", 32.0)
        o.u32("{arch}.rope.scaling.original_context_length", d.n_ctx // 32)
    elif arch == "gemma4":
        ghd, is_swa = d.ghd(arch), d.gemma4_is_swa()
        _hparams(o, d, n_ff=d.n_ff, head_dim=ghd,  # key_length / rope dims: the full layers'
                 n_head_kv=[d.n_head_kv if s else d.n_head_kv_global for s in is_swa])
        o.u32("{arch}.attention.key_length_swa", hd)
        o.u32("{arch}.attention.value_length_swa", hd)
        o.u32("{arch}.rope.dimension_count_swa", hd)
        o.f32("{arch}.rope.freq_base", 1_000_000.0)  # full layers
        o.f32("{arch}.rope.freq_base_swa", d.rope_base)
        o.u32("{arch}.attention.sliding_window", d.n_swa)
        o.arr("{arch}.attention.sliding_window_pattern", is_swa)
        o.u32("{arch}.attention.shared_kv_layers", 0)
        o.u32("{arch}.embedding_length_per_layer_input", 0)
        o.f32("{arch}.final_logit_softcapping", d.softcap)
        # proportional RoPE (partial_rotary_factor 0.25) on full layers: unrotated pairs get freq 1e30
        n_rot = ghd // 8
        o.w.add_tensor("rope_freqs.weight", np.array([1.0] * n_rot + [1e30] * (ghd // 2 - n_rot), np.float32))
    else:  # llama4
        _hparams(o, d, n_ff=d.n_ff, head_dim=hd, n_head_kv=d.n_head_kv)
        o.f32("{arch}.rope.freq_base", 500_000.0)
        _moe_hparams(o, d)
        o.u32("{arch}.interleave_moe_layer_step", d.moe_every)

    for i in range(d.n_layer):
        o.norm(f"blk.{i}.attn_norm.weight", n)
        if arch in ("qwen3", "qwen3moe"):
            _attn(o, i, n, d.n_head, d.n_head_kv, hd)
            o.norm(f"blk.{i}.attn_q_norm.weight", hd)
            o.norm(f"blk.{i}.attn_k_norm.weight", hd)
            o.norm(f"blk.{i}.ffn_norm.weight", n)
            if arch == "qwen3":
                _dense_ffn(o, i, n, d.n_ff)
            else:
                _experts(o, i, d)
        elif arch == "gpt-oss":
            _attn(o, i, n, d.n_head, d.n_head_kv, hd, bias=True)
            o.vec(f"blk.{i}.attn_sinks.weight", d.n_head, scale=1.0)  # [n_head]
            o.norm(f"blk.{i}.post_attention_norm.weight", n)
            _experts(o, i, d, bias=True)
        elif arch == "gemma4":
            swa = d.gemma4_is_swa()[i]
            lhd, lkv = (hd, d.n_head_kv) if swa else (d.ghd(arch), d.n_head_kv_global)
            _attn(o, i, n, d.n_head, lkv, lhd, v=swa)  # full layers: attention_k_eq_v, V = K
            o.norm(f"blk.{i}.attn_q_norm.weight", lhd)
            o.norm(f"blk.{i}.attn_k_norm.weight", lhd)
            o.norm(f"blk.{i}.post_attention_norm.weight", n)
            o.norm(f"blk.{i}.ffn_norm.weight", n)
            _dense_ffn(o, i, n, d.n_ff)
            o.norm(f"blk.{i}.post_ffw_norm.weight", n)
            o.w.add_tensor(f"blk.{i}.layer_output_scale.weight", np.array([0.5 + 0.5 * o.rng.random()], np.float32))
        else:  # llama4
            _attn(o, i, n, d.n_head, d.n_head_kv, hd)
            o.norm(f"blk.{i}.ffn_norm.weight", n)
            if (i + 1) % d.moe_every == 0:
                _experts(o, i, d)
                _dense_ffn(o, i, n, d.n_ff_exp, suffix="_shexp")  # shared expert
            else:
                _dense_ffn(o, i, n, d.n_ff)
    return _write(o.w, path)


def hf_config(arch: str, dims: ArchDims | None = None) -> dict:
    """The HF config.json of the target `write_arch_target(arch, dims)` writes."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r} (one of {', '.join(ARCHS)})")
    d = dims or ArchDims()
    hd = d.hd(arch)
    base = {"architectures": [HF_CLASS[arch]], "vocab_size": N_VOCAB, "hidden_size": d.n_embd,
            "num_hidden_layers": d.n_layer, "num_attention_heads": d.n_head, "num_key_value_heads": d.n_head_kv,
            "head_dim": hd, "intermediate_size": d.n_ff, "max_position_embeddings": d.n_ctx,
            "rms_norm_eps": d.rms_eps, "torch_dtype": "bfloat16"}
    if arch == "qwen3":
        return {**base, "model_type": "qwen3", "hidden_act": "silu", "rope_theta": d.rope_base,
                "attention_bias": False, "tie_word_embeddings": d.is_tied(arch)}
    if arch == "qwen3moe":
        return {**base, "model_type": "qwen3_moe", "hidden_act": "silu", "rope_theta": d.rope_base,
                "attention_bias": False, "tie_word_embeddings": d.is_tied(arch), "num_experts": d.n_expert,
                "num_experts_per_tok": d.n_expert_used, "moe_intermediate_size": d.n_ff_exp,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    if arch == "gpt-oss":
        return {**base, "model_type": "gpt_oss", "intermediate_size": d.n_ff_exp, "hidden_act": "silu",
                "num_local_experts": d.n_expert, "num_experts_per_tok": d.n_expert_used,
                "sliding_window": d.n_swa, "attention_bias": True, "tie_word_embeddings": d.is_tied(arch),
                "layer_types": ["sliding_attention" if s else "full_attention" for s in d.gpt_oss_is_swa()],
                "rope_theta": d.rope_base, "swiglu_limit": 7.0,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": d.n_ctx // 32}}
    if arch == "gemma4":
        text = {**base, "model_type": "gemma4_text", "hidden_activation": "gelu_pytorch_tanh",
                "global_head_dim": d.ghd(arch), "num_global_key_value_heads": d.n_head_kv_global,
                "attention_k_eq_v": True, "sliding_window": d.n_swa, "final_logit_softcapping": d.softcap,
                "layer_types": ["sliding_attention" if s else "full_attention" for s in d.gemma4_is_swa()],
                "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "enable_moe_block": False,
                "tie_word_embeddings": d.is_tied(arch),
                "rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                       "rope_theta": 1_000_000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": d.rope_base}}}
        text.pop("architectures"), text.pop("torch_dtype")
        return {"architectures": [HF_CLASS[arch]], "model_type": "gemma4", "text_config": text,
                "tie_word_embeddings": d.is_tied(arch), "torch_dtype": "bfloat16"}
    text = {**base, "model_type": "llama4_text", "hidden_act": "silu", "intermediate_size": d.n_ff_exp,
            "intermediate_size_mlp": d.n_ff, "num_local_experts": d.n_expert, "num_experts_per_tok": d.n_expert_used,
            "interleave_moe_layer_step": d.moe_every, "rope_theta": 500_000.0, "use_qk_norm": True,
            "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "tie_word_embeddings": d.is_tied(arch)}
    text.pop("architectures"), text.pop("torch_dtype")
    return {"architectures": [HF_CLASS[arch]], "model_type": "llama4", "text_config": text,
            "tie_word_embeddings": d.is_tied(arch), "torch_dtype": "bfloat16"}
