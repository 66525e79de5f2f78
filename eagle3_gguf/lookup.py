"""Free drafts: prompt lookup. Where the text so far ends with an n-gram it already holds, the tokens that
followed that n-gram last time are proposed as a draft. Making one costs no draft step (a dictionary look-up),
and where text repeats (code edits, quotes, rewrites, earlier turns) it is right for many tokens in a row.

`LookupIndex` holds the sequence (prompt + generated) and, for every n in N_MIN..N_MAX, the latest earlier
position each n-gram ended at; it grows by the tokens a cycle keeps (a dictionary write per n and token), and
is cut back where the caches are (a new prompt sharing a prefix). `LookupAcceptance` learns online, by the
length of the match that proposed a draft, how often each draft position is accepted: the policy weighs a
lookup draft with it against the head's draft and plain decoding (policy.AdaptivePolicy.lookup).
"""

from __future__ import annotations

from dataclasses import dataclass

N_MIN, N_MAX = 2, 5  # n-gram lengths tried, longest first
MATCH_BINS = N_MAX - N_MIN + 1  # acceptance is learnt per matched n


@dataclass(slots=True)
class Lookup:
    """A proposed continuation and the n-gram length that matched."""

    tokens: list[int]
    n: int


class LookupIndex:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._at: list[dict[tuple[int, ...], int]] = [{} for _ in range(MATCH_BINS)]  # per n: n-gram -> end
        self._indexed = 0  # n-grams ending before this position are in the index

    def __len__(self) -> int:
        return len(self.tokens)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (the index is rebuilt where it held later ones)."""
        if n >= len(self.tokens):
            return
        del self.tokens[n:]
        if self._indexed > max(n - 1, 0):
            kept = self.tokens
            self.tokens, self._indexed = [], 0
            for d in self._at:
                d.clear()
            self.extend(kept)

    def extend(self, tokens) -> None:
        """Append tokens; every n-gram that now has a token after it is indexed at its end."""
        seq = self.tokens
        seq.extend(int(t) for t in tokens)
        end = len(seq) - 1  # the newest token has nothing after it yet
        for i in range(self._indexed, end):
            for k, d in enumerate(self._at):
                n = N_MIN + k
                if i + 1 >= n:
                    d[tuple(seq[i + 1 - n:i + 1])] = i
        self._indexed = max(self._indexed, end)

    def propose(self, k_max: int) -> Lookup | None:
        """The continuation (at most k_max tokens) of the longest n-gram the sequence ends with that it held
        before, or None."""
        seq = self.tokens
        for k in range(MATCH_BINS - 1, -1, -1):
            n = N_MIN + k
            if len(seq) <= n:
                continue
            i = self._at[k].get(tuple(seq[-n:]))
            if i is not None:
                return Lookup(seq[i + 1:i + 1 + k_max], n)
        return None


# The prior P(accept) of a lookup draft by matched n (N_MIN..N_MAX): a long match is a copy in progress more
# often than a short one. Optimistic enough that a long match is tried once where rows are dear (2 rows at
# 2x one row, 5 at 3.6x: SmolLM2 Q4_1, 2 cores); what it then gets decides.
PRIOR_BY_N = (0.3, 0.5, 0.7, 0.9)
PRIOR_COUNT = 2.0
# What a new text keeps of the evidence from earlier ones (forget()): a policy that stops verifying lookups learns
# nothing more of them, so one text's misses would keep it off lookups for every later text, however much they copy
# (a long-lived process: serve, the drop-in, bench; measured on SmolLM2, bench/NOTES.md exactness)
KEEP_PER_TEXT = 0.5


class LookupAcceptance:
    """P(lookup draft j accepted | drafts before it accepted, matched n), counts with a prior."""

    def __init__(self, k_max: int):
        self.hits = [[PRIOR_COUNT * p] * k_max for p in PRIOR_BY_N]  # [MATCH_BINS][K_max]
        self.seen = [[PRIOR_COUNT] * k_max for _ in PRIOR_BY_N]

    def forget(self, keep: float = KEEP_PER_TEXT) -> None:
        """A new text: keep this share of the evidence beyond the prior (the estimates move back towards it)."""
        for b, p in enumerate(PRIOR_BY_N):
            hits, seen = self.hits[b], self.seen[b]
            for j in range(len(seen)):
                hits[j] = PRIOR_COUNT * p + keep * (hits[j] - PRIOR_COUNT * p)
                seen[j] = PRIOR_COUNT + keep * (seen[j] - PRIOR_COUNT)

    def prob(self, n: int, j: int) -> float:
        b = n - N_MIN
        return self.hits[b][j] / self.seen[b][j]

    def observe(self, n: int, n_verified: int, n_accepted: int) -> None:
        b = n - N_MIN
        for j in range(min(n_accepted + 1, n_verified)):
            self.hits[b][j] += 1.0 if j < n_accepted else 0.0
            self.seen[b][j] += 1.0
