"""How likely a draft is to be kept: P(draft accepted | earlier drafts accepted, the head's top probability) by draft
position (`Acceptance`), from counts in confidence bins with a prior (a calibrated head's confidence), pooled across
positions while a position has few counts; and the expected acceptance of a step not yet drafted (the running mean of
that estimate at each position), for planning ahead. `BranchAcceptance`: the same for a draft tree's runner-ups.
policy.py decides from them.
"""

from __future__ import annotations

from array import array

from .draft import NativeJudge
from .tree import DraftTree

N_BINS = 10  # confidence bins over [0, 1]
PRIOR_COUNT = 4.0  # pseudo-counts of each prior
LOOKAHEAD_EMA = 0.5  # weight of one draft step in a position's expected acceptance (stretches are short)


def _bin(conf: float) -> int:
    return min(int(conf * N_BINS), N_BINS - 1)


class Acceptance:
    """Online P(accept | position, confidence) and the expected acceptance of the next step. The counts are arrays of
    doubles (a list's speed in Python) that chain.c's judge reads and updates in place (native_judge)."""

    def __init__(self, k_max: int, lookahead_prior: float = 0.5):
        self.k_max = k_max
        mids = [(b + 0.5) / N_BINS for b in range(N_BINS)]
        self.pool_hits = array("d", [PRIOR_COUNT * m for m in mids])  # [N_BINS], prior: a calibrated head
        self.pool_seen = array("d", [PRIOR_COUNT] * N_BINS)
        self.hits = array("d", [0.0] * (k_max * N_BINS))  # [K_max * N_BINS]: position i's bins at i * N_BINS
        self.seen = array("d", [0.0] * (k_max * N_BINS))
        self.lookahead = array("d", [lookahead_prior] * k_max)  # [K_max]: expected acceptance of a step not yet drafted

    def prob(self, i: int, conf: float) -> float:
        """Chance that draft i (0-based) is accepted, given drafts 0..i-1 were, at this confidence."""
        b = _bin(conf)
        pooled = self.pool_hits[b] / self.pool_seen[b]
        at = i * N_BINS + b
        return (self.hits[at] + PRIOR_COUNT * pooled) / (self.seen[at] + PRIOR_COUNT)

    def native_judge(self, **kw) -> NativeJudge:
        """AdaptivePolicy.judge's rule over these arrays, for chain.c (kw: the policy's `done` and `changed`)."""
        return NativeJudge(hits=self.hits, seen=self.seen, pool_hits=self.pool_hits, pool_seen=self.pool_seen,
                           lookahead=self.lookahead, prior=PRIOR_COUNT, ema=LOOKAHEAD_EMA, **kw)

    def saw_step(self, i: int, p: float) -> None:
        """Draft step i was run and its estimate is p: move the position's expectation towards it."""
        self.lookahead[i] += LOOKAHEAD_EMA * (p - self.lookahead[i])

    def observe(self, confs: list[float], n_verified: int, n_accepted: int) -> None:
        """Drafts 0..n_verified-1 (confidences `confs`) were verified and the first n_accepted kept: each
        draft up to and including the first rejected one is an observation; later ones are not."""
        for i in range(min(n_accepted + 1, n_verified)):
            b = _bin(confs[i])
            ok = 1.0 if i < n_accepted else 0.0
            self.hits[i * N_BINS + b] += ok
            self.seen[i * N_BINS + b] += 1.0
            self.pool_hits[b] += ok
            self.pool_seen[b] += 1.0


class BranchAcceptance:
    """Online P(the target takes a runner-up token | its parent is reached), by the head's probability of it:
    the chance a draft tree's branch is kept (tree.py). Prior: the head's probability itself."""

    def __init__(self):
        mids = [(b + 0.5) / N_BINS for b in range(N_BINS)]
        self.hits = [PRIOR_COUNT * m for m in mids]  # [N_BINS]
        self.seen = [PRIOR_COUNT] * N_BINS

    def prob(self, p: float) -> float:
        b = _bin(p)
        return self.hits[b] / self.seen[b]

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        """The tree was verified and `path` kept: each branch whose parent was reached is an observation."""
        reached = {0, *path}
        for node in range(tree.chain + 1, len(tree.tokens)):
            parent = tree.parents[node]
            if parent in reached:
                b = _bin(tree.probs[node] / tree.probs[parent])
                self.hits[b] += node in path
                self.seen[b] += 1.0

