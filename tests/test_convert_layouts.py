"""Readers (safetensors / sharded / .bin; f32, f16, bf16) and layout detection + layer-id conventions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from checkpoints import DEFAULT_IDS, LAYOUTS, CkptDims, f32_to_bf16_bits, random_weights, write_checkpoint
from eagle3_gguf import keys
from eagle3_gguf.convert import detect_layout, open_checkpoint, resolve_layer_ids
from eagle3_gguf.convert.layouts import (
    CONVENTION_DEFAULT, CONVENTION_INPUT, CONVENTION_OUTPUT, LAYOUT_MODELOPT, LAYOUT_SAFEAI, LAYOUT_SPECFORGE,
    LAYOUT_SPECULATORS,
)
from eagle3_gguf.errors import Eagle3Error

NAMES = {"safeai": LAYOUT_SAFEAI, "speculators": LAYOUT_SPECULATORS, "modelopt": LAYOUT_MODELOPT,
         "specforge": LAYOUT_SPECFORGE}


# ------------------------------------------------------------------------------------------------
# Readers
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "bin"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_reader_roundtrip(tmp_path, fmt, dtype):
    if fmt == "bin":
        pytest.importorskip("torch")
    w = random_weights(CkptDims(), seed=1)
    src = write_checkpoint(tmp_path / "c", "safeai", weights=w, fmt=fmt, dtype=dtype)
    ckpt = open_checkpoint(src)
    assert len(ckpt.files) == (2 if fmt == "sharded" else 1)
    assert set(ckpt.tensors) == {("midlayer." + k[2:] if k.startswith("L.") else k) for k in w}
    q = ckpt.load("midlayer.self_attn.q_proj.weight")
    want = w["L.self_attn.q_proj.weight"]
    if dtype == "f16":
        want = want.astype(np.float16).astype(np.float32)
    elif dtype == "bf16":
        want = (f32_to_bf16_bits(want).astype(np.uint32) << 16).view(np.float32)
    assert q.dtype == np.float32 and np.array_equal(q, want)
    assert ckpt.tensors["midlayer.self_attn.q_proj.weight"].dtype == dtype.upper()
    assert np.array_equal(ckpt.load("d2t"), w["d2t"]) and ckpt.load("d2t").dtype == np.int64
    assert ckpt.load("t2d").dtype == bool


def test_reader_accepts_file_config_or_index_path(tmp_path):
    d = write_checkpoint(tmp_path / "c", "speculators", fmt="sharded")
    for src in (d, d / "config.json", d / "model.safetensors.index.json"):
        ckpt = open_checkpoint(src)
        assert ckpt.config["architectures"] == ["Eagle3Speculator"]
        assert "layers.0.mlp.up_proj.weight" in ckpt.tensors
    d2 = write_checkpoint(tmp_path / "single", "safeai")
    assert open_checkpoint(d2 / "model.safetensors").config_path == d2 / "config.json"


def test_bf16_without_torch(tmp_path, monkeypatch):
    """bf16 safetensors are read by bit shifting: torch is never imported."""
    import builtins

    src = write_checkpoint(tmp_path / "c", "safeai", dtype="bf16")
    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch blocked")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    ckpt = open_checkpoint(src)
    assert ckpt.load("fc.weight").dtype == np.float32


# ------------------------------------------------------------------------------------------------
# Layouts
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_detects_each_layout(tmp_path, layout):
    spec = detect_layout(open_checkpoint(write_checkpoint(tmp_path / layout, layout)))
    assert spec.layout == NAMES[layout]
    prefix = "midlayer." if layout in ("safeai", "specforge") else "layers.0."
    assert spec.source(keys.blk(keys.T_ATTN_Q)).src_name == prefix + "self_attn.q_proj.weight"
    assert spec.source(keys.blk(keys.T_ATTN_NORM_2)).src_name == prefix + "hidden_norm.weight"
    assert spec.source(keys.T_OUTPUT_NORM).src_name == "norm.weight"
    assert spec.source(keys.T_D2T).src_name == "d2t"
    assert spec.raw_layer_ids == DEFAULT_IDS[layout]
    assert spec.dropped == ([] if layout == "modelopt" else ["t2d"])
    assert (spec.source(keys.T_TOKEN_EMBD) is not None) == (layout == "specforge")
    hp = spec.hparams
    assert (hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_ff, hp.head_dim, hp.rms_eps) == (64, 4, 2, 128, 16, 1e-5)


def test_hub_style_safeai_config_is_safeai(tmp_path):
    """Published SafeAILab heads say LlamaForCausalLMEagle3 without eagle_config: midlayer.* → SafeAILab."""
    d = write_checkpoint(tmp_path / "c", "safeai", config_extra={"architectures": ["LlamaForCausalLMEagle3"]})
    assert detect_layout(open_checkpoint(d)).layout == LAYOUT_SAFEAI


def test_speculators_norm_before_fc_and_residual(tmp_path):
    d = write_checkpoint(tmp_path / "c", "speculators", norm_before_fc=True, norm_before_residual=True)
    spec = detect_layout(open_checkpoint(d))
    assert spec.norm_before_fc and spec.norm_before_residual
    assert spec.source(keys.T_ENC_OUTPUT_NORM).src_name == "input_norm.weight"


def _spec(tmp_path, layout, ids):
    return detect_layout(open_checkpoint(write_checkpoint(tmp_path / "c", layout, layer_ids=ids)))


def test_output_of_layer_ids_are_shifted(tmp_path):
    ids = resolve_layer_ids(_spec(tmp_path, "modelopt", [1, 14, 26]), 30)  # ModelOpt default for 30 layers
    assert ids.ids == [2, 15, 27] and ids.raw == [1, 14, 26] and ids.convention == CONVENTION_OUTPUT
    assert ids.source == "config.json eagle_config.eagle_aux_hidden_state_layer_ids"


def test_input_of_layer_ids_are_kept(tmp_path):
    ids = resolve_layer_ids(_spec(tmp_path, "speculators", [2, 15, 27]), 30)
    assert ids.ids == [2, 15, 27] and ids.convention == CONVENTION_INPUT
    assert ids.source == "config.json eagle_aux_hidden_state_layer_ids"


def test_default_ids_only_when_none_named(tmp_path):
    ids = resolve_layer_ids(_spec(tmp_path, "safeai", None), 30)
    assert ids.ids == [2, 15, 27] and ids.raw is None and ids.convention == CONVENTION_DEFAULT
    assert ids.source.startswith("default [2, n//2, n-3]")


def test_override_wins(tmp_path):
    ids = resolve_layer_ids(_spec(tmp_path, "modelopt", [1, 2, 3]), 30, [3, 10, 30])
    assert ids.ids == [3, 10, 30] and ids.source == "--layer-ids" and ids.convention == CONVENTION_INPUT


def test_final_output_id_is_valid_but_beyond_is_not(tmp_path):
    spec = _spec(tmp_path, "speculators", [2, 3, 6])
    assert resolve_layer_ids(spec, 6).ids == [2, 3, 6]
    with pytest.raises(Eagle3Error, match=r"^layer ids \[2, 3, 7\] \(input-of-layer, from --layer-ids\) are out of "
                                          r"range for a 6-layer target: each must be 0\.\.6 \(6 = final output\)$"):
        resolve_layer_ids(spec, 6, [2, 3, 7])


def test_layer_ids_at_most_three(tmp_path):
    spec = detect_layout(open_checkpoint(write_checkpoint(tmp_path / "two", "speculators", layer_ids=[2, 3])))
    assert spec.raw_layer_ids == [2, 3] and resolve_layer_ids(spec, 6).ids == [2, 3]  # padded when converted
    d = write_checkpoint(tmp_path / "c", "speculators", layer_ids=[2, 3, 4, 5])
    with pytest.raises(Eagle3Error, match=r"'eagle_aux_hidden_state_layer_ids' names 4 target layers \[2, 3, 4, 5\]; "
                                          r"the pinned llama.cpp eagle3 graph reads exactly 3 \(its loader refuses "
                                          r"other counts\), so this head cannot run$"):
        detect_layout(open_checkpoint(d))


def test_multi_layer_head_is_refused(tmp_path):
    w = random_weights(CkptDims(), seed=0)
    w["layers.1.mlp.up_proj.weight"] = w["L.mlp.up_proj.weight"]
    d = write_checkpoint(tmp_path / "c", "speculators", weights=w)
    with pytest.raises(Eagle3Error, match=r"head has 2 decoder layers \(0, 1\); the pinned llama.cpp eagle3 graph "
                                          r"runs exactly one$"):
        detect_layout(open_checkpoint(d))


def test_unexpected_tensor_is_refused(tmp_path):
    w = random_weights(CkptDims(), seed=0)
    w["L.self_attn.q_proj.bias"] = np.zeros(64, dtype=np.float32)
    d = write_checkpoint(tmp_path / "c", "safeai", weights=w)
    with pytest.raises(Eagle3Error, match=r"unexpected tensor 'midlayer.self_attn.q_proj.bias' in a SafeAILab/EAGLE "
                                          r"head; the pinned eagle3 graph has no place for it$"):
        detect_layout(open_checkpoint(d))


def test_rope_scaling_is_read(tmp_path):
    d = write_checkpoint(tmp_path / "c", "safeai", config_extra={
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0}, "rope_theta": 500000.0})
    hp = detect_layout(open_checkpoint(d)).hparams
    assert hp.rope_scaling.kind == "llama3" and hp.rope_theta == 500000.0
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Eagle3Error,
                       match=r"rope_scaling type 'dynamic' is not supported \(linear, yarn and llama3 are\)$"):
        detect_layout(open_checkpoint(d))
