"""Differential test against upstream's converter (the vendored convert_hf_to_gguf.py at the pin).

The same SafeAILab- and speculators-layout checkpoints go through upstream's converter (given a HF
target directory this test writes) and ours: the eagle3 metadata and every tensor must agree, exactly
for f32/f16; our Q4_0 fc must be ggml's quantization of their fc. Upstream's tokenizer step is
stubbed out (it needs the target's HF tokenizer files); ours copies the tokenizer from the target
GGUF, which test_convert_head checks on its own.

Needs the vendored tree (scripts/fetch_llama_cpp.py puts it in vendor/llama.cpp/) and `transformers`
(imported by upstream's converter); skipped when either is absent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from checkpoints import CkptDims, random_weights, write_checkpoint
from eagle3_gguf.convert import convert_head
from eagle3_gguf.convert.quantize import dequantize, quantize_q4_0
from eagle3_gguf.gguf_file import read_gguf_metadata

VENDOR = Path(__file__).resolve().parent.parent / "vendor" / "llama.cpp"

pytestmark = [
    pytest.mark.upstream,
    pytest.mark.skipif(not (VENDOR / "convert_hf_to_gguf.py").is_file(),
                       reason="vendored llama.cpp tree absent (run scripts/fetch_llama_cpp.py)"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                       reason="upstream's convert_hf_to_gguf.py imports transformers, which is not installed"),
]

# Runs upstream's converter with its tokenizer step stubbed out (argv: vendor, ckpt, target_dir, out, outtype).
_DRIVER = """
import runpy, sys
vendor, ckpt, target, out, outtype = sys.argv[1:]
sys.path[:0] = [vendor + "/gguf-py", vendor]
import conversion.llama
conversion.llama.LlamaModel.set_vocab = lambda self: None
sys.argv = ["convert_hf_to_gguf.py", ckpt, "--outfile", out, "--outtype", outtype, "--target-model-dir", target]
runpy.run_path(vendor + "/convert_hf_to_gguf.py", run_name="__main__")
"""

# Keys upstream adds from transformers' config defaults that ours writes only when the config names them.
_UPSTREAM_ONLY_OK = {"eagle3.attention.key_length", "eagle3.attention.value_length"}


def _hf_target_dir(path: Path) -> Path:
    """A HF target directory matching the tiny target GGUF: its config.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 6, "vocab_size": 49152,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True,
    }))
    return path


def _upstream(ckpt: Path, target_dir: Path, out: Path, outtype: str) -> None:
    env = {**os.environ, "NO_LOCAL_GGUF": ""}
    env.pop("NO_LOCAL_GGUF")
    res = subprocess.run([sys.executable, "-c", _DRIVER, str(VENDOR), str(ckpt), str(target_dir), str(out), outtype],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]


def _eagle3_keys(meta) -> dict:
    return {kv.key: kv.value for kv in meta.kvs if kv.key.startswith("eagle3.")}


@pytest.mark.parametrize("layout", ["safeai", "speculators"])
@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_same_metadata_and_tensors_as_upstream(tmp_path, tiny_target, layout, outtype):
    w = random_weights(CkptDims(), seed=21)
    ids = None if layout == "safeai" else [2, 3, 4]
    ckpt = write_checkpoint(tmp_path / "ckpt", layout, weights=w, layer_ids=ids,
                            norm_before_residual=layout == "speculators")
    theirs_path, ours_path = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    _upstream(ckpt, _hf_target_dir(tmp_path / "target"), theirs_path, outtype)
    convert_head(ckpt, ours_path, tiny_target, outtype=outtype, fc_type=outtype)
    ours_q4 = tmp_path / "ours-q4.gguf"
    convert_head(ckpt, ours_q4, tiny_target, outtype=outtype)  # default fc type: Q4_0

    theirs, ours = read_gguf_metadata(theirs_path), read_gguf_metadata(ours_path)
    assert theirs.get("general.architecture") == ours.get("general.architecture") == "eagle3"
    tk, ok = _eagle3_keys(theirs), _eagle3_keys(ours)
    assert set(ok) <= set(tk), f"keys only we write: {set(ok) - set(tk)}"
    assert set(tk) - set(ok) <= _UPSTREAM_ONLY_OK, f"keys only upstream writes: {set(tk) - set(ok)}"
    for key in ok:
        if isinstance(ok[key], float):
            assert ok[key] == pytest.approx(tk[key]), key
        else:
            assert ok[key] == tk[key], key
    for key in set(tk) - set(ok):
        assert tk[key] == ok["eagle3.rope.dimension_count"], key  # the default head_dim, spelled out

    t_tensors = {t.name: t for t in theirs.tensors}
    assert sorted(t_tensors) == sorted(t.name for t in ours.tensors)
    for t in ours.tensors:
        u = t_tensors[t.name]
        assert (t.shape, t.ggml_type) == (u.shape, u.ggml_type), t.name
        assert np.array_equal(ours.tensor_data(t.name), theirs.tensor_data(t.name)), f"{t.name} differs"

    fc_theirs = theirs.tensor_data("fc.weight")  # [64 rows, row bytes]
    fc_theirs = dequantize(fc_theirs.view(np.float32 if outtype == "f32" else np.float16), GT[outtype.upper()], 192)
    q4 = read_gguf_metadata(ours_q4)
    assert q4.tensor("fc.weight").ggml_type == GT.Q4_0
    if outtype == "f32":  # their fc is the checkpoint's: ours must be exactly its Q4_0
        assert np.array_equal(q4.tensor_data("fc.weight"), quantize_q4_0(fc_theirs))
    rel = np.linalg.norm(dequantize(q4.tensor_data("fc.weight"), GT.Q4_0, 192) - fc_theirs) / np.linalg.norm(fc_theirs)
    assert rel < 0.15
