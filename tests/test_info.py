"""`eagle3-gguf info` on targets and heads, and its one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from eagle3_gguf import keys
from eagle3_gguf.gguf_file import KeyValue
from model_factory import rewrite_gguf

CLI = [sys.executable, "-m", "eagle3_gguf.cli.main"]


def run(*args):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def test_help_lists_commands():
    r = run("--help")
    assert r.returncode == 0
    assert "info" in r.stdout


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="/dev/full: a disk always full (Linux)")
def test_output_that_cannot_be_written_is_one_line_not_a_cut_file(smollm2_path):
    """stdout on a full disk: `info --json > file` exited 0 with its JSON cut at 4096 bytes (the interpreter's last
    flush failed unseen), and `--tensors` ended in a traceback. Now one line and exit 2, whichever command writes."""
    for args in (["info", str(smollm2_path), "--json"], ["info", str(smollm2_path), "--tensors"], ["info", "--help"]):
        with open("/dev/full", "w") as full:
            r = subprocess.run([*CLI, *args], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
        assert (r.returncode, r.stderr) == (2, "error: the output could not be written (No space left on device)\n")


def test_info_target_smollm2(smollm2_path):
    r = run("info", str(smollm2_path), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["kind"] == "target" and d["architecture"] == "llama"
    assert (d["n_layer"], d["n_embd"], d["n_vocab"]) == (30, 576, 49152)
    assert d["extraction_supported"] is True and d["chat_template"] is True
    assert (d["n_head"], d["n_head_kv"], d["context_length"]) == (9, 3, 8192)
    mix = d["tensor_types"]
    assert sum(t["count"] for t in mix.values()) == d["n_tensors"] == len(d["tensors"])
    assert sum(t["bytes"] for t in mix.values()) == sum(t["bytes"] for t in d["tensors"])
    assert list(mix)[0] == max(mix, key=lambda name: mix[name]["bytes"]) and "F32" in mix


def test_info_target_is_a_summary_and_tensors_on_request(smollm2_path):
    d = json.loads(run("info", str(smollm2_path), "--json").stdout)
    r = run("info", str(smollm2_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) <= 20, r.stdout
    assert lines[1].strip().startswith("architecture     llama  (")
    for expected in ("layers           30", "hidden size      576",
                     "attention heads  9 (KV heads 3)", "vocab            49152", "context (train)  8192",
                     "chat template    yes", "EAGLE-3 target   yes"):
        assert any(line.strip() == expected for line in lines), (expected, r.stdout)
    mix_line = next(line for line in lines if line.strip().startswith("tensor types"))
    assert all(f"{name} x{share['count']} (" in mix_line for name, share in d["tensor_types"].items())
    assert not any(t["name"] in r.stdout for t in d["tensors"])
    full = run("info", str(smollm2_path), "--tensors").stdout.splitlines()
    assert full[: len(lines)] == lines and full[len(lines)] == "  tensors:"
    assert [line.split()[0] for line in full[len(lines) + 1:]] == [t["name"] for t in d["tensors"]]


def test_info_head(tiny_head_d2t):
    r = run("info", str(tiny_head_d2t), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["kind"] == "eagle3-head" and d["target_layers"] == [0, 2, 5]
    assert d["target_hidden_size"] == 64 and d["draft_vocab"] == 512
    assert d["norm_before_residual"] is False and d["norm_before_fc"] is False
    assert d["own_output"] is True and d["own_token_embd"] is False
    types = {t["name"]: t["type"] for t in d["tensors"]}
    assert types["d2t"] == "I64" and types["fc.weight"] == "F32"
    text = run("info", str(tiny_head_d2t)).stdout
    assert "target layers    [0, 2, 5]" in text and "draft vocab      512 tokens (d2t)" in text
    assert "fc.weight" not in text and "fc.weight" in run("info", str(tiny_head_d2t), "--tensors").stdout


@pytest.mark.parametrize("case", ["missing", "not-gguf", "truncated-header", "truncated-data", "directory",
                                  "big-endian"])
def test_info_bad_input_one_line_exit_2(case, tmp_path, tiny_head):
    path = tmp_path / "x.gguf"
    expected = {
        "missing": f"error: {path}: no such file",
        "not-gguf": f"error: {path}: not a GGUF file (expected magic 'GGUF', found b'hell')",
        "truncated-header": f"error: {path}: corrupt GGUF (its header ends early: the file is cut short): download or "
                            "convert it again",
        "truncated-data": f"error: {path}: truncated GGUF (its tensors end at byte {len(tiny_head.read_bytes())}, the "
                          f"file has {len(tiny_head.read_bytes()) - 1000})",
        "directory": f"error: {tmp_path}: not a file",
        # it read 'unsupported GGUF version 50331648': 3, byte-swapped
        "big-endian": f"error: {path}: a big-endian GGUF (version 3): llama.cpp reads little-endian ones here "
                      "(gguf-convert-endian converts it)",
    }[case]
    data = tiny_head.read_bytes()
    if case == "not-gguf":
        path.write_text("hello world")
    elif case == "truncated-header":
        path.write_bytes(data[:100])
    elif case == "truncated-data":
        path.write_bytes(data[: len(data) - 1000])
    elif case == "big-endian":  # the version field as a big-endian writer leaves it (the rest need not be)
        path.write_bytes(data[:4] + (3).to_bytes(4, "big") + data[8:])
    r = run("info", str(tmp_path if case == "directory" else path))
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(expected), lines[0]


def test_info_head_per_layer_head_count(tmp_path, tiny_head):
    """llama.cpp reads a head count as one value or one per layer: a one-layer head's array of one is that value
    (it once raised a TypeError here); an array of two is refused in one line."""
    key = keys.arch_key(keys.KEY_HEAD_COUNT, keys.ARCH_EAGLE3)
    one = rewrite_gguf(tiny_head, tmp_path / "one.gguf", kvs={key: KeyValue(key, [4], VT.ARRAY, VT.UINT32)})
    r = run("info", str(one), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n_head"] == 4
    two = rewrite_gguf(tiny_head, tmp_path / "two.gguf", kvs={key: KeyValue(key, [4, 4], VT.ARRAY, VT.UINT32)})
    r = run("info", str(two))
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == f"error: {two}: {key} holds 2 values; a one-layer head has one: convert the head again\n"


def test_info_head_geometry_one_line(tmp_path, tiny_head):
    """`info` reads a head through the same geometry check as `generate` (gguf_file.check_head)."""
    kv = keys.arch_key(keys.KEY_HEAD_COUNT_KV, keys.ARCH_EAGLE3)
    k = np.zeros((48, 128), dtype=np.float32)  # [3 KV heads x head_dim 16, 2 x hidden 64]
    bad = rewrite_gguf(tiny_head, tmp_path / "kv3.gguf", kvs={kv: KeyValue(kv, 3, VT.UINT32)},
                       tensors={keys.blk(keys.T_ATTN_K): k, keys.blk(keys.T_ATTN_V): k})
    r = run("info", str(bad))
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (f"error: {bad}: 4 attention heads are not a multiple of 3 KV heads, which llama.cpp's "
                        f"grouped-query attention needs (it aborts): convert the head again\n")
