"""A random speculators EAGLE 3.1 head (fc_norm + norm_output) for SmolLM2: it converts, upstream's
`llama-speculative-simple` loads it and drafts with it without error (ignoring both norms), and our
`generate` with it gives exactly the target-only greedy text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from build_upstream import bin_dir  # noqa: E402

from checkpoints import dims_with, write_checkpoint  # noqa: E402
from eagle3_gguf.convert import convert_head  # noqa: E402
from eagle3_gguf.head_norms import HeadNorms  # noqa: E402
from eagle3_gguf.pair import default_type_v  # noqa: E402
from generate_flags import fixed_policy  # noqa: E402

SPEC = bin_dir() / "llama-speculative-simple"
pytestmark = [pytest.mark.upstream, pytest.mark.slow,
              pytest.mark.skipif(not SPEC.exists(),
                                 reason="upstream tools not built: python scripts/build_upstream.py")]

SMOLLM2_HEAD = dims_with(n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_embd_tgt=576, draft_vocab=2048)


@pytest.fixture(scope="module")
def head31(tmp_path_factory, smollm2_path) -> Path:
    tmp = tmp_path_factory.mktemp("h31")
    src = write_checkpoint(tmp / "ckpt", "speculators", SMOLLM2_HEAD, seed=4, layer_ids=[2, 15, 27], fc_norm=True,
                           norm_output=True)
    result = convert_head(src, tmp / "head31.gguf", smollm2_path)
    assert (result.fc_norm, result.norm_output) == ([3, 576], True)
    return result.out


def test_upstream_loads_and_drafts_with_a_31_head(head31, smollm2_path):
    prompt = "The capital of France is"
    up = subprocess.run([str(SPEC), "-m", str(smollm2_path), "-md", str(head31), "--spec-type", "draft-eagle3",
                         "--spec-draft-n-max", "4", "-p", prompt, "-n", "24", "--temp", "0", "-t", "2", "-c", "512",
                         "--seed", "1", "-ctv", default_type_v(0)],
                        capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stderr[-2000:]
    assert "n_drafted" in up.stderr  # it really drafted with the head
    assert prompt in up.stdout


def test_generate_with_a_31_head_is_lossless(head31, smollm2_path):
    assert HeadNorms.load(head31) is not None  # the session applies both norms
    r = subprocess.run([sys.executable, "-m", "eagle3_gguf.cli.main", "generate", "-m", str(smollm2_path),
                        "--draft", str(head31), "-p", "Explain how a lighthouse works, step by step.", "--chat",
                        "-n", "64", "--draft-max", "4", "--draft-p-min", "0", "-t", "2", "--baseline", "--json",
                        *fixed_policy()],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["identical"] is True
    assert out["stats"]["n_generated"] == out["baseline"]["n_generated"] >= 32
    assert out["stats"]["n_drafted"] > 0
