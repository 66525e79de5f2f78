"""OracleSession: a head that drafts the target's true future tokens on a schedule of right/wrong."""

from __future__ import annotations

import itertools

from eagle3_gguf.session import Eagle3Session


class OracleSession(Eagle3Session):
    """Runs the real head (so its KV moves as usual) but returns the target's own future tokens: the
    first `good` of each cycle right and the rest wrong, `good` cycling through a schedule, so that
    every acceptance length gets exercised."""

    def __init__(self, *args, truth: list[int], schedule: list[int], **kw):
        super().__init__(*args, **kw)
        self.truth = truth
        self.schedule = itertools.cycle(schedule)

    def draft(self, id_last: int, n_max: int, judge=None, p_min: float = 0.0) -> list[int]:
        real = super().draft(id_last, n_max, judge, p_min)
        start = self.pending_pos + 2  # id_last sits at pending_pos + 1
        good = next(self.schedule)
        future = self.truth[start:start + len(real)]
        return [t if i < good else (t + 1) % 49152 for i, t in enumerate(future)]
