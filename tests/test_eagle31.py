"""EAGLE 3.1 heads (fc_norm, norm_output) and EAGLE 3.0 / norm_before_fc heads, converted and run.

Parity: for each variant a random speculators checkpoint is converted (f32), drafted from by our
session on the tiny target (llama.cpp + eagle3_gguf.head_norms), and compared with the torch reference
(eagle3_gguf.train.model.Eagle3Head.unroll, loaded with the checkpoint's own weights): the draft
logits of steps 1..4 agree within max |diff| <= 1e-3 x max |logit| + 1e-4 on the draft vocab (exactly
-inf elsewhere) and the drafted tokens are equal. With the 3.1 hooks switched off — what upstream
llama.cpp runs — the logits of a 3.1 head leave that tolerance, so the test sees the hooks work.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from checkpoints import CkptDims, random_weights, write_checkpoint  # noqa: E402
from eagle3_gguf import keys  # noqa: E402
from eagle3_gguf.batch import Batch  # noqa: E402
from eagle3_gguf.context import Context  # noqa: E402
from eagle3_gguf.convert import convert_head  # noqa: E402
from eagle3_gguf.errors import Eagle3Error  # noqa: E402
from eagle3_gguf.gguf_file import read_gguf, read_gguf_metadata  # noqa: E402
from eagle3_gguf.head_norms import HeadNorms  # noqa: E402
from eagle3_gguf.native import Model  # noqa: E402
from eagle3_gguf.pair import PairConfig, load_pair  # noqa: E402
from eagle3_gguf.session import Eagle3Session  # noqa: E402
from eagle3_gguf.train.export import _NAMES, read_token_embeddings  # noqa: E402
from eagle3_gguf.train.model import Eagle3Head, HeadConfig  # noqa: E402
from generate_flags import fixed_policy  # noqa: E402
from model_factory import HeadSpec, write_random_head  # noqa: E402

PROMPT = [1, 17, 305, 4021, 77, 12000, 9, 411, 2315]
N_STEPS = 4
# variant -> (norm_before_fc, fc_norm, norm_output)
VARIANTS = {
    "3.0": (False, False, False),
    "norm_before_fc": (True, False, False),
    "fc_norm": (False, True, False),
    "norm_output": (False, False, True),
    "fc_norm+norm_output": (False, True, True),
    "norm_before_fc+norm_output": (True, False, True),
}


def torch_head(w: dict[str, np.ndarray], d: CkptDims, embed: np.ndarray, flags: tuple[bool, bool, bool],
               norm_before_residual: bool = False) -> Eagle3Head:
    """The training model with a checkpoint's weights (layout-neutral names, see checkpoints.py)."""
    nbf, fcn, nout = flags
    cfg = HeadConfig(n_embd=d.n_embd, n_ff=d.n_ff, n_head=d.n_head, n_head_kv=d.n_head_kv, n_embd_tgt=d.n_embd_tgt,
                     n_vocab=d.target_vocab, draft_vocab=d.draft_vocab or d.target_vocab, rms_eps=d.rms_eps,
                     rope_theta=d.rope_theta, n_embd_head=d.head_dim or 0,
                     norm_before_fc=nbf, fc_norm=fcn, norm_output=nout, norm_before_residual=norm_before_residual)
    head = Eagle3Head(cfg, torch.from_numpy(embed))
    state = {param: w[name.replace("midlayer.", "L.")] for param, name in _NAMES.items()}
    if nbf:
        state["input_norm.weight"] = w["input_norm.weight"]
    if fcn:
        state.update({f"fc_norm.{i}.weight": w[f"fc_norm.{i}.weight"] for i in range(3)})
    head.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    return head.eval()


def draft_with_logits(session: Eagle3Session, ctx: Context, id_last: int) -> tuple[list[int], list[np.ndarray]]:
    """session.draft(id_last, N_STEPS), recording the logits row each draft step reads.  # [n_vocab] each"""
    seen: list[np.ndarray] = []
    read = ctx.logits_ith

    def recording(i: int) -> np.ndarray:
        row = read(i)
        seen.append(row.copy())
        return row

    ctx.logits_ith = recording
    try:
        return session.draft(id_last, N_STEPS).tokens, seen
    finally:
        del ctx.logits_ith


@pytest.fixture(scope="module")
def embed(tiny_target) -> np.ndarray:
    return read_token_embeddings(tiny_target)  # [n_vocab, n_embd]


def _max_err(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    return float(np.abs(got - want).max()), float(np.abs(want).max())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_draft_logits_match_the_torch_reference(tmp_path, tiny_target, embed, variant):
    nbf, fcn, nout = flags = VARIANTS[variant]
    d = CkptDims()
    w = random_weights(d, seed=11, norm_before_fc=nbf, fc_norm=fcn)
    src = write_checkpoint(tmp_path / "ckpt", "speculators", d, weights=w, norm_before_fc=nbf, fc_norm=fcn,
                           norm_output=nout)
    head_path = tmp_path / "head.gguf"
    result = convert_head(src, head_path, tiny_target, outtype="f32", fc_type="f32")
    assert (result.norm_before_fc, result.fc_norm, result.norm_output) == (nbf, [3, 64] if fcn else None, nout)
    ids = (w["d2t"] + np.arange(len(w["d2t"]))).astype(np.int64)  # [draft_vocab] target ids
    worst_plain = check_drafts(tiny_target, head_path, torch_head(w, d, embed, flags), ids, variant)
    if variant not in ("3.0", "norm_before_fc"):
        assert worst_plain > 10, f"{variant}: drafting without the 3.1 hooks stays within tolerance"


def check_drafts(target, head_path, head: Eagle3Head, ids: np.ndarray, what: str) -> float:
    """Our session drafts N_STEPS tokens after PROMPT; each step's logits match the torch head's unroll
    (on the draft vocab `ids`, -inf elsewhere) and the tokens are its argmax. Returns how far (in
    tolerances) the logits of the same session with the hooks off land from the reference."""
    n = len(PROMPT)
    config = PairConfig(n_ctx=128, n_batch=64, n_threads=2)
    with load_pair(target, head_path, config) as pair, Eagle3Session(pair.target, pair.head) as session, \
            Batch(64) as batch:
        assert (session.norms is None) == (not (head.c.fc_norm or head.c.norm_output))  # no hook cost for EAGLE-3
        batch.set(PROMPT, 0, logits="last")
        pair.target.decode(batch)
        id_last = int(np.argmax(pair.target.logits_ith(n - 1)))
        feats = session.extract.gather(n).copy()  # [n, 3 * n_embd_tgt] raw target features
        session.process(PROMPT, 0)
        drafts, logits = draft_with_logits(session, pair.head, id_last)
        norms, session.norms = session.norms, None  # what upstream llama.cpp runs: no fc_norm, h fed back
        session.reset()
        session.process(PROMPT, 0)
        _, plain = draft_with_logits(session, pair.head, id_last)
        session.norms = norms
    assert len(drafts) == N_STEPS and len(logits) == N_STEPS

    chain = np.asarray(PROMPT[1:] + [id_last] + drafts[:N_STEPS - 1], dtype=np.int64)  # [n + 3]
    with torch.no_grad():
        steps = head.unroll(torch.from_numpy(feats)[None], torch.from_numpy(chain)[None], N_STEPS)
        ref = [head.logits(h[0, n - 1]).double().numpy() for h in steps]  # [draft_vocab] per step
    worst_plain = 0.0
    for j in range(N_STEPS):
        assert np.isneginf(np.delete(logits[j], ids)).all(), f"step {j + 1}: finite logits outside the d2t ids"
        err, scale = _max_err(logits[j][ids], ref[j])
        assert err <= 1e-3 * scale + 1e-4, f"{what} step {j + 1}: max |diff| {err:.3g}, scale {scale:.3g}"
        assert drafts[j] == int(ids[int(np.argmax(ref[j]))]), f"{what}: step {j + 1} drafted another token"
        worst_plain = max(worst_plain, _max_err(plain[j][ids], ref[j])[0] / (1e-3 * scale + 1e-4))
    return worst_plain


def test_hooks_apply_per_slice_rms_norm_and_output_norm(tmp_path, tiny_target):
    """HeadNorms against a float64 numpy computation, on a converted fc_norm + norm_output head."""
    d = CkptDims()
    w = random_weights(d, seed=5, fc_norm=True)
    src = write_checkpoint(tmp_path / "ckpt", "speculators", d, weights=w, fc_norm=True, norm_output=True)
    head = convert_head(src, tmp_path / "h.gguf", tiny_target, outtype="f32", fc_type="f32").out
    norms = HeadNorms.load(head)
    assert norms is not None and norms.eps == pytest.approx(d.rms_eps, rel=1e-6)  # stored as f32
    np.testing.assert_array_equal(norms.fc_norm, np.stack([w[f"fc_norm.{i}.weight"] for i in range(3)]))
    np.testing.assert_array_equal(norms.output_norm, w["norm.weight"])
    rng = np.random.default_rng(0)
    feats = (rng.standard_normal((5, 3 * d.n_embd_tgt)) * [[0.1] * 64 + [3.0] * 64 + [40.0] * 64]).astype(np.float32)
    want = np.concatenate([x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True) + d.rms_eps)
                           * w[f"fc_norm.{i}.weight"] for i, x in enumerate(np.split(feats, 3, axis=1))], axis=1)
    np.testing.assert_allclose(norms.apply_features(feats), want, rtol=2e-6, atol=0)
    h = rng.standard_normal(d.n_embd).astype(np.float32) * 7  # [n_embd]
    want_h = h / np.sqrt(np.mean(h.astype(np.float64) ** 2) + d.rms_eps) * w["norm.weight"]
    np.testing.assert_allclose(norms.feedback(h), want_h, rtol=2e-6, atol=0)
    src30 = write_checkpoint(tmp_path / "c30", "speculators", d, seed=5)
    assert HeadNorms.load(convert_head(src30, tmp_path / "h30.gguf", tiny_target).out) is None


def test_specforge_fc_norm_converts(tmp_path, tiny_target):
    """SpecForge: midlayer.* + fc_norm.{i}, flags in eagle_config; output-of-layer ids shifted as before."""
    src = write_checkpoint(tmp_path / "c", "specforge", seed=3, fc_norm=True, norm_output=True, layer_ids=[1, 2, 4])
    r = convert_head(src, tmp_path / "h.gguf", tiny_target)
    assert r.layout == "SpecForge" and r.layer_ids.ids == [2, 3, 5]
    assert (r.fc_norm, r.norm_output) == ([3, 64], True)
    meta = read_gguf_metadata(r.out)
    assert meta.get(keys.KEY_FC_NORM) is True and meta.get(keys.KEY_NORM_OUTPUT) is True
    assert len(meta.get(keys.KEY_FC_NORM_WEIGHT)) == 3 * 64
    assert not [t.name for t in meta.tensors if "fc_norm" in t.name]  # carried as metadata, not as tensors


def test_pinned_loader_refuses_an_extra_tensor_but_not_extra_metadata(tmp_path, tiny_target):
    """Why the fc_norm weights are metadata: llama.cpp at the pin refuses a head GGUF with one tensor
    its eagle3 arch does not create (done_getting_tensors: wrong number of tensors), while our own
    metadata keys load."""
    spec = HeadSpec(n_embd_tgt=64, target_layers=(1, 3, 5))
    extra = write_random_head(tmp_path / "extra.gguf", spec, tokenizer_from=tiny_target,
                              extra_tensors={"fc_norm.0.weight": np.ones(64, dtype=np.float32)})
    with pytest.raises(Eagle3Error, match="llama.cpp could not load it"):
        Model(extra)
    meta = write_random_head(tmp_path / "meta.gguf", spec, tokenizer_from=tiny_target,
                             extra_kvs={keys.KEY_FC_NORM: True, keys.KEY_FC_NORM_WEIGHT: [1.0] * (3 * 64),
                                        keys.KEY_NORM_OUTPUT: True})
    with Model(meta) as model:
        assert model.target_layer_ids() == [1, 3, 5]
    assert HeadNorms.load(meta).fc_norm.shape == (3, 64)


def test_info_describes_31_flags_and_shapes(tmp_path, tiny_target):
    src = write_checkpoint(tmp_path / "c", "speculators", seed=2, fc_norm=True, norm_output=True)
    head = convert_head(src, tmp_path / "h.gguf", tiny_target).out
    cli = [sys.executable, "-m", "eagle3_gguf.cli.main", "info", str(head)]
    d = json.loads(subprocess.run([*cli, "--json"], capture_output=True, text=True, check=True).stdout)
    assert (d["fc_norm"], d["norm_output"], d["norm_before_fc"]) == ([3, 64], True, False)
    text = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
    assert "norm_before_fc=false, fc_norm=true, norm_output=true" in text
    assert f"fc_norm          [3, 64] f32 in metadata {keys.KEY_FC_NORM_WEIGHT}" in text


def test_bad_fc_norm_metadata_is_one_line(tmp_path, tiny_target):
    spec = HeadSpec(n_embd_tgt=64, target_layers=(1, 3, 5))
    bad = write_random_head(tmp_path / "bad.gguf", spec, tokenizer_from=tiny_target,
                            extra_kvs={keys.KEY_FC_NORM: True, keys.KEY_FC_NORM_WEIGHT: [1.0] * 100})
    r = subprocess.run([sys.executable, "-m", "eagle3_gguf.cli.main", "info", str(bad)], capture_output=True,
                       text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (f"error: {bad}: {keys.KEY_FC_NORM} is set but {keys.KEY_FC_NORM_WEIGHT} holds 100 values, "
                        f"expected 3 x 64: convert the head again\n")
    with pytest.raises(Eagle3Error, match="holds 100 values"):
        load_pair(tiny_target, bad, PairConfig(n_ctx=64))
    assert read_gguf(bad).arch == "eagle3"


@pytest.mark.parametrize("layer_ids,fc_norm", [([2, 4], True), ([3], False)])
def test_head_reading_fewer_than_three_features_runs_exactly(tmp_path, tiny_target, layer_ids, fc_norm):
    """speculators allows any number of target layers; the pinned graph reads 3. A head naming fewer is
    padded (last id repeated, zero fc columns): llama.cpp's g equals fc(fc_norm(x_a), fc_norm(x_b)) over
    the head's own features, computed here in numpy, and the head drafts."""
    n_feat, d = len(layer_ids), CkptDims()
    w = random_weights(d, seed=8, fc_norm=fc_norm)
    w["fc.weight"] = w["fc.weight"][:, :n_feat * d.n_embd_tgt].copy()  # [n_embd, n_feat * n_embd_tgt]
    if fc_norm:
        w = {k: v for k, v in w.items() if not k.startswith("fc_norm.") or int(k.split(".")[1]) < n_feat}
    src = write_checkpoint(tmp_path / "ckpt", "speculators", d, weights=w, layer_ids=layer_ids, fc_norm=fc_norm)
    r = convert_head(src, tmp_path / "h.gguf", tiny_target, outtype="f32", fc_type="f32")
    padded = layer_ids + [layer_ids[-1]] * (3 - n_feat)
    assert r.layer_ids.ids == layer_ids and read_gguf_metadata(r.out).get("eagle3.target_layers") == padded
    assert any("zero fc columns" in note for note in r.notes)
    n = len(PROMPT)
    with load_pair(tiny_target, r.out, PairConfig(n_ctx=128, n_batch=64, n_threads=2)) as pair, \
            Eagle3Session(pair.target, pair.head) as session, Batch(64) as batch:
        batch.set(PROMPT, 0, logits="last")
        pair.target.decode(batch)
        own = np.concatenate([pair.target.layer_inp(lid, n) for lid in layer_ids], axis=1)  # [n, n_feat * 64]
        g = session.encode(session.features(n))  # [n, n_embd]
        session.process(PROMPT, 0)
        drafts = session.draft(int(np.argmax(pair.target.logits_ith(n - 1))), N_STEPS).tokens
    x = own.astype(np.float64).reshape(n, n_feat, d.n_embd_tgt)
    if fc_norm:
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + d.rms_eps) \
            * np.stack([w[f"fc_norm.{i}.weight"] for i in range(n_feat)])
    want = x.reshape(n, -1) @ w["fc.weight"].T.astype(np.float64)  # [n, n_embd]
    np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert len(drafts) == N_STEPS


def test_train_exports_an_eagle31_head(tmp_path, tiny_target, embed):
    """`train --eagle31`: the head trains with fc_norm + norm_output, exports in the speculators layout,
    converts, drafts like the trained torch head and decodes losslessly."""
    from safetensors.numpy import load_file

    from eagle3_gguf.train import PipelineConfig, run_training
    from eagle3_gguf.train.loop import TrainConfig

    cfg = PipelineConfig(n_prompts=4, layer_ids=[1, 3, 4], draft_vocab=256, n_ff=64, n_seq=2, max_new=16,
                         n_threads=2, eagle31=True, train=TrainConfig(n_unroll=3, max_steps=8, batch_tokens=256,
                                                                      lr=3e-3, held_out=0.25, n_threads=2))
    res = run_training(tiny_target, tmp_path / "run", cfg)
    config = json.loads((res.checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"]
    assert (config["fc_norm"], config["norm_output"]) == (True, True)
    w = load_file(str(res.checkpoint / "model.safetensors"))
    assert sorted(k for k in w if k.startswith("fc_norm.")) == [f"fc_norm.{i}.weight" for i in range(3)]
    assert not np.allclose(w["fc_norm.0.weight"], 1.0)  # trained, not left at init
    info = read_gguf(res.gguf)
    assert info.metadata[keys.KEY_NORM_OUTPUT] is True and len(info.metadata[keys.KEY_FC_NORM_WEIGHT]) == 3 * 64

    neutral = {k.replace("layers.0.", "L."): v for k, v in w.items()}
    d = CkptDims(n_ff=64, draft_vocab=256)
    # the GGUF holds f16 matrices and a Q4_0 fc: compare with an f32 conversion of the same checkpoint
    f32 = convert_head(res.checkpoint, tmp_path / "f32.gguf", tiny_target, layer_ids=[1, 3, 4], outtype="f32",
                       fc_type="f32").out
    ids = (w["d2t"] + np.arange(len(w["d2t"]))).astype(np.int64)
    check_drafts(tiny_target, f32, torch_head(neutral, d, embed, (False, True, True)), ids, "trained 3.1 head")

    r = subprocess.run([sys.executable, "-m", "eagle3_gguf.cli.main", "generate", "-m", str(tiny_target), "--draft",
                        str(res.gguf), "-p", "Hello there", "-n", "24", "--draft-max", "3", "--draft-p-min", "0",
                        "-t", "2", "--baseline", "--json", *fixed_policy()], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["identical"] is True and out["stats"]["n_drafted"] > 0
