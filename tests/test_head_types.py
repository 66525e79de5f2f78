"""scripts/bench_head_types.py: a head's matrices re-encoded in another type (what convert --outtype writes) keep its
metadata, fc and d2t, load, and draft; the draft-step part runs at the tiny shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import GGUFReader

import bench_head_types
from eagle3_gguf.assets import default_head_path
from eagle3_gguf.decode import GenerateConfig, Runner
from eagle3_gguf.gguf_file import read_gguf_metadata
from eagle3_gguf.pair import PairConfig, load_pair
from eagle3_gguf.session import Eagle3Session

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_head_types.py"


def tensors(path: Path) -> dict[str, tuple[GT, bytes]]:
    return {t.name: (GT(t.tensor_type), np.asarray(t.data).tobytes()) for t in GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("types")
    return {t: bench_head_types.reencode(default_head_path(), out / f"{t}.gguf", t) for t in bench_head_types.TYPES}


def test_q8_0_again_is_the_shipped_head_byte_for_byte(heads):
    """The shipped head's matrices are Q8_0: re-encoding their values as Q8_0 gives the same blocks (ggml's
    quantizer is idempotent there), so the other types differ from it by their type alone."""
    assert tensors(heads["q8_0"]) == tensors(default_head_path())
    assert read_gguf_metadata(heads["q8_0"]).kvs == read_gguf_metadata(default_head_path()).kvs


def test_other_types_change_the_matrices_only(heads):
    shipped = tensors(default_head_path())
    for head_type, want in (("f16", GT.F16), ("q4_0", GT.Q4_0)):
        got = tensors(heads[head_type])
        assert got.keys() == shipped.keys()
        for name, (t, data) in got.items():
            if shipped[name][0] == GT.Q8_0:
                assert t == want, name
            else:  # fc (Q4_0), the norms, d2t
                assert (t, data) == shipped[name], name


def test_each_type_drafts_and_keeps_the_text(heads, smollm2_path):
    prompt = list(range(1000, 1016))
    texts = []
    for head in heads.values():
        with load_pair(smollm2_path, head, PairConfig(n_ctx=256, n_threads=1)) as pair, \
                Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as dec:
            base = dec.generate(prompt, GenerateConfig(n_predict=24), speculative=False)
            spec = dec.generate(prompt, GenerateConfig(n_predict=24, draft_policy="fixed", draft_max=3,
                                                       draft_p_min=0.0, draft_lookup=False))
            assert spec.tokens == base.tokens and spec.stats.n_drafted > 0
            texts.append(base.tokens)
    assert all(t == texts[0] for t in texts)


def test_the_draft_step_part_at_the_tiny_shape(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--shape", "tiny", "--skip-acceptance", "-t", "1", "--work",
                        str(tmp_path / "work"), "--out", str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    steps = data["draft_step"]["steps"]
    assert [s["head_type"] for s in steps] == list(bench_head_types.TYPES) and data["acceptance"] == []
    assert data["draft_step"]["target_row_ms"] > 0 and all(s["decode_ms"] > 0 for s in steps)
    mib = {s["head_type"]: s["mib"] for s in steps}
    assert mib["f16"] > mib["q8_0"] > mib["q4_0"]


def test_bad_inputs_are_one_line():
    r = subprocess.run([sys.executable, str(SCRIPT), "--shape", "huge"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
