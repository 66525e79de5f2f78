"""The EAGLE-3 head in torch, with exactly the math of the pinned `src/models/eagle3.cpp` graph.

Encoder: g = fc(features)                        features = the target's 3 layer inputs, concatenated
         (norm_before_fc: one RMSNorm over the concatenation first; EAGLE 3.1 fc_norm: one RMSNorm per
         feature slice first, which the pinned graph lacks and eagle3_gguf.head_norms applies)
Decoder, per row (token t, g):
    x     = input_layernorm(embed(t)) ‖ hidden_norm(g)          # [2 * n_embd]
    a     = attention(q/k/v take x; RoPE on q, k)               # GQA, scale 1/sqrt(head_dim)
    r     = a + (hidden_norm(g) if norm_before_residual else g)
    h     = r + mlp(post_attention_layernorm(r))                # SwiGLU; h is fed back as g next step
    logit = lm_head(norm(h))                                    # over the draft vocab
    (EAGLE 3.1 norm_output: norm(h), not h, is fed back as g; the logits are the same)

Weights are kept in the Hugging Face layout (nn.Linear: [out, in]; RoPE in the rotate-half
convention), the layout SafeAILab checkpoints use; the converter permutes q/k rows for llama.cpp.
Token embeddings are the target's, frozen.

Training-time test (`unroll`): step 0 runs every position i of a sequence on the real pair
(t[i+1], g_i) at position i and predicts t[i+2]. Step j > 0 continues the draft chain that started
at i: it feeds (t[i+1+j], h of step j-1 at i) at position i+j; its query sees the step-0 keys of
positions 0..i (what the draft KV cache holds from real features) plus the keys its own chain wrote
at steps 1..j (the speculative entries), exactly what llama.cpp's draft cache holds at inference.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class HeadConfig:
    n_embd: int  # the head's hidden size (= the target's: it reads the target's token embeddings)
    n_ff: int
    n_head: int
    n_head_kv: int
    n_embd_tgt: int  # the target's hidden size; features are 3 * n_embd_tgt wide
    n_vocab: int  # the target's vocab
    draft_vocab: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    norm_before_residual: bool = False
    max_position: int = 4096
    # EAGLE 3.1 (speculators): at most one of norm_before_fc / fc_norm
    norm_before_fc: bool = False  # one RMSNorm over the 3 concatenated features (input_norm)
    fc_norm: bool = False  # one RMSNorm per feature (fc_norm.{i})
    norm_output: bool = False  # feed norm(h) back across draft steps
    n_embd_head: int = 0  # attention head width when not n_embd // n_head (gemma-4's heads: 256 at hidden 5376)

    @classmethod
    def for_target(cls, tgt, draft_vocab: int, n_ff: int | None = None, eagle31: bool = False) -> "HeadConfig":
        """The head for a target (a gguf_file.TargetInfo, as export.read_target checks it): its widths,
        attention heads, norm epsilon, RoPE and context (2048 where the GGUF has none); the MLP as wide as
        the target's unless n_ff says otherwise. eagle31: the EAGLE 3.1 head we train, fc_norm + norm_output."""
        return cls(n_embd=tgt.n_embd, n_ff=n_ff or int(tgt.n_ff), n_head=int(tgt.n_head),
                   n_head_kv=int(tgt.n_head_kv), n_embd_tgt=tgt.n_embd, n_vocab=tgt.n_vocab, draft_vocab=draft_vocab,
                   rms_eps=float(tgt.rms_eps), rope_theta=float(tgt.rope_theta),
                   max_position=tgt.n_ctx_train or 2048, fc_norm=eagle31, norm_output=eagle31)

    @property
    def head_dim(self) -> int:
        return self.n_embd_head or self.n_embd // self.n_head

    def to_dict(self) -> dict:
        """The fields; the EAGLE 3.1 flags only when set, so checkpoints saved before they existed
        still compare equal on resume."""
        d = asdict(self)
        for flag in ("norm_before_fc", "fc_norm", "norm_output", "n_embd_head"):
            if not d[flag]:
                del d[flag]
        return d


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Rope(nn.Module):
    """HF rotate-half RoPE (llama.cpp's NORM rope after its q/k row permutation)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: [B, n_heads, T, head_dim], pos: [T] or [B, T]"""
        ang = pos.float().unsqueeze(-1) * self.inv_freq  # [.., T, head_dim/2]
        emb = torch.cat((ang, ang), dim=-1)
        if emb.dim() == 3:
            emb = emb.unsqueeze(1)  # [B, 1, T, head_dim]
        return x * emb.cos() + rotate_half(x) * emb.sin()


class Attention(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        hd = c.head_dim
        self.c = c
        self.q_proj = nn.Linear(2 * c.n_embd, c.n_head * hd, bias=False)
        self.k_proj = nn.Linear(2 * c.n_embd, c.n_head_kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * c.n_embd, c.n_head_kv * hd, bias=False)
        self.o_proj = nn.Linear(c.n_head * hd, c.n_embd, bias=False)
        self.rope = Rope(hd, c.rope_theta)

    def qkv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, 2 * n_embd] -> q [B, n_head, T, hd], k/v [B, n_head, T, hd] (kv heads repeated)"""
        B, T, _ = x.shape
        c, hd = self.c, self.c.head_dim
        q = self.q_proj(x).view(B, T, c.n_head, hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.n_head_kv, hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.n_head_kv, hd).transpose(1, 2)
        q, k = self.rope(q, pos), self.rope(k, pos)
        rep = c.n_head // c.n_head_kv
        return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

    def out(self, a: torch.Tensor) -> torch.Tensor:
        """a: [B, n_head, T, hd] -> [B, T, n_embd]"""
        B, _, T, _ = a.shape
        return self.o_proj(a.transpose(1, 2).reshape(B, T, -1))


class Eagle3Head(nn.Module):
    def __init__(self, c: HeadConfig, embed: torch.Tensor):
        """embed: the target's token embeddings  # [n_vocab, n_embd] (frozen)"""
        super().__init__()
        self.c = c
        self.register_buffer("embed", embed.float(), persistent=False)
        if c.fc_norm and c.norm_before_fc:
            raise ValueError("fc_norm and norm_before_fc are mutually exclusive")
        self.input_norm = RMSNorm(3 * c.n_embd_tgt, c.rms_eps) if c.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(c.n_embd_tgt, c.rms_eps) for _ in range(3)) if c.fc_norm else None
        self.fc = nn.Linear(3 * c.n_embd_tgt, c.n_embd, bias=False)
        self.input_layernorm = RMSNorm(c.n_embd, c.rms_eps)
        self.hidden_norm = RMSNorm(c.n_embd, c.rms_eps)
        self.attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.n_embd, c.rms_eps)
        self.gate_proj = nn.Linear(c.n_embd, c.n_ff, bias=False)
        self.up_proj = nn.Linear(c.n_embd, c.n_ff, bias=False)
        self.down_proj = nn.Linear(c.n_ff, c.n_embd, bias=False)
        self.norm = RMSNorm(c.n_embd, c.rms_eps)
        self.lm_head = nn.Linear(c.n_embd, c.draft_vocab, bias=False)
        self.scale = 1.0 / math.sqrt(c.head_dim)

    # -- pieces --------------------------------------------------------------------------------
    def encode(self, feats: torch.Tensor) -> torch.Tensor:
        """feats: [..., 3 * n_embd_tgt] -> g [..., n_embd]"""
        if self.input_norm is not None:
            feats = self.input_norm(feats)
        if self.fc_norm is not None:
            feats = torch.cat([norm(x) for norm, x in zip(self.fc_norm, feats.chunk(3, dim=-1))], dim=-1)
        return self.fc(feats)

    def feedback(self, h: torch.Tensor) -> torch.Tensor:
        """The g of the next draft step: h, or norm(h) with norm_output.  # [..., n_embd]"""
        return self.norm(h) if self.c.norm_output else h

    def _input(self, tokens: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> attention input x [B, T, 2 * n_embd], residual [B, T, n_embd]"""
        gn = self.hidden_norm(g)
        x = torch.cat((self.input_layernorm(self.embed[tokens]), gn), dim=-1)
        return x, (gn if self.c.norm_before_residual else g)

    def _finish(self, attn_out: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        """-> pre-norm hidden h [B, T, n_embd]"""
        r = attn_out + resid
        m = self.post_attention_layernorm(r)
        return r + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [..., n_embd] -> [..., draft_vocab]"""
        return self.lm_head(self.norm(h))

    # -- one plain causal pass (what llama.cpp computes for a batch of real pairs) --------------------
    def forward(self, tokens: torch.Tensor, g: torch.Tensor, pos0: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens: [B, T], g: [B, T, n_embd] at positions pos0.. -> (logits [B, T, V'], h [B, T, n_embd])"""
        T = tokens.shape[1]
        x, resid = self._input(tokens, g)
        pos = torch.arange(pos0, pos0 + T, device=tokens.device)
        q, k, v = self.attn.qkv(x, pos)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        h = self._finish(self.attn.out(a), resid)
        return self.logits(h), h

    # -- training-time test ------------------------------------------------------------------------
    def unroll(self, feats: torch.Tensor, tokens: torch.Tensor, n_steps: int) -> list[torch.Tensor]:
        """feats: [B, T, 3 * n_embd_tgt] (rows 0..T-1), tokens: [B, T + n_steps] with tokens[:, m] =
        t[m + 1] (the token after row m). Returns the pre-norm hidden state per step j: [B, T, n_embd];
        `logits(h)` of row i predicts t[i + 2 + j] (computed by the caller, only where it is needed)."""
        B, T, _ = feats.shape
        g = self.encode(feats)  # [B, T, n_embd]
        base = torch.arange(T, device=feats.device)
        causal = base[None, :] <= base[:, None]  # [T(query), T(key)]
        k0 = v0 = None
        chain_k: list[torch.Tensor] = []
        chain_v: list[torch.Tensor] = []
        out = []
        for j in range(n_steps):
            x, resid = self._input(tokens[:, j:j + T], g)
            q, k, v = self.attn.qkv(x, base + j)  # [B, nh, T, hd]
            if j == 0:
                k0, v0 = k, v
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            else:
                chain_k.append(k)
                chain_v.append(v)
                s0 = (q @ k0.transpose(-1, -2)) * self.scale  # [B, nh, T, T]
                s0 = s0.masked_fill(~causal, float("-inf"))
                sd = torch.stack([(q * kk).sum(-1) for kk in chain_k], dim=-1) * self.scale  # [B, nh, T, j]
                p = torch.softmax(torch.cat((s0, sd), dim=-1), dim=-1)
                a = p[..., :T] @ v0 + (p[..., T:].unsqueeze(-1) * torch.stack(chain_v, dim=-2)).sum(-2)
            h = self._finish(self.attn.out(a), resid)
            out.append(h)
            g = self.feedback(h)
        return out
