"""Every bad input: one `error: ...` line on stderr, exit 2, and no output (nor temp) file left behind."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from checkpoints import CkptDims, dims_with, random_weights, write_checkpoint
from eagle3_gguf.cli.main import app

runner = CliRunner()


def _fails(tmp_path: Path, args: list[str], message: str | None = None, *, prefix: str | None = None) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    out = out_dir / "head.gguf"
    res = runner.invoke(app, ["convert", *args, "-o", str(out)])
    assert res.exit_code == 2, res.output
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: "), res.stderr
    line = res.stderr[len("error: "):-1]
    if message is not None:
        assert line == message
    if prefix is not None:
        assert line.startswith(prefix), line
    assert list(out_dir.iterdir()) == [], "output or temp file left behind"


def _ckpt(tmp_path: Path, layout: str = "safeai", **kw) -> Path:
    return write_checkpoint(tmp_path / "ckpt", layout, **kw)


def test_truncated_safetensors(tmp_path, tiny_target):
    src = _ckpt(tmp_path)
    f = src / "model.safetensors"
    size = f.stat().st_size - 100
    with open(f, "r+b") as fh:
        fh.truncate(size)
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name, info = next((k, v) for k, v in header.items() if 8 + n + v["data_offsets"][1] > size)
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{f}: truncated safetensors file (tensor '{name}' needs bytes up to {8 + n + info['data_offsets'][1]}, "
           f"file has {size})")


def test_not_a_safetensors_file(tmp_path, tiny_target):
    src = _ckpt(tmp_path)
    (src / "model.safetensors").write_bytes(b"\x01\x02")
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src / 'model.safetensors'}: truncated safetensors file (2 bytes, no header)")


def test_unreadable_safetensors(tmp_path, tiny_target):
    """An OSError reading the weights (here a folder in the file's place; unreadable permissions give the same)."""
    src = _ckpt(tmp_path)
    f = src / "model.safetensors"
    f.unlink()
    f.mkdir()
    _fails(tmp_path, [str(src), "-t", str(tiny_target)], f"{f}: cannot read (Is a directory)")


def test_truncated_bin(tmp_path, tiny_target):
    pytest.importorskip("torch")
    src = _ckpt(tmp_path, fmt="bin")
    f = src / "pytorch_model.bin"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           prefix=f"{f}: not a readable PyTorch checkpoint (truncated or corrupt: ")


def test_bad_json_config(tmp_path, tiny_target):
    src = _ckpt(tmp_path)
    (src / "config.json").write_text('{"hidden_size": 64,, }')
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src / 'config.json'}: invalid JSON (Expecting property name enclosed in double quotes at line 1, "
           f"column 20)")
    (src / "config.json").write_text("null")
    _fails(tmp_path, [str(src), "-t", str(tiny_target)], f"{src / 'config.json'}: expected a JSON object")


def test_missing_config(tmp_path, tiny_target):
    src = _ckpt(tmp_path)
    (src / "config.json").unlink()
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: no config.json next to the checkpoint (an EAGLE-3 head ships one with hidden_size, "
           f"num_attention_heads, ...)")


def test_missing_tensor(tmp_path, tiny_target):
    w = random_weights(CkptDims())
    del w["L.mlp.up_proj.weight"]
    src = _ckpt(tmp_path, weights=w)
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: missing tensor 'midlayer.mlp.up_proj.weight' (a SafeAILab/EAGLE head needs it)")


def test_missing_shard(tmp_path, tiny_target):
    src = _ckpt(tmp_path, fmt="sharded")
    (src / "model-00002-of-00002.safetensors").unlink()
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src / 'model.safetensors.index.json'}: shard 'model-00002-of-00002.safetensors' is missing")


def test_fc_shape_vs_target_hidden(tmp_path, tiny_target):
    src = _ckpt(tmp_path, dims=dims_with(n_embd_tgt=96))
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: fc.weight is [64, 288], so the head was trained for a target of hidden size 96, "
           f"but {tiny_target.name} has hidden size 64")


def test_wrong_attention_shape(tmp_path, tiny_target):
    src = _ckpt(tmp_path, config_extra={"num_key_value_heads": 4})
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: 'midlayer.self_attn.k_proj.weight' is [32, 128], expected [64, 128] from config.json")


def test_heads_not_a_multiple_of_kv_heads(tmp_path):
    """Issue 52: a config of 14 attention heads over 3 KV heads (hidden 896) converted without a word, and
    `generate` then died in GGML_ASSERT(ggml_can_mul_mat(k, q)). Every tensor agrees with the config and the
    target, so only the head-count rule stands between it and a GGUF."""
    dims = dims_with(n_embd=896, n_head=14, n_head_kv=3, n_embd_tgt=896)
    src = _ckpt(tmp_path, dims=dims)
    target = tmp_path / "target" / "config.json"
    target.parent.mkdir()
    target.write_text(json.dumps({"num_hidden_layers": 24, "hidden_size": 896, "vocab_size": 49152}))
    _fails(tmp_path, [str(src), "-t", str(target)],
           f"{src / 'config.json'}: 14 attention heads are not a multiple of 3 KV heads, which llama.cpp's "
           f"grouped-query attention needs (it aborts): fix config.json")


@pytest.mark.parametrize("config, message", [
    ({"head_dim": 15}, "RoPE turns 15 dimensions of each 15-wide head; llama.cpp needs an even number, at most the "
                       "head size (it aborts)"),
    ({"num_attention_heads": 128}, "head size (head_dim) is 0; the eagle3 graph needs at least 1"),
    ({"num_key_value_heads": 8}, "4 attention heads are not a multiple of 8 KV heads, which llama.cpp's "
                                 "grouped-query attention needs (it aborts)"),
])
def test_head_geometry_the_graph_cannot_run(tmp_path, tiny_target, config, message):
    """Refused from config.json alone, before a tensor is read (an odd head_dim once made the RoPE row permutation
    raise a ValueError)."""
    src = _ckpt(tmp_path, config_extra=config)
    _fails(tmp_path, [str(src), "-t", str(tiny_target)], f"{src / 'config.json'}: {message}: fix config.json")


@pytest.mark.parametrize("tensor, shape, expected", [
    ("q_proj", (64, 128), [128, 128]),  # config head_dim 32: 4 heads x 32 rows
    ("o_proj", (64, 64), [64, 128]),
])
def test_attention_shape_vs_heads_x_head_dim(tmp_path, tiny_target, tensor, shape, expected):
    w = random_weights(dims_with(head_dim=32))
    w[f"L.self_attn.{tensor}.weight"] = np.zeros(shape, dtype=np.float32)
    src = _ckpt(tmp_path, dims=dims_with(head_dim=32), weights=w)
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: 'midlayer.self_attn.{tensor}.weight' is {list(shape)}, expected {expected} from config.json")


@pytest.mark.parametrize("name, value, message", [
    ("fc.weight", np.zeros((64, 200), dtype=np.float32),  # [n_embd, 200]: not 3 x any target hidden size
     "fc.weight is [64, 200], expected [hidden_size 64, 3 x target hidden]"),
    ("t2d", np.zeros(32000, dtype=bool),
     "t2d is [32000], expected [target vocab 49152]: the head was trained for another vocabulary"),
])
def test_weights_against_the_target(tmp_path, tiny_target, name, value, message):
    """fc's input against the target's layers x hidden size, t2d against its vocabulary."""
    w = random_weights(CkptDims())
    w[name] = value
    src = _ckpt(tmp_path, weights=w)
    _fails(tmp_path, [str(src), "-t", str(tiny_target)], f"{src}: {message}")


def test_t2d_disagrees_with_d2t(tmp_path, tiny_target):
    w = random_weights(CkptDims())
    ids = np.flatnonzero(w["t2d"])  # [512] the target ids d2t maps onto
    unmarked = int(np.flatnonzero(~w["t2d"])[0])
    w["t2d"][unmarked] = True
    src = _ckpt(tmp_path, weights=w)
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: t2d marks 513 target tokens but d2t maps 512: the two maps disagree, so the head was exported "
           f"wrong")
    w["t2d"][ids[5]] = False  # 512 marks again, one of them not d2t's
    src = _ckpt(tmp_path, weights=w)
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: d2t maps draft token 5 to target id {ids[5]}, which t2d does not mark: the two maps disagree, "
           f"so the head was exported wrong")


def test_the_file_to_write_goes_through_the_loaders_check(tmp_path, tiny_target, monkeypatch):
    """The converter hands the metadata and tensor table it is about to write to gguf_file.check_head, the check
    `generate` runs: here a rope scaling type llama.cpp aborts on, slipped into the metadata."""
    from gguf import GGUFValueType as VT

    from eagle3_gguf import keys
    from eagle3_gguf.convert import convert as conv
    from eagle3_gguf.gguf_file import KeyValue

    key = keys.arch_key(keys.KEY_ROPE_SCALING_TYPE, keys.ARCH_EAGLE3)
    metadata = conv._metadata
    monkeypatch.setattr(conv, "_metadata", lambda *a: metadata(*a) + [KeyValue(key, "llama3", VT.STRING)])
    src = _ckpt(tmp_path)
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: RoPE scaling type 'llama3' is not one llama.cpp knows (none, linear, yarn, longrope): fix the "
           f"checkpoint or its config.json")


@pytest.mark.parametrize("layout,ids,convention,source", [
    ("speculators", [2, 3, 9], "input-of-layer", "config.json eagle_aux_hidden_state_layer_ids"),
    ("modelopt", [1, 3, 6], "output-of-layer (converted: +1)",
     "config.json eagle_config.eagle_aux_hidden_state_layer_ids"),
])
def test_layer_ids_out_of_range(tmp_path, tiny_target, layout, ids, convention, source):
    src = _ckpt(tmp_path, layout, layer_ids=ids)
    got = [x + 1 for x in ids] if layout == "modelopt" else ids
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"layer ids {got} ({convention}, from {source}) are out of range for a 6-layer target: "
           f"each must be 0..6 (6 = final output)")


@pytest.mark.parametrize("key", ["hidden_act", "hidden_activation"])
def test_non_silu_mlp(tmp_path, tiny_target, key):
    """NeMo saves gemma drafts with gelu_pytorch_tanh; the pinned graph's MLP is SiLU-gated only."""
    src = _ckpt(tmp_path, config_extra={key: "gelu_pytorch_tanh"})
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src / 'config.json'}: config {key} 'gelu_pytorch_tanh': the pinned llama.cpp eagle3 graph's MLP "
           f"is SiLU-gated only, so this head cannot run there")


def test_layer_ids_flag_out_of_range_and_malformed(tmp_path, tiny_target):
    src = _ckpt(tmp_path)
    _fails(tmp_path, [str(src), "-t", str(tiny_target), "--layer-ids", "2,3,-1"],
           "layer ids [2, 3, -1] (input-of-layer, from --layer-ids) are out of range for a 6-layer target: "
           "each must be 0..6 (6 = final output)")
    _fails(tmp_path, [str(src), "-t", str(tiny_target), "--layer-ids", "2,x,5"],
           "--layer-ids '2,x,5': expected 3 comma-separated integers, e.g. 2,15,27")
    _fails(tmp_path, [str(src), "-t", str(tiny_target), "--layer-ids", "2,5"],
           "--layer-ids '2,5': expected exactly 3 ids, e.g. 2,15,27")


def test_d2t_out_of_range(tmp_path, tiny_target):
    w = random_weights(CkptDims())
    w["d2t"][-1] = 49152 - 511  # → target id 49152, one past the vocabulary
    src = _ckpt(tmp_path, weights=w)
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: d2t maps draft token 511 to target id 49152, outside the target vocabulary 0..49151")


def test_d2t_duplicates(tmp_path, tiny_target):
    w = random_weights(CkptDims())
    ids = w["d2t"] + np.arange(512)
    w["d2t"][7] = ids[3] - 7  # draft tokens 3 and 7 → the same target id
    src = _ckpt(tmp_path, weights=w)
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: d2t maps draft tokens 3 and 7 to the same target id {int(ids[3])}")


def test_lm_head_rows_vs_d2t(tmp_path, tiny_target):
    w = random_weights(CkptDims())
    w["lm_head.weight"] = w["lm_head.weight"][:500]
    src = _ckpt(tmp_path, weights=w, config_extra={"draft_vocab_size": 500})
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: lm_head has 500 rows but d2t has 512 entries (llama.cpp needs them equal)")


def test_unknown_layout(tmp_path, tiny_target):
    w = {("model.layers.0." + k[2:] if k.startswith("L.") else k): v for k, v in random_weights(CkptDims()).items()}
    src = tmp_path / "ckpt"
    write_checkpoint(src, "safeai")
    from checkpoints import save_safetensors

    save_safetensors(src / "model.safetensors", w)
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: unknown checkpoint layout (tensors: d2t, fc.weight, lm_head.weight, ...); expected SafeAILab "
           f"(midlayer.*), speculators (Eagle3Speculator), ModelOpt (LlamaForCausalLMEagle3, layers.0.*) or "
           f"SpecForge (midlayer.*, eagle_config)")


def test_fc_norm_count_mismatch(tmp_path, tiny_target):
    w = random_weights(CkptDims(), fc_norm=True)
    del w["fc_norm.2.weight"]
    src = _ckpt(tmp_path, "speculators", weights=w, fc_norm=True)
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: head has 2 fc_norm weights but fc reads 3 target features: one per feature is needed")


def test_fc_norm_numbering_gap(tmp_path, tiny_target):
    w = random_weights(CkptDims(), fc_norm=True)
    w["fc_norm.3.weight"] = w.pop("fc_norm.2.weight")
    src = _ckpt(tmp_path, "speculators", weights=w, fc_norm=True)
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: fc_norm weights are numbered [0, 1, 3], expected 0..2 (one per target feature)")


def test_fc_norm_shape_mismatch(tmp_path, tiny_target):
    w = random_weights(CkptDims(), fc_norm=True)
    w["fc_norm.1.weight"] = np.ones(63, dtype=np.float32)
    src = _ckpt(tmp_path, "specforge", weights=w, fc_norm=True)
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: 'fc_norm.1.weight' is [63], expected [target hidden 64]")


def test_fc_norm_flag_without_weights(tmp_path, tiny_target):
    src = _ckpt(tmp_path, "speculators", config_extra={"fc_norm": True})
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: config sets fc_norm but the checkpoint has no fc_norm.{{i}}.weight tensors")


def test_fc_norm_with_norm_before_fc(tmp_path, tiny_target):
    src = _ckpt(tmp_path, "speculators", norm_before_fc=True, fc_norm=True)
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: head has both fc_norm (per-feature norms) and norm_before_fc ('input_norm.weight'); "
           f"EAGLE 3.1 makes them mutually exclusive")


def test_more_than_three_target_layers(tmp_path, tiny_target):
    w = random_weights(CkptDims(), fc_norm=True)
    w["fc.weight"] = np.zeros((64, 4 * 64), dtype=np.float32)  # [n_embd, 4 * n_embd_tgt]
    w["fc_norm.3.weight"] = w["fc_norm.2.weight"]
    src = _ckpt(tmp_path, "speculators", weights=w, fc_norm=True, layer_ids=[1, 2, 3, 5])
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src / 'config.json'}: 'eagle_aux_hidden_state_layer_ids' names 4 target layers [1, 2, 3, 5]; the "
           f"pinned llama.cpp eagle3 graph reads exactly 3 (its loader refuses other counts), so this head cannot run")


def test_fewer_target_layers_with_norm_before_fc(tmp_path, tiny_target):
    w = random_weights(CkptDims())
    w["fc.weight"] = w["fc.weight"][:, :128]  # [n_embd, 2 * n_embd_tgt]
    w["input_norm.weight"] = np.ones(128, dtype=np.float32)  # [2 * n_embd_tgt]
    src = _ckpt(tmp_path, "speculators", weights=w, norm_before_fc=True, layer_ids=[2, 4])
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           f"{src}: norm_before_fc spans the 2 features this head reads; the pinned graph reads 3 and that norm "
           f"cannot be padded, so this head cannot run")


def test_bad_targets(tmp_path, tiny_target):
    from eagle3_gguf.convert import convert_head

    src = _ckpt(tmp_path)
    tiny_head = convert_head(src, tmp_path / "a-head.gguf", tiny_target).out
    _fails(tmp_path, [str(src), "-t", str(tmp_path / "nope.gguf")],
           f"{tmp_path / 'nope.gguf'}: no such target file (give the target .gguf or its config.json)")
    _fails(tmp_path, [str(src), "-t", str(src / "model.safetensors")],
           f"{src / 'model.safetensors'}: target must be a GGUF file or a HF config.json")
    _fails(tmp_path, [str(src), "-t", str(tiny_head)], f"{tiny_head}: this is an EAGLE-3 head, not a target model")
    bad = tmp_path / "trunc.gguf"
    bad.write_bytes(tiny_target.read_bytes()[:5000])
    _fails(tmp_path, [str(src), "-t", str(bad)],
           f"{bad}: corrupt GGUF (its header ends early: the file is cut short): download or convert it again")


def test_missing_source_and_output_dir(tmp_path, tiny_target):
    _fails(tmp_path, [str(tmp_path / "nothing"), "-t", str(tiny_target)],
           f"{tmp_path / 'nothing'}: no such file or directory")
    src = _ckpt(tmp_path)
    res = runner.invoke(app, ["convert", str(src), "-t", str(tiny_target), "-o", str(tmp_path / "no" / "h.gguf")])
    assert res.exit_code == 2
    assert res.stderr == f"error: {tmp_path / 'no' / 'h.gguf'}: output directory {tmp_path / 'no'} does not exist\n"


def test_failure_mid_stream_leaves_nothing(tmp_path, tiny_target):
    """fc is already written when down_proj overflows f16: the temp file is removed, no output appears."""
    w = random_weights(CkptDims())
    w["L.mlp.down_proj.weight"][0, 0] = 1e5
    src = _ckpt(tmp_path, weights=w)
    _fails(tmp_path, [str(src), "-t", str(tiny_target), "--outtype", "f16"],
           "midlayer.mlp.down_proj.weight: values up to 1e+05 overflow f16 (max 65504); use --outtype bf16 or f32")


def test_a_block_scale_overflow_is_one_line(tmp_path, tiny_target):
    """Q8_0 (the default) stores a block's scale amax / 127 in f16: past 65504 x 127 it cannot."""
    w = random_weights(CkptDims())
    w["L.mlp.down_proj.weight"][0, 0] = 1e7
    src = _ckpt(tmp_path, weights=w)
    _fails(tmp_path, [str(src), "-t", str(tiny_target)],
           "midlayer.mlp.down_proj.weight: values up to 1e+07 overflow Q8_0's f16 block scales; use bf16 or f32 for "
           "it (--outtype, --fc-type)")


def test_existing_output_survives_a_failed_run(tmp_path, tiny_target):
    w = random_weights(CkptDims())
    w["d2t"][0] = -1
    src = _ckpt(tmp_path, weights=w)
    out = tmp_path / "keep.gguf"
    out.write_bytes(b"previous")
    res = runner.invoke(app, ["convert", str(src), "-t", str(tiny_target), "-o", str(out)])
    assert res.exit_code == 2 and out.read_bytes() == b"previous"


def test_bad_types(tmp_path, tiny_target):
    src = _ckpt(tmp_path)
    _fails(tmp_path, [str(src), "-t", str(tiny_target), "--outtype", "q4_0"],
           "--outtype q4_0: choose from f32, f16, bf16, q8_0 (fc has its own --fc-type)")
    _fails(tmp_path, [str(src), "-t", str(tiny_target), "--fc-type", "q5_k"],
           "--fc-type q5_k: choose from q4_0, q8_0, f16, bf16, f32")


@pytest.mark.parametrize("value, dtype, expected", [
    (np.nan, np.float32, "holds NaN or infinite values: the checkpoint is damaged (nothing was written)"),
    (np.inf, np.float32, "holds NaN or infinite values: the checkpoint is damaged (nothing was written)"),
    (0, np.int64, "holds I64 values, not floats: not a weight of an EAGLE-3 head"),
])
def test_weights_that_are_no_numbers_are_refused(tmp_path, tiny_target, value, dtype, expected):
    """A diverged checkpoint's NaN fc converted before, and `generate` then failed deep in the policy; an integer fc
    converted silently."""
    w = random_weights(CkptDims())
    w["fc.weight"] = w["fc.weight"].astype(dtype)
    w["fc.weight"][0, 0] = value
    src = _ckpt(tmp_path, weights=w)
    _fails(tmp_path, [str(src), "-t", str(tiny_target)], f"{src}: tensor 'fc.weight' {expected}")


def test_an_output_that_is_an_input_or_no_regular_file_is_refused(tmp_path, tiny_target):
    """-o naming the checkpoint's file, its config or the target replaced it with the head; -o /dev/null replaced
    the device with a file (as root)."""
    src = _ckpt(tmp_path)
    target = tmp_path / "target.gguf"
    target.write_bytes(tiny_target.read_bytes())
    for out, expected in ((src / "model.safetensors", f"is an input of this conversion ({src / 'model.safetensors'}); "
                                                     "name another output (-o)"),
                          (src / "config.json", f"is an input of this conversion ({src / 'config.json'}); name "
                                                "another output (-o)"),
                          (target, f"is an input of this conversion ({target}); name another output (-o)"),
                          (Path("/dev/null"), "not a regular file; name a .gguf file to write (-o head.gguf)")):
        before = out.read_bytes() if out.is_file() else None
        res = runner.invoke(app, ["convert", str(src), "-t", str(target), "-o", str(out)])
        assert res.exit_code == 2 and res.stderr.splitlines() == [f"error: {out}: {expected}"], res.output
        assert out.read_bytes() == before if before is not None else Path("/dev/null").is_char_device()
