"""A draft: what the head proposes in one cycle. The head's session makes it, the drafting policies judge its steps
and plan with it, draft trees are built from it: a module of its own, so that none of them imports another for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from .spec_sampling import Dist

CATCH_UP_WINDOW = 8  # rows the head keeps aside while the policy does not draft (scripts/bench.py measured it)


@dataclass(slots=True)
class Draft:
    """What one draft() made: the tokens to verify and what the head said at every step it ran (a step's
    token may be cut, so confs can be longer than tokens)."""

    tokens: list[int] = field(default_factory=list)
    confs: list[float] = field(default_factory=list)  # the head's top probability, one per step
    qs: list[Dist] = field(default_factory=list)  # q, one per step (drafts drawn from q; empty for argmax drafts)
    # draft(n_alt=m): each step's m runner-up tokens and their probabilities, best first (tree branches)
    alt_tokens: list[list[int]] = field(default_factory=list)  # [steps][m]
    alt_probs: list[list[float]] = field(default_factory=list)  # [steps][m]


def judge_p_min(confs: list[float], n_max: int, p_min: float) -> int:
    """Upstream's rule after draft step i = len(confs): stop and verify the first i - 1 drafts where the step's top
    probability fell under p_min, all i at n_max; else -1, draft another step."""
    i = len(confs)
    if confs[-1] < p_min:
        return i - 1
    return i if i >= n_max else -1
