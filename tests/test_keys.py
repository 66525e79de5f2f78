"""keys.py against the pinned llama.cpp tree (vendor/llama.cpp, fetched by scripts/fetch_llama_cpp.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eagle3_gguf import keys

VENDOR = Path(__file__).resolve().parent.parent / "vendor" / "llama.cpp"
pytestmark = pytest.mark.skipif(not (VENDOR / "src" / "llama-arch.cpp").exists(),
                                reason="vendor/llama.cpp not fetched: run python scripts/fetch_llama_cpp.py")


def _src(rel: str) -> str:
    return (VENDOR / rel).read_text(encoding="utf-8")


def test_eagle3_kv_names_match_llama_arch():
    arch = _src("src/llama-arch.cpp")
    found = dict(re.findall(r'\{\s*(LLM_KV_\w+),\s*"([^"]+)"\s*\}', arch))
    assert found["LLM_KV_TARGET_LAYERS"] == keys.KEY_TARGET_LAYERS.replace("{arch}", "%s")
    assert found["LLM_KV_TARGET_HIDDEN_SIZE"] == keys.KEY_TARGET_HIDDEN_SIZE.replace("{arch}", "%s")
    assert found["LLM_KV_NORM_BEFORE_RESIDUAL"] == keys.KEY_NORM_BEFORE_RESIDUAL.replace("{arch}", "%s")
    assert found["LLM_KV_NORM_BEFORE_FC"] == keys.KEY_NORM_BEFORE_FC.replace("{arch}", "%s")
    assert found["LLM_KV_ATTENTION_LAYERNORM_RMS_EPS"] == keys.KEY_RMS_EPS.replace("{arch}", "%s")
    assert found["LLM_KV_EMBEDDING_LENGTH"] == keys.KEY_EMBEDDING_LENGTH.replace("{arch}", "%s")
    assert '{ LLM_ARCH_EAGLE3,           "eagle3"           }' in arch


def test_eagle3_tensor_names_match_gguf_py():
    consts = _src("gguf-py/gguf/constants.py")
    names = dict(re.findall(r'MODEL_TENSOR\.(\w+):\s+"([^"]+)"', consts))
    assert names["FC"] + ".weight" == keys.T_FC
    assert names["D2T"] == keys.T_D2T
    assert names["ENC_OUTPUT_NORM"] + ".weight" == keys.T_ENC_OUTPUT_NORM
    assert names["ATTN_NORM_2"] + ".weight" == keys.T_ATTN_NORM_2
    assert names["ATTN_OUT"] + ".weight" == keys.T_ATTN_OUT
    assert names["TOKEN_EMBD"] + ".weight" == keys.T_TOKEN_EMBD
    assert names["OUTPUT"] + ".weight" == keys.T_OUTPUT
    for t in ("ATTN_Q", "ATTN_K", "ATTN_V", "FFN_NORM", "FFN_GATE", "FFN_UP", "FFN_DOWN", "ATTN_NORM"):
        assert names[t] + ".weight" == getattr(keys, "T_" + t)


def test_eagle3_graph_uses_every_required_tensor():
    graph = _src("src/models/eagle3.cpp")
    for needle in ("LLM_TENSOR_FC", "LLM_TENSOR_ATTN_NORM_2", "LLM_TENSOR_D2T", "LLM_TENSOR_ENC_OUTPUT_NORM",
                   "hparams.norm_before_residual", "hparams.norm_before_fc", "target_layer_ids.size() != 3"):
        assert needle in graph


def _arches_whose_graph_sets(field: str) -> set[str]:
    classes = set()
    for f in (VENDOR / "src" / "models").glob("*.cpp"):
        s = f.read_text(encoding="utf-8")
        if field in s:
            classes.update(re.findall(r"llama_model_(\w+)::", s))
    mapping = _src("src/llama-model.cpp")
    body = mapping[mapping.index("static llama_model * llama_model_mapping"):]
    body = body[:body.index("\n}\n")]
    arches, pending = set(), []
    for line in body.splitlines():
        if m := re.search(r"case (LLM_ARCH_\w+):", line):
            pending.append(m.group(1))
        elif m := re.search(r"new llama_model_(\w+)\(", line):
            if m.group(1) in classes:
                arches.update(pending)
            pending = []
    names = dict(re.findall(r'\{\s*(LLM_ARCH_\w+),\s*"([^"]+)"\s*\}', _src("src/llama-arch.cpp")))
    return {names[a] for a in arches}


def test_hooked_target_archs_match_the_pinned_graphs():
    assert _arches_whose_graph_sets("t_layer_inp") == keys.HOOKED_TARGET_ARCHS
    assert "qwen2" not in keys.HOOKED_TARGET_ARCHS and "gemma3" not in keys.HOOKED_TARGET_ARCHS


def test_captured_target_archs_name_their_residual_stream():
    """eagle3_gguf.capture reads `l_out-{il}`: every captured arch's graph names it, and none is hooked."""
    assert keys.CAPTURED_TARGET_ARCHS <= _arches_whose_graph_sets('cb(cur, "l_out", il)')
    assert not keys.CAPTURED_TARGET_ARCHS & keys.HOOKED_TARGET_ARCHS


def test_final_output_archs_are_hooked_archs_that_set_h_nextn():
    assert _arches_whose_graph_sets("t_h_nextn") & keys.HOOKED_TARGET_ARCHS == keys.FINAL_OUTPUT_TARGET_ARCHS


def test_mangled_names_match_llama_ext_h():
    header = _src("src/llama-ext.h")
    for name in keys.MANGLED_SYMBOLS:
        assert re.search(rf"LLAMA_API [^;]*\b{name}\s*\(", header), name
        assert 'extern "C"' not in header
