"""train.streams: the rounds both answer writers decode in (a new prompt's prefill alone, the running answers
together in sequence order), and the bookkeeping of one decode, on a stand-in context whose greedy choice is
known."""

from __future__ import annotations

import numpy as np

from eagle3_gguf.train.streams import Stream, decode, round_groups


class _Batch:
    def set_rows(self, tokens, pos, seq_ids, outputs) -> None:
        self.rows = (tokens.tolist(), pos.tolist(), seq_ids.tolist(), outputs.tolist())


class _Context:
    """A target whose greedy choice after a row is the row's token + 1; remembers what was decoded."""

    def __init__(self, batch: _Batch):
        self.batch, self.decoded, self.removed = batch, [], []

    def decode(self, batch: _Batch) -> None:
        self.decoded.append(batch.rows)

    def logits_ith(self, i: int) -> np.ndarray:
        logits = np.zeros(64, np.float32)
        logits[self.batch.rows[0][i] + 1] = 1.0
        return logits

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        self.removed.append((seq, p0, p1))
        return True


def test_rounds_and_decode():
    streams = [Stream(s) for s in range(4)]
    streams[2].start(7, [10, 11, 12])
    streams[0].start(3, np.asarray([20, 21], np.int32))
    assert round_groups(streams) == [[streams[0]], [streams[2]]]  # idle streams are left out
    batch = _Batch()
    ctx = _Context(batch)
    for group in round_groups(streams):
        assert decode(ctx, batch, group) == [0, len(group[0].tokens) - 1]
    assert ctx.decoded == [([20, 21], [0, 1], [0, 0], [False, True]), ([10, 11, 12], [0, 1, 2], [2, 2, 2],
                                                                       [False, False, True])]
    assert streams[0].tokens == [20, 21, 22] and streams[2].tokens == [10, 11, 12, 13]
    assert (streams[0].n_fed, streams[0].n_answer, streams[2].n_fed, streams[2].n_answer) == (2, 1, 3, 1)

    streams[1].start(9, [30, 31])  # a new prompt while two answers run: its prefill first, alone
    groups = round_groups(streams)
    assert groups == [[streams[1]], [streams[0], streams[2]]]
    decode(ctx, batch, groups[0])
    assert decode(ctx, batch, groups[1]) == [0, 1, 2]  # one row each, in sequence order
    assert ctx.decoded[-1] == ([22, 13], [2, 3], [0, 2], [True, True])
    assert streams[0].tokens[-1] == 23 and streams[2].tokens[-1] == 14 and streams[1].tokens == [30, 31, 32]

    streams[2].stop(ctx)
    assert not streams[2].busy and ctx.removed == [(2, 0, -1)]
    assert round_groups(streams) == [[streams[0], streams[1]]]
