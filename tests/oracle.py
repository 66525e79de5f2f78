"""OracleSession: a head that drafts the target's true future tokens on a schedule of right/wrong."""

from __future__ import annotations

import dataclasses
import itertools

from eagle3_gguf.session import Draft, Eagle3Session


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

    def draft(self, id_last: int, n_max: int, judge=None, p_min: float = 0.0, sampler=None, n_alt: int = 0) -> Draft:
        if self.confident and judge is not None:
            policy_judge = judge
            judge = lambda confs, n: policy_judge([0.99] * len(confs), n)  # noqa: E731
        real = super().draft(id_last, n_max, judge, p_min, sampler, n_alt)
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
