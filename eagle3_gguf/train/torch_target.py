"""Teacher forcing in torch: the target's forward written once more, on its GGUF's weights dequantized, so that a
head trains on a GPU machine without llama.cpp and without data on disk.

`TorchTarget` runs a llama-architecture GGUF (SmolLM2 and the other `llama` targets) as llama.cpp's graph does
(RMSNorm, RoPE on adjacent pairs as the GGUF's q/k rows are stored, with Llama 3's frequency factors where the GGUF
has them, grouped-query attention, SwiGLU) in float32 and returns, for every position of a batch of records, the
three layer inputs EAGLE-3 reads and the target's top-k next tokens. Against llama.cpp's CPU forward of the same
SmolLM2 Q4_1 file the features agree to a cosine above 0.998 and the greedy tokens on ~99% of positions (llama.cpp
rounds activations to 8 bits for its dot products): tests/test_torch_target.py.

`OnlineData` is the teacher-forced data set computed as training reads it: the records' tokens and answer masks
(sharegpt.prepare's), their features and soft labels from the TorchTarget, batch by batch (`select`). The training
loop reads it as it reads a `data.Dataset` on disk. Self-distillation needs answers first: `TorchTarget.generate`
answers a batch of prompts greedily (KV cache; each answer equals the full forward's argmax at every step), for
answers.self_distilled.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .. import keys
from ..errors import Eagle3Error
from ..gguf_file import GGUFFile, TargetInfo, read_gguf
from .answers import gguf_identity
from .data import Dataset, TokenRecords
from .export import tensor_f32
from .loop import make_batches

LOGIT_ROWS = 4096  # rows of the lm_head at a time: [4096, n_vocab] float32 is 0.8 GB at SmolLM2's vocab
# grouped-query attention inside F.scaled_dot_product_attention (torch 2.5 on): no copy of the cache per step
SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [n_embd]
    wq: torch.Tensor  # [n_head * head_dim, n_embd]
    wk: torch.Tensor  # [n_head_kv * head_dim, n_embd]
    wv: torch.Tensor  # [n_head_kv * head_dim, n_embd]
    wo: torch.Tensor  # [n_embd, n_head * head_dim]
    ffn_norm: torch.Tensor  # [n_embd]
    gate: torch.Tensor  # [n_ff, n_embd]
    up: torch.Tensor  # [n_ff, n_embd]
    down: torch.Tensor  # [n_embd, n_ff]


@dataclass
class TeacherRows:
    feats: torch.Tensor  # [B, T, 3 * n_embd] float32: the inputs of the requested layers, concatenated in order
    topk_ids: torch.Tensor  # [B, T, k] int64: the target's k likeliest next tokens after each position, best first
    topk_logp: torch.Tensor  # [B, T, k] float32: their log-probabilities over the full vocab


# the tensors of a plain llama GGUF (and Llama 3's RoPE frequency factors): anything else (biases, experts, fused
# qkv) is refused
_BLOCK = {"attn_norm": keys.T_ATTN_NORM, "wq": keys.T_ATTN_Q, "wk": keys.T_ATTN_K, "wv": keys.T_ATTN_V,
          "wo": keys.T_ATTN_OUT, "ffn_norm": keys.T_FFN_NORM, "gate": keys.T_FFN_GATE, "up": keys.T_FFN_UP,
          "down": keys.T_FFN_DOWN}
_GLOBAL = (keys.T_TOKEN_EMBD, keys.T_OUTPUT_NORM, keys.T_OUTPUT, keys.T_ROPE_FREQS)
ELSEWHERE = "leave out --online: llama.cpp makes this target's data"


@dataclass
class KV:
    k: torch.Tensor  # [B, n_head_kv, columns, head_dim]
    v: torch.Tensor  # [B, n_head_kv, columns, head_dim]


@dataclass
class TeacherBatch:
    rows: TeacherRows  # [B, T, ...]: every padded position
    real: torch.Tensor  # [B, T] bool: a record's token, not padding
    answer: torch.Tensor  # [B, T] bool: an answer token (predicting it trains the head)


class TorchTarget:
    """A llama-architecture target in torch (float32), for teacher forcing (module doc)."""

    def __init__(self, info: TargetInfo, g: GGUFFile, layers: list[int], device: torch.device):
        self.info, self.layers, self.device = info, list(layers), device
        self.path = g.path
        self.n_head, self.n_head_kv = int(info.n_head), int(info.n_head_kv)
        self.head_dim = info.n_embd // self.n_head
        self.eps = float(info.rms_eps)

        def w(name: str) -> torch.Tensor:
            return torch.from_numpy(tensor_f32(g, name, "convert the target again")).to(device)

        self.embd = w(keys.T_TOKEN_EMBD)  # [n_vocab, n_embd]
        self.output = w(keys.T_OUTPUT) if g.tensor(keys.T_OUTPUT) is not None else self.embd  # tied where absent
        self.output_norm = w(keys.T_OUTPUT_NORM)
        self.blocks = [_Layer(**{field: w(keys.blk(name, i)) for field, name in _BLOCK.items()})
                       for i in range(info.n_layer)]  # every layer: the soft labels need the logits
        texts = [bytes(t).decode(errors="replace") for t in g.metadata.get(keys.KEY_TOKENIZER_TOKENS) or []]
        ids = [g.metadata.get(k) for k in (keys.KEY_TOKENIZER_EOS_ID, keys.KEY_TOKENIZER_EOT_ID,
                                             keys.KEY_TOKENIZER_EOM_ID)]
        # where a generation ends: llama.cpp's end-of-generation tokens
        self.stop = frozenset([int(i) for i in ids if i is not None] +
                              [i for i, t in enumerate(texts) if t in keys.EOG_TOKEN_TEXTS])
        half = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device) / self.head_dim
        self.inv_freq = (float(info.rope_theta) ** -half).float()  # [head_dim / 2]
        if g.tensor(keys.T_ROPE_FREQS) is not None:  # Llama 3's RoPE scaling: each pair's angle divided, as ggml's
            self.inv_freq = self.inv_freq / w(keys.T_ROPE_FREQS)  # [head_dim / 2]

    @classmethod
    def from_gguf(cls, path: str | Path, layers: list[int], device: torch.device) -> "TorchTarget":
        """The target of a GGUF, checked to be one this forward computes as llama.cpp does (one Eagle3Error
        line otherwise, before any weight is read)."""
        g = read_gguf(path)
        info = TargetInfo.from_gguf(g)
        name = g.path.name
        if g.arch != keys.ARCH_LLAMA:
            raise Eagle3Error(f"{name}: the torch target runs llama-architecture GGUFs, not '{g.arch}': {ELSEWHERE}")
        known = set(_GLOBAL) | {keys.blk(t, i) for t in _BLOCK.values() for i in range(info.n_layer)}
        other = [t.name for t in g.tensors if t.name not in known]
        if other:
            raise Eagle3Error(f"{name}: the torch target has no place for {other[0]} ({len(other)} such tensors): "
                              f"{ELSEWHERE}")
        factor = g.get(keys.KEY_ROPE_SCALING_FACTOR, g.get(keys.KEY_ROPE_SCALE_LINEAR))
        if (g.get(keys.KEY_ROPE_SCALING_TYPE) not in (None, "none", "linear") or factor not in (None, 0.0, 1.0)
                or g.get(keys.KEY_ROPE_SCALING_ATTN_FACTOR) not in (None, 1.0)):
            raise Eagle3Error(f"{name}: the torch target does not scale RoPE: {ELSEWHERE}")
        if not isinstance(info.n_head, int) or not isinstance(info.n_head_kv, int):
            raise Eagle3Error(f"{name}: the torch target needs one head count for all layers: {ELSEWHERE}")
        head_dim = info.n_embd // info.n_head
        if any(g.get(k, head_dim) != head_dim for k in (keys.KEY_KEY_LENGTH, keys.KEY_VALUE_LENGTH)):
            raise Eagle3Error(f"{name}: the torch target needs heads of n_embd / n_head = {head_dim}: {ELSEWHERE}")
        freqs = g.tensor(keys.T_ROPE_FREQS)
        if g.get(keys.KEY_ROPE_DIMENSION_COUNT, head_dim) != head_dim or (
                freqs is not None and int(np.prod(freqs.shape)) != head_dim // 2):
            raise Eagle3Error(f"{name}: the torch target rotates all {head_dim} dimensions of a head, one factor per "
                              f"pair: {ELSEWHERE}")
        if len(layers) != keys.N_TARGET_LAYERS or not all(0 <= lid < info.n_layer for lid in layers):
            raise Eagle3Error(f"{name}: the torch target extracts 3 layer inputs in 0..{info.n_layer - 1}, "
                              f"not {list(layers)}: pick the head's layers of this target")
        return cls(info, g, layers, device)

    @cached_property
    def identity(self) -> str:
        """Which GGUF answers (answers.self_distilled's check): hashed when first asked, not at every load."""
        return gguf_identity(self.path)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """llama.cpp's normal RoPE: dimensions (2i, 2i + 1) rotate together.  # x: [B, T, heads, head_dim]"""
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2)

    def _blocks(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, cache: list[KV] | None = None,
                at: int = 0, feats: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """The layers over x [B, q, n_embd] at positions pos [B, q]; mask [B, 1, q, keys] bool (None: causal over
        x alone); with a cache, its columns at..at + q take this call's keys and values and the queries see
        columns 0..at + q. feats collects the requested layers' inputs."""
        B, q, _ = x.shape
        hd = self.head_dim
        ang = pos.float()[..., None] * self.inv_freq  # [B, q, hd / 2]
        cos, sin = torch.cos(ang)[:, :, None], torch.sin(ang)[:, :, None]  # [B, q, 1, hd / 2]
        for il, L in enumerate(self.blocks):
            if feats is not None and il in self.layers:
                feats[il] = x
            h = self._rms(x, L.attn_norm)
            qh = self._rope((h @ L.wq.T).view(B, q, self.n_head, hd), cos, sin).transpose(1, 2)
            kh = self._rope((h @ L.wk.T).view(B, q, self.n_head_kv, hd), cos, sin).transpose(1, 2)
            vh = (h @ L.wv.T).view(B, q, self.n_head_kv, hd).transpose(1, 2)
            if cache is not None:
                cache[il].k[:, :, at:at + q], cache[il].v[:, :, at:at + q] = kh, vh
                kh, vh = cache[il].k[:, :, :at + q], cache[il].v[:, :, :at + q]
            # head j reads kv head j // (n_head / n_head_kv), as ggml broadcasts (in the kernel where torch can)
            if self.n_head != self.n_head_kv and not SDPA_GQA:
                kh = kh.repeat_interleave(self.n_head // self.n_head_kv, dim=1)
                vh = vh.repeat_interleave(self.n_head // self.n_head_kv, dim=1)
            gqa = {"enable_gqa": True} if SDPA_GQA and self.n_head != self.n_head_kv else {}
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None,
                                               **gqa)  # [B, n_head, q, hd]
            x = x + o.transpose(1, 2).reshape(B, q, -1) @ L.wo.T
            h = self._rms(x, L.ffn_norm)
            x = x + (F.silu(h @ L.gate.T) * (h @ L.up.T)) @ L.down.T
        return x

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, k: int) -> TeacherRows:
        """Every position of right-padded records (causal: padding changes no earlier row).  # tokens: [B, T]"""
        B, T = tokens.shape
        feats: dict[int, torch.Tensor] = {}
        pos = torch.arange(T, device=self.device).expand(B, T)
        x = self._blocks(self.embd[tokens], pos, None, feats=feats)  # [B, T, n_embd]
        x = self._rms(x, self.output_norm).reshape(B * T, -1)
        ids, logp = [], []
        for a in range(0, B * T, LOGIT_ROWS):
            logits = x[a:a + LOGIT_ROWS] @ self.output.T  # [rows, n_vocab]
            val, idx = torch.topk(logits, k, dim=1)
            ids.append(idx)
            logp.append(val - torch.logsumexp(logits, dim=1, keepdim=True))
        return TeacherRows(torch.cat([feats[lid] for lid in self.layers], -1), torch.cat(ids).view(B, T, k),
                           torch.cat(logp).view(B, T, k))

    @torch.no_grad()
    def generate(self, prompts: list[np.ndarray], max_new: int, stop: frozenset[int] | None = None) -> list[np.ndarray]:
        """Greedy answers to a batch of prompts, each up to max_new tokens and ending with the first stop token
        it emits (kept; default: the target's end-of-generation tokens); left-padded prompts, a KV cache. On a CPU
        every token is the full forward's argmax; a GPU may part near-ties.  # prompts: B x [n_i] -> B x [<= max_new]"""
        stop = self.stop if stop is None else stop
        if not prompts or min(len(p) for p in prompts) == 0:
            raise Eagle3Error("generate needs at least one prompt, none of them empty")
        B, P = len(prompts), max(len(p) for p in prompts)
        dev, total = self.device, P + max_new
        pad = torch.tensor([P - len(p) for p in prompts], device=dev)  # [B]
        tokens = torch.zeros((B, P), dtype=torch.int64, device=dev)
        for b, p in enumerate(prompts):
            tokens[b, P - len(p):] = torch.from_numpy(np.asarray(p, np.int64))
        cols = torch.arange(total, device=dev)
        real = cols[None] >= pad[:, None]  # [B, total]: key columns holding a token (not padding)
        causal = torch.ones((P, P), dtype=torch.bool, device=dev).tril()
        # a padding row attends to itself alone: finite, and no real row ever attends to it
        mask = (real[:, None, None, :P] & causal) | torch.eye(P, dtype=torch.bool, device=dev)  # [B, 1, P, P]
        cache = [KV(torch.zeros((B, self.n_head_kv, total, self.head_dim), device=dev),
                    torch.zeros((B, self.n_head_kv, total, self.head_dim), device=dev)) for _ in self.blocks]
        pos = (cols[None, :P] - pad[:, None]).clamp(min=0)  # [B, P]
        x = self._blocks(self.embd[tokens], pos, mask, cache, 0)
        stop_ids = torch.tensor(sorted(stop), dtype=torch.int64, device=dev)
        out = torch.zeros((B, max_new), dtype=torch.int64, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        n = 0
        while n < max_new and not bool(done.all()):
            nxt = (self._rms(x[:, -1], self.output_norm) @ self.output.T).argmax(-1)  # [B]
            out[:, n] = nxt
            n += 1
            done |= torch.isin(nxt, stop_ids)
            if n < max_new:
                x = self._blocks(self.embd[nxt][:, None], (P + n - 1 - pad)[:, None],
                                 real[:, None, None, :P + n], cache, P + n - 1)
        answers = []
        for row in out[:, :n].cpu().numpy():
            ends = np.flatnonzero(np.isin(row, list(stop)))
            answers.append(row[:ends[0] + 1 if len(ends) else n].astype(np.int32))
        return answers


@dataclass
class OnlineData:
    """Teacher-forced records whose features and soft labels a TorchTarget computes when a batch is read
    (module doc)."""

    target: TorchTarget
    records: TokenRecords  # tokens and answer masks, each record cut and kept as `of` does
    topk: int
    own_answers: bool = False  # the answers are the target's own greedy ones (self_distilled): its choices (a GPU's
    #                            forward may part near-ties; only the draft vocab's counts read them)

    @classmethod
    def of(cls, target: TorchTarget, records: TokenRecords, max_tokens: int, topk: int,
           own_answers: bool = False) -> "OnlineData":
        """What data.teacher_forced_data keeps of the records (TokenRecords.teachable)."""
        kept = [r for r in (records.teachable(i, max_tokens) for i in range(records.n_records)) if r is not None]
        return cls(target, TokenRecords.join([t for t, _ in kept], [m for _, m in kept]), topk, own_answers)

    @property
    def n_records(self) -> int:
        return self.records.n_records

    @property
    def starts(self) -> np.ndarray:
        return self.records.starts

    def head(self, n: int) -> "OnlineData":
        """The first n records, on the same target."""
        return OnlineData(self.target, self.records.head(n), self.topk, self.own_answers)

    def _teacher(self, parts: list[tuple[np.ndarray, np.ndarray]], k: int) -> TeacherBatch:
        """One forward of the target over records (their tokens and answer masks), right-padded."""
        T = max(len(t) for t, _ in parts)
        tokens = np.zeros((len(parts), T), np.int64)  # [B, T]
        real = np.zeros((len(parts), T), bool)  # [B, T]
        answer = np.zeros((len(parts), T), bool)  # [B, T]
        for b, (t, m) in enumerate(parts):
            tokens[b, :len(t)], real[b, :len(t)], answer[b, :len(t)] = t, True, m
        dev = self.target.device
        return TeacherBatch(self.target.forward(torch.from_numpy(tokens).to(dev), k), torch.from_numpy(real).to(dev),
                            torch.from_numpy(answer).to(dev))

    def select(self, records: list[int]) -> tuple[Dataset, list[int]]:
        """These records as a Dataset (their features and top-k from one forward of the target), and their
        indices in it."""
        parts = [self.records.record(r) for r in records]
        tb = self._teacher(parts, self.topk)
        data = Dataset(tokens=np.concatenate([t for t, _ in parts]), feats=tb.rows.feats[tb.real].cpu().numpy(),
                       starts=np.cumsum([0] + [len(t) for t, _ in parts]).astype(np.int64),
                       n_prompt=np.array([int(np.argmax(m)) for _, m in parts], np.int32), manifest=None,
                       mask=np.concatenate([m for _, m in parts]),
                       topk_ids=tb.rows.topk_ids[tb.real].int().cpu().numpy(),
                       topk_logp=tb.rows.topk_logp[tb.real].cpu().numpy())
        return data, list(range(len(parts)))

    def label_counts(self, n_vocab: int, records: list[int] | None = None, batch_tokens: int = 16384) -> np.ndarray:
        """How often each target token is the target's choice at an answer position (its top-1 after the token
        before), in these records (default all): a forward per batch, nothing copied back but the counts; the answer
        tokens themselves where they are the target's own greedy answers (no forward).  # [n_vocab] int64"""
        records = list(range(self.n_records)) if records is None else records
        if self.own_answers:
            answers = [t[m] for t, m in (self.records.record(r) for r in records)]
            return np.bincount(np.concatenate([np.zeros(0, np.int32)] + answers), minlength=n_vocab).astype(np.int64)
        counts = torch.zeros(n_vocab, dtype=torch.int64, device=self.target.device)
        for group in make_batches(self, records, batch_tokens, None):
            tb = self._teacher([self.records.record(r) for r in group], 1)
            counts += torch.bincount(tb.rows.topk_ids[:, :-1, 0][tb.answer[:, 1:]], minlength=n_vocab)
        return counts.cpu().numpy()
