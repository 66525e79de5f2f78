"""scripts/emulate.py: a pair's llama.cpp calls padded to the prices a lent GPU measured (bench/scale-gpu)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import emulate
from eagle3_gguf.errors import Eagle3Error

ROOT = Path(__file__).resolve().parent.parent
H200 = ROOT / "bench" / "scale-gpu" / "results.json"


def h200(shape: str = "llama-8b") -> dict:
    return next(s for s in json.loads(H200.read_text())["shapes"] if s["shape"] == shape)


def test_prices_of_a_run_that_timed_each_width_after_another(tmp_path):
    """A run from before the warm curve (2026-11-27) timed every width after another: its curve is shifted down to
    the warm row (Parts), and the switch is what a row right after two rows cost beyond it."""
    data = json.loads(H200.read_text())
    for shape in data["shapes"]:
        del shape["physics"]["switch_ms"]
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    p = emulate.prices_of(path, "llama-8b:q4_k_m")
    ph = data["shapes"][0]["physics"]
    parts = ph["parts"]
    assert p.verify_ms[0] == pytest.approx(parts["target_row_ms"])
    assert p.verify_ms[4] - p.verify_ms[0] == pytest.approx(ph["verify_ms"][4] - ph["verify_ms"][0])
    assert p.first_ms == pytest.approx(parts["target_row_after_ms"] - parts["target_row_ms"]) and p.first_ms > 0.5
    assert p.head_decode_ms == parts["head_decode_ms"] and p.head_encode_ms == parts["head_encode_ms"]
    assert p.target(20) > p.target(17) > p.target(1)  # a prompt past the curve: along its last slope


def test_prices_of_a_run_with_a_warm_curve(tmp_path):
    data = json.loads(H200.read_text())
    data["shapes"][0]["physics"]["switch_ms"] = 0.25
    del data["shapes"][0]["physics"]["capture_ms"]  # the switch before the capture was measured apart (call 1)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    p = emulate.prices_of(path, "llama-8b:q4_k_m")
    assert p.verify_ms == data["shapes"][0]["physics"]["verify_ms"] and p.first_ms == 0.25 and p.capture_ms == 0.0


def test_prices_split_the_switch_into_the_first_call_and_the_capture(tmp_path):
    """The H200's switch (a width's first two verifies beyond two warm ones): the first call pays what a row right
    after two rows cost beyond a warm one, the second the rest (ggml-cuda's capture); or as the run measured them."""
    ph = h200()["physics"]
    p = emulate.prices_of(H200, "llama-8b:q4_k_m")
    assert p.first_ms == pytest.approx(ph["switch_ms"] - ph["capture_ms"]) and p.capture_ms == ph["capture_ms"]
    assert 0.5 < p.first_ms < p.capture_ms  # capturing 8B's graph costs more than running it uncaptured
    data = json.loads(H200.read_text())
    del data["shapes"][0]["physics"]["capture_ms"]
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    p = emulate.prices_of(path, "llama-8b:q4_k_m")
    first = ph["parts"]["target_row_after_ms"] - ph["parts"]["target_row_ms"]
    assert p.first_ms == pytest.approx(first) and p.capture_ms == pytest.approx(ph["switch_ms"] - first)


@pytest.mark.parametrize("spec", ["bench/scale-gpu/results.json", "bench/scale-gpu/results.json:gemma-9b:q4_0",
                                  "bench/nowhere.json:llama-8b:q4_k_m", "README.md:llama-8b:q4_k_m"])
def test_a_bad_emulation_is_one_line(spec):
    with pytest.raises(Eagle3Error) as e:
        emulate.parse(f"{ROOT}/{spec}")
    assert str(e.value).startswith("--emulate") and "\n" not in str(e.value)


@pytest.mark.parametrize("slowdown", [0.5, 0.0, float("nan"), float("inf")])
def test_a_bad_slowdown_is_one_line(slowdown):
    with pytest.raises(Eagle3Error) as e:
        emulate.parse(f"{H200}:llama-8b:q4_k_m", slowdown)
    assert str(e.value).startswith("--emulate-slowdown") and "\n" not in str(e.value)


def test_a_slowdown_scales_every_price_and_says_so():
    """A host slower than the GPU's emulates it in slow motion: each price (warm rows, switch, capture, the head's
    graphs) times the factor, and the source names it."""
    p, slow = emulate.prices_of(H200, "llama-8b:q4_k_m"), emulate.parse(f"{H200}:llama-8b:q4_k_m", 2.5)
    assert slow.prices == emulate.Prices([2.5 * t for t in p.verify_ms], 2.5 * p.first_ms, 2.5 * p.head_decode_ms,
                                         2.5 * p.head_encode_ms, 2.5 * p.head_switch_ms, 2.5 * p.capture_ms)
    assert slow.source.endswith(" x2.5") and emulate.parse(f"{H200}:llama-8b:q4_k_m").prices == p


def test_each_call_is_priced_as_the_gpu_ran_it():
    """A call of the shape before it costs the warm price; another shape (rows, or graph) adds the switch, and the
    target's second call of a shape in a row the capture."""
    prices = emulate.Prices([2.0, 3.0], 4.0, 0.5, 0.25, 1.0)
    target, head = emulate.Runner(prices, is_target=True), emulate.Runner(prices, is_target=False)
    assert [target.price("llama_decode", n) for n in (1, 1, 2, 2, 1, 4)] == [6.0, 2.0, 7.0, 3.0, 6.0, 9.0]
    cuda = emulate.Runner(emulate.Prices([2.0, 3.0], 1.0, 0.5, 0.25, 1.0, capture_ms=4.0), is_target=True)
    assert [cuda.price("llama_decode", n) for n in (1, 1, 1, 2, 1, 1, 1)] == [3.0, 6.0, 2.0, 4.0, 3.0, 6.0, 2.0]
    assert [head.price(g, n) for g, n in [("llama_encode", 2), ("llama_decode", 2), ("llama_decode", 1),
                                          ("llama_decode", 1)]] == [1.25, 1.5, 1.5, 0.5]


def test_a_call_spins_to_its_price():
    """The real call runs, then the runner waits out the rest of the price (never less: a busy machine only adds)."""
    run = emulate.Runner(emulate.Prices([2.0], 3.0, 0.5, 0.25, 1.0), is_target=True)
    ran = []

    def llama_decode(ctx, batch) -> int:
        ran.append(batch.n_tokens)
        return 0
    t = time.perf_counter()
    assert run(lambda graph, *a: graph(*a), llama_decode, "ctx", SimpleNamespace(n_tokens=1)) == 0
    assert 1e3 * (time.perf_counter() - t) >= 5.0 and ran == [1] and run.calls == 1


def test_the_spin_is_the_contexts_native_time():
    """The wait stands for the GPU's time: it goes to the context's native seconds beside the real call's, so that
    the statistics' Python (wall time less native) is this host's own, not the padding."""
    ctx = SimpleNamespace(t_native=0.0)

    def call(graph, *args) -> int:  # Context._call: the real call, timed into t_native
        t = time.perf_counter()
        rc = graph(*args)
        ctx.t_native += time.perf_counter() - t
        return rc
    run = emulate.Runner(emulate.Prices([2.0], 3.0, 0.5, 0.25, 1.0), is_target=True, ctx=ctx)
    t = time.perf_counter()
    run(call, lambda *a: 0, "ctx", SimpleNamespace(n_tokens=1))
    wall = time.perf_counter() - t
    assert 4.5e-3 <= ctx.t_native <= wall and wall - ctx.t_native < 1e-3  # 5 ms priced, as good as all of it native


def test_bench_scale_emulates_the_gpu_on_this_cpu(tmp_path, smollm2_path):
    """--emulate: the tiny pair's calls at the H200's 8B prices: the curve it measures is at least the H200's (the
    spin only adds time), the table says what it emulated, and the run keeps target-only's text. What it measured
    stays out of --work's cache, whose keys know the files and not the prices (a later run at other prices, or none,
    would price its policy by them)."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_scale.py"), "--tiny", "--profiles", "vllm-8b",
                        "--emulate", f"{H200}:llama-8b:q4_k_m", "--budget", "0.001", "--work", str(tmp_path / "work"),
                        "--tokenizer", str(smollm2_path), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    [shape] = json.loads((tmp_path / "out" / "results.json").read_text())["shapes"]
    ph, want = shape["physics"], emulate.prices_of(H200, "llama-8b:q4_k_m")
    assert all(got >= w - 0.01 for got, w in zip(ph["verify_ms"], want.verify_ms))
    assert ph["parts"]["head_decode_ms"] >= want.head_decode_ms - 0.01
    assert shape["emulated"].startswith(f"{H200}:llama-8b:q4_k_m; real calls past the emulated time: target ")
    assert "emulating" in (tmp_path / "out" / "results.md").read_text()
    assert all(o["identical"] == 1 for o in shape["outcomes"] if "--exact off" not in o["contender"])
    work = tmp_path / "work"
    assert not (work / "cache" / "costs").exists() and not list(work.glob("cache-emulated-*"))
