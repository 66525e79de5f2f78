"""Converted heads run in llama.cpp: each layout loads with the target, drafts tokens, and its draft
logits match a small numpy reference of the EAGLE-3 head forward (src/models/eagle3.cpp's math,
computed from the *checkpoint's* weights with HF rotate-half RoPE, so the q/k permutation is checked too).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from checkpoints import EXPECTED_IDS, LAYOUTS, CkptDims, random_weights, write_checkpoint
from eagle3_gguf.batch import Batch, BatchExt
from eagle3_gguf.context import LLAMA_PROCESS_TYPE_DECODE, LLAMA_PROCESS_TYPE_ENCODE, Context
from eagle3_gguf.convert import convert_head
from eagle3_gguf.convert.quantize import dequantize
from eagle3_gguf.gguf_file import read_gguf_metadata
from eagle3_gguf.native import Model

PROMPT = [1, 17, 305, 4021, 77, 12000, 9]
N_STEPS = 3


@dataclass
class Trace:
    features: np.ndarray  # [n, 3 * n_embd_tgt] from the target
    g: np.ndarray  # [n, n_embd] encoder output
    logits: list[np.ndarray]  # per decoder call: [rows, n_vocab] (prefill: all rows; then one row per step)
    tokens: list[int]  # the drafted tokens (argmax), target ids
    next_token: int  # the target's own next token after the prompt (the first decoder row's partner)


def run_llama_cpp(target, head, prompt: list[int], n_steps: int) -> Trace:
    """Target prefill with extraction → head ENCODE → head DECODE (token[k+1], g[k]) → n_steps greedy drafts."""
    tm, hm = Model(target), Model(head)
    tc = Context(tm, n_ctx=128, n_batch=64, n_threads=2)
    hc = Context(hm, n_ctx=128, n_batch=64, n_threads=2, ctx_other=tc)
    ids = hm.target_layer_ids()
    for lid in ids:
        if lid < tm.n_layer:
            tc.set_layer_inp(lid)
        else:
            tc.set_nextn(True, masked=False)
    hc.set_nextn(True, masked=True)
    n = len(prompt)
    batch = Batch(64)
    batch.set(prompt, 0, logits="all")
    tc.decode(batch)
    features = np.concatenate([tc.layer_inp(i, n) if i < tm.n_layer else tc.nextn(n) for i in ids], axis=1)
    features = features.copy()  # [n, 3 * n_embd_tgt]
    next_token = int(np.argmax(tc.logits_ith(n - 1)))

    be = BatchExt(hc)
    for k in range(n):
        be.add_embd(features[k], k)
    hc.process(LLAMA_PROCESS_TYPE_ENCODE, be)
    g = hc.nextn(n).copy()  # [n, n_embd]

    be.clear()
    seq = prompt[1:] + [next_token]
    for k in range(n):
        be.add_token(seq[k], k, g[k], output=True)
    hc.process(LLAMA_PROCESS_TYPE_DECODE, be)
    logits = [hc.logits(n).copy()]
    h = hc.nextn_ith(n - 1).copy()
    tokens = []
    for step in range(n_steps):
        tok = int(np.argmax(logits[-1][-1]))
        tokens.append(tok)
        be.clear()
        be.add_token(tok, n + step, h, output=True)
        hc.process(LLAMA_PROCESS_TYPE_DECODE, be)
        logits.append(hc.logits(1).copy())
        h = hc.nextn_ith(0).copy()
    for obj in (be, hc, tc, hm, tm):
        obj.close()
    return Trace(features, g, logits, tokens, next_token)


# ------------------------------------------------------------------------------------------------
# numpy reference of the head (float64)
# ------------------------------------------------------------------------------------------------


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_hf(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """HF rotate-half RoPE on [heads, hd]."""
    hd = x.shape[-1]
    ang = pos * theta ** (-np.arange(0, hd, 2) / hd)  # [hd/2]
    cos, sin = np.concatenate([np.cos(ang)] * 2), np.concatenate([np.sin(ang)] * 2)
    rot = np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], axis=-1)
    return x * cos + rot * sin


class ReferenceHead:
    def __init__(self, w: dict[str, np.ndarray], d: CkptDims, embd: np.ndarray, n_vocab: int,
                 norm_before_residual: bool = False):
        self.w = {k: v.astype(np.float64) for k, v in w.items() if v.dtype == np.float32}
        self.d, self.embd, self.n_vocab = d, embd.astype(np.float64), n_vocab
        self.d2t = (w["d2t"] + np.arange(len(w["d2t"]))) if "d2t" in w else None
        self.nbr = norm_before_residual
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []

    def encode(self, feats: np.ndarray) -> np.ndarray:
        if "input_norm.weight" in self.w:
            feats = _rms(feats, self.w["input_norm.weight"], self.d.rms_eps)
        return feats @ self.w["fc.weight"].T  # [n, n_embd]

    def step(self, token: int, g: np.ndarray, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """One decoder row at `pos` (positions must come in order): → (logits [n_vocab], prenorm h [n_embd])."""
        w, d = self.w, self.d
        hd, grp = d.n_embd // d.n_head, d.n_head // d.n_head_kv
        e = _rms(self.embd[token], w["L.input_layernorm.weight"], d.rms_eps)
        gn = _rms(g, w["L.hidden_norm.weight"], d.rms_eps)
        x = np.concatenate([e, gn])  # [2 * n_embd]
        q = _rope_hf((w["L.self_attn.q_proj.weight"] @ x).reshape(d.n_head, hd), pos, d.rope_theta)
        k = _rope_hf((w["L.self_attn.k_proj.weight"] @ x).reshape(d.n_head_kv, hd), pos, d.rope_theta)
        v = (w["L.self_attn.v_proj.weight"] @ x).reshape(d.n_head_kv, hd)
        self.keys.append(k)
        self.values.append(v)
        K, V = np.stack(self.keys), np.stack(self.values)  # [pos+1, n_head_kv, hd]
        out = np.empty((d.n_head, hd))
        for hh in range(d.n_head):
            s = K[:, hh // grp] @ q[hh] / np.sqrt(hd)
            p = np.exp(s - s.max())
            out[hh] = (p / p.sum()) @ V[:, hh // grp]
        ffn_inp = w["L.self_attn.o_proj.weight"] @ out.reshape(-1) + (gn if self.nbr else g)
        f = _rms(ffn_inp, w["L.post_attention_layernorm.weight"], d.rms_eps)
        mlp = w["L.mlp.down_proj.weight"] @ (_silu(w["L.mlp.gate_proj.weight"] @ f) * (w["L.mlp.up_proj.weight"] @ f))
        h = mlp + ffn_inp
        draft = w["lm_head.weight"] @ _rms(h, w["norm.weight"], d.rms_eps)
        if self.d2t is None:
            return draft, h
        logits = np.full(self.n_vocab, -np.inf)
        logits[self.d2t] = draft
        return logits, h


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def _target_embd(target) -> np.ndarray:
    """The target's token embeddings as llama.cpp sees them (dequantized).  # [n_vocab, n_embd]"""
    meta = read_gguf_metadata(target)
    info = meta.tensor("token_embd.weight")
    return dequantize(meta.tensor_data(info.name), info.ggml_type, info.shape[0])


@pytest.fixture(scope="module")
def target_embd(tiny_target) -> np.ndarray:
    return _target_embd(tiny_target)


def _assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite), f"{what}: -inf pattern differs (d2t scatter)"
    err = np.abs(got[finite] - want[finite]).max()
    scale = np.abs(want[finite]).max()
    assert err <= 1e-3 * scale + 1e-4, f"{what}: max |diff| {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_loads_drafts_and_matches_reference(tmp_path, tiny_target, target_embd, layout):
    d = CkptDims()
    nbr = nbf = layout == "speculators"  # exercise norm_before_residual and norm_before_fc once
    # (specforge ends on id 6 == n_layer: llama targets hand zeros there; both sides use the same features)
    w = random_weights(d, seed=7, embed=layout == "specforge", norm_before_fc=nbf)
    src = write_checkpoint(tmp_path / layout, layout, d, weights=w, norm_before_residual=nbr, norm_before_fc=nbf)
    head = tmp_path / "head.gguf"
    result = convert_head(src, head, tiny_target, outtype="f32", fc_type="f32")
    assert result.layer_ids.ids == EXPECTED_IDS[layout]
    assert (result.norm_before_residual, result.norm_before_fc) == (nbr, nbf)

    trace = run_llama_cpp(tiny_target, head, PROMPT, N_STEPS)
    assert len(trace.tokens) == N_STEPS
    embd = w["embed_tokens.weight"] if "embed_tokens.weight" in w else target_embd
    ref = ReferenceHead(w, d, embd, n_vocab=d.target_vocab, norm_before_residual=nbr)
    g = ref.encode(trace.features.astype(np.float64))
    np.testing.assert_allclose(trace.g, g, rtol=1e-4, atol=1e-4)

    seq = PROMPT[1:] + [trace.next_token]
    for k in range(len(PROMPT)):  # prefill: (token[k+1], g[k]) at pos k
        logits, h = ref.step(seq[k], g[k], k)
        _assert_close(trace.logits[0][k], logits, f"{layout} prefill row {k}")
    for step, tok in enumerate(trace.tokens):  # greedy drafts: (argmax, prenorm h) at the next position
        assert tok == int(np.argmax(logits)), f"{layout}: draft step {step} picked a different token"
        logits, h = ref.step(tok, h, len(PROMPT) + step)
        _assert_close(trace.logits[1 + step][0], logits, f"{layout} draft step {step}")


def test_quantized_default_head_drafts(tmp_path, tiny_target):
    """Default types (fc Q4_0, matrices Q8_0) load and draft: finite logits exactly on the d2t ids."""
    w = random_weights(CkptDims(), seed=3)
    src = write_checkpoint(tmp_path / "ckpt", "safeai", weights=w)
    head = tmp_path / "head.gguf"
    convert_head(src, head, tiny_target)
    meta = read_gguf_metadata(head)
    assert meta.get("eagle3.target_layers") == [2, 3, 3]
    assert {t.name: t.ggml_type.name for t in meta.tensors if t.name in ("fc.weight", "blk.0.ffn_up.weight",
                                                                          "output.weight")} == \
        {"fc.weight": "Q4_0", "blk.0.ffn_up.weight": "Q8_0", "output.weight": "Q8_0"}
    trace = run_llama_cpp(tiny_target, head, PROMPT, 2)
    d2t_ids = set((w["d2t"] + np.arange(len(w["d2t"]))).tolist())
    assert all(t in d2t_ids for t in trace.tokens)
    last = trace.logits[-1][0]
    assert set(np.flatnonzero(np.isfinite(last)).tolist()) == d2t_ids


def test_session_drafts_the_same_with_a_converted_head(tmp_path, tiny_target):
    """The project's own pair check + Eagle3Session accept a converted head and draft what the direct
    native run above drafts (SpecForge layout: own token_embd, d2t, output-of-layer ids)."""
    from eagle3_gguf.pair import PairConfig, load_pair
    from eagle3_gguf.session import Eagle3Session

    src = write_checkpoint(tmp_path / "c", "specforge", weights=random_weights(CkptDims(), seed=9, embed=True),
                           layer_ids=[1, 2, 4])  # → [2, 3, 5]: no final-output id, which llama targets lack
    head = tmp_path / "head.gguf"
    convert_head(src, head, tiny_target, outtype="f32", fc_type="f32")
    direct = run_llama_cpp(tiny_target, head, PROMPT, N_STEPS)
    config = PairConfig(n_ctx=128, n_batch=64, n_threads=2, cache_type_v="f16")  # the direct run's cache
    with load_pair(tiny_target, head, config) as pair, Eagle3Session(pair.target, pair.head) as session:
        batch = Batch(64)
        batch.set(PROMPT, 0, logits="last")
        pair.target.decode(batch)
        next_token = int(np.argmax(pair.target.logits_ith(len(PROMPT) - 1)))
        session.process(PROMPT, 0)
        drafted = session.draft(next_token, N_STEPS).tokens
        batch.close()
    assert next_token == direct.next_token
    assert drafted == direct.tokens
