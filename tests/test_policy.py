"""The drafting policy on synthetic worlds (cost curves and acceptance it must discover); the cost curve's own tests
are in test_costs.py."""

from __future__ import annotations

import copy
from array import array
from typing import Callable

import numpy as np
import pytest

from eagle3_gguf.costs import CostCurve
from eagle3_gguf.policy import CHECK_MAX, CHECK_MIN, PROBE_MAX, PROBE_MIN, AdaptivePolicy, FixedPolicy


class World:
    """A head whose draft i is accepted with probability `accept` (given the earlier ones were), at a
    stated confidence, and a target whose verify of n rows takes costs[n - 1] seconds."""

    def __init__(self, costs: list[float], draft_step: float, accept: float, conf: float, seed: int = 0,
                 load: Callable[[float, float], tuple[float, float]] | None = None,
                 switch: tuple[float, float] = (0.0, 0.0)):
        """load: what a busy machine makes of a cycle's (verify, draft) seconds (None: an idle one); switch: what a
        verify of another row count than the last costs on top, and the next of that count (ggml-cuda's capture)."""
        self.costs, self.d, self.accept, self.conf = costs, draft_step, accept, conf
        self.rng = np.random.default_rng(seed)
        self.load = load
        self.switch, self.last, self.run_of = switch, 0, 0

    def cycle(self, policy, k_cap: int) -> tuple[int, float, int]:
        """One cycle under `policy`: (tokens emitted, seconds, drafts verified)."""
        k = policy.plan(k_cap)
        confs: list[float] = []
        j = 0
        if k > 0:
            while True:
                confs.append(self.conf)
                j = policy.judge(confs, k)
                if j >= 0:
                    break
        n_acc = 0
        while n_acc < j and self.rng.random() < self.accept:
            n_acc += 1
        t_verify, t_draft = self.costs[j], len(confs) * self.d
        self.run_of = self.run_of + 1 if j + 1 == self.last else 1
        self.last = j + 1
        t_verify += self.switch[0] if self.run_of == 1 else self.switch[1] if self.run_of == 2 else 0.0
        if self.load is not None:
            t_verify, t_draft = self.load(t_verify, t_draft)
        policy.observe(confs, j, n_acc, len(confs), t_verify, t_draft, n_acc + 1)
        return n_acc + 1, t_verify + t_draft, j

    def run(self, policy, k_cap: int, cycles: int) -> tuple[float, list[int]]:
        tokens, seconds, trace = 0, 0.0, []
        for _ in range(cycles):
            n, t, j = self.cycle(policy, k_cap)
            tokens, seconds = tokens + n, seconds + t
            trace.append(j)
        return tokens / seconds, trace

    def expected_rate(self, k: int) -> float:
        """Tokens per second of always drafting and verifying k."""
        tokens = 1 + sum(self.accept ** m for m in range(1, k + 1))
        return tokens / (self.costs[k] + k * self.d)


CPU = [1.0, 1.6, 2.0, 2.4, 2.45]  # SmolLM2 Q4_1 on 2 cores, in single-row units
GPU = [1.0, 1.02, 1.04, 1.06, 1.08]  # five rows cost about one
KNEE = [1.0, 1.05, 1.1, 3.0, 3.1]  # cheap up to 3 rows, then a cliff


def adaptive(costs: list[float], d: float, k: int = 4) -> AdaptivePolicy:
    policy = AdaptivePolicy(CostCurve(list(costs), d, source="given"), k)
    policy.begin()
    return policy


def test_nothing_pays_on_cpu_with_a_weak_head():
    world = World(CPU, 0.05, accept=0.35, conf=0.35)
    policy = adaptive(CPU, 0.05)
    rate, trace = world.run(policy, 4, 400)
    assert rate >= 0.97 * world.expected_rate(0)
    assert trace.count(0) >= 0.95 * len(trace)
    assert all(world.expected_rate(k) < world.expected_rate(0) for k in range(1, 5))  # the world is as claimed


def test_a_new_text_starts_with_a_probe():
    policy = adaptive(CPU, 0.05)
    assert policy.plan(4) == 4 and policy.probing  # it looks at the head's confidence first
    policy.observe([0.1], 0, 0, 1, CPU[0], 0.05, 1)
    assert policy.plan(4) == 0


def test_random_head_settles_on_plain_decoding_within_20_cycles():
    world = World(GPU, 0.02, accept=0.0, conf=0.01)  # even where verifying is free, a random head never pays
    policy = adaptive(GPU, 0.02)
    rate, trace = world.run(policy, 4, 300)
    assert max(trace[20:]) == 0
    assert policy.stats.probes <= 2 + 300 // 16  # it backs off while probes find nothing
    assert rate >= 0.97 * world.expected_rate(0)


def test_good_head_on_gpu_drafts_k_max():
    world = World(GPU, 0.02, accept=0.85, conf=0.9)
    policy = adaptive(GPU, 0.02)
    rate, trace = world.run(policy, 4, 300)
    assert trace.count(4) >= 0.9 * len(trace)
    best = max(world.expected_rate(k) for k in range(5))
    assert best == world.expected_rate(4) and rate >= 0.97 * best


def test_finds_the_knee():
    world = World(KNEE, 0.02, accept=0.95, conf=0.97)
    policy = adaptive(KNEE, 0.02)
    rate, trace = world.run(policy, 4, 400)
    rates = [world.expected_rate(k) for k in range(5)]
    assert int(np.argmax(rates)) == 2
    assert max(set(trace[100:]), key=trace[100:].count) == 2
    assert rate >= 0.97 * max(rates)


def test_confidence_decides_mid_draft():
    """A head that is sure of the first token and unsure of the rest: the draft stops after one step."""
    policy = adaptive(CPU, 0.02)
    for _ in range(200):  # teach it: confident drafts are accepted, unconfident ones are not
        policy.observe([0.95, 0.1], 2, 1, 2, CPU[2], 0.04, 2)
    assert policy.judge([0.95], 4) == -1
    assert policy.judge([0.95, 0.1], 4) == 1
    assert policy.judge([0.1], 4) == 0


def test_fixed_policy_is_upstreams_rule():
    fixed = FixedPolicy(3, p_min=0.5)
    assert fixed.plan(10) == 3 and fixed.plan(2) == 2
    assert fixed.judge([0.9], 3) == -1 and fixed.judge([0.9, 0.4], 3) == 1 and fixed.judge([0.9] * 3, 3) == 3


def test_probing_backs_off_to_the_cap():
    world = World(CPU, 0.05, accept=0.0, conf=0.9)  # confident and always wrong: every probe fails
    policy = adaptive(CPU, 0.05)
    world.run(policy, 4, 600)
    assert policy.probe_gap == PROBE_MAX



def test_a_probe_with_a_draft_accepted_still_backs_off_unless_drafting_pays():
    """A weak head gets a probe's first draft now and then; that alone does not make drafting pay on a CPU, so
    the probes keep backing off (each costs most of a target step)."""
    policy = adaptive(CPU, 0.05)
    assert policy.plan(4) == 4 and policy.probing
    policy.observe([0.4], 1, 1, 1, CPU[1], 0.05, 2)  # one draft verified and accepted
    assert policy.plan(4) == 0  # drafting does not pay ...
    assert policy.probe_gap == 2 * PROBE_MIN  # ... so the back-off grows instead of starting over
    good = adaptive(GPU, 0.02)  # where verifying is nearly free, the same probe makes drafting pay
    good.plan(4)
    good.observe([0.9], 1, 1, 1, GPU[1], 0.02, 2)
    assert good.probe_gap == PROBE_MIN and good.plan(4) == 4 and not good.probing


def test_back_off_carries_over_to_the_next_text():
    """Probes that found nothing in one text keep their back-off in the next; its first cycle still probes."""
    world = World(CPU, 0.05, accept=0.0, conf=0.9)
    policy = adaptive(CPU, 0.05)
    world.run(policy, 4, 600)
    policy.begin()
    assert policy.plan(4) == 4 and policy.probing
    policy.observe([0.9], 0, 0, 1, CPU[0], 0.05, 1)  # the probe found nothing
    _, trace = world.run(policy, 4, PROBE_MAX - 1)
    assert max(trace) == 0 and policy.stats.probes == 1


def test_the_head_reads_the_whole_prompt_only_where_drafting_pays():
    weak = adaptive(CPU, 0.05)
    World(CPU, 0.05, accept=0.0, conf=0.01).run(weak, 4, 100)
    assert not weak.wants_prompt()
    good = adaptive(GPU, 0.02)
    World(GPU, 0.02, accept=0.85, conf=0.9).run(good, 4, 100)
    assert good.wants_prompt()
    assert FixedPolicy(4, 0.5).wants_prompt()


def test_a_drafting_cycle_pays_its_fixed_cost():
    """Verifying is nearly free (GPU), but catching the head up costs as much as a target step: a head that
    is right 60% of the time does not pay for one draft, and does for four."""
    costs = CostCurve(list(GPU), 0.01, 1.0)
    one, four = AdaptivePolicy(costs, 1), AdaptivePolicy(CostCurve(list(GPU), 0.01, 1.0), 4)
    for policy in (one, four):
        policy.begin()
        policy.acc.lookahead[:] = array("d", [0.6] * policy.k_max)
        policy.probe_wait = PROBE_MAX  # past the first cycle's probe
    assert one.plan(1) == 0 and not one.probing and four.plan(4) == 4


def test_a_change_of_width_is_paid_where_it_happens():
    """A GPU's warm rows are nearly free, but a verify of another width than the last decode's pays a switch (0.3 of a
    row: ggml-cuda's graph captured again). After a plain cycle, an unsure draft is not worth leaving one row for; the
    same draft after a 3-row verify is verified whole, since stopping early would change the width too."""
    def policy(last_rows: int, switch: float = 0.3) -> AdaptivePolicy:
        p = AdaptivePolicy(CostCurve([1.0, 1.05, 1.1], 0.01, source="given", frozen=True, switch_s=switch), 2)
        p.begin()
        for _ in range(200):  # teach it: drafts at confidence 0.25 are right a quarter of the time
            p.observe([0.25, 0.25], 2, 0, 2, 1.1, 0.02, 1)
            p.observe([0.25, 0.25], 2, 2, 2, 1.1, 0.02, 3)
            p.observe([0.25, 0.25], 2, 0, 2, 1.1, 0.02, 1)
            p.observe([0.25, 0.25], 2, 0, 2, 1.1, 0.02, 1)
        p.last_rows = last_rows
        return p

    assert policy(1).judge([0.25], 2) == 0  # one row, as the last cycle: no switch
    assert policy(3).judge([0.25], 2) == -1  # drafting on to 3 rows, the last cycle's width, costs less than 1 row
    assert policy(3).judge([0.25, 0.25], 2) == 2
    assert policy(1, 0.0).judge([0.25], 2) == policy(3, 0.0).judge([0.25], 2)  # without a switch: the curve's alone


def test_the_switch_is_learnt_apart_from_the_rows():
    """A plain cycle right after a drafting one pays the switch: its warm time moves the curve's scale, not the
    switch it paid (nor does a verify of rows after plain cycles move that row count's price)."""
    p = AdaptivePolicy(CostCurve([1.0, 1.2, 1.4], 0.01, source="given", switch_s=0.5), 2)
    p.begin()
    p.observe([0.9, 0.9], 2, 2, 2, 1.4 + 0.5, 0.02, 3)  # the first cycle after the prompt: a switch
    p.observe([0.9, 0.9], 2, 2, 2, 1.4, 0.02, 3)  # the same width again: warm
    p.observe_plain(1.0 + 0.5)  # back to one row: a switch
    p.observe_plain(1.0)
    assert p.costs.scale == pytest.approx(1.0) and p.costs.verify(3) == pytest.approx(1.4)
    p.observe_plain(1.5)  # one row after one row, yet 1.5: the machine is slower
    assert p.costs.scale > 1.1


def test_the_capture_is_paid_by_the_second_verify_of_a_width():
    """ggml-cuda runs a changed graph uncaptured once and captures it on the next call of that shape (8B on an H200:
    +1.3 ms, then +4.4 ms, on a 3.9 ms row). The second verify's capture is the switch's, not the width's: a policy
    that learnt it as the rows' price stopped drafting on the H200 (9 of 629 cycles) where a frozen curve drafted
    every cycle."""
    curve = CostCurve([1.0, 1.2, 1.4], 0.01, source="given", switch_s=1.5, capture_s=1.1)
    p = AdaptivePolicy(curve, 2)
    p.begin()
    p.observe([0.9, 0.9], 2, 2, 2, 1.4 + 0.4, 0.02, 3)  # 3 rows after the prompt: the first share
    p.observe([0.9, 0.9], 2, 2, 2, 1.4 + 1.1, 0.02, 3)  # again: the capture
    p.observe([0.9, 0.9], 2, 2, 2, 1.4, 0.02, 3)  # warm
    assert p.costs.verify(3) == pytest.approx(1.4)
    p.observe_plain(1.0 + 0.4)
    p.observe_plain(1.0 + 1.1)
    p.observe_plain(1.0)
    assert p.costs.scale == pytest.approx(1.0) and p.costs.verify(3) == pytest.approx(1.4)
    assert p.run == 3 and p.finish_stats().capture_cost == pytest.approx(1.1)
    # what is learnt keeps at least a quarter of a timing (a switch priced above what one costs must not make a verify
    # look free); a warm verify is learnt as it is
    assert p._warm(1.2, 2) == pytest.approx(0.3) and p._warm(2.0, 2) == pytest.approx(0.9) and p._warm(2.0, 3) == 2.0


def test_a_width_verified_once_is_priced_with_the_capture_to_come():
    """After one verify of a new width the next one of it still pays the capture: the prices say so, and the other
    widths pay the whole switch."""
    p = AdaptivePolicy(CostCurve([1.0, 1.2, 1.4], 0.01, source="given", frozen=True, switch_s=1.5, capture_s=1.1), 2)
    p.begin()
    p.observe([0.9, 0.9], 2, 2, 2, 0.0, 0.0, 3)
    assert p._prices() == pytest.approx([2.5, 2.7, 1.4 + 1.1])
    p.observe([0.9, 0.9], 2, 2, 2, 0.0, 0.0, 3)
    assert p._prices() == pytest.approx([2.5, 2.7, 1.4])


def test_each_row_count_learns_its_own_verify_cost():
    """Verifying two rows in a drafting cycle costs more than the back-to-back calibration says (the head ran
    just before): the refined curve takes the real figure for two rows and keeps one row's, and a row count
    not seen since is priced at least like the largest one below it."""
    curve = CostCurve([1.0, 1.36, 1.7, 2.0, 2.5], 0.05)
    for _ in range(40):
        curve.observe_verify(1, 1.0)
    for _ in range(14):
        curve.observe_verify(2, 1.9)
    assert curve.verify(1) == pytest.approx(1.0, rel=0.02)
    assert curve.verify(2) == pytest.approx(1.9, rel=0.05)  # the calibration still counts a little
    assert curve.relative()[2] == curve.relative()[1]  # three rows, calibrated at 1.7, never seen
    assert curve.relative()[3] == pytest.approx(2.0, rel=0.03)


def test_drafting_stops_when_real_verifies_cost_more_than_calibrated():
    """Calibrated while the machine was busy (one row at 1.7 steps) and with two rows too cheap against
    one, a draft of a head right 45% of the time pays (1.45 tokens for 2.06 busy steps against 1 token
    for 1.7). In real cycles one row costs 1 step and two rows 1.6, and it does not pay. Two-row timings
    alone would leave one row's price at 1.7: the policy times a plain cycle now and then, learns both,
    and decodes plainly at target-only speed, probing now and then."""
    world = World(CPU, 0.02, accept=0.45, conf=0.45, seed=3)
    policy = AdaptivePolicy(CostCurve([1.7, 2.04, 2.55, 3.06, 3.57], 0.02 * 1.7, source="given"), 4)
    policy.begin()
    rate, trace = world.run(policy, 4, 300)
    assert sum(j > 0 for j in trace[100:]) <= 3, trace
    assert rate >= 0.97 / CPU[0]
    assert policy.costs.verify(1) == pytest.approx(1.0, rel=0.02)


def test_drafting_times_a_plain_cycle_now_and_then():
    """Where drafting pays every cycle, a plain cycle comes after CHECK_MIN drafting cycles, and the gap
    doubles up to CHECK_MAX while one row costs what the curve says."""
    world = World(GPU, 0.02, accept=0.95, conf=0.95, seed=1)
    policy = adaptive(GPU, 0.02)
    _, trace = world.run(policy, 4, 2000)
    plain = [i for i, j in enumerate(trace) if j == 0]
    assert 1 <= len([i for i in plain if i < 3 * CHECK_MIN]) <= 3
    assert len(plain) <= 3 + 2000 // CHECK_MAX + 6, plain
    assert max(b - a for a, b in zip(plain, plain[1:])) == CHECK_MAX + 1


def test_a_plain_streak_learns_what_cycle_by_cycle_learning_would():
    """Where nothing can pay even at plain decoding's own rate, plan() runs the plain cycles up to the next
    probe's catch-up window as a streak and learns their timings at its end: the same cycles are plain,
    rows are kept for the same cycles, the probe comes at the same cycle, and the costs, rate and
    statistics come out exactly as learning cycle by cycle would leave them."""
    rng = np.random.default_rng(1)
    times = list(CPU[0] * (1.0 + 0.2 * rng.random(200)))  # plain cycles of varying speed
    runs = []
    class CycleByCycle(AdaptivePolicy):
        def _streak_length(self) -> int:
            return 0

    for streaks in (True, False):
        policy = (AdaptivePolicy if streaks else CycleByCycle)(CostCurve(list(CPU), 0.05, source="given"), 4)
        policy.begin()
        policy.probe_gap = policy.probe_wait = PROBE_MAX  # past the first probe, backed off
        plan = []
        for t in times:
            k = policy.plan(4)
            plan.append((k, policy.keep_rows, policy._deferring))
            if k:
                policy.observe([0.05], 0, 0, 1, t, 0.05, 1)  # the probe finds nothing
            else:
                policy.observe_plain(t)
        st = policy.finish_stats()
        runs.append(([(k, keep) for k, keep, _ in plan], policy.costs.scale, policy.rate,
                     policy.costs.now_s, st.chosen, st.trace, st.predicted_s, st.probes))
        if streaks:
            assert sum(d for _, _, d in plan) >= 0.7 * len(times)  # most cycles were in a streak
    assert runs[0] == runs[1]
    keeps = [i for i, (k, keep) in enumerate(runs[0][0]) if keep]
    probes = [i for i, (k, _) in enumerate(runs[0][0]) if k]
    assert probes and all(i - 8 in keeps for i in probes if i >= 8)  # the window opens 8 cycles before a probe


# -- a frozen curve: costs as given, whatever the machine's timings ------------------------------------

def busy(seed: int) -> Callable[[float, float], tuple[float, float]]:
    """A loaded machine: verifies 3-30x as slow as the curve says, at random, and draft steps 500x."""
    rng = np.random.default_rng(seed)
    return lambda t_verify, t_draft: (t_verify * rng.uniform(3.0, 30.0), 500.0 * t_draft)


def test_a_frozen_curve_learns_nothing_from_timings():
    curve = CostCurve([1.0, 1.36, 1.7], 0.05, 0.1, "given", frozen=True)
    before = copy.deepcopy(curve)
    curve.observe_verify(1, 9.0)
    curve.observe_verify(3, 9.0)
    curve.observe_draft(2, 9.0)
    assert curve == before and curve.verify(1) == 1.0 and curve.relative()[2] == 1.7


def test_a_frozen_policy_chooses_alike_at_any_timing():
    """On a frozen curve wildly slow and noisy timings leave every choice, the curve and the rate as at the
    stated costs (the policy prices each cycle by the curve), and it times no plain cycle while drafting
    pays: a good head on a GPU's curve drafts K every cycle. The same timings mostly stop a learning one."""
    runs = {}
    for frozen, machine in [(True, "idle"), (True, "busy"), (False, "busy")]:
        policy = AdaptivePolicy(CostCurve(list(GPU), 0.02, 0.05, "given", frozen=frozen), 4)
        policy.begin()
        world = World(GPU, 0.02, accept=0.85, conf=0.9, seed=2, load=busy(1) if machine == "busy" else None)
        _, trace = world.run(policy, 4, 300)
        runs[frozen, machine] = (trace, policy.costs, policy.rate, policy.stats)
    assert runs[True, "busy"] == runs[True, "idle"]
    trace, costs, rate, stats = runs[True, "busy"]
    assert trace == [4] * 300 and stats.plain_cycles == 0
    assert costs.now_s == GPU and costs.scale == 1.0 and costs.draft_fixed_s == 0.05
    assert 1.0 / GPU[0] < rate < 5.0 / (GPU[4] + 0.05 + 4 * 0.02)  # tokens per second of the curve's cycles
    learnt = runs[False, "busy"][0]
    assert learnt.count(4) < 0.5 * len(learnt), learnt  # a learning policy finds drafting 500x dearer


def test_a_frozen_policy_decodes_plainly_alike_at_any_timing():
    """A weak head on a CPU's frozen curve: the same plain cycles (streaks included) and probes on a busy
    machine as on an idle one."""
    runs = []
    for load in (None, busy(3)):
        policy = AdaptivePolicy(CostCurve(list(CPU), 0.05, source="given", frozen=True), 4)
        policy.begin()
        _, trace = World(CPU, 0.05, accept=0.35, conf=0.35, seed=4, load=load).run(policy, 4, 400)
        runs.append((trace, policy.stats, policy.rate, policy.probe_gap))
    assert runs[0] == runs[1]
    trace, stats = runs[0][:2]
    assert trace.count(0) >= 0.95 * len(trace) and stats.probes >= 4


def test_a_draft_step_is_priced_as_the_loop_pays_it():
    """Calibration times warm drafts repeated; in the loop a step follows the target's graph and costs more (an
    H200 at 8B's head: 0.52 ms against 0.43). The steps after a draft's first, timed apart, price a step (the
    calibration counting as two timings); the first step and the catch-up stay the fixed cost. A tree's draft is
    not timed apart: it moves the fixed cost alone."""
    curve = CostCurve(list(GPU), 0.02, 0.05, "measured")
    assert curve.step_s == 0.02
    for _ in range(200):
        curve.observe_draft(3, 0.05 + 3 * 0.06, 2 * 0.06)
    assert curve.step_s == pytest.approx(0.06, rel=1e-4) and curve.draft_fixed_s == pytest.approx(0.05, rel=1e-3)
    assert curve.draft_step_s == 0.02  # the calibration, as cached
    tree = CostCurve(list(GPU), 0.02, 0.05, "measured")
    for _ in range(200):
        tree.observe_draft(3, 0.05 + 3 * 0.06)
    assert tree.step_s == 0.02 and tree.draft_fixed_s == pytest.approx(0.05 + 3 * 0.04, rel=1e-3)


@pytest.mark.parametrize("seed", range(4))
def test_a_policy_that_times_its_steps_drafts_the_length_that_pays(seed):
    """Nearly free verify rows, and draft steps that cost the loop 40 times the calibration's: one draft pays most.
    Timed apart, the steps are priced so and the policy drafts one; priced at the calibration, with the rest learnt as
    the fixed cost of any drafting cycle, one draft looks as dear as four and it decodes plainly instead."""
    curve, d_loop = [1.0, 1.02, 1.04, 1.06, 1.08], 0.4
    traces = {}
    for timed in (False, True):
        world = World(curve, d_loop, accept=0.6, conf=0.6, seed=seed)
        assert max(range(5), key=world.expected_rate) == 1
        policy = AdaptivePolicy(CostCurve(list(curve), 0.01, 0.0, "given"), 4)
        policy.begin()
        trace = []
        for _ in range(400):
            k = policy.plan(4)
            confs, j = [], 0
            if k > 0:
                while (j := policy.judge(confs := confs + [world.conf], k)) < 0:
                    pass
            n_acc = 0
            while n_acc < j and world.rng.random() < world.accept:
                n_acc += 1
            steps = len(confs)
            policy.observe(confs, j, n_acc, steps, curve[j], steps * d_loop, n_acc + 1,
                           t_steps=(steps - 1) * d_loop if timed and steps else None)
            trace.append(j)
        traces[timed] = trace[200:]
    assert traces[True].count(1) >= 190, traces[True]
    assert traces[False].count(1) < 20, traces[False]


@pytest.mark.parametrize("seed", range(4))
def test_a_check_lets_the_policy_move_to_the_width_that_pays_where_a_change_of_width_is_dear(seed):
    """While drafting pays, a plain cycle now and then times one row (a check). Where a change of width costs more than
    a cycle gains (8B on an H200: a 4.8-8.5 ms switch), a policy kept the width it first drafted at (a probe's, with
    its first estimates), and pricing the return from a check as a change stopped drafting for good after the first
    check where the switch outweighs a cycle's gain. The cycle after a check prices every width warm: here the first
    drafts are 4 (a confident head), the widths that pay most warm 2 and 3, and the policy moves there at a check."""
    costs, switch = [1.0, 1.1, 1.3, 1.5, 1.7], (0.5, 1.5)
    world = World(costs, 0.1, accept=0.75, conf=0.95, seed=seed, switch=switch)
    assert [round(world.expected_rate(k), 2) for k in range(5)] == [1.0, 1.46, 1.54, 1.52, 1.45]
    policy = AdaptivePolicy(CostCurve(list(costs), 0.1, 0.0, "given", switch_s=sum(switch), capture_s=switch[1]), 4)
    policy.begin()
    _, trace = world.run(policy, 4, 400)
    assert trace[:8] == [4] * 8 and trace[8] == 0, trace  # the first check after CHECK_MIN drafting cycles
    assert trace[-100:].count(4) == 0 and trace[-100:].count(0) <= 2, trace


def test_the_warm_prices_after_a_check_last_one_cycle_whatever_decides_it():
    """The cycle after a check is priced warm once, whether plan() or a lookup draft decides it (the loop asks for a
    lookup before plan(): a run of copies after a check must pay the switch again from its second cycle)."""
    from eagle3_gguf.lookup import Lookup

    curve = CostCurve([1.0, 1.1, 1.2, 1.3, 1.4], 0.02, 0.05, "given", switch_s=2.0, capture_s=1.5)
    policy = AdaptivePolicy(curve, 4, lookup_max=4)
    policy.begin()
    world = World(curve.verify_s, 0.02, accept=0.9, conf=0.9, seed=5, switch=(0.5, 1.5))
    while policy.stats.plain_cycles == 0:
        world.cycle(policy, 4)  # draft until the first check's plain cycle
    assert policy.stats.trace[-1] == 0 and policy._prices() == curve.now_s  # the next cycle: every width warm
    for _ in range(3):
        j = policy.lookup(Lookup([1, 2, 3, 4], 4), 4)
        policy.observe_lookup(4, j, j, curve.verify_s[j], j + 1)
        assert policy._prices() != curve.now_s  # the switch priced again
