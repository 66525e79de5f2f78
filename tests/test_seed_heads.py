"""The heads the seed documents name (tests/seed_heads.py), end to end.

Each converts with its target described both ways, a tiny GGUF of the target's architecture
(tests/arch_targets.py) and that target's HF config.json, with the right layer ids, norm flags and
vocab and no false note. Where the target's architecture has hidden-state hooks at the pin, the
converted head loads in upstream's `llama-speculative-simple`; there and where eagle3_gguf.capture
takes the states (llama4), our greedy output equals target-only's, with drafts accepted through the
target's multi-row verify (an oracle session).
The gemma-4 head's draft logits match the torch reference of the head (head_dim != hidden / heads,
the target's token table used unscaled, as speculators trains it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from build_upstream import bin_dir  # noqa: E402

from arch_targets import ArchDims, hf_config, write_arch_target  # noqa: E402
from eagle3_gguf import keys  # noqa: E402
from eagle3_gguf.convert import convert_head  # noqa: E402
from eagle3_gguf.decode import GenerateConfig, Runner  # noqa: E402
from eagle3_gguf.convert.convert import DEFAULT_OUTTYPE  # noqa: E402
from eagle3_gguf.convert.quantize import ggml_type  # noqa: E402
from eagle3_gguf.gguf_file import read_gguf_metadata  # noqa: E402
from eagle3_gguf.gguf_file import tensor_bytes as stored_bytes  # noqa: E402
from eagle3_gguf.pair import PairConfig, load_pair  # noqa: E402
from eagle3_gguf.tokens import tokenize  # noqa: E402
from eagle3_gguf.train.export import read_token_embeddings  # noqa: E402
from model_factory import TinyDims, write_tiny_target  # noqa: E402
from oracle import OracleSession, lossless_runs  # noqa: E402
from seed_heads import N_TARGET_LAYER, N_VOCAB, SEED_HEADS, write_seed_head  # noqa: E402

SPEC = bin_dir() / "llama-speculative-simple"
HOOKED = [k for k, h in SEED_HEADS.items() if h.target_arch in keys.HOOKED_TARGET_ARCHS]  # upstream runs these
RUNNABLE = HOOKED + [k for k, h in SEED_HEADS.items() if h.target_arch in keys.CAPTURED_TARGET_ARCHS]  # we run
LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                "num_hidden_layers": N_TARGET_LAYER, "vocab_size": N_VOCAB, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """arch -> (tiny GGUF target, its HF config.json), each written once."""
    root = tmp_path_factory.mktemp("seed-targets")
    out = {}
    for arch in sorted({h.target_arch for h in SEED_HEADS.values()}):
        gguf = root / f"{arch}.gguf"
        if arch == keys.ARCH_LLAMA:
            write_tiny_target(gguf, TinyDims(n_layer=N_TARGET_LAYER))
            config = LLAMA_CONFIG
        else:
            write_arch_target(gguf, arch, ArchDims(n_layer=N_TARGET_LAYER))
            config = hf_config(arch, ArchDims(n_layer=N_TARGET_LAYER))
        (root / arch).mkdir()
        (root / arch / "config.json").write_text(json.dumps(config))
        out[arch] = (gguf, root / arch / "config.json")
    return out


def _converted(tmp_path: Path, key: str, targets, kind: str = "gguf"):
    head = SEED_HEADS[key]
    gguf, config = targets[head.target_arch]
    src = write_seed_head(tmp_path / key, key, embed=read_token_embeddings(gguf))
    return convert_head(src, tmp_path / f"{key}-{kind}.gguf", gguf if kind == "gguf" else config)


@pytest.mark.parametrize("key", list(SEED_HEADS))
def test_converts_with_either_target_description(tmp_path, targets, key):
    head = SEED_HEADS[key]
    hooked = head.target_arch in keys.HOOKED_TARGET_ARCHS
    by_kind = {kind: _converted(tmp_path, key, targets, kind) for kind in ("gguf", "config.json")}
    for kind, r in by_kind.items():
        assert r.layout == head.detected, kind
        assert r.layer_ids.ids == head.expected_ids, kind
        assert (r.norm_before_residual, r.norm_before_fc, r.fc_norm is not None, r.norm_output) == (
            bool(head.config.get("norm_before_residual")), head.norm_before_fc, head.fc_norm, head.norm_output), kind
        assert r.draft_vocab == head.dims.draft_vocab and r.target_vocab == N_VOCAB and r.own_output, kind
        hook_notes = [n for n in r.notes if "hidden-state hooks" in n or "names no architecture" in n]
        assert hook_notes == ([] if hooked else [f"target arch '{head.target_arch}' has no hidden-state hooks at "
                                                 "the pinned llama.cpp: eagle3-gguf generate captures them (an eval "
                                                 "callback); upstream llama.cpp cannot run this pair"]), (kind, r.notes)
        meta = read_gguf_metadata(r.out)
        assert meta.get("eagle3.target_layers") == head.expected_ids
        if head.dims.head_dim is not None:  # q wider than hidden: the graph needs the head width spelled out
            assert meta.get("eagle3.attention.key_length") == meta.get("eagle3.attention.value_length") == 32
            assert meta.tensor("blk.0.attn_q.weight").shape == [128, 128]  # [2 * n_embd, n_head * head_dim]
    gguf, config = by_kind["gguf"], by_kind["config.json"]
    assert not gguf.own_token_embd and "embed_tokens.weight" in gguf.dropped
    assert config.own_token_embd and any("embed_tokens kept: with only a config.json" in n for n in config.notes)
    tensor_bytes = {kind: sum(t.bytes for t in r.rows) for kind, r in by_kind.items()}
    table = stored_bytes([64, N_VOCAB], ggml_type(DEFAULT_OUTTYPE))  # in convert's default type
    assert tensor_bytes["config.json"] - tensor_bytes["gguf"] == table  # the table, nothing else


def test_qwen3_head_drops_its_frozen_table(tmp_path, targets):
    """The issue's size case: the copy of the target's token table is what the file loses."""
    r = _converted(tmp_path, "qwen3-8b", targets)
    src_bytes = (tmp_path / "qwen3-8b" / "model.safetensors").stat().st_size
    assert r.file_bytes < 0.4 * src_bytes, (r.file_bytes, src_bytes)
    assert any(n.startswith("embed_tokens is the target's Q8_0 token table") for n in r.notes), r.notes


@pytest.mark.upstream
@pytest.mark.slow
@pytest.mark.skipif(not SPEC.exists(), reason="upstream tools not built: python scripts/build_upstream.py")
@pytest.mark.parametrize("key", HOOKED)
def test_upstream_loads_and_drafts(tmp_path, targets, key):
    r = _converted(tmp_path, key, targets)
    gguf = targets[SEED_HEADS[key].target_arch][0]
    up = subprocess.run([str(SPEC), "-m", str(gguf), "-md", str(r.out), "--spec-type", "draft-eagle3",
                         "--spec-draft-n-max", "3", "-p", "The capital of France is", "-n", "16", "--temp", "0",
                         "-t", "2", "-c", "512", "--seed", "1"], capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stderr[-2000:]
    assert "n_drafted" in up.stderr, up.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("key", RUNNABLE)
def test_lossless_on_its_target_architecture(tmp_path, targets, key):
    r = _converted(tmp_path, key, targets)
    gguf = targets[SEED_HEADS[key].target_arch][0]
    cfg = GenerateConfig(n_predict=32, draft_max=4, draft_policy="fixed")
    with load_pair(gguf, r.out, PairConfig(n_ctx=512, n_batch=64)) as pair:
        for text in ("The capital of France is", "def fib(n):"):
            base, spec, oracle = lossless_runs(pair, tokenize(pair.target_model, text), cfg, [4, 0, 3, 1, 2])
            assert spec.tokens == base.tokens, (key, text)
            assert spec.stats.n_drafted > 0
            assert oracle.tokens == base.tokens, (key, text)
            assert all(oracle.stats.accept_hist[n] > 0 for n in (0, 4)), oracle.stats.accept_hist


def test_gemma4_head_drafts_as_its_torch_reference(tmp_path, targets):
    """head_dim 32 x 4 heads at hidden 64 (gemma-4-31B's 256 x 32 at 5376), norm_before_residual, on a
    gemma4 target whose token table the head reads unscaled (speculators trains it so; upstream's graph
    does the same)."""
    from test_eagle31 import check_drafts, torch_head

    head = SEED_HEADS["gemma-4-31b"]
    gguf = targets["gemma4"][0]
    embed = read_token_embeddings(gguf)  # [N_VOCAB, 64], as the GGUF stores it (no sqrt(hidden) scale)
    src = write_seed_head(tmp_path / "ckpt", "gemma-4-31b", embed=embed)
    r = convert_head(src, tmp_path / "head.gguf", gguf, outtype="f32", fc_type="f32")
    from checkpoints import random_weights

    w = random_weights(head.dims, 0)
    w = {k: _bf16(v) if v.dtype == np.float32 else v for k, v in w.items()}  # as the bf16 checkpoint holds them
    ids = (w["d2t"] + np.arange(len(w["d2t"]))).astype(np.int64)  # [draft_vocab] target ids
    ref = torch_head(w, head.dims, embed, (False, False, False), norm_before_residual=True)
    check_drafts(gguf, r.out, ref, ids, "gemma-4-31b")


def _bf16(x: np.ndarray) -> np.ndarray:
    from checkpoints import f32_to_bf16_bits

    return (f32_to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


@pytest.mark.slow
def test_full_vocab_head_runs(tmp_path, targets):
    """Maverick's shape (lm_head over the whole vocab, no d2t) on a hooked target of the same widths: its
    own target's llama4 graph has no hooks at the pin."""
    gguf = targets[keys.ARCH_LLAMA][0]
    src = write_seed_head(tmp_path / "ckpt", "llama4-maverick", embed=read_token_embeddings(gguf))
    r = convert_head(src, tmp_path / "head.gguf", gguf)
    assert r.draft_vocab is None and r.own_output and "d2t" not in {t.name for t in r.rows}
    cfg = GenerateConfig(n_predict=32, draft_max=4, draft_policy="fixed")
    with load_pair(gguf, r.out, PairConfig(n_ctx=512, n_batch=64)) as pair:
        prompt = tokenize(pair.target_model, "The capital of France is")
        with Runner(pair.target) as plain:
            base = plain.generate(prompt, cfg, speculative=False)
        with OracleSession(pair.target, pair.head, truth=prompt + base.tokens, schedule=[4, 1]) as s, \
                Runner(pair.target, s) as d:
            spec = d.generate(prompt, cfg)
        assert np.isfinite(pair.head.logits_ith(0)).all()  # draft logits over every target token
    assert spec.tokens == base.tokens and spec.stats.n_accepted > 0
