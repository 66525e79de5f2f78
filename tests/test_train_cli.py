"""`eagle3-gguf train`: end to end on the tiny target through the CLI, and its one-line errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from model_factory import TinyDims, write_tiny_target

from eagle3_gguf.train.prompts import SOURCE

CLI = [sys.executable, "-m", "eagle3_gguf.cli.main"]

# Runs the CLI with `torch` hidden from importlib, as on an install without the [train] extra.
NO_TORCH = ("import importlib.util, sys; real = importlib.util.find_spec; "
            "importlib.util.find_spec = lambda n, *a: None if n == 'torch' else real(n, *a); "
            "sys.argv = ['eagle3-gguf'] + sys.argv[1:]; from eagle3_gguf.cli.main import main; main()")


def run(*args, cli=CLI):
    return subprocess.run([*cli, *args], capture_output=True, text=True, timeout=600)


def test_train_without_torch_says_how_to_install(tmp_path, tiny_target):
    r = run("train", "-m", str(tiny_target), "-o", str(tmp_path / "o"), cli=[sys.executable, "-c", NO_TORCH])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == "error: training needs torch: pip install 'eagle3-gguf[train]'"


def test_train_bad_layer_ids_is_one_line(tmp_path, tiny_target):
    pytest.importorskip("torch")
    r = run("train", "-m", str(tiny_target), "-o", str(tmp_path / "o"), "--layer-ids", "1,2")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--layer-ids" in r.stderr


def test_train_data_model_must_be_the_same_model(tmp_path, tiny_target):
    pytest.importorskip("torch")
    other = write_tiny_target(tmp_path / "other.gguf", dataclasses.replace(TinyDims(), n_layer=5),
                              tokenizer_from=tiny_target)
    r = run("train", "-m", str(tiny_target), "-o", str(tmp_path / "o"), "--data-model", str(other))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: --data-model {other}: not the same model as {tiny_target} (vocab, hidden size, layers 49152, 64, 5 "
        f"vs 49152, 64, 6): pass another quantization of the target"]
    assert not (tmp_path / "o" / "data").exists()


def test_train_cli_end_to_end(tmp_path, tiny_target):
    pytest.importorskip("torch")
    out = tmp_path / "run"
    twin = write_tiny_target(tmp_path / "twin.gguf", TinyDims(), seed=5, tokenizer_from=tiny_target)  # same shapes
    args = ["train", "-m", str(tiny_target), "-o", str(out), "--prompts", "4", "--steps", "4", "--draft-vocab",
            "256", "--ffn", "64", "--max-new", "12", "--parallel", "2", "--data-model", str(twin),
            "--layer-ids", "1,3,4", "-t", "2"]
    r = run(*args)
    assert r.returncode == 0, r.stderr
    assert "training    4 steps" in r.stdout and (out / "head.gguf").is_file()
    assert (out / "checkpoint" / "config.json").is_file()
    assert json.loads((out / "data" / "manifest.json").read_text())["target"] == str(twin)
    r = run(*args)  # the folder holds a run: refuse unless --resume
    assert r.returncode == 2 and "--resume" in r.stderr
    r = run(*args[:-2], "--resume", "--steps", "6")
    assert r.returncode == 0, r.stderr
    assert "training    6 steps" in r.stdout
    r = run(*args, "--resume", "--prompt-mix", "prose")  # other prompts must not extend this data
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: {out / 'data'}: existing data answers other prompts ({SOURCE}): resume with the same prompt mix and "
        "--prompt-format, or use another output folder"]


def test_train_unknown_prompt_mix_is_one_line(tmp_path, tiny_target):
    pytest.importorskip("torch")
    r = run("train", "-m", str(tiny_target), "-o", str(tmp_path / "o"), "--prompt-mix", "poetry")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: --prompt-mix poetry: one of balanced, prose"]
    assert not (tmp_path / "o" / "data").exists()


def test_train_prompt_format_is_checked_against_the_target(tmp_path, tiny_target):
    """A base model's GGUF has no chat template: --prompt-format chat and ShareGPT data (rendered with the
    template) are refused in one line before anything is written."""
    pytest.importorskip("torch")
    base = write_tiny_target(tmp_path / "base.gguf", TinyDims(), tokenizer_from=tiny_target, chat_template=False)
    out = tmp_path / "o"
    for args, line in (
            (["--prompt-format", "xml"], "error: --prompt-format xml: one of auto, chat, raw"),
            (["--prompt-format", "chat"], "error: base.gguf has no chat template: pass --prompt-format raw"),
            (["--data-source", "sharegpt"], "error: --data-source sharegpt renders conversations with the target's "
                                            "chat template and base.gguf has none: use --data-source self")):
        r = run("train", "-m", str(base), "-o", str(out), *args)
        assert (r.returncode, r.stderr.strip().splitlines()) == (2, [line])
        assert not out.exists()
    r = run("train", "-m", str(tiny_target), "-o", str(out), "--prompt-format", "raw", "--data-source", "sharegpt")
    assert (r.returncode, r.stderr.strip().splitlines()) == (2, [
        "error: --data-source sharegpt renders conversations with the target's chat template: use --data-source self"])


def test_train_online_refuses_what_the_torch_target_does_not_run(tmp_path, tiny_target):
    """--online: ShareGPT only, no disk budget, and a target the torch forward computes as llama.cpp does; each
    refused in one line before anything is written."""
    pytest.importorskip("torch")
    qwen2 = write_tiny_target(tmp_path / "qwen2.gguf", TinyDims(), tokenizer_from=tiny_target, arch="qwen2")
    out = tmp_path / "o"
    for model, args, line in (
            (tiny_target, [], "error: --online teacher-forces ShareGPT conversations: add --data-source sharegpt"),
            (tiny_target, ["--data-source", "sharegpt", "--max-data-gb", "2"],
             "error: --max-data-gb: --online keeps no data on disk; leave one of them out"),
            (qwen2, ["--data-source", "sharegpt"], "error: qwen2.gguf: the torch target runs llama-architecture "
             "GGUFs, not 'qwen2': leave out --online: llama.cpp makes this target's data")):
        r = run("train", "-m", str(model), "-o", str(out), "--online", *args)
        assert (r.returncode, r.stderr.strip().splitlines()) == (2, [line])
        assert not out.exists()


def test_train_bad_numbers_paths_and_devices_are_one_line_before_any_data(tmp_path, tiny_target):
    """Each checked before the data is made (minutes with the default --prompts), and none leaves a folder."""
    pytest.importorskip("torch")
    import torch

    out, a_file = tmp_path / "o", tmp_path / "file.txt"
    a_file.write_text("x")
    no_cuda = [] if torch.cuda.is_available() else [
        (["--device", "cuda"], "--device cuda: this torch sees no cuda device (--device auto picks what it has)")]
    for args, line in (
            (["--steps", "-1"], "--steps must be at least 1 (got -1)"),
            (["--unroll", "0"], "--unroll must be at least 1 (got 0)"),
            (["--epochs", "nan"], "--epochs must be a positive number (got nan)"),
            (["--lr", "-1"], "--lr must be a number, 0 or more (got -1.0)"),
            (["--lr", "inf"], "--lr must be a number, 0 or more (got inf)"),
            (["--max-data-gb", "nan"], "--max-data-gb must be a positive number (got nan)"),
            (["--prompts", "-5"], "--prompts must be at least 1 (got -5)"),
            (["--prompts", "100000001"], "--prompts must be at most 100000 of our prompts (got 100000001); for more "
                                         "text, --data-source sharegpt"),
            (["--parallel", "0"], "--parallel must be at least 1 (got 0)"),
            (["--ffn", "-3"], "--ffn must be at least 1 (got -3)"),
            (["--draft-vocab", "0"], "--draft-vocab must be at least 1 (got 0)"),
            (["--draft-vocab", "49153"], "--draft-vocab 49153: the target has 49152 tokens; at most that many"),
            (["--resume"], f"{out}: no run to resume there: drop --resume to start one"),
            (["-t", "100000"], "-t must be between 1 and 512 (got 100000)"),
            (["--device", "tpu"], "--device tpu: one of auto, cpu, cuda (cuda:N), mps"),
            *no_cuda):
        r = run("train", "-m", str(tiny_target), "-o", str(out), *args)
        assert (r.returncode, r.stderr.strip().splitlines()) == (2, [f"error: {line}"]), args
        assert not out.exists()
    for path, line in ((a_file, f"{a_file}: not a folder; -o names the run's folder (made if missing)"),
                       (Path("/proc/run"), "/proc/run: cannot make the run's folder (")):
        r = run("train", "-m", str(tiny_target), "-o", str(path))
        assert r.returncode == 2 and r.stderr.startswith(f"error: {line}"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
