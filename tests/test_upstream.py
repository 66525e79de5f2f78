"""Differential test against upstream's C++ EAGLE-3 runtime, built from the pinned tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from build_upstream import bin_dir  # noqa: E402

from eagle3_gguf.decode import GenerateConfig, Runner  # noqa: E402
from eagle3_gguf.pair import PairConfig, default_type_v, load_pair  # noqa: E402
from eagle3_gguf.session import Eagle3Session  # noqa: E402
from eagle3_gguf.tokens import tokenize  # noqa: E402
from model_factory import HeadSpec, write_random_head  # noqa: E402

SPEC = bin_dir() / "llama-speculative-simple"
pytestmark = [pytest.mark.upstream, pytest.mark.slow,
              pytest.mark.skipif(not SPEC.exists(), reason="upstream tools not built: python scripts/build_upstream.py")]


def test_same_greedy_text_as_llama_speculative_simple(smollm2_path, tmp_path):
    head = write_random_head(tmp_path / "h.gguf", HeadSpec(576, (2, 15, 27), n_embd=576, n_head=9, n_head_kv=3,
                                                           n_ff=1536, draft_vocab=2048), tokenizer_from=smollm2_path)
    prompt = "The capital of France is"
    n = 40
    up = subprocess.run([str(SPEC), "-m", str(smollm2_path), "-md", str(head), "--spec-type", "draft-eagle3",
                         "--spec-draft-n-max", "4", "-p", prompt, "-n", str(n), "--temp", "0", "-t", "2",
                         "-c", "1024", "--seed", "1", "-ctv", default_type_v(0)],  # our default V cache
                        capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stderr[-2000:]
    assert "n_drafted" in up.stderr  # upstream really drafted with the head
    upstream_text = up.stdout[up.stdout.index(prompt) + len(prompt):]
    with load_pair(smollm2_path, head, PairConfig(n_ctx=1024)) as pair:
        with Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
            ours = d.generate(tokenize(pair.target_model, prompt), GenerateConfig(n_predict=n, draft_max=4, draft_policy="fixed"))
    assert len(ours.text) > 40
    assert upstream_text.startswith(ours.text), (upstream_text[:300], ours.text[:300])
