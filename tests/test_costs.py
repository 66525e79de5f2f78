"""The cost curve (costs.py): its cache per set-up, and what `measure` makes of timed verifies and drafts."""

from __future__ import annotations

import json
import math

import pytest

from eagle3_gguf.costs import CostCurve, CostKey, load_costs, measure, save_costs


@pytest.fixture
def key(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_GGUF_CACHE", str(tmp_path / "cache"))
    target, head = tmp_path / "t.gguf", tmp_path / "h.gguf"
    target.write_bytes(b"target")
    head.write_bytes(b"head")
    return CostKey.for_files(target, head, 2, "kv 1/30", 512)


def test_cost_cache_round_trip(key):
    curve = CostCurve([0.01, 0.016, 0.02], 0.001, switch_s=0.003, capture_s=0.001)
    save_costs(key, curve)
    got = load_costs(key, 2)
    assert got.verify_s == curve.verify_s and got.draft_step_s == curve.draft_step_s and got.source == "cache"
    assert got.switch_s == 0.003 and got.capture_s == 0.001
    assert load_costs(key, 3) is None  # too short for a larger K: measure again


@pytest.mark.parametrize("damage", ["garbage", "nan", "negative", "other key", "old version", "capture past switch"])
def test_cost_cache_is_never_trusted_blindly(key, damage):
    save_costs(key, CostCurve([0.01, 0.016, 0.02], 0.001))
    path = key.path()
    data = json.loads(path.read_text())
    if damage == "garbage":
        path.write_text('{"version": 1, "key": ')
    else:
        if damage == "nan":
            data["verify_s"][1] = math.nan
        elif damage == "negative":
            data["draft_step_s"] = -1.0
        elif damage == "other key":
            data["key"]["n_threads"] = 3
        elif damage == "old version":
            data["version"] = 0
        elif damage == "capture past switch":  # a share of the switch cannot exceed it
            data["switch_s"], data["capture_s"] = 0.001, 0.002
        path.write_text(json.dumps(data))
    assert load_costs(key, 2) is None


def test_a_changed_file_is_a_new_key(key, tmp_path):
    save_costs(key, CostCurve([0.01, 0.016], 0.001))
    (tmp_path / "t.gguf").write_bytes(b"target, requantized")
    assert load_costs(CostKey.for_files(tmp_path / "t.gguf", tmp_path / "h.gguf", 2, "kv 1/30", 512), 1) is None


def test_another_cpu_model_is_a_new_key(key, tmp_path, monkeypatch):
    """A home directory that moved to another machine with the same CPU features measures again."""
    import eagle3_gguf.costs as costs

    assert costs.cpu_model() in key.machine
    save_costs(key, CostCurve([0.01, 0.016], 0.001))
    monkeypatch.setattr(costs, "cpu_model", lambda: "Another CPU")
    other = CostKey.for_files(tmp_path / "t.gguf", tmp_path / "h.gguf", 2, "kv 1/30", 512)
    assert other.machine != key.machine and load_costs(other, 1) is None


def test_measure_takes_warm_costs_and_prices_a_change_of_shape_apart():
    """Each size is timed 3 times in a row: the first call after another size pays a rebuild (0.3), the second a
    capture (0.1, as ggml-cuda's), later ones are warm. The curve is the warm costs (the least-disturbed call: a
    disturbed one is left out) kept monotone, the switch what the first two calls cost beyond two warm ones."""
    calls = []

    def verify(n: int) -> float:
        same = [m == n for m in reversed(calls)]
        run = next((i for i, x in enumerate(same) if not x), len(same))  # calls of n just before this one
        calls.append(n)
        disturbed = 5.0 if len(calls) == 6 else 0.0  # the first run's warm call of two rows
        return {1: 1.0, 2: 1.5, 3: 1.4}[n] + (0.3 if run == 0 else 0.1 if run == 1 else 0.0) + disturbed

    curve = measure(verify, lambda steps: 0.1 * steps, 2)
    assert curve.verify_s == [1.0, 1.5, 1.5] and curve.switch_s == pytest.approx(0.4)
    assert curve.capture_s == pytest.approx(0.1)  # the second call's share
    assert curve.draft_step_s == pytest.approx(0.1) and curve.draft_fixed_s == pytest.approx(0.0, abs=1e-12)
    assert calls[:9] == [1, 1, 1, 2, 2, 2, 3, 3, 3] and len(calls) == 27  # 3 runs of 3 a size, the sizes in turn


def test_a_cpu_curve_has_a_switch_only_where_a_change_costs():
    """Where repeating a shape costs nothing less (no graph to rebuild), the switch is 0."""
    curve = measure(lambda n: 1.0 + 0.5 * (n - 1), lambda steps: 0.1 * steps, 3)
    assert curve.switch_s == 0.0 and curve.capture_s == 0.0 and curve.verify_s == [1.0, 1.5, 2.0, 2.5]


def test_measure_times_long_drafts_sparsely():
    """Past DENSE_ROWS rows (lookup drafts up to 16) every 4th size down from the last is timed, the rest lie
    on the line between them."""
    calls = []

    def verify(n: int) -> float:
        calls.append(n)
        return 1.0 + 0.25 * (n - 1) + (1.0 if n == 13 else 0.0)

    curve = measure(verify, lambda steps: 0.1 * steps, 16, reps=1)
    assert sorted(set(calls)) == [*range(1, 10), 13, 17] and len(calls) == 3 * 11
    want = [1.0 + 0.25 * (n - 1) for n in range(1, 18)]
    want[9:13] = [3.0 + 0.5 * i for i in range(1, 5)]  # 10..13 rows: from 9 (3.0) to 13 (4.0 + 1.0)
    want[13:16] = [5.0] * 3  # 14..16: between 13 and 17 (5.0), never below 13 rows
    assert curve.verify_s == pytest.approx(want) and len(curve.verify_s) == 17
