"""scripts/synthetic.py: quantized blocks written directly, targets and heads of real shapes that llama.cpp loads
and decodes with, the tiny shape standing in for Llama-3.1-8B's and Qwen2.5-1.5B's (the same code)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import gguf
from gguf import GGMLQuantizationType as GT

import synthetic
from eagle3_gguf.decode import GenerateConfig, Runner
from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.gguf_file import read_gguf
from eagle3_gguf.pair import PairConfig, load_pair, read_pair
from eagle3_gguf.session import Eagle3Session

TINY = synthetic.SHAPES["tiny"]
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "synthetic.py"


@pytest.fixture(autouse=True)
def own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE3_GGUF_CACHE", str(tmp_path / "cache"))  # probes and cost curves of their own


@pytest.mark.parametrize("qtype", [GT.Q4_0, GT.Q8_0, GT.Q4_K, GT.Q6_K])
def test_blocks_dequantize_to_the_std_asked_centred(qtype):
    """ggml's layouts (gguf-py's dequantizer reads them back): the weights have the std asked, no offset."""
    rng = np.random.default_rng(3)
    raw = synthetic.BLOCKS[qtype](rng, 4096, 0.02)  # [nb, block bytes]
    assert raw.shape[1] == gguf.GGML_QUANT_SIZES[qtype][1]
    x = gguf.quants.dequantize(raw, qtype)  # [nb * block values]
    assert np.isfinite(x).all()
    assert x.std() == pytest.approx(0.02, rel=0.1)
    assert abs(x.mean()) < 0.02 * x.std()


def test_q4_k_scales_pack_as_ggml_reads_them():
    sc = np.random.default_rng(0).integers(0, 64, (16, 8), dtype=np.uint8)
    m = np.random.default_rng(1).integers(0, 64, (16, 8), dtype=np.uint8)
    got_sc, got_m = gguf.quants.Q4_K.get_scale_min(synthetic._pack_k4_scales(sc, m))
    assert np.array_equal(got_sc, sc) and np.array_equal(got_m, m)


def test_the_q4_k_m_mix_is_llama_quantizes():
    s = synthetic.SHAPES["llama-8b"]
    plans = {p.name: p for p in synthetic.target_tensors(s, "q4_k_m", (0, 1))}
    # the output Q8_0 where the mix has Q6_K: an untied target's output rows are quantized from values (NEXT_LOGIT)
    assert plans["output.weight"].ggml_type == GT.Q8_0 and plans["token_embd.weight"].ggml_type == GT.Q4_K
    six = [i for i in range(s.n_layer) if plans[f"blk.{i}.attn_v.weight"].ggml_type == GT.Q6_K]
    assert six == [i for i in range(s.n_layer) if plans[f"blk.{i}.ffn_down.weight"].ggml_type == GT.Q6_K]
    assert six == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]  # use_more_bits at 32 layers
    assert plans["blk.5.attn_q.weight"].ggml_type == GT.Q4_K and plans["blk.5.ffn_norm.weight"].ggml_type == GT.F32
    # 8.0B weights, 4.6 GiB as Q4_K_M
    assert s.n_params == pytest.approx(8.03e9, rel=0.01)
    assert sum(p.n_bytes for p in plans.values()) / 2**30 == pytest.approx(4.7, abs=0.1)
    q40 = {p.name: p.ggml_type for p in synthetic.target_tensors(s, "q4_0", ())}
    assert (q40["output.weight"], q40["token_embd.weight"], q40["blk.0.attn_v.weight"]) == (GT.Q8_0, GT.Q4_0, GT.Q4_0)
    tied = {p.name: p.ggml_type for p in synthetic.target_tensors(synthetic.SHAPES["qwen-1.5b"], "q4_0", ())}
    assert "output.weight" not in tied and tied["token_embd.weight"] == GT.Q6_K  # tied: the output's type


@pytest.fixture(scope="module")
def made(tmp_path_factory, smollm2_path):
    out = tmp_path_factory.mktemp("synthetic")
    first = synthetic.make_pair(out, "tiny", "q4_k_m", smollm2_path, jobs=2, head_types=tuple(synthetic.HEAD_TYPES))
    return first, synthetic.make_pair(out, "tiny", "q4_0", smollm2_path, jobs=2)


def test_one_head_per_type_serves_every_target_type(made):
    first, second = made
    assert first.head_types == tuple(synthetic.HEAD_TYPES) and second.head_types == ("f16",)
    assert [h.name for h in first.heads] == [f"synthetic-tiny-eagle3-{t}.gguf" for t in synthetic.HEAD_TYPES]
    assert second.head == first.head  # made once, kept
    with pytest.raises(Eagle3Error, match="head types q5_1: name one or more of f16, q8_0, q4_0"):
        synthetic.make_pair(first.target.parent, "tiny", "q4_0", first.target, head_types=("q5_1",))


def test_a_heads_matrices_are_its_type_fc_q4_0(made):
    """What convert's --outtype writes: the layer's matrices and lm_head in the type, fc Q4_0, norms F32, and
    general.file_type saying it; the same d2t whatever the type."""
    d2ts = []
    for head_type, path in zip(made[0].head_types, made[0].heads):
        r = gguf.GGUFReader(path)
        types = {t.name: GT(t.tensor_type) for t in r.tensors}
        want, file_type = synthetic.HEAD_TYPES[head_type]
        assert types["fc.weight"] == GT.Q4_0 and types["output_norm.weight"] == GT.F32
        assert {types[n] for n in types if n.startswith("blk.0.") and "norm" not in n} == {want}
        assert types["output.weight"] == want
        assert read_gguf(path).metadata["general.file_type"] == file_type
        d2ts.append(np.asarray(next(t for t in r.tensors if t.name == "d2t").data))
    assert all(np.array_equal(d, d2ts[0]) for d in d2ts)


def test_files_hold_what_was_planned_and_pair(made):
    for m in made:
        target, head = read_pair(m.target, m.head)  # HeadInfo checks the head against the eagle3 graph
        assert (target.n_layer, target.n_embd, target.n_vocab) == (TINY.n_layer, TINY.n_embd, TINY.n_vocab)
        assert head.draft_vocab == TINY.draft_vocab and head.target_layers == list(TINY.target_layers)
        assert head.target_hidden_size == TINY.n_embd and not head.own_token_embd and head.own_output
        g = read_gguf(m.target)
        types = g.get("tokenizer.ggml.token_type")
        assert len(types) == TINY.n_vocab and set(types[49152:]) == {synthetic.TOKEN_UNUSED}
        assert g.get("tokenizer.chat_template") is None
    r = gguf.GGUFReader(made[0].target)
    planned = {p.name: p for p in synthetic.target_tensors(TINY, "q4_k_m", ())}
    assert [t.name for t in r.tensors] == list(planned)
    for t in r.tensors:
        assert t.tensor_type == planned[t.name].ggml_type and t.n_bytes == planned[t.name].n_bytes
    tensors = {t.name: t for t in r.tensors}
    rows = gguf.quants.dequantize(tensors["output.weight"].data, GT.Q8_0)  # [n_vocab, n_embd]
    embd = gguf.quants.dequantize(tensors["token_embd.weight"].data, GT.Q4_K)  # [n_vocab, n_embd]
    control = np.flatnonzero(np.asarray(read_gguf(made[0].target).get("tokenizer.ggml.token_type")) == 3)
    assert control.size and np.isfinite(rows).all() and not rows[control].any()  # the control tokens' rows are zero
    # a successor model: token j's output row is token j - 1's embedding (tiny's vocab is one chunk: row 0 the last's)
    scale = synthetic.NEXT_LOGIT / TINY.n_embd
    keep = np.setdiff1d(np.arange(TINY.n_vocab), control)
    assert np.allclose(rows[keep], scale * np.roll(embd, 1, axis=0)[keep], atol=0.01 * scale * np.abs(embd).max())


def test_llama_cpp_decodes_them_speculation_identical(made):
    """Both target types and every head type load; the logits are finite and peaked at the successor token (a margin
    of NEXT_LOGIT's order); a speculative run drafts and equals target-only; no control token is ever chosen, so the
    run goes its length."""
    for target, head in [(made[0].target, h) for h in made[0].heads] + [(made[1].target, made[1].head)]:
        with load_pair(target, head, PairConfig(n_ctx=512, n_threads=1)) as pair, \
                Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as dec:
            prompt = list(range(1000, 1024))
            base = dec.generate(prompt, GenerateConfig(n_predict=32), speculative=False)
            spec = dec.generate(prompt, GenerateConfig(n_predict=32, draft_policy="fixed", draft_max=3))
            assert spec.tokens == base.tokens and len(base.tokens) == 32
            assert spec.stats.n_drafted > 0
            assert len(set(base.tokens)) > 8  # not one token over and over
            dec.generate(prompt, GenerateConfig(n_predict=1), speculative=False)  # on a CPU the logits are read out
            z = pair.target.logits_ith(len(prompt) - 1)  # [n_vocab]: the prefill's last row
            p = np.exp(z - z.max())
            assert np.isfinite(z).all() and p.max() / p.sum() > 0.99  # peaked: the successor's logit stands out
            top2 = np.sort(z)[-2:]
            assert top2[1] - top2[0] > 0.5 * synthetic.NEXT_LOGIT  # far above any rounding between batch widths
            assert base.tokens[1:8] == [t + 1 for t in base.tokens[:7]]  # the text walks consecutive ids


@pytest.mark.parametrize("qtype, matrices, output", [("q8_0", GT.Q8_0, GT.Q8_0), ("f16", GT.F16, GT.F16)])
def test_a_target_of_one_type_throughout_decodes_speculation_identical(made, smollm2_path, qtype, matrices, output):
    """Q8_0 and F16 targets: every matrix in the type (an F16 target's output too), general.file_type saying it, the
    successor model's text, and a speculative run (drafts verified) equal to target-only's."""
    m = synthetic.make_pair(made[0].target.parent, "tiny", qtype, smollm2_path, jobs=2)
    assert m.head == made[0].head  # the shape's head, made before
    types = {t.name: GT(t.tensor_type) for t in gguf.GGUFReader(m.target).tensors}
    assert {types[n] for n in types if n.startswith("blk.") and "norm" not in n} == {matrices}
    assert (types["token_embd.weight"], types["output.weight"]) == (matrices, output)
    assert read_gguf(m.target).metadata["general.file_type"] == synthetic.FILE_TYPES[qtype]
    with load_pair(m.target, m.head, PairConfig(n_ctx=512, n_threads=1)) as pair, \
            Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as dec:
        prompt = list(range(1000, 1024))
        base = dec.generate(prompt, GenerateConfig(n_predict=32), speculative=False)
        spec = dec.generate(prompt, GenerateConfig(n_predict=32, draft_policy="fixed", draft_max=3))
    assert spec.tokens == base.tokens and base.tokens[1:8] == [t + 1 for t in base.tokens[:7]]
    assert spec.stats.n_drafted > 0  # (a random head: verified, not kept)


def test_tied_embeddings_load(tmp_path, smollm2_path):
    """Qwen2.5-1.5B's shape ties the output to token_embd (Q6_K, as llama-quantize makes it)."""
    s = dataclasses.replace(TINY, tied=True)
    target = synthetic.write_target(tmp_path / "tied.gguf", s, "q4_k_m", smollm2_path)
    head = synthetic.write_head(tmp_path / "head.gguf", s, target)
    with load_pair(target, head, PairConfig(n_ctx=256, n_threads=1)) as pair, Runner(pair.target) as dec:
        out = dec.generate(list(range(1000, 1016)), GenerateConfig(n_predict=16), speculative=False)
    assert len(out.tokens) == 16


def test_generate_cli_on_a_synthetic_pair(made):
    """What a user would type: the head drafts, the output is target-only's."""
    m = made[0]
    r = subprocess.run([sys.executable, "-m", "eagle3_gguf.cli.main", "generate", "-m", str(m.target), "--draft",
                        str(m.head), "-p", "Hello there", "-n", "8", "-t", "1", "--baseline",
                        "--draft-policy", "fixed", "--draft-max", "3", "--draft-p-min", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    stats = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1)
                 for line in r.stderr.splitlines() if "  " in line.strip())
    assert stats["identical output"] == "yes"
    assert int(stats["drafted / accepted"].split(" / ")[0]) > 0


def test_bad_inputs_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--shape", "nope", "--out", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
