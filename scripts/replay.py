"""ReplaySession: a head whose drafts are right at a stated rate, for benchmarks of shapes without trained weights.

A synthetic target (scripts/synthetic.py) has the cost of a real one but no head trained for it, and acceptance is
what speculation's speed turns on. ReplaySession replays a stated acceptance profile instead: it runs the real
head's draft steps (so they are timed, and its cache moves as usual), then puts in their place the target-only
continuation's tokens, each position right with the profile's conditional probability (seeded), and a token that is
not the truth elsewhere. Verification is the real one: the target keeps what equals its own choice, so the text is
target-only's and the acceptance follows the profile. The head's confidence at step i is reported as the profile's
p_i (at a runner-up, its calibrated chance): the drafting policy sees a calibrated head.

Draft trees replay too: at a node on the true path, its likeliest child is right with p_d; where it is not, the
head's j-th runner-up is with the profile's alts[j] (given the ones before it were wrong); a child the tree did
not keep (it holds a node's likeliest children) cannot be right. tests/oracle.py's OracleSession is the tests'
deterministic schedule; this is the benchmarks' random one.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.draft import Draft, judge_p_min
from eagle3_gguf.session import Eagle3Session
from eagle3_gguf.tree import DraftTree


@dataclass(frozen=True)
class Profile:
    """P(draft i right | drafts 0..i-1 right) by position, the last one holding past the end, and the runner-ups'
    P(runner-up j right | the likeliest token and runner-ups 0..j-1 wrong), the same at every depth."""

    name: str
    chain: tuple[float, ...]
    alts: tuple[float, ...] = ()
    source: str = ""

    def p(self, i: int) -> float:
        return self.chain[min(i, len(self.chain) - 1)]

    def alt(self, j: int) -> float:
        return self.alts[j] if j < len(self.alts) else 0.0

    def tau(self, k: int) -> float:
        """Expected tokens per target forward of a chain of k drafts: 1 + sum over j of P(the first j all right)."""
        reach, total = 1.0, 1.0
        for i in range(k):
            reach *= self.p(i)
            total += reach
        return total

    def label(self) -> str:
        return f"{self.name} ({' / '.join(f'{p:.2f}' for p in self.chain)}; tau {self.tau(4):.2f} at K=4)"


# A runner-up's chance where the likeliest token missed: our shipped SmolLM2 head's measured first-draft coverage
# (top-1 39.3%, top-2 49.9%, top-3 54.8%, top-4 57.1% on 12 explanation prompts; ../shared/REFERENCE.md), as
# conditional rates. No published 8B head gives its runner-ups' rates, so both profiles take these.
SHIPPED_ALTS = (0.175, 0.098, 0.051)
RESYNC_CHUNK = 32  # target-only's tokens asked of a resync at a time: a cycle reads at most 17 positions
U_MARGIN = 64  # the draws a replay holds past its truth's length (a resynced truth is as long; drafts past it miss)

PROFILES = {
    "vllm-8b": Profile("vllm-8b", (0.80, 0.75, 0.70, 0.65), SHIPPED_ALTS,
                       "tau 3.09 at K=4: about what vLLM publishes for the Llama-3.1-8B EAGLE-3 head on MT-bench "
                       "(3.08)"),
    "shipped": Profile("shipped", (0.407, 0.413, 0.437, 0.51), SHIPPED_ALTS,
                       "our shipped SmolLM2 head on all 80 MT-bench prompts, fixed K=4 (bench/all-k4-shipped)"),
}


def parse_profile(text: str) -> Profile:
    """A profile by name (PROFILES) or as its chain rates, e.g. '0.8/0.75/0.7/0.65'."""
    if text in PROFILES:
        return PROFILES[text]
    try:
        chain = tuple(float(x) for x in text.split("/"))
    except ValueError:
        chain = ()
    if not chain or not all(0.0 <= p <= 1.0 for p in chain):
        raise Eagle3Error(f"profile '{text}': name one of {', '.join(PROFILES)} or give rates in [0, 1] as 0.8/0.7")
    return Profile(text, chain, SHIPPED_ALTS, "as given")


class ReplaySession(Eagle3Session):
    """Runs the real head's draft steps, then replays `profile` against `truth` (the prompt and target-only's
    tokens after it: target position i holds truth[i]). Greedy verification only.

    Where a verify width is not exact (a GPU's kernels can compute a batch row unlike a lone row), the run's text
    can part from target-only's at a near-tie; from there the truth no longer says what the target will choose.
    `resync(tokens, n)`, given, returns target-only's n tokens after the run's text so far, and the replay goes on
    against them.

    `t_aside`: the seconds the replay itself took inside draft() (choosing tokens, resyncing), which a user's head
    does not spend: a benchmark leaves them out of the run's time, its drafting and its Python."""

    def __init__(self, *args, truth: list[int], profile: Profile, seed: int = 0,
                 resync: Callable[[list[int], int], list[int]] | None = None, **kw):
        super().__init__(*args, **kw)
        self.profile = profile
        self.resync = resync
        self.n_vocab = self.target.model.n_vocab
        self.replay(truth, seed)

    def replay(self, truth: list[int], seed: int = 0) -> None:
        """Start over against a new truth (the next prompt's), the counters at zero."""
        self.truth = list(truth)
        self.goal = len(self.truth)  # the truth's length: a resynced one is extended up to it as it is read
        # One uniform draw per target position (column 0: the likeliest token; 1 + j: runner-up j), so that whether a
        # draft there is right does not depend on what was drafted before: every contender and policy of a prompt
        # faces the same easy and hard positions (common random numbers: their ratios vary far less than their speeds).
        # A position is never asked twice on the truth: a rejected draft's position gets the target's own token.
        self.u = np.random.default_rng(seed).random((self.goal + U_MARGIN, 1 + len(self.profile.alts)))
        self.steps = 0  # the head's decoder runs in drafts (a tree: one per depth)
        self.cycles = 0  # drafts made (each with a catch-up)
        self.resyncs = 0
        self.t_aside = 0.0

    def _follow(self, id_last: int) -> int:
        """Where the first draft goes (a target position), after checking that the run's text is still the truth's
        there: all it emitted passed as id_last or as a draft equal to the truth, so a part shows at id_last."""
        at = self.pending_pos + self.shift + 1  # id_last's target position
        if self.resync is not None and at < self.goal and self._true(at) != id_last:
            self.truth = self.truth[:at] + [id_last]
            self._extend()
            self.resyncs += 1
        return at + 1

    def _extend(self) -> None:
        """RESYNC_CHUNK more of target-only's tokens after the truth so far (a resynced truth grows as the run
        reads it: the run may part again soon, and a plain decode of the whole rest took ~0.5 s at 8B's shape)."""
        n = min(RESYNC_CHUNK, self.goal - len(self.truth))
        more = self.resync(self.truth, n) if n > 0 else []
        self.truth += more
        if len(more) < n:  # target-only ended there (an end token)
            self.goal = len(self.truth)

    def _true(self, pos: int) -> int | None:
        """The token target-only put at target position pos (None past the truth given)."""
        while self.resync is not None and len(self.truth) <= pos < self.goal:
            self._extend()
        return self.truth[pos] if 0 <= pos < len(self.truth) else None

    def _u(self, pos: int, k: int) -> float:
        """The draw for target position pos, column k (1.0, never right, past the draws held or the profile's
        runner-ups)."""
        u = self.u
        return float(u[pos, k]) if pos < u.shape[0] and k < u.shape[1] else 1.0

    def _wrong(self, true: int | None, k: int) -> int:
        """A k-th token that is not the truth (siblings take different k, so they differ too)."""
        return ((true if true is not None else 0) + 1 + k) % self.n_vocab

    def draft(self, id_last: int, n_max: int, judge=None, p_min: float = 0.0, sampler=None, n_alt: int = 0,
              native=None) -> Draft:
        if sampler is not None:
            raise Eagle3Error("a replayed head drafts for greedy verification only (temperature 0)")
        prof = self.profile
        inner = judge if judge is not None else lambda confs, n: judge_p_min(confs, n, p_min)  # noqa: E731
        ps = [prof.p(i) for i in range(n_max)]  # once a draft: the judge runs inside every step, in the run's Python
        calibrated = lambda confs, n: inner(ps[:len(confs)], n)  # noqa: E731
        self.judge_sees = ps
        real = super().draft(id_last, n_max, calibrated, p_min, None, n_alt, native)
        t0 = time.perf_counter()
        start = self._follow(id_last)
        self.steps += len(real.confs)
        self.cycles += 1
        tokens, alt_tokens, alt_probs = [], [], []
        on_truth = True
        for i in range(len(real.confs)):
            true = self._true(start + i)
            right = on_truth and true is not None and self._u(start + i, 0) < prof.p(i)
            tokens.append(true if right else self._wrong(true, 0))
            if n_alt:
                # which runner-up is right where the likeliest token is not (none: -1); a runner-up's probability
                # is its chance at this step, as the head's is (the policy multiplies in reaching the step)
                hit, miss = -1, 1.0 - prof.p(i)
                probs = []
                for j in range(len(real.alt_tokens[i])):
                    probs.append(miss * prof.alt(j))
                    if hit < 0 and on_truth and not right and true is not None and \
                            self._u(start + i, j + 1) < prof.alt(j):
                        hit = j
                    miss *= 1.0 - prof.alt(j)
                alt_tokens.append([true if j == hit else self._wrong(true, j + 1) for j in range(len(probs))])
                alt_probs.append(probs)
            on_truth = right
        confs = [prof.p(i) for i in range(len(real.confs))]
        out = dataclasses.replace(real, tokens=tokens[:len(real.tokens)], confs=confs, alt_tokens=alt_tokens,
                                  alt_probs=alt_probs)
        self.t_aside += time.perf_counter() - t0
        return out

    def _top(self, logits: np.ndarray, k: int) -> tuple[list[int], list[float]]:
        """A candidate's k children in draft_tree's expansion: the real head's tokens (replaced afterwards), the
        profile's chances as their probabilities, so that the tree the expansion keeps is the one a head of this
        profile would grow. draft_tree expands the root first, then k candidates a depth (a depth holds at least
        k once the root's children are in): the call's count gives the depth being expanded."""
        tokens, _ = super()._top(logits, k)
        d = 0 if self._tops == 0 else (self._tops - 1) // k + 1  # the children's draft position
        self._tops += 1
        p, miss, probs = self.profile.p(d), 1.0, []
        for rank in range(len(tokens)):
            probs.append(p if rank == 0 else (1.0 - p) * miss * self.profile.alt(rank - 1))
            if rank:
                miss *= 1.0 - self.profile.alt(rank - 1)
        return tokens, probs

    def draft_tree(self, id_last: int, depth: int, topk: int, n_nodes: int) -> DraftTree:
        self._tops = 0
        tree = super().draft_tree(id_last, depth, topk, n_nodes)
        t0 = time.perf_counter()
        prof = self.profile
        start = self._follow(id_last)
        self.steps += min(depth, n_nodes)  # one decoder run a depth (topk rows each)
        self.cycles += 1
        tokens = list(tree.tokens)
        on_truth = [True] + [False] * tree.n_nodes  # [N + 1]: the node is the truth's token there
        for node in range(tree.n_nodes + 1):  # parents come before their children
            kids = sorted(tree.children(node), key=lambda c: (-tree.probs[c], c))  # the ranks _top gave
            if not kids:
                continue
            d = tree.depths[node]  # the children's draft position
            true = self._true(start + d)
            hit = -1  # the rank the truth holds among the head's topk candidates (-1: none of them)
            if on_truth[node] and true is not None:
                if self._u(start + d, 0) < prof.p(d):
                    hit = 0
                else:
                    hit = next((j + 1 for j in range(topk - 1) if self._u(start + d, j + 1) < prof.alt(j)), -1)
            for rank, c in enumerate(kids):
                on_truth[c] = rank == hit
                tokens[c] = true if rank == hit else self._wrong(true, rank)
        self.t_aside += time.perf_counter() - t0
        return DraftTree(tokens, tree.parents, tree.depths, tree.chain, tree.probs)
