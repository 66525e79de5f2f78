"""OracleSession: a head that drafts the target's true future tokens on a schedule of right/wrong; and
stated_costs: the cost curve a test fixes, so that the drafting policy's choices hang on it and on the tokens,
not on how busy the machine is."""

from __future__ import annotations

import dataclasses
import itertools

from eagle3_gguf.costs import CostCurve
from eagle3_gguf.draft import Draft
from eagle3_gguf.session import Eagle3Session

# What verifying 1..17 rows costs, in one-row units: SmolLM2 Q4_1 on 2 CPU cores (bench/NOTES.md: 2 rows
# 1.71x, 3 rows 2.12x, 5 rows 3.45x, 17 rows 7.4-8.3x), and a GPU's (17 rows cost about one)
CPU_ROWS = [1.0, 1.7, 2.1, 2.6, 3.1, 3.4, 3.7, 4.0, 4.3, 4.75, 5.2, 5.65, 6.1, 6.55, 7.0, 7.45, 7.9]
GPU_ROWS = [1.0 + 0.02 * n for n in range(17)]


def stated_costs(rows: list[float], draft_step: float, draft_fixed: float, row_s: float = 0.01) -> CostCurve:
    """A frozen curve (nothing learnt from timings) of `rows` (one-row units), a draft step and a drafting
    cycle's fixed cost (likewise), one row taking row_s seconds. Set it as a Runner's `spec.costs` before
    generating: the speculator calibrates only where it has no curve long enough for the run's drafts."""
    return CostCurve([row_s * c for c in rows], row_s * draft_step, row_s * draft_fixed, "given", frozen=True)


class OracleSession(Eagle3Session):
    """Runs the real head (so its KV moves as usual) but returns the target's own future tokens: the
    first `good` of each cycle right and the rest wrong, `good` cycling through a schedule, so that
    every acceptance length gets exercised."""

    def __init__(self, *args, truth: list[int], schedule: list[int], confident: bool = False, **kw):
        """confident: the drafting policy sees a top probability of 0.99 at every step (a head that is
        sure of itself, as one that agrees with the target would be)."""
        super().__init__(*args, **kw)
        self.truth = truth
        self.schedule = itertools.cycle(schedule)
        self.confident = confident

    def draft(self, id_last: int, n_max: int, judge=None, p_min: float = 0.0, sampler=None, n_alt: int = 0,
              native=None) -> Draft:
        if self.confident and judge is not None:
            policy_judge = judge
            judge = lambda confs, n: policy_judge([0.99] * len(confs), n)  # noqa: E731
            self.judge_sees = [0.99] * n_max
        real = super().draft(id_last, n_max, judge, p_min, sampler, n_alt, native)
        confs = [0.99] * len(real.confs) if self.confident else real.confs
        start = self.pending_pos + self.shift + 2  # id_last sits at target position pending_pos + shift + 1
        good = next(self.schedule)
        future = self.truth[start:start + len(real.tokens)]
        tokens = [t if i < good else (t + 1) % 49152 for i, t in enumerate(future)]
        return dataclasses.replace(real, tokens=tokens, confs=confs)


def lossless_runs(pair, prompt: list[int], config, schedule: list[int]):
    """Target-only, the pair's head, and an OracleSession on `schedule` (so drafts are accepted through the
    target's verify), each generating from `prompt`: (base, spec, oracle) RunResults to compare."""
    from eagle3_gguf.decode import Runner

    with Runner(pair.target) as plain:
        base = plain.generate(prompt, config, speculative=False)
    with Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
        spec = d.generate(prompt, config)
    with OracleSession(pair.target, pair.head, truth=prompt + base.tokens, schedule=schedule) as s, \
            Runner(pair.target, s) as d:
        oracle = d.generate(prompt, config)
    return base, spec, oracle
