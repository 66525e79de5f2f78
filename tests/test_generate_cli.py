"""`eagle3-gguf generate`: mismatched pairs and bad flags give one line and exit 2; a good run streams
the target's text and reports statistics."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from eagle3_gguf.cli.main import app
from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.gguf_file import HeadInfo, TargetInfo, read_gguf
from eagle3_gguf.pair import check_pair
from model_factory import HeadSpec, TinyDims, write_random_head, write_tiny_target


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def one_line_error(r, expected: str) -> None:
    assert r.exit_code == 2, (r.exit_code, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0] == f"error: {expected}", lines[0]


@pytest.fixture(scope="module")
def heads(tmp_path_factory, tiny_target):
    d = tmp_path_factory.mktemp("heads")
    mk = lambda name, **kw: write_random_head(d / name, HeadSpec(**kw), tokenizer_from=tiny_target)  # noqa: E731
    return {
        "wide": mk("wide.gguf", n_embd_tgt=128, target_layers=(1, 3, 5)),
        "far": mk("far.gguf", n_embd_tgt=64, target_layers=(1, 3, 9)),
        "final": mk("final.gguf", n_embd_tgt=64, target_layers=(1, 3, 6)),
    }


@pytest.fixture(scope="module")
def mla_target(tmp_path_factory, tiny_target):
    """Labelled deepseek2 (MLA: neither hooked nor captured); refused before llama.cpp reads it."""
    return write_tiny_target(tmp_path_factory.mktemp("q") / "deepseek2.gguf", TinyDims(), arch="deepseek2",
                             tokenizer_from=tiny_target)


def test_pair_mismatches_one_line_exit_2(tiny_target, tiny_head, heads, mla_target):
    base = ["generate", "-m", str(tiny_target), "-p", "hi", "-n", "4"]
    one_line_error(invoke(*base, "--draft", str(heads["wide"])),
                   "head expects target hidden size 128, but tiny-target.gguf has 64: this head was trained for "
                   "another model")
    one_line_error(invoke(*base, "--draft", str(heads["far"])),
                   "head extracts target layer 9, but tiny-target.gguf has 6 layers (ids 0..5): reconvert the head "
                   "with --layer-ids")
    one_line_error(invoke(*base, "--draft", str(heads["final"])),
                   "head extracts layer id 6 (the final output), which the pinned llama.cpp does not expose for "
                   "'llama' targets: reconvert the head with --layer-ids below 6")
    one_line_error(invoke(*base, "--draft", str(tiny_target)),
                   f"{tiny_target}: architecture is 'llama', not an EAGLE-3 head ('eagle3')")
    one_line_error(invoke("generate", "-m", str(tiny_head), "--draft", str(tiny_head), "-p", "hi"),
                   f"{tiny_head}: this is an EAGLE-3 head; pass it with --draft and the target with -m")
    r = invoke("generate", "-m", str(mla_target), "--draft", str(tiny_head), "-p", "hi")
    assert r.exit_code == 2
    assert r.stderr.startswith("error: deepseek2.gguf: the pinned llama.cpp cannot extract hidden states from "
                               "'deepseek2' models (supported: bailingmoe3, deepseek4, gemma3, gemma4, gpt-oss,")


def test_vocab_and_lm_head_mismatches(tiny_target, tiny_head):
    target = TargetInfo.from_gguf(read_gguf(tiny_target))
    head = HeadInfo.from_gguf(read_gguf(tiny_head))
    with pytest.raises(Eagle3Error) as e:
        check_pair(target, dataclasses.replace(head, n_vocab=32000))
    assert str(e.value) == ("head vocab (32000) differs from the target's (49152): the head belongs to another "
                            "tokenizer")
    with pytest.raises(Eagle3Error) as e:
        check_pair(target, dataclasses.replace(head, draft_vocab=512, own_output=False))
    assert str(e.value) == "tiny-head.gguf: head has a d2t map but no lm_head (output.weight) of its own"


@pytest.mark.parametrize("flags, expected", [
    (["-n", "0"], "-n must be at least 1 (got 0)"),
    (["--draft-max", "40"], "--draft-max must be between 0 and 32 (got 40)"),
    (["--temp", "-1"], "--temp must be 0 (greedy) or a finite number above it (got -1.0)"),
    (["--temp", "nan"], "--temp must be 0 (greedy) or a finite number above it (got nan)"),
    (["--temp", "inf"], "--temp must be 0 (greedy) or a finite number above it (got inf)"),
    (["--seed", "-2"], "--seed must be between 0 and 2^64 - 1, or -1 for a random one (got -2)"),
    (["--draft-p-min", "1.5"], "--draft-p-min must be in [0, 1) (got 1.5)"),
    (["-t", "0"], "-t must be between 1 and 512 (got 0)"),
    (["-t", "100000"], "-t must be between 1 and 512 (got 100000)"),  # more crash ggml's thread pool
    (["-f", "/nonexistent/prompt.txt", "-p", "x"], "give the prompt with -p or -f, not both"),
    (["-f", "/nonexistent/prompt.txt"], "/nonexistent/prompt.txt: no such prompt file"),
    (["-ctv", "f17"], "unknown KV cache type 'f17' for -ctv (one of: auto, f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, "
                      "q5_0, q5_1)"),
    (["-ctk", "auto"], "unknown KV cache type 'auto' (one of: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1)"),
])
def test_bad_flags_one_line_exit_2(tiny_target, tiny_head, flags, expected):
    one_line_error(invoke("generate", "-m", str(tiny_target), "--draft", str(tiny_head), *flags), expected)


def test_llama_cpps_head_and_draft_flags(tiny_target, tiny_head, tmp_path, monkeypatch):
    """llama.cpp's -md / --model-draft name the head as --draft does; llama.cpp's --draft N (its --draft-max N) gets
    one line saying so, on every command that takes a head."""
    r = invoke("generate", "-m", str(tiny_target), "--model-draft", str(tiny_head), "-p", "hello", "-n", "2")
    assert r.exit_code == 0, r.output
    monkeypatch.chdir(tmp_path)  # no file named 8 here
    hint = "--draft 8: no such file; --draft is the EAGLE-3 head's GGUF here (llama.cpp's --draft N is {})"
    for command, instead in (("generate", "--draft-max 8"), ("serve", "--draft-max 8"),
                             ("bench", "--contenders k8, measured beside target-only")):  # bench has no --draft-max
        one_line_error(invoke(command, "-m", str(tiny_target), "--draft", "8"), hint.format(instead))


def test_a_prompt_file_that_is_no_text_is_one_line(tiny_target, tiny_head, tmp_path):
    binary = tmp_path / "prompt.txt"
    binary.write_bytes(b"\xff\xfeh\x00i\x00")  # UTF-16
    for path, expected in ((binary, f"{binary}: not UTF-8 text"),
                           (tmp_path, f"{tmp_path} is a directory: -f takes a text file")):
        one_line_error(invoke("generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-f", str(path)), expected)



def test_a_prompt_from_a_pipe_is_read(tiny_target, tiny_head):
    """-f <(...) hands a pipe (/dev/fd/N), not a file: its text is the prompt, as -p's."""
    import os

    args = ("generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-n", "6", "--json")
    r, w = os.pipe()
    os.write(w, b"The capital of France is")
    os.close(w)
    try:
        piped = invoke(*args, "-f", f"/dev/fd/{r}")
    finally:
        os.close(r)
    typed = invoke(*args, "-p", "The capital of France is")
    assert piped.exit_code == typed.exit_code == 0, piped.output
    assert json.loads(piped.stdout)["text"] == json.loads(typed.stdout)["text"]


def test_a_head_with_nan_weights_is_one_line(tiny_target, tiny_head, tmp_path):
    """A head whose weights hold NaN (convert refuses such checkpoints; a file from elsewhere may not): its draft
    steps give no probability, and generate says so in one line where the policy failed on a NaN deep inside."""
    import gguf

    from eagle3_gguf.session import NO_PROBABILITY

    bad = tmp_path / "nan-head.gguf"
    bad.write_bytes(tiny_head.read_bytes())
    norm = next(t for t in gguf.GGUFReader(bad).tensors if t.name == "output_norm.weight")
    with open(bad, "r+b") as f:  # the head's final norm: every logit NaN
        f.seek(norm.data_offset)
        f.write(np.full(norm.n_elements, np.nan, np.float32).tobytes())
    for policy in ("fixed", "adaptive"):
        one_line_error(invoke("generate", "-m", str(tiny_target), "--draft", str(bad), "-p", "hello", "-n", "8",
                              "--draft-policy", policy), NO_PROBABILITY)


def test_missing_model_file(tiny_head, tmp_path):
    one_line_error(invoke("generate", "-m", str(tmp_path / "nope.gguf"), "--draft", str(tiny_head), "-p", "x"),
                   f"{tmp_path / 'nope.gguf'}: no such file")


def test_a_context_past_the_free_memory_is_one_line(tiny_target, tiny_head, monkeypatch):
    """llama.cpp zeroes the whole KV cache as it makes it: past the free memory the process was killed, silently."""
    from eagle3_gguf import pair
    monkeypatch.setattr(pair, "free_memory", lambda: 2**21)
    # 6 layers x 2 KV heads x head size 16, an f16 K and a bf16 V element each: 768 bytes a token
    one_line_error(invoke("generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-c", "4096", "-p", "x"),
                   "a context of 4096 tokens needs 3.0 MiB for tiny-target.gguf's KV cache alone, more than the 2.0 MiB "
                   "this machine has free: lower -c (n_ctx)")


def test_prompt_longer_than_context(tiny_target, tiny_head, tmp_path, monkeypatch):
    """Said before the exactness probe and the cost curve are measured (seconds on a new set-up, and two lines)."""
    monkeypatch.setenv("EAGLE3_GGUF_CACHE", str(tmp_path))  # a new set-up: nothing measured yet
    one_line_error(invoke("generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-c", "256",
                          "-p", "word " * 400),
                   "the prompt has 401 tokens, the context only 256: raise -c")  # 400 words + the trailing space
    assert not (tmp_path / "exact").exists() and not (tmp_path / "costs").exists()


def test_generate_json_with_baseline(tiny_target, tiny_head):
    r = invoke("generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-p", "The capital of France is",
               "-n", "24", "--baseline", "--json", "--draft-policy", "fixed")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["identical"] is True
    st = d["stats"]
    assert st["n_generated"] == 24 and st["n_accepted"] + st["n_target_forwards"] == 24
    assert st["draft_max"] == 4 and len(st["accept_hist"]) == 5
    assert d["baseline"]["n_generated"] == 24 and d["speedup"] > 0


def test_generate_a_draft_tree(tiny_target, tiny_head):
    """--draft-topk opens the target with a sequence per branch; the tree cycles are counted, the text is the
    target's."""
    r = invoke("generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-p", "The capital of France is",
               "-n", "24", "--baseline", "--json", "--draft-policy", "fixed", "--draft-p-min", "0", "--draft-max", "3",
               "--draft-topk", "3", "--draft-nodes", "5")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    st = d["stats"]
    assert d["identical"] is True and st["tree_cycles"] > 0 and st["tree_nodes"] <= 5 * st["tree_cycles"]
    one_line_error(invoke("generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-p", "x",
                          "--draft-topk", "0"), "--draft-topk must be between 1 and 8 (got 0)")
    # up to the context's end: the head's tree needs top-k cells a depth there, the target's only its nodes
    r = invoke("generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-p", "The capital of France is",
               "-c", "64", "-n", "600", "--json", "--draft-policy", "fixed", "--draft-p-min", "0", "--draft-max", "6",
               "--draft-topk", "4")
    assert r.exit_code == 0, r.output
    st = json.loads(r.stdout)["stats"]
    assert st["stop_reason"] == "context full" and st["tree_cycles"] > 0


def test_generate_caps_trees_for_the_adaptive_policy_only():
    """generate's default: the adaptive policy may add branches (caps 4 / 8, config.ADAPTIVE_TREE), the fixed one
    drafts chains unless a tree is asked for; a given value is kept; serve passes chains (1 / 0)."""
    from eagle3_gguf.cli.common import drafting_from_flags

    flags = dict(draft_max=4, draft_p_min=0.5, spec_sampling="rejection", draft_temp_scale=None, draft_lookup="on",
                 draft_lookup_max=16)

    def caps(policy, topk, nodes):
        d = drafting_from_flags(draft_policy=policy, draft_topk=topk, draft_nodes=nodes, **flags)
        return d.draft_topk, d.draft_nodes, d.tree_sequences

    assert caps("adaptive", None, None) == (4, 8, 9)
    assert caps("fixed", None, None) == (1, 0, 1)
    assert caps("adaptive", None, 6) == (4, 6, 9) and caps("adaptive", 2, None) == (2, 8, 8)
    assert caps("fixed", 3, None) == (3, 0, 12) and caps("adaptive", 1, 0) == (1, 0, 1)
    with pytest.raises(Eagle3Error, match=r"^--draft-temp-scale shapes the draws of chain drafts: a fixed tree"):
        drafting_from_flags(draft_policy="fixed", draft_topk=2, draft_nodes=None, temp=0.8,
                            **dict(flags, draft_temp_scale=0.5))


def test_generate_streams_text_and_prints_stats(tiny_target, tiny_head):
    r = invoke("generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-p", "Hello", "-n", "8",
               "--baseline")
    assert r.exit_code == 0, r.output
    assert "identical output   yes" in r.stderr
    assert "tau (tokens/forward)" in r.stderr and "acceptance by position" in r.stderr
    rows = re.search(r"verify rows \(cycles\) +(.+)", r.stderr)[1]  # "1: 5  3: 2": each cycle after the prefill
    forwards = int(re.search(r"target forwards +(\d+)", r.stderr)[1])
    assert sum(int(c) for c in re.findall(r"\d+: (\d+)", rows)) == forwards - 1
    assert r.stdout.endswith("\n") and len(r.stdout.strip()) > 0


def test_cache_type_llama_cpp_refuses(tiny_target, tiny_head):
    # q8_0 blocks are 32 wide; the tiny target's heads are 16: llama.cpp refuses the context (no abort)
    one_line_error(invoke("generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-p", "x", "-ctk", "q8_0"),
                   f"{tiny_target}: llama.cpp could not create a context (n_ctx=4096, KV cache q8_0/bf16; "
                   "-v shows why)")


@pytest.mark.parametrize("ctv", ["bf16", "f16"])
def test_identical_past_256_tokens_on_two_threads(tiny_target, tiny_head, ctv):
    """The default bf16 V cache keeps every row batch-invariant (tests/test_native.py pins why), so the
    text equals target-only decoding past the 256 tokens where f16/f16 single rows go split-KV; with
    -ctv f16 the exactness probe finds no width above 1 exact, and the CLI says so (--exact strict: identical)."""
    r = invoke("generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-p", "Once upon a time", "-n", "400",
               "-t", "2", "--draft-policy", "fixed", "--draft-p-min", "0", "--baseline", "--json", "-ctv", ctv)
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["stats"]["n_generated"] == 400 and d["stats"]["n_drafted"] > 300  # rows decoded in verify batches
    if ctv == "bf16":
        assert d["identical"] is True and r.stderr == "" and d["stats"]["exact"]["kept"] is True
    else:
        assert r.stderr.startswith("note: on this set-up no verify batch of 2 or more rows is computed bit for bit "
                                   "as a lone row (exactness probe: 1 of 1..5, width 2 parts (")
        assert d["stats"]["exact"]["kept"] is False
        r = invoke("generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-p", "Once upon a time", "-n",
                   "400", "-t", "2", "--draft-policy", "fixed", "--baseline", "--json", "-ctv", ctv, "--exact", "strict")
        d = json.loads(r.stdout)
        assert d["identical"] is True and d["stats"]["n_drafted"] == 0 and d["stats"]["exact"]["kept"] is True


@pytest.mark.slow
def test_offload_flags(tiny_target, tiny_head):
    """-ngl / -ngld (llama.cpp's names) on both commands; on this CPU-only build `-ngl 99 -ngld 99` runs
    with target-only's text, the statistics say where each model ran, and bad values get one line. The embedded
    pair counts (its head predicts " 11, 12, ...") at a fixed K, so drafts are verified and kept on any machine:
    the adaptive policy prices drafts from this machine's timings, and with the tiny pair on a busy machine it
    drafted nothing."""
    for command in ("generate", "serve"):
        help_text = invoke(command, "--help").output
        for flag in ("-ngl", "--n-gpu-layers", "-ngld", "--n-gpu-layers-draft"):
            assert flag in help_text, (command, flag)
    r = invoke("generate", "-p", "Count from 1 to 40: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "-n", "16", "--baseline",
               "--json", "-ngl", "99", "-ngld", "99", "--draft-policy", "fixed", "--draft-max", "4", "--draft-p-min", "0")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["identical"] is True and d["stats"]["n_accepted"] > 0
    assert d["stats"]["target_on"] == "CPU" and d["stats"]["head_on"] == "CPU"  # no GPU backend in this build
    assert d["baseline"]["target_on"] == "CPU" and d["baseline"]["head_on"] == ""
    r = invoke("generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-p", "Hi", "-n", "4", "-ngl", "all")
    assert r.exit_code == 0 and "ran on" in r.stderr and "target CPU; head CPU" in r.stderr, r.output
    for flag, value in (("-ngl", "x"), ("-ngld", "-3"), ("--n-gpu-layers", "1.5")):
        one_line_error(invoke("generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-p", "x", flag, value),
                       f"{flag.replace('--n-gpu-layers', '-ngl')} must be a number of layers, 'auto' or 'all' "
                       f"(got {value})")


def test_lookup_drafts_only(tiny_target, tiny_head):
    """--draft-head off: every draft is a lookup draft, no draft step runs, and the text is target-only's."""
    r = invoke("generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-n", "96", "--baseline", "--json",
               "-p", "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat",
               "--draft-head", "off")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    st = d["stats"]
    assert d["identical"] is True and st["draft_max"] == 0 and st["t_draft"] == 0.0
    assert st["n_drafted"] == st["lookup_drafted"]
    one_line_error(invoke("generate", "-p", "x", "--draft-head", "off", "--draft-policy", "fixed"),
                   "--draft-head off drafts from lookups only: it needs --draft-lookup on and --draft-policy adaptive")


def test_help_keeps_sentences_whole(monkeypatch):
    """The commands table wraps each command's summary where the terminal ends, not where its docstring's lines do."""
    monkeypatch.setenv("COLUMNS", "200")
    r = invoke("--help")
    assert r.exit_code == 0, r.output
    assert "tensor types, context, chat template and whether" in r.stdout  # one docstring line ended at "context,"
    assert "in one batch. Every token is the target's own choice" in r.stdout


def test_the_demo_says_what_it_shows():
    """Without -p, generate runs its demo (a code edit) and says in one line which drafts carried it, from the run's
    own figures: the break-even acceptance is 1 - c(2) - d of its cost curve."""
    from eagle3_gguf.cli.generate import demo_line
    from eagle3_gguf.policy import PolicyStats
    from eagle3_gguf.stats import SpecStats

    st = SpecStats(draft_max=4, lookup_max=16, n_generated=100, n_accepted=50, lookup_accepted=45,
                   policy=PolicyStats("adaptive", cost_curve=[1.0, 1.6, 2.0], draft_step_cost=0.1))
    line = demo_line(st, 1.12)
    assert line.startswith("what you see: a code edit, whose answer repeats its prompt: 45 of the 100 tokens came "
                           "from lookup drafts (copies of the text so far, no draft step), 5 from the head's drafts, "
                           "1.12x target-only.")
    assert "kept over 70% of the time (2 verify rows cost 1.60x one row, a draft step 0.10x): expect about" in line
    cheap = SpecStats(n_generated=10, policy=PolicyStats("adaptive", cost_curve=[1.0, 1.05], draft_step_cost=0.05))
    assert "kept over 10% of the time" in demo_line(cheap, None) and "a head that good gains there too" in \
        demo_line(cheap, None) and "(--baseline adds the speedup)" in demo_line(cheap, None)
    dear = SpecStats(n_generated=10, policy=PolicyStats("adaptive", cost_curve=[1.0, 2.0], draft_step_cost=0.05))
    assert "a head draft cannot pay here even when always kept (2 verify rows cost 2.00x one row" in demo_line(dear, 1.2)
    # far below 1x, another job slowed one of the two runs (a newcomer read 0.30x and no word of why)
    assert "busy" not in line and "busy" not in demo_line(dear, 0.95)
    assert demo_line(dear, 0.3).endswith(" Below 1x here, the machine was likely busy while one of the two runs ran "
                                         "(they are timed one after the other): run it again when it is idle, or "
                                         "`eagle3-gguf bench`, which interleaves them and says when target-only's own "
                                         "runs differ.")


@pytest.mark.slow
def test_the_main_command_runs_the_demo():
    r = invoke("generate", "--baseline", "-n", "48")
    assert r.exit_code == 0, r.output
    assert "identical output   yes" in r.stderr and "\nwhat you see: a code edit" in r.stderr, r.stderr
    lookups = re.search(r"of them from lookup\s+(\d+) / (\d+)", r.stderr)
    assert lookups and f": {lookups.group(2)} of the 48 tokens came from lookup drafts" in r.stderr, r.stderr


@pytest.mark.parametrize("args, expected", [
    (["bench", "--nope"], "No such option: --nope (Possible options: --model) (see eagle3-gguf bench --help)"),
    (["generate", "extra"], "Got unexpected extra argument(s) (extra) (see eagle3-gguf generate --help)"),
    (["convert"], "Missing argument 'src'. (see eagle3-gguf convert --help)"),
    (["generate", "-n", "x"], "Invalid value for '-n' / '--n-predict': * (see eagle3-gguf generate --help)"),
    (["nosuch"], "No such command 'nosuch'. (see eagle3-gguf --help)"),
])
def test_usage_errors_are_one_line(args, expected):
    """What click itself refuses (an unknown flag or command, a stray argument, a value of the wrong type) is one
    line and exit 2 from the installed command, as our own checks are, not click's boxed usage screen."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "eagle3_gguf.cli.main", *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout)
    lines = r.stderr.strip().splitlines()
    head, _, tail = f"error: {expected}".partition(" * ")  # * : the type's own words, which vary with typer
    assert len(lines) == 1 and lines[0].startswith(head) and lines[0].endswith(tail), r.stderr
