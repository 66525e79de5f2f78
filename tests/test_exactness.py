"""The exactness probe (eagle3_gguf/exactness.py): which verify widths compute every row as target-only decoding
does, measured at load and cached per set-up; the run keeps to them unless told otherwise (--exact)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from arch_targets import ArchDims, write_arch_target
from eagle3_gguf import exactness
from eagle3_gguf.batch import Batch
from eagle3_gguf.cli.main import app
from eagle3_gguf.config import DraftConfig
from eagle3_gguf.context import Context
from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.native import Model, cache_type, flash_attn_type
from eagle3_gguf.pair import PairConfig, load_pair
from model_factory import HeadSpec, write_random_head

# an F32 MoE router is multiplied by ggml_vec_dot_f32 for one row and by llamafile's sgemm for two or more:
# its logits differ in the last bits on nearly every row, and the text parts where two experts nearly tie
MOE = ["--draft-policy", "fixed", "--draft-max", "1", "--draft-p-min", "0", "-t", "2", "-p", "def fib(n):"]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_GGUF_CACHE", str(tmp_path / "cache"))  # every test probes afresh, as a new user does


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("moe")
    f32 = write_arch_target(d / "qwen3moe-f32-router.gguf", "qwen3moe", ArchDims(f32_router=True))
    q8 = write_arch_target(d / "qwen3moe.gguf", "qwen3moe", ArchDims())
    head = write_random_head(d / "head.gguf", HeadSpec(n_embd_tgt=64, target_layers=(1, 3, 5)), tokenizer_from=f32)
    return {"f32": f32, "q8": q8, "head": head}


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def generate_json(*args: str) -> dict:
    r = invoke("generate", *args, "--baseline", "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout) | {"stderr": r.stderr}


ROUTER = "ffn_moe_logits-0: MUL_MAT of F32 64 x 4, at depth 8"  # where the F32 router parts


def test_probe_finds_the_f32_router_inexact(moe):
    for router, exact, parts_at in (("f32", 1, ROUTER), ("q8", 9, "")):
        with load_pair(moe[router], moe["head"], PairConfig(n_ctx=1024, n_threads=2)) as pair, \
                pair.speculator() as spec:
            found = spec.probe_exact(9)
            assert spec.probe_exact(9) == replace(found, source="cache"), router
        assert (found.probed, found.exact, found.source) == (9, exact, "probed"), router
        assert found.depths == (8, 257)
        assert found.parts_at == parts_at, router


def test_a_diagnosis_that_fails_leaves_the_widths_standing(moe, monkeypatch):
    """Naming where a width parts takes another decode or context (a GPU near full may refuse one): its failure is
    its answer, and the widths found stand; an interrupt still ends the probe."""
    def fails(*_args):
        raise Eagle3Error("llama.cpp could not create a context")
    monkeypatch.setattr(exactness, "_parting_node", fails)
    with load_pair(moe["f32"], moe["head"], PairConfig(n_ctx=1024, n_threads=2)) as pair, pair.speculator() as spec:
        found = spec.probe_exact(9)
        assert (found.exact, found.parts_at) == (1, "not named (llama.cpp could not create a context)")

        def interrupted(*_args):
            raise KeyboardInterrupt
        monkeypatch.setattr(exactness, "_parting_node", interrupted)
        with pytest.raises(KeyboardInterrupt):
            exactness.probe(spec.target, spec.session.extract.enable, 9, spec.batch)


def test_where_a_width_parts_on_a_context_of_its_own(moe):
    with load_pair(moe["f32"], moe["head"], PairConfig(n_ctx=1024, n_threads=2)) as pair:
        tokens = np.random.default_rng(exactness.SEED).integers(0, pair.target.model.n_vocab, 16)
        assert exactness.where_parts(pair.target, tokens, exactness.SHALLOW, 2) == ROUTER
    with load_pair(moe["q8"], moe["head"], PairConfig(n_ctx=1024, n_threads=2)) as pair:
        assert exactness.where_parts(pair.target, tokens, exactness.SHALLOW, 8) == exactness.WHOLE_ONLY  # none


def test_a_batch_split_into_ubatches_is_probed_as_computed(tiny_target):
    """Below the widest batch, n_ubatch splits it into ubatches of widths probed before it: every width is exact
    (were each compared as one graph's products, every width past n_ubatch would part)."""
    with Model(tiny_target) as model, \
            Context(model, n_ctx=1024, n_ubatch=4, n_threads=2, type_k=cache_type("f16"), type_v=cache_type("bf16"),
                    flash_attn=flash_attn_type(True)) as ctx, Batch(512) as batch:
        found = exactness.probe(ctx, lambda _on: None, 17, batch)
    assert (found.probed, found.exact, found.parts_at) == (17, 17, "")


def test_a_quantized_cache_is_probed_as_the_weights_allow(tmp_path, smollm2_path):
    """A q8_0 cache's graph multiplies Q, K and V by a Hadamard rotation over [head_dim, n_head * n_tokens]: products
    that span no batch's tokens alone, which the probe skips. They once counted towards where a stopped decode ends
    but not towards what was compared, so width 2 "parted" (exact 1 where the weights' kernels allow more)."""
    import synthetic
    made = synthetic.make_pair(tmp_path, "tiny", "q4_k_m", smollm2_path)
    found = {}
    for k, v in (("f16", "bf16"), ("q8_0", "q8_0")):
        with Model(made.target, repack=False) as model, \
                Context(model, n_ctx=1024, n_threads=2, type_k=cache_type(k), type_v=cache_type(v),
                        flash_attn=flash_attn_type(True)) as ctx, Batch(512) as batch:
            found[v] = exactness.probe(ctx, lambda _on: None, 17, batch)
    assert found["q8_0"].exact == found["bf16"].exact >= 2  # Q4_K's kernels decide, whichever the cache
    assert found["q8_0"].parts_at == found["bf16"].parts_at


def test_the_probe_names_the_attention_that_parts(tiny_target, tiny_head):
    """With K and V both f16, ggml-cpu's flash attention splits a lone row's 512 KV cells across 2 threads: the first
    node to part is layer 0's attention, past 256 tokens; with the default bf16 V none parts."""
    for v, exact, parts_at in (("f16", 1, "FLASH_ATTN_EXT over a F16 K / F16 V cache of 512 cells, at depth 257"),
                               ("bf16", 17, "")):
        with load_pair(tiny_target, tiny_head, PairConfig(n_ctx=1024, n_threads=2, cache_type_v=v)) as pair, \
                pair.speculator() as spec:
            found = spec.probe_exact(17)
        assert (found.exact, found.parts_at.startswith("layer 0, " if parts_at else "")) == (exact, True), v
        assert found.parts_at.endswith(parts_at), v


def test_strict_keeps_target_only_text_where_off_does_not(moe):
    m = ["-m", str(moe["f32"]), "--draft", str(moe["head"]), "-n", "300", *MOE]
    off = generate_json(*m, "--exact", "off")
    assert off["identical"] is False and off["stats"]["n_drafted"] > 100
    assert off["stats"]["exact"] == {"mode": "off", "probed": 0, "exact": 0, "depths": [], "source": "",
                                     "seconds": 0.0, "kept": False, "rows_max": 512, "parts_at": ""}
    strict = generate_json(*m, "--exact", "strict")
    assert strict["identical"] is True and strict["stats"]["n_drafted"] == 0
    ex = strict["stats"]["exact"]
    assert (ex["mode"], ex["probed"], ex["exact"], ex["kept"], ex["rows_max"]) == ("strict", 2, 1, True, 1)
    assert ex["parts_at"] == ROUTER
    auto = generate_json(*m)  # the default: says so, and speculates as upstream does
    assert auto["stats"]["exact"]["kept"] is False and auto["stats"]["exact"]["source"] == "cache"
    assert auto["stderr"].startswith("note: on this set-up no verify batch of 2 or more rows is computed bit for bit "
                                     "as a lone row (exactness probe: 1 of 1..2, width 2 parts (cached; depths 8, 257))")
    assert auto["stats"]["n_drafted"] > 100 and auto["identical"] is False


def test_an_exact_target_keeps_every_width(moe):
    d = generate_json("-m", str(moe["q8"]), "--draft", str(moe["head"]), "-n", "300", *MOE)
    ex = d["stats"]["exact"]
    assert (ex["mode"], ex["probed"], ex["exact"], ex["kept"], ex["source"]) == ("auto", 2, 2, True, "probed")
    assert d["identical"] is True and d["stats"]["n_drafted"] > 100 and d["stderr"] == ""


def test_the_cached_probe_is_probed_again_when_the_set_up_changes(tiny_target, tiny_head):
    m = ["-m", str(tiny_target), "--draft", str(tiny_head), "-p", "Once upon a time", "-n", "8"]
    sources = [generate_json(*m, *flags)["stats"]["exact"]["source"]
               for flags in ([], [], ["-t", "1"], ["-t", "1"], ["-ctv", "f16"], ["--draft-max", "2"], [])]
    # a narrower run is answered by the probe of a wider one (--draft-max 2: lookups still verify 17 rows)
    assert sources == ["probed", "cache", "probed", "cache", "probed", "cache", "cache"]
    wider = generate_json(*m, "--draft-lookup-max", "20", "--draft-max", "20")["stats"]["exact"]
    assert (wider["source"], wider["probed"]) == ("probed", 21)


def test_the_statistics_say_it(tiny_target, tiny_head):
    m = ["generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-p", "Once upon a time", "-n", "8"]
    r = invoke(*m)
    assert r.exit_code == 0, r.output
    lines = {line.split("  ")[0]: line for line in r.stderr.splitlines()}
    assert lines["exact verify widths"].split("  ", 1)[1].strip().startswith("1..17 of 1..17 (probed in ")
    assert lines["kept to them"].endswith("yes: verify batches of at most 17 rows, so the output is target-only's")
    assert "where it parts" not in lines
    r = invoke(*m, "-ctv", "f16", "-t", "2")  # a lone row's split-KV attention (test_the_probe_names_the_attention...)
    assert r.exit_code == 0, r.output
    lines = {line.split("  ")[0]: line for line in r.stderr.splitlines()}
    assert lines["where it parts"].endswith("FLASH_ATTN_EXT over a F16 K / F16 V cache of 512 cells, at depth 257")
    r = invoke(*m, "--exact", "off")
    assert "not probed (--exact off)" in r.stderr and "note:" not in r.stderr


def test_an_interrupt_as_the_probes_callback_is_entered_ends_the_probe_with_nothing_cached(tiny_target, tiny_head,
                                                                                            monkeypatch, tmp_path):
    """Python runs a pending signal's handler (Ctrl-C, SIGTERM) as the next Python function is entered, here the
    probe's eval callback mid-decode, before its own try: ctypes printed and dropped that KeyboardInterrupt, the run
    went on, and a probe cut short cached widths it had not measured. Now the interrupt ends the probe."""
    from eagle3_gguf import exactness

    class Interrupted(exactness.ProbeCallback):
        calls = 0

        def _eval(self, t, ask, user_data):  # raises where a signal's handler would: before any line of the callback
            Interrupted.calls += 1
            if Interrupted.calls == 40:
                raise KeyboardInterrupt
            return super()._eval(t, ask, user_data)

    monkeypatch.setattr(exactness, "ProbeCallback", Interrupted)
    with load_pair(tiny_target, tiny_head, PairConfig(n_ctx=1024, n_threads=2)) as pair, pair.speculator() as spec:
        with pytest.raises(KeyboardInterrupt):
            spec.probe_exact(9)
        assert Interrupted.calls >= 40 and not list((tmp_path / "cache").rglob("*.json"))
        monkeypatch.setattr(exactness, "ProbeCallback", exactness.ProbeCallback)
        assert spec.probe_exact(9).source == "probed"  # and the hook is ctypes' own again
    assert list((tmp_path / "cache").rglob("*.json"))


def test_bad_mode():
    r = invoke("generate", "-p", "x", "--exact", "sometimes")
    assert r.exit_code == 2 and r.stderr == "error: --exact must be auto, strict, off (got sometimes)\n"
    with pytest.raises(Eagle3Error, match=r"^exact must be auto, strict, off \(got yes\)$"):
        DraftConfig(exact="yes")
