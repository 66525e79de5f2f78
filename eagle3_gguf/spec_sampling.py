"""Speculative sampling at temperature > 0: the math of drafting from q and verifying against p.

Two verification rules, both exact (every emitted token is distributed as target-only sampling):

- "match" (upstream llama.cpp's rule): the head drafts its argmax; at each verify row the target samples
  its own token from p and the draft is kept only where the two are equal. A draft d is kept with
  probability p(d).
- "rejection" (Leviathan et al. 2023; Chen et al. 2023): the head drafts d ~ q, its own distribution;
  d is kept with probability min(1, p(d) / q(d)); at the first rejection the cycle's token is drawn from
  the residual norm(max(0, p - q)); after a full accept the bonus token is drawn from p. A draft is kept
  with probability sum_x min(p(x), q(x)) = 1 - TV(p, q), which beats p(argmax q) when q is calibrated
  (close to p) and p is flat, and loses when q is flatter than p (it then drafts tokens the target
  rarely wants). So q's temperature is a knob of its own: `draft_scale` multiplies the target's
  temperature for q (1: the same transform as p; < 1: sharper; 0: the argmax, which accepts exactly as
  often as "match"). Any q is exact as long as the drafts are drawn from the very q used to verify.

p and q are the same closed-form chain as llama.cpp's sampler (`Transform`: top-k → top-p → min-p →
temperature), p over the target's logits row, q over the head's logits restricted to its draft vocab
(the pinned graph scatters them into the target vocab through d2t; -inf elsewhere, so q is zero there).
One seeded random stream serves the drafts, the accept tests and the residual/bonus draws, in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .errors import Eagle3Error

SPEC_SAMPLING = ("rejection", "match")


@dataclass
class Dist:
    """A distribution over token ids with finite support, most probable first."""

    ids: np.ndarray  # [m] int64: token ids
    probs: np.ndarray  # [m] float64: their probabilities (> 0, summing to 1)

    def sample(self, u: float) -> int:
        """The token at cumulative probability u (u uniform in [0, 1): a draw)."""
        j = int(np.searchsorted(np.cumsum(self.probs), u, side="right"))
        return int(self.ids[min(j, self.ids.size - 1)])

    def prob(self, token: int) -> float:
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[0]]) if hit.size else 0.0

    def at(self, tokens: np.ndarray) -> np.ndarray:
        """Probabilities of many tokens.  # tokens: [n] -> [n]"""
        order = np.argsort(self.ids, kind="stable")
        ids = self.ids[order]  # [m], ascending
        j = np.minimum(np.searchsorted(ids, tokens), ids.size - 1)  # [n]
        return np.where(ids[j] == tokens, self.probs[order][j], 0.0)


def one_hot(token: int) -> Dist:
    return Dist(np.array([token], np.int64), np.ones(1))


@dataclass(frozen=True)
class Transform:
    """llama.cpp's sampling chain in closed form: top-k → top-p → min-p (all at temperature 1) → temperature.
    top_k <= 0, top_p >= 1 and min_p <= 0 switch a stage off, as in llama.cpp."""

    temperature: float
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05

    def __post_init__(self) -> None:
        if not self.temperature > 0.0:
            raise Eagle3Error(f"a sampling distribution needs a temperature > 0 (got {self.temperature})")

    def dist(self, logits: np.ndarray, ids: np.ndarray | None = None, scale: float = 1.0) -> Dist:
        """The distribution of a logits row at temperature * scale (scale 0: the top token).
        `ids` maps positions of `logits` to token ids (None: the positions are the ids); entries of -inf
        (outside a head's draft vocab) get probability 0.  # logits: [m], ids: [m]"""
        n = logits.size
        k = min(self.top_k, n) if self.top_k > 0 else n
        cand = top_k(logits, k)  # [k], descending
        if scale <= 0.0:
            return one_hot(int(cand[0] if ids is None else ids[cand[0]]))
        z = logits[cand].astype(np.float64)  # [k]
        p = np.exp(z - z[0])  # [k]
        p /= p.sum()
        keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1) if self.top_p < 1.0 else k
        keep = max(1, min(keep, k))
        keep = max(1, int(np.sum(p[:keep] >= self.min_p * p[0])))
        keep = min(keep, int(np.count_nonzero(p[:keep] > 0.0)) or 1)  # -inf logits never make the cut
        z = z[:keep] / (self.temperature * scale)
        q = np.exp(z - z[0])  # [keep]
        q /= q.sum()
        cand = cand[:keep]
        return Dist((cand if ids is None else ids[cand]).astype(np.int64), q)


def top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest logits, largest first.  # logits: [n] -> [k]
    A full partition of a 49k-row costs ~0.5 ms; the k largest lie within a few units of the maximum,
    so the partition runs over the rows above a threshold (widened until k are in)."""
    n = logits.size
    if k >= n:
        cand = np.arange(n)
    else:
        cand = None
        top = float(logits.max())
        for width in (8.0, 16.0, 32.0, 64.0):
            above = np.flatnonzero(logits >= top - width)  # [m]
            if above.size >= k:
                m = above.size
                cand = above if m == k else above[np.argpartition(logits[above], m - k)[m - k:]]
                break
        if cand is None:
            cand = np.argpartition(logits, n - k)[n - k:]
    return cand[np.argsort(-logits[cand], kind="stable")]


def residual(p: Dist, q: Dist) -> Dist:
    """norm(max(0, p - q)): where the cycle's token comes from after a rejection. Its support lies in
    p's. Where p <= q everywhere on p's support (p == q, up to rounding) a rejection cannot happen; p
    is returned then."""
    r = np.maximum(p.probs - q.at(p.ids), 0.0)  # [m_p]
    total = r.sum()
    if not total > 0.0:
        return p
    keep = r > 0.0
    return Dist(p.ids[keep], r[keep] / total)


@dataclass
class SamplingCounts:
    """What one run's verification did, by outcome."""

    accepted: int = 0  # drafts kept
    rejected: int = 0  # cycles ended by a rejection (their token drawn from the residual)
    bonus: int = 0  # cycles whose last token was drawn from p (no draft left to verify)


@dataclass
class RejectionSampler:
    """Speculative sampling for one generation: the target's transform, q's temperature scale and the
    one random stream that draws the drafts, the accept tests and the residual or bonus tokens."""

    transform: Transform
    draft_scale: float
    rng: np.random.Generator

    def __post_init__(self) -> None:
        if self.draft_scale < 0.0:
            raise Eagle3Error(f"the draft temperature scale cannot be negative (got {self.draft_scale})")
        self.counts = SamplingCounts()

    def draft(self, logits: np.ndarray, ids: np.ndarray | None = None) -> tuple[int, Dist]:
        """A draft token drawn from the head's q, and q.  # logits: [m] (the head's), ids: [m]"""
        q = self.transform.dist(logits, ids, self.draft_scale)
        if q.ids.size == 1:  # one-hot (scale 0, or one token left by the cuts): nothing to draw
            return int(q.ids[0]), q
        return q.sample(self.rng.random()), q

    def target(self, logits: np.ndarray) -> Dist:
        """p: the target's distribution at a verify row.  # logits: [n_vocab]"""
        return self.transform.dist(logits)

    def pick(self, logits: np.ndarray) -> int:
        """A token drawn from p at a draft tree's node.  # logits: [n_vocab]
        A tree holds the head's likeliest tokens, fixed before verification, not draws from q. For fixed
        proposals the recursive rejection rule (SpecInfer's: accept child c with its probability under the
        residual, take c out of it, try the next) keeps a child exactly when it is a draw from p, so the walk
        keeps the target's own sample where it is a child: the same acceptance, with one draw per node."""
        return self.target(logits).sample(self.rng.random())

    def verify(self, drafts: Sequence[int], qs: Sequence[Dist], row_logits: Callable[[int], np.ndarray],
               stop: Callable[[int], bool] | None = None) -> list[int]:
        """The tokens a cycle emits: the accepted drafts, then the token drawn at the first rejection
        (from the residual) or after the last draft (from p). Verify row i holds the target's logits
        after drafts[:i]; `stop(token)` ends the cycle at an accepted draft (an end of generation).
        drafts[i] must have been drawn from qs[i]."""
        if len(qs) < len(drafts):
            raise Eagle3Error(f"rejection sampling needs q for every draft ({len(drafts)} drafts, {len(qs)} q's)")
        out: list[int] = []
        rng = self.rng
        for i, d in enumerate(drafts):
            p = self.target(row_logits(i))
            q = qs[i]
            p_d, q_d = p.prob(d), q.prob(d)
            if q_d > 0.0 and rng.random() * q_d < p_d:  # accept with probability min(1, p(d) / q(d))
                out.append(d)
                self.counts.accepted += 1
                if stop is not None and stop(d):
                    return out
                continue
            out.append(residual(p, q).sample(rng.random()))
            self.counts.rejected += 1
            return out
        out.append(self.target(row_logits(len(drafts))).sample(rng.random()))
        self.counts.bonus += 1
        return out


def verify_match(drafts: Sequence[int], pick: Callable[[int], int],
                 stop: Callable[[int], bool] | None = None) -> list[int]:
    """The exact-match rule: `pick(i)` is the target's own token at verify row i (its sampler, called
    once per emitted token, in order); drafts are kept while they equal it. Returns the emitted tokens."""
    out: list[int] = []
    for i in range(len(drafts) + 1):
        choice = pick(i)
        out.append(choice)
        if i >= len(drafts) or drafts[i] != choice or (stop is not None and stop(choice)):
            break
    return out
