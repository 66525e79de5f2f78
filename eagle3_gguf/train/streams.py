"""Greedy answers in flight: llama.cpp answers many prompts at once, each in its own KV stream.

The target's answers are made this way twice: with every row's layer inputs, as training data
(`data.generate_data`), and as tokens alone, for a GPU machine's teacher (`answers.llama_answers`). Both keep
`Stream`s in a context with one KV stream per sequence (kv_unified=False: a row attends over its own sequence
only, 2.5x the tokens/s of one unified cache) and decode them a round at a time (`round_groups`, `decode`): each
new prompt's prefill alone, then the running answers one row each, together, in sequence order (per-sequence
streams keep a batch's rows in that order only: see context.Context). The callers refill idle streams, keep what
else they need of a decode, and say when an answer is finished (`Stream.stop`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from ..batch import Batch
    from ..context import Context


@dataclass
class Stream:
    """One answer being made in KV sequence `seq`."""

    seq: int
    key: int = -1  # the caller's name for the prompt (an index); -1 while idle
    tokens: list[int] = field(default_factory=list)  # prompt + answer so far
    n_prompt: int = 0
    n_fed: int = 0  # tokens decoded into the sequence

    @property
    def busy(self) -> bool:
        return self.key >= 0

    @property
    def n_answer(self) -> int:
        return len(self.tokens) - self.n_prompt

    def start(self, key: int, prompt: Sequence[int]) -> None:
        self.key, self.tokens, self.n_prompt, self.n_fed = key, [int(t) for t in prompt], len(prompt), 0

    def stop(self, ctx: Context) -> None:
        """The answer is finished: its sequence is cleared for the next prompt."""
        ctx.seq_rm(self.seq, 0, -1)
        self.key = -1


def round_groups(streams: list[Stream]) -> list[list[Stream]]:
    """One round's decodes over the busy streams: each new prompt's prefill alone, then the running answers
    (one token each not yet decoded) together, in sequence order."""
    busy = sorted((s for s in streams if s.busy), key=lambda s: s.seq)
    running = [s for s in busy if s.n_fed > 0]
    return [[s] for s in busy if s.n_fed == 0] + ([running] if running else [])


def decode(ctx: Context, batch: Batch, group: list[Stream]) -> list[int]:
    """Decode each stream's tokens not yet decoded in one batch, the output on its last row, and append the
    target's greedy choice to its tokens. Returns where each stream's rows begin in the batch, and the batch's
    row count last (stream i's rows: starts[i]..starts[i + 1])."""
    rows_tok: list[int] = []
    rows_pos: list[int] = []
    rows_seq: list[int] = []
    rows_out: list[bool] = []
    starts = [0]
    for s in group:
        new = s.tokens[s.n_fed:]
        rows_tok += new
        rows_pos += range(s.n_fed, s.n_fed + len(new))
        rows_seq += [s.seq] * len(new)
        rows_out += [False] * (len(new) - 1) + [True]
        starts.append(len(rows_tok))
    batch.set_rows(np.asarray(rows_tok, np.int32), np.asarray(rows_pos, np.int32), np.asarray(rows_seq, np.int32),
                   np.asarray(rows_out))
    ctx.decode(batch)
    for s, end in zip(group, starts[1:]):
        s.n_fed = len(s.tokens)
        s.tokens.append(int(np.argmax(ctx.logits_ith(end - 1))))
    return starts
