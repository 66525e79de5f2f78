"""End to end: each layout converts; the GGUF holds the pinned tree's keys, types and bytes; the CLI
prints the layout, the id convention and source, and the tensor table; `info` reads the head back."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from typer.testing import CliRunner

from checkpoints import EXPECTED_IDS, LAYOUTS, CkptDims, dims_with, random_weights, write_checkpoint
from eagle3_gguf import keys
from eagle3_gguf.cli.main import app
from eagle3_gguf.convert import convert as convert_module
from eagle3_gguf.convert import convert_head, default_out_path
from eagle3_gguf.convert.convert import permute_rope_rows
from eagle3_gguf.convert.quantize import quantize_q4_0, quantize_q8_0
from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.gguf_file import TargetInfo, read_gguf, read_gguf_metadata

A = lambda template: keys.arch_key(template, keys.ARCH_EAGLE3)  # noqa: E731
runner = CliRunner()


def _f16(meta, name) -> np.ndarray:
    return meta.tensor_data(name).view(np.float16)


def _f32(meta, name) -> np.ndarray:
    return meta.tensor_data(name).view(np.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_converts_with_pinned_keys_types_and_bytes(tmp_path, tiny_target, layout):
    w = random_weights(CkptDims(), seed=11, embed=layout == "specforge")
    src = write_checkpoint(tmp_path / "ckpt", layout, weights=w)
    out = tmp_path / "head.gguf"
    r = convert_head(src, out, tiny_target, outtype="f16")  # f16: the matrices' bytes are the checkpoint's, rounded
    assert r.out == out and out.is_file() and r.file_bytes == out.stat().st_size
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]

    meta = read_gguf_metadata(out)
    target = read_gguf_metadata(tiny_target)
    assert meta.get(keys.KEY_ARCHITECTURE) == "eagle3"
    assert meta.get(A(keys.KEY_TARGET_LAYERS)) == EXPECTED_IDS[layout] == r.layer_ids.ids
    assert meta.get(A(keys.KEY_TARGET_HIDDEN_SIZE)) == 64
    assert meta.get(A(keys.KEY_NORM_BEFORE_RESIDUAL)) is False and meta.get(A(keys.KEY_NORM_BEFORE_FC)) is False
    assert meta.get(A(keys.KEY_BLOCK_COUNT)) == 1 and meta.get(A(keys.KEY_EMBEDDING_LENGTH)) == 64
    assert meta.get(A(keys.KEY_FEED_FORWARD_LENGTH)) == 128
    assert (meta.get(A(keys.KEY_HEAD_COUNT)), meta.get(A(keys.KEY_HEAD_COUNT_KV))) == (4, 2)
    assert meta.get(A(keys.KEY_RMS_EPS)) == pytest.approx(1e-5) and meta.get(A(keys.KEY_ROPE_FREQ_BASE)) == 10000.0
    assert meta.get(A(keys.KEY_ROPE_DIMENSION_COUNT)) == 16 and meta.get(A(keys.KEY_VOCAB_SIZE)) == 49152
    tok = lambda m: [(kv.key, kv.vtype, kv.sub_type, kv.value) for kv in m.kvs if kv.key.startswith("tokenizer.")]  # noqa: E731
    assert tok(meta) == tok(target) and len(meta.get(keys.KEY_TOKENIZER_TOKENS)) == 49152

    types = {t.name: t.ggml_type for t in meta.tensors}
    assert types.pop(keys.T_FC) == GT.Q4_0 and types.pop(keys.T_D2T) == GT.I64
    for name, t in types.items():
        assert t == (GT.F32 if "norm" in name else GT.F16), name
    assert "t2d" not in types and (keys.T_TOKEN_EMBD in types) == (layout == "specforge")
    final_note = any(n.startswith("layer id 6 is the final output") for n in r.notes)
    assert final_note == (6 in EXPECTED_IDS[layout])  # llama targets expose no final output at the pin
    assert meta.tensor(keys.T_FC).shape == [192, 64] and meta.tensor(keys.T_OUTPUT).shape == [64, 512]

    assert np.array_equal(meta.tensor_data(keys.T_FC), quantize_q4_0(w["fc.weight"]))
    q = permute_rope_rows(w["L.self_attn.q_proj.weight"], 4).astype(np.float16)
    k = permute_rope_rows(w["L.self_attn.k_proj.weight"], 2).astype(np.float16)
    assert np.array_equal(_f16(meta, keys.blk(keys.T_ATTN_Q)), q.reshape(len(q), -1))
    assert np.array_equal(_f16(meta, keys.blk(keys.T_ATTN_K)), k.reshape(len(k), -1))
    assert np.array_equal(_f16(meta, keys.blk(keys.T_ATTN_V)), w["L.self_attn.v_proj.weight"].astype(np.float16))
    assert np.array_equal(_f32(meta, keys.blk(keys.T_ATTN_NORM_2))[0], w["L.hidden_norm.weight"])
    assert np.array_equal(_f32(meta, keys.blk(keys.T_FFN_NORM))[0], w["L.post_attention_layernorm.weight"])
    d2t = meta.tensor_data(keys.T_D2T).view(np.int64)[0]
    assert np.array_equal(d2t, w["d2t"] + np.arange(512))  # absolute target ids
    rows = {row.name: row for row in r.rows}
    assert rows[keys.T_FC].type == "Q4_0" and 0.02 < rows[keys.T_FC].rel_error < 0.15
    assert rows[keys.T_D2T].rel_error is None and rows[keys.blk(keys.T_ATTN_NORM)].rel_error == 0.0
    assert rows[keys.blk(keys.T_ATTN_Q)].shape == [128, 64]  # GGUF order: row length first


def test_permutation_is_upstreams(tmp_path):
    """Rows of each head go from HF's [first half | second half] to interleaved pairs (i, i + half)."""
    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of dim 8, 3 inputs
    p = permute_rope_rows(w, 2)
    assert [int(r[0]) // 3 for r in p] == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]


@pytest.mark.parametrize("outtype,fc_type", [("q8_0", "q8_0"), ("bf16", "f16"), ("f32", "f32")])
def test_outtypes(tmp_path, tiny_target, outtype, fc_type):
    w = random_weights(CkptDims(), seed=5)
    out = tmp_path / "h.gguf"
    convert_head(write_checkpoint(tmp_path / "c", "speculators", weights=w), out, tiny_target, outtype=outtype,
                 fc_type=fc_type)
    meta = read_gguf_metadata(out)
    assert meta.tensor(keys.T_FC).ggml_type.name == fc_type.upper()
    assert meta.tensor(keys.blk(keys.T_FFN_UP)).ggml_type.name == outtype.upper()
    assert meta.tensor(keys.T_OUTPUT_NORM).ggml_type == GT.F32
    if outtype == "q8_0":
        assert np.array_equal(meta.tensor_data(keys.blk(keys.T_FFN_UP)), quantize_q8_0(w["L.mlp.up_proj.weight"]))
        assert meta.get(keys.KEY_QUANTIZATION_VERSION) == 2
    if outtype == "f32":
        assert np.array_equal(_f32(meta, keys.T_FC), w["fc.weight"])
    assert meta.get(keys.KEY_FILE_TYPE) == {"q8_0": 7, "bf16": 32, "f32": 0}[outtype]


def test_bf16_sharded_and_bin_checkpoints_convert(tmp_path, tiny_target):
    pytest.importorskip("torch")
    w = random_weights(CkptDims(), seed=6)
    heads = []
    for fmt in ("sharded", "bin"):
        out = tmp_path / f"{fmt}.gguf"
        convert_head(write_checkpoint(tmp_path / fmt, "safeai", weights=w, fmt=fmt, dtype="bf16"), out, tiny_target,
                     outtype="bf16", fc_type="f32")
        heads.append(read_gguf_metadata(out))
    for name in (keys.T_FC, keys.blk(keys.T_ATTN_Q), keys.T_OUTPUT):
        assert np.array_equal(heads[0].tensor_data(name), heads[1].tensor_data(name)), name


def test_no_d2t_full_vocab_head_and_borrowed_lm_head(tmp_path, tiny_target):
    d = dims_with(draft_vocab=None)
    out = tmp_path / "h.gguf"
    r = convert_head(write_checkpoint(tmp_path / "c", "safeai", d, lm_head=False), out, tiny_target)
    meta = read_gguf_metadata(out)
    assert meta.tensor(keys.T_D2T) is None and meta.tensor(keys.T_OUTPUT) is None
    assert r.draft_vocab is None and not r.own_output


def test_target_as_hf_config(tmp_path):
    cfg = tmp_path / "target" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 64,
                               "vocab_size": 49152}))
    out = tmp_path / "h.gguf"
    r = convert_head(write_checkpoint(tmp_path / "c", "modelopt", layer_ids=[1, 14, 26]), out, cfg)
    meta = read_gguf_metadata(out)
    assert meta.get(A(keys.KEY_TARGET_LAYERS)) == [2, 15, 27]
    assert meta.get(keys.KEY_TOKENIZER_MODEL) == "none" and meta.get(A(keys.KEY_VOCAB_SIZE)) == 49152
    assert any("no tokenizer copied" in n for n in r.notes)
    assert any("names no architecture the pinned llama.cpp converts" in n for n in r.notes)  # no "architectures"


@pytest.mark.parametrize("hf, arch, note", [
    ("GptOssForCausalLM", "gpt-oss", None),  # HF's model_type gpt_oss is llama.cpp's gpt-oss, which is hooked
    ("Qwen3MoeForCausalLM", "qwen3moe", None),
    ("MistralForCausalLM", "llama", None),  # llama.cpp converts Mistral as llama
    ("Qwen2ForCausalLM", "qwen2", "target arch 'qwen2' has no hidden-state hooks at the pinned llama.cpp: "
                                  "eagle3-gguf generate captures them (an eval callback)"),
    ("Gemma3ForConditionalGeneration", "gemma3", "target arch 'gemma3' has no hidden-state hooks at the pinned "
                                                 "llama.cpp: eagle3-gguf generate captures them"),
    ("Phi3ForCausalLM", "phi3", "target arch 'phi3' has no hidden-state hooks at the pinned "
                                "llama.cpp: the head converts but cannot run with this target"),
    ("DeepseekV2ForCausalLM", "deepseek2", "target arch 'deepseek2' has no hidden-state hooks at the pinned "
                                           "llama.cpp: the head converts but cannot run with this target"),
])
def test_a_config_targets_architecture_is_llama_cpps_name(tmp_path, hf, arch, note):
    from eagle3_gguf.convert.convert import describe_target

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": [hf], "model_type": hf.lower(), "num_hidden_layers": 30,
                               "hidden_size": 64, "vocab_size": 49152}))
    info = describe_target(cfg)
    assert info.arch == arch and info.hooked == (arch in keys.HOOKED_TARGET_ARCHS)
    r = convert_head(write_checkpoint(tmp_path / "c", "modelopt", layer_ids=[1, 14, 26]), tmp_path / "h.gguf", cfg)
    hook_notes = [n for n in r.notes if "hidden-state hooks" in n or "names no architecture" in n]
    assert (hook_notes == []) if note is None else (len(hook_notes) == 1 and hook_notes[0].startswith(note))


def test_the_architecture_table_is_the_pinned_converters():
    """eagle3_gguf/hf_archs.py is what scripts/hf_archs.py reads from the pinned llama.cpp's converter now."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / "vendor" / "llama.cpp" / "conversion").is_dir():
        pytest.skip("vendor/llama.cpp not fetched (python scripts/fetch_llama_cpp.py)")
    r = subprocess.run([sys.executable, str(root / "scripts" / "hf_archs.py"), "--check"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_llama3_rope_scaling_writes_rope_freqs(tmp_path, tiny_target):
    d = write_checkpoint(tmp_path / "c", "safeai", config_extra={
        "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    out = tmp_path / "h.gguf"
    convert_head(d, out, tiny_target)
    meta = read_gguf_metadata(out)
    freqs = _f32(meta, keys.T_ROPE_FREQS)[0]
    assert freqs.shape == (8,) and freqs[0] == 1.0 and freqs[-1] == pytest.approx(8.0)


def test_head_dim_from_config_writes_key_length(tmp_path, tiny_target):
    w = random_weights(CkptDims(), seed=0)
    for n in ("q_proj", "k_proj", "v_proj"):  # head_dim 32 instead of 64 / 4 = 16
        w[f"L.self_attn.{n}.weight"] = np.concatenate([w[f"L.self_attn.{n}.weight"]] * 2)
    w["L.self_attn.o_proj.weight"] = np.concatenate([w["L.self_attn.o_proj.weight"]] * 2, axis=1)
    out = tmp_path / "h.gguf"
    d = write_checkpoint(tmp_path / "c", "safeai", weights=w, config_extra={"head_dim": 32})
    convert_head(d, out, tiny_target)
    meta = read_gguf_metadata(out)
    assert meta.get(A(keys.KEY_KEY_LENGTH)) == 32 == meta.get(A(keys.KEY_VALUE_LENGTH))
    assert meta.get(A(keys.KEY_ROPE_DIMENSION_COUNT)) == 32


def test_default_out_path_and_progress(tmp_path, tiny_target):
    src = write_checkpoint(tmp_path / "my-head", "safeai")
    seen = []
    r = convert_head(src, None, tiny_target, progress=lambda row, done, total: seen.append((row.name, done, total)))
    assert r.out == default_out_path(src) == tmp_path / "my-head.gguf" and r.out.is_file()
    assert [s[0] for s in seen] == [row.name for row in r.rows]
    assert seen[-1][1] == seen[-1][2] == sum(row.bytes for row in r.rows)
    assert default_out_path(src / "model.safetensors") == src / "model.gguf"
    old = os.umask(0o027)  # a new file's mode follows the umask, as a file open() makes (mkstemp's is 0600)
    try:
        assert convert_head(src, tmp_path / "shared.gguf", tiny_target).out.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old)


def test_a_target_read_once_is_not_read_again(tmp_path, tiny_target, monkeypatch):
    """convert_head takes the TargetInfo a caller read already (run_training passes its own): the same
    bytes as from the path, no second read of the target's header; its tokenizer is still required."""
    src = write_checkpoint(tmp_path / "c", "safeai")
    by_path = convert_head(src, tmp_path / "a.gguf", tiny_target, name="h")
    tgt = TargetInfo.from_gguf(read_gguf(tiny_target))
    monkeypatch.setattr(convert_module, "read_gguf", lambda path: pytest.fail(f"{path} read again"))
    by_info = convert_head(src, tmp_path / "b.gguf", tgt, name="h")
    assert by_info.out.read_bytes() == by_path.out.read_bytes() and by_info.target_kind == "gguf"
    with pytest.raises(Eagle3Error) as e:
        convert_head(src, tmp_path / "c.gguf", dataclasses.replace(tgt, tokenizer=[]))
    assert str(e.value) == f"{tiny_target}: target GGUF carries no tokenizer ({keys.KEY_TOKENIZER_TOKENS})"


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def test_cli_prints_layout_convention_source_and_table(tmp_path, tiny_target):
    src = write_checkpoint(tmp_path / "c", "modelopt")
    out = tmp_path / "h.gguf"
    res = runner.invoke(app, ["convert", str(src), "--target", str(tiny_target), "-o", str(out)])
    assert res.exit_code == 0, res.output
    types = {t.name: t.ggml_type for t in read_gguf_metadata(out).tensors}  # the defaults: fc Q4_0, matrices Q8_0
    assert types[keys.T_FC] == GT.Q4_0 and types[keys.blk(keys.T_FFN_UP)] == types[keys.T_OUTPUT] == GT.Q8_0
    text = res.stdout
    assert "layout           NVIDIA ModelOpt" in text
    assert "layer ids        [2, 3, 5]  output-of-layer (converted: +1) (checkpoint says [1, 2, 4])" in text
    assert "ids source       config.json eagle_config.eagle_aux_hidden_state_layer_ids" in text
    assert "fc.weight" in text and "Q4_0" in text and "blk.0.attn_q.weight" in text
    assert f"wrote            {out}" in text


def test_cli_layer_ids_override_and_types(tmp_path, tiny_target):
    src = write_checkpoint(tmp_path / "c", "safeai")
    out = tmp_path / "h.gguf"
    res = runner.invoke(app, ["convert", str(src), "-t", str(tiny_target), "-o", str(out), "--layer-ids", "1,3,6",
                              "--outtype", "q8_0", "--fc-type", "f16"])
    assert res.exit_code == 0, res.output
    assert "layer ids        [1, 3, 6]  input-of-layer" in res.stdout and "ids source       --layer-ids" in res.stdout
    meta = read_gguf_metadata(out)
    assert meta.get(A(keys.KEY_TARGET_LAYERS)) == [1, 3, 6]
    assert meta.tensor(keys.T_FC).ggml_type == GT.F16 and meta.tensor(keys.T_OUTPUT).ggml_type == GT.Q8_0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_info_shows_ids_and_flags(tmp_path, tiny_target, layout):
    out = tmp_path / "h.gguf"
    nbr = layout == "speculators"
    convert_head(write_checkpoint(tmp_path / "c", layout, norm_before_residual=nbr), out, tiny_target)
    res = runner.invoke(app, ["info", str(out)])
    assert res.exit_code == 0, res.output
    assert f"target layers    {EXPECTED_IDS[layout]}" in res.stdout
    assert f"norm_before_residual={str(nbr).lower()}, norm_before_fc=false" in res.stdout
    assert "512 tokens (d2t)" in res.stdout


def test_streaming_peak_memory(tmp_path, tiny_target):
    """Tensor by tensor: peak Python/numpy memory stays under ~3x the largest tensor in float32
    (here the own 49152 x 64 token_embd read from bf16; the target's tokenizer keys count too)."""
    import tracemalloc

    src = write_checkpoint(tmp_path / "c", "specforge", dtype="bf16")
    largest = 49152 * 64 * 4
    tracemalloc.start()
    try:
        convert_head(src, tmp_path / "h.gguf", tiny_target)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * largest, f"peak {peak / 2**20:.1f} MiB for a {largest / 2**20:.1f} MiB tensor"


def test_cli_progress_bar_for_big_heads(tmp_path, tiny_target, monkeypatch):
    import eagle3_gguf.cli.convert as cli_convert

    monkeypatch.setattr(cli_convert, "_BAR_MIN_BYTES", 0)  # treat this tiny head as big
    src = write_checkpoint(tmp_path / "c", "safeai")
    res = runner.invoke(app, ["convert", str(src), "-t", str(tiny_target), "-o", str(tmp_path / "h.gguf")])
    assert res.exit_code == 0, res.output
    assert "writing" in res.stderr and "wrote" in res.stdout


def test_a_copy_of_the_targets_embeddings_is_left_out(tmp_path, tiny_target):
    """A head shipping a frozen copy of its target's token table (RedHatAI's Qwen3-8B head does) is written
    without it and borrows the target's; a table that differs, or one that cannot be compared (the target given as
    config.json), is kept; each case says so in one note."""
    from gguf import quants

    from eagle3_gguf.gguf_file import read_gguf, read_tensor_data

    info = next(t for t in read_gguf(tiny_target).raw.tensors if t.name == keys.T_TOKEN_EMBD)
    table = quants.dequantize(read_tensor_data(tiny_target, info), info.ggml_type).reshape(49152, 64)
    rng = np.random.default_rng(1)
    cases = {"copy": table, "copy of the unquantized table": table + 0.002 * rng.standard_normal(table.shape),
             "retrained": table + 0.2 * rng.standard_normal(table.shape)}
    for name, embd in cases.items():
        w = random_weights(CkptDims(), 0, embed=True)
        w["embed_tokens.weight"] = embd.astype(np.float32)
        out = tmp_path / f"{name}.gguf"
        r = convert_head(write_checkpoint(tmp_path / name, "specforge", weights=w), out, tiny_target)
        embd_notes = [n for n in r.notes if n.startswith("embed_tokens")]
        assert len(embd_notes) == 1, r.notes
        kept = name == "retrained"
        assert r.own_token_embd == kept and (read_gguf_metadata(out).tensor(keys.T_TOKEN_EMBD) is not None) == kept
        assert embd_notes[0].startswith("embed_tokens kept: it differs" if kept else
                                        "embed_tokens is the target's Q8_0 token table"), embd_notes
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 6, "hidden_size": 64,
                               "vocab_size": 49152}))
    r = convert_head(write_checkpoint(tmp_path / "c", "specforge", weights=w), tmp_path / "cfg.gguf", cfg)
    assert r.own_token_embd and "embed_tokens kept: with only a config.json the target's table cannot be compared " \
                                "(give the target .gguf to drop a copy of it)" in r.notes
