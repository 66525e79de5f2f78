"""Eagle3Session: the EAGLE-3 head's side of speculative decoding, over the native binding.

Lifecycle (the semantics of upstream's `common_speculative_impl_draft_eagle3`, written anew):

- `keep(tokens, pos0)` after every target decode whose first `len(tokens)` rows the target kept: the
  three extracted layer inputs of those rows are copied aside, nothing runs yet. `process(tokens, pos0)`
  does the same and catches up at once (the prompt).
- Catching up (at the next `draft`, or `process`): the kept rows go through the draft encoder
  (`llama_encode`, fc) in one batch → g; the draft decoder stores the pairs (token[p+1], g[p]) at
  position p, in one batch with the next draft's seed step. The last row's pair needs the next token,
  which is not known yet: it is deferred (`pending_g` at `pending_pos`).
- `draft(id_last, n_max, judge)`: seed step (id_last, pending_g) at pending_pos, then autoregressive
  steps that feed the draft's own pre-norm hidden state back in place of g; after every step `judge`
  (the drafting policy) says whether to go on or how many of the drafts to verify.
- `accept(n_accepted)`: drop the draft's speculative KV entries (everything after the seed), so that
  the kept rows' pairs are rewritten from real target features.

While the policy does not draft, rows only pile up aside; at most `window` of them are kept, so a
draft after a long plain stretch catches up on the last `window` rows only. llama.cpp wants a
sequence's positions without holes, so the head's positions then run behind the target's: the rows
dropped leave a gap (`gaps`), and later rows sit in the head at their target position minus the gaps
before them. The head attends over less context, with its recent rows at their true distances, never
over a wrong one.

Unlike upstream, rows the target rejected never reach the draft encoder or decoder.

Positions: the target holds token t_i at position i. The draft holds at position i - (gaps before i)
the pair (t_{i+1}, g_i), where g_i = fc(target features of t_i); its output there predicts t_{i+2}.
The API takes target positions; `pending_pos` and the queues are in the head's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import chain
from .batch import Batch
from .context import Context
from .errors import Eagle3Error
from .extract import TargetFeatures
from .draft import CATCH_UP_WINDOW, Draft, NativeJudge, judge_p_min
from .head_norms import HeadNorms
from .spec_sampling import Dist, RejectionSampler
from .tree import DraftTree, Expansion, head_sequences


# what a head with NaN or infinite weights gives (convert refuses such checkpoints; other tools may not)
NO_PROBABILITY = "the head's draft step gave no probability (NaN): its weights hold NaN or infinite values"
# rows a head decode or encode carries with outputs at most: more queued pairs (a prompt's) go first in decodes without
# outputs, since their logits are never read (bench/NOTES.md "graph-choice"); and while the graph chooses, an output
# row also takes llama.cpp's host output buffer 4 x n_vocab values (2 MiB at Llama 3's vocab; it never shrinks)
OUTPUT_ROWS = 32


class RowsAside:
    """The rows the target kept that the head has not seen yet: tokens and features in preallocated
    arrays, appended at the end and dropped from the front, so that setting one row aside per plain
    cycle writes one row instead of copying them all (a cycle's Python runs cache-cold after the
    target's decode: 40 us a cycle with concatenation, measured)."""

    def __init__(self, width: int, capacity: int = 64):
        self.tok = np.zeros(capacity, np.int32)  # [capacity]
        self.feat = np.zeros((capacity, width), np.float32)  # [capacity, 3 * n_embd_tgt]
        self.start = self.end = 0  # live rows: start..end-1
        self.pos0 = 0  # head position of the first live row
        self._addr = self.feat.ctypes.data  # where feat's rows start (push_one copies a row there)
        self._row_bytes = width * 4

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def tokens(self) -> np.ndarray:
        return self.tok[self.start:self.end]  # [n]

    @property
    def feats(self) -> np.ndarray:
        return self.feat[self.start:self.end]  # [n, 3 * n_embd_tgt]

    @property
    def feats_addr(self) -> int:
        """The address of feats' first row (rows follow contiguously)."""
        return self._addr + self.start * self._row_bytes

    def extend(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Room for n more rows at the end: their token and feature slots, to be filled.
        # -> [n], [n, 3 * n_embd_tgt]"""
        if self.end + n > len(self.tok):
            live = self.end - self.start
            if live + n > len(self.tok):  # grow
                cap = max(2 * len(self.tok), live + n)
                tok = np.zeros(cap, np.int32)
                feat = np.zeros((cap, self.feat.shape[1]), np.float32)
            else:  # move the live rows to the front
                tok, feat = self.tok, self.feat
            tok[:live] = self.tok[self.start:self.end]
            feat[:live] = self.feat[self.start:self.end]
            self.tok, self.feat, self.start, self.end = tok, feat, 0, live
            self._addr = feat.ctypes.data
        a = self.end
        self.end = e = a + n
        return self.tok[a:e], self.feat[a:e]

    def push_one(self, token: int) -> int:
        """Room for one more row at the end, its token set: the address of its feature row, to be filled
        (extend(1) without the two array views)."""
        if self.end == len(self.tok):
            self.extend(1)
            self.end -= 1
        a = self.end
        self.tok[a] = token
        self.end = a + 1
        return self._addr + a * self._row_bytes

    def drop_back(self, n: int) -> None:
        """Take back the last n rows (rows extend() made room for that were never filled)."""
        self.end -= n
        if self.start == self.end:
            self.start = self.end = 0

    def drop_front(self, e: int) -> None:
        """Drop the oldest e rows (pos0 stays: they become a gap, and the rows after it move up)."""
        self.start += e
        if self.start == self.end:
            self.start = self.end = 0

    def clear(self) -> None:
        self.start = self.end = 0


class Eagle3Session:
    # seconds spent inside draft() on work no head does (a benchmark's replay choosing tokens and resyncing to
    # target-only's text): the loop's statistics keep them, the policy learns the draft's cost without them
    t_aside = 0.0
    # seconds inside draft() on the steps after the first (each a 1-row decoder graph, reading its row, the judge):
    # a step's price as the loop pays it, which a calibration of warm repeated drafts reads low on a GPU (0.52 ms
    # against 0.43 at 8B's head on an H200: bench/NOTES.md, scale-gpu ninth session)
    t_steps = 0.0
    # the confidences a stand-in head (a benchmark's replay, a test's oracle) reports for its steps instead of the real
    # head's, which its own judge wrapper shows the policy: chain.c's judge sees these
    judge_sees: list[float] | None = None

    def __init__(self, target: Context, draft: Context, target_layers: list[int] | None = None,
                 window: int = CATCH_UP_WINDOW):
        self.target = target
        self.draft_ctx = draft
        self.layers = list(target_layers if target_layers is not None else draft.model.target_layer_ids())
        if len(self.layers) != 3:
            raise Eagle3Error(f"an EAGLE-3 head extracts exactly 3 target layers, this one names {self.layers}")
        self.extract = TargetFeatures(target, self.layers)
        self.norms = HeadNorms.for_model(draft.model)  # EAGLE 3.1 fc_norm / norm_output; None for EAGLE-3
        self.n_embd = draft.model.n_embd
        self.window = window
        draft.set_nextn(True, masked=True)
        n_ub = draft.n_ubatch
        self.n_ubatch = n_ub
        self.enc_batch = Batch(n_ub, self.extract.width)  # feature rows → g
        self.dec_batch = Batch(n_ub, self.n_embd)  # (token, g) pairs + the draft steps
        self.pending_g = np.zeros(self.n_embd, dtype=np.float32)  # [n_embd]
        self.pending_pos = -1
        self._open = False  # the deferred pair is neither in the draft cache nor queued
        self.aside = RowsAside(self.extract.width)  # rows the target kept that the head has not seen yet
        self.gaps: list[tuple[int, int]] = []  # (target position, length): rows the head never saw
        self.shift = 0  # their total length: head position = target position - shift, from the last gap on
        # decoder pairs ready to go with the next draft's seed step
        self._q_tok = np.zeros(0, np.int32)  # [n_q]
        self._q_pos = np.zeros(0, np.int32)  # [n_q]
        self._q_g = np.zeros((0, self.n_embd), np.float32)  # [n_q, n_embd]
        self._seed_tok = np.zeros(min(n_ub, OUTPUT_ROWS), np.int32)  # [rows]: _seed_aside's tokens
        # chain.c's seed writes the seed step's g into these in turn (the other may be pending_g, which it reads), by
        # address: after the graphs each numpy array's .ctypes costs ~5 us
        self._seed_g = np.zeros((2, self.n_embd), np.float32)  # [2, n_embd]
        self._seed_g_addr = (self._seed_g[0].ctypes.data, self._seed_g[1].ctypes.data)
        self._seed_tok_addr = self._seed_tok.ctypes.data
        self._seed_turn = 0
        self._vocab: np.ndarray | None = None  # draft-vocab ids inside the full logits row, once known
        self._chain: chain.Chain | None = None  # drafts in one C call (choose_in_graph makes it)

    def close(self) -> None:
        self.enc_batch.close()
        self.dec_batch.close()

    def __enter__(self) -> "Eagle3Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset(self) -> None:
        """Forget everything (new prompt): clears the draft KV, the rows aside and the deferred row."""
        self.draft_ctx.clear()
        self.pending_pos = -1
        self._open = False
        self.gaps, self.shift = [], 0
        self._drop_rows()
        self._set_queue(self._q_tok[:0], self._q_pos[:0], self._q_g[:0])

    def choose_in_graph(self, k: int) -> bool:
        """Let the head's graph choose each draft step's k likeliest tokens with their probabilities (choice.py)
        instead of handing back its logits over the whole target vocab for numpy to gather, exponentiate and search
        (~50 us a step at a 32k draft vocab, and the row's copy off a GPU): k = 1 + the runner-ups a step reports;
        0 reads the logits again. Greedy chains only: rejection sampling draws from the logits, and a draft tree's
        depths run on sequences the graph's choice does not serve. Returns whether the graph chooses. Where it does, an
        EAGLE-3 head's draft steps can run in one C call (chain.py; built here, once, not in a timed draft)."""
        chooses = self.draft_ctx.set_graph_choice(k, probs=True)
        if chooses and self._chain is None and self.norms is None and chain.available():
            self._chain = chain.Chain(self.draft_ctx, self.dec_batch, self.enc_batch)
        return chooses

    @property
    def chooses_in_graph(self) -> int:
        """The tokens the head's graph chooses a step (0: it hands back its logits)."""
        choice = self.draft_ctx.graph_choice
        return choice.k if choice is not None else 0

    def truncate(self, n: int) -> bool:
        """Keep what the head holds of target positions < n (a new prompt sharing n tokens with the old
        context); the next process() resumes at n, with no deferred row. False (and nothing kept) where
        the draft cache cannot cut there; reset() then."""
        self.catch_up()
        self.flush()  # rows aside and queued pairs reach the draft cache first, then the cut applies to all
        gaps = [(t0, min(e, n - t0)) for t0, e in self.gaps if t0 < n]
        shift = sum(e for _, e in gaps)
        if not self.draft_ctx.seq_rm(0, n - shift, -1):
            return False
        self.gaps, self.shift = gaps, shift
        self.pending_pos = -1  # the pair at n - 1 is already in the draft cache
        self._open = False
        return True

    # -- features --------------------------------------------------------------------------------
    def features(self, n_rows: int, out: np.ndarray | None = None, rows: np.ndarray | None = None) -> np.ndarray:
        """The three extracted target layers of the last target decode's first n_rows rows (or of the given
        rows among them), concatenated as the head's encoder expects (into `out` when given).
        # [n_rows or len(rows), 3 * n_embd_tgt]"""
        return self._fc_norm(self.extract.gather(n_rows, rows=rows, out=out))

    def _fc_norm(self, feats: np.ndarray) -> np.ndarray:
        """EAGLE 3.1's fc_norm, slice by slice, in place (nothing for an EAGLE-3 head).
        # [n, 3 * n_embd_tgt]"""
        if self.norms is not None:
            feats[:] = self.norms.apply_features(feats)
        return feats

    def encode(self, feats: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Run the head's encoder (fc) on feature rows (into `out` when given).
        # [n, 3 * n_embd_tgt] -> [n, n_embd]"""
        n = feats.shape[0]
        g = np.empty((n, self.n_embd), dtype=np.float32) if out is None else out  # [n, n_embd]
        base = self.draft_ctx.pos_max() + 1  # the encoder ignores positions; llama.cpp wants them after the KV
        chunk = min(self.n_ubatch, OUTPUT_ROWS) if self.chooses_in_graph else self.n_ubatch  # every row an output
        for i in range(0, n, chunk):
            m = min(chunk, n - i)
            self.enc_batch.set_embd(feats[i:i + m], np.arange(base, base + m, dtype=np.int32))
            self.draft_ctx.encode(self.enc_batch)
            g[i:i + m] = self.draft_ctx.nextn(m)
        return g

    # -- lifecycle -------------------------------------------------------------------------------
    def keep(self, tokens, pos0: int, feats: np.ndarray | None = None, trim: bool = True) -> None:
        """The target kept `tokens` at positions pos0.. (rows 0..n-1 of its last decode, unless `feats`
        is given): set their features aside for the next catch-up, at most `window` rows unless trim is
        False.  # feats: [n, 3 * n_embd_tgt]"""
        n = len(tokens)
        if n == 0:
            return
        aside = self.aside
        h0 = pos0 - self.shift
        have = len(aside)
        if have and aside.pos0 + have != h0:
            raise Eagle3Error(f"rows kept at {pos0} do not follow the rows set aside up to "
                              f"{aside.pos0 + have + self.shift}")
        if not have:
            aside.pos0 = h0
        if n == 1 and feats is None:  # a plain cycle's row: copied straight from llama.cpp's buffers
            dst = aside.push_one(tokens[0])
            try:
                self.extract.gather_one(dst)
                if self.norms is not None:
                    self._fc_norm(aside.feat[aside.end - 1:aside.end])  # [1, 3 * n_embd_tgt]
            except BaseException:
                aside.drop_back(1)  # no half-filled rows stay aside
                raise
        else:
            tok, feat = aside.extend(n)  # [n], [n, 3 * n_embd_tgt]
            try:
                tok[:] = tokens
                if feats is None:
                    self.features(n, out=feat)
                else:
                    feat[:] = feats
            except BaseException:
                aside.drop_back(n)  # no half-filled rows stay aside
                raise
        if trim and have + n > self.window:
            self._trim(have + n - self.window)

    def process(self, tokens, pos0: int, feats: np.ndarray | None = None) -> None:
        """Feed the head rows the target kept, all of them, now (the prompt): the encoder runs; the
        decoder pairs are queued."""
        self.keep(tokens, pos0, feats, trim=False)
        self.catch_up()

    def skip(self, tokens, pos0: int) -> None:
        """The target kept `tokens` at positions pos0.., but the head will not see them, nor the rows
        aside before them (the policy will not draft for a while): they become a gap."""
        n = len(tokens)
        if n == 0:
            return
        aside = self.aside
        have = aside.end - aside.start
        if not have:  # a plain cycle's rows, nothing aside: they only become (or extend) a gap
            self._gap(pos0 - self.shift, int(tokens[0]), n)
            return
        if aside.pos0 + have != pos0 - self.shift:
            raise Eagle3Error(f"rows skipped at {pos0} do not follow the rows set aside up to "
                              f"{aside.pos0 + have + self.shift}")
        self._gap(aside.pos0, int(aside.tok[aside.start]), have + n)
        self._drop_rows()

    def _trim(self, e: int) -> None:
        """Drop the oldest e rows aside: they become a gap."""
        aside = self.aside
        self._gap(aside.pos0, int(aside.tok[aside.start]), e)
        aside.drop_front(e)

    def _gap(self, start: int, first_token: int, e: int) -> None:
        """Rows from head position `start` on (e of them, the first holding first_token) leave the head
        for good: the deferred pair takes first_token, and later rows move up by e."""
        if self._open and self.pending_pos + 1 == start:
            self._queue_pair(first_token, self.pending_pos, self.pending_g)
            self._open = False
        t0 = start + self.shift
        gaps = self.gaps
        self.shift += e
        if gaps:
            g0, ge = gaps[-1]
            if g0 + ge == t0:  # it follows the last gap (a plain streak's rows): that one grows
                gaps[-1] = (g0, ge + e)
                return
        gaps.append((t0, e))

    def _queue_pair(self, token: int, pos: int, g: np.ndarray) -> None:
        self._set_queue(np.append(self._q_tok, np.int32(token)), np.append(self._q_pos, np.int32(pos)),
                        np.concatenate([self._q_g, g[None]]))

    def _drop_rows(self) -> None:
        self.aside.clear()

    @property
    def can_seed(self) -> bool:
        """Whether a draft has a row to start from: one processed, or rows set aside (catch_up encodes them).
        Not after a reset or a cut until a kept row, where every row since was skipped."""
        return self.pending_pos >= 0 or len(self.aside) > 0

    def catch_up(self) -> None:
        """Encode the rows set aside and queue their decoder pairs (token[p+1], g[p]); the last row's g
        waits for the next token as the deferred pair."""
        n = len(self.aside)
        if n == 0:
            return
        toks, pos0 = self.aside.tokens, self.aside.pos0
        g = self.encode(self.aside.feats)  # [n, n_embd]
        q_tok, q_pos, q_g = [self._q_tok], [self._q_pos], [self._q_g]
        # complete the deferred pair unless the draft has already written it (draft() seeds it)
        if self._open and self.pending_pos + 1 == pos0:
            q_tok.append(toks[:1])
            q_pos.append(np.array([self.pending_pos], np.int32))
            q_g.append(self.pending_g[None])
        q_tok.append(toks[1:])
        q_pos.append(np.arange(pos0, pos0 + n - 1, dtype=np.int32))
        q_g.append(g[:n - 1])
        self._set_queue(np.concatenate(q_tok), np.concatenate(q_pos), np.concatenate(q_g))
        self.pending_g = g[n - 1].copy()
        self.pending_pos = pos0 + n - 1
        self._open = True
        self._drop_rows()

    def _set_queue(self, tok: np.ndarray, pos: np.ndarray, g: np.ndarray) -> None:
        self._q_tok, self._q_pos, self._q_g = tok, pos, g

    def flush(self) -> None:
        """Run the queued decoder pairs now (draft() does this itself), in n_ubatch chunks: only their KV entries
        are wanted, so no row is an output (none of their logits is computed into a buffer or copied out)."""
        n = len(self._q_tok)
        for i in range(0, n, self.n_ubatch):
            m = min(self.n_ubatch, n - i)
            self.dec_batch.set_embd(self._q_g[i:i + m], self._q_pos[i:i + m], self._q_tok[i:i + m], outputs=False)
            self.draft_ctx.decode(self.dec_batch)
        self._set_queue(self._q_tok[:0], self._q_pos[:0], self._q_g[:0])

    def _draft_logits(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The head's logits over its draft vocab and their target ids (None: the whole vocab).
        # logits: [n_vocab], -inf outside the draft vocab -> [n_draft_vocab], [n_draft_vocab]"""
        if self._vocab is None:
            finite = np.flatnonzero(np.isfinite(logits))
            self._vocab = finite if finite.size < logits.size else np.arange(0)
        if self._vocab.size:
            return logits[self._vocab], self._vocab
        return logits, None

    def _choose(self, logits: np.ndarray, sampler: RejectionSampler | None, qs: list[Dist],
                alts: Draft | None = None, n_alt: int = 0) -> tuple[int, float]:
        """One draft step's token and the head's top probability: the argmax, or a draw from q (appended to
        qs). The draft-vocab logits are gathered once for both: right after a decode the row is out of
        cache, and a second gather cost ~0.1 ms a step (a third of rejection sampling's extra Python).
        # logits: [n_vocab], -inf outside the draft vocab"""
        z, ids = self._draft_logits(logits)  # [n_draft_vocab], [n_draft_vocab] or None
        j = int(z.argmax())  # the method: np.argmax's dispatch costs a cache-cold step ~5 us
        # exp(z - z_max) in place (no temporaries: ~10 us a step, cold), on z itself where it is a gathered
        # copy nobody reads after; the whole-vocab row is llama.cpp's buffer, and the sampler still needs z
        e = np.subtract(z, z[j], out=z if ids is not None and sampler is None else None)
        conf = float(1.0 / np.exp(e, out=e).sum())
        if not 0.0 < conf <= 1.0:
            raise Eagle3Error(NO_PROBABILITY)
        if n_alt:  # e holds exp(z - z_max), ours to overwrite: the runner-ups are its next largest entries
            # argmax after argmax, each found one struck out: ~2 us a runner-up at a 32k draft vocab, where
            # np.argpartition and a sort took ~50 us a step (bench/NOTES.md, "Python at real vocab sizes")
            top, probs = [], []
            e[j] = -1.0
            for _ in range(min(n_alt, e.size - 1)):
                t = int(e.argmax())
                top.append(int(ids[t]) if ids is not None else t)
                probs.append(float(e[t]) * conf)
                e[t] = -1.0
            alts.alt_tokens.append(top)
            alts.alt_probs.append(probs)
        if sampler is None:
            return (int(ids[j]) if ids is not None else j), conf
        token, q = sampler.draft(z, ids)
        qs.append(q)
        return token, conf

    def _chosen(self, row: int, alts: Draft | None, n_alt: int) -> tuple[int, float]:
        """_choose's token and top probability (and runner-ups) as the head's graph chose them at batch `row`."""
        ids, probs = self.draft_ctx.sampled_top(row)  # the k likeliest, in no order (draft() checked n_alt < k)
        if not 0.0 <= probs[0] <= 1.0:  # (a NaN head's are all NaN)
            raise Eagle3Error(NO_PROBABILITY)
        if len(ids) == 1:
            return ids[0], probs[0]
        order = sorted(range(len(ids)), key=probs.__getitem__, reverse=True)
        if n_alt:
            alts.alt_tokens.append([ids[j] for j in order[1:1 + n_alt]])
            alts.alt_probs.append([probs[j] for j in order[1:1 + n_alt]])
        return ids[order[0]], probs[order[0]]

    def _seed(self, id_last: int) -> int:
        """Fill the decoder batch with the seed step (id_last, pending_g) at pending_pos, after the queued
        pairs: the seed's row in it."""
        n = len(self.aside)
        if n and not len(self._q_tok):
            o = int(self._open and self.pending_pos + 1 == self.aside.pos0)  # the deferred pair goes first
            if o + n <= len(self._seed_tok):
                return self._seed_aside(id_last, n, o)
        self.catch_up()
        if self.pending_pos < 0:
            raise Eagle3Error("draft() before process(): feed the head the prompt first")
        self.draft_ctx.seq_rm(0, self.pending_pos, -1)
        # The queued pairs ride along with the seed step (one graph instead of two), all rows marked as
        # outputs: the pinned eagle3 decoder graph has no output-row selection (no inp_out_ids), so with
        # outputs on a subset of rows llama.cpp hands back the first rows' logits, not the marked ones. More than
        # OUTPUT_ROWS go first with none (a 300-token prompt's first draft 55 -> 52 ms on 2 cores).
        if len(self._q_tok) + 1 > min(self.n_ubatch, OUTPUT_ROWS):
            self.flush()
        q = len(self._q_tok)
        tok = np.append(self._q_tok, np.int32(id_last))  # [q + 1]
        pos = np.append(self._q_pos, np.int32(self.pending_pos))  # [q + 1]
        g = np.concatenate([self._q_g, self.pending_g[None]])  # [q + 1, n_embd]
        self._set_queue(self._q_tok[:0], self._q_pos[:0], self._q_g[:0])
        self._open = False  # the seed step writes the deferred pair
        self.dec_batch.set_embd(g, pos, tok)
        return q

    def _seed_aside(self, id_last: int, n: int, o: int) -> int:
        """_seed, the common case (nothing queued, a cycle's few rows aside): what catch_up would queue and the seed
        step are one run of positions, pending_pos - o.. (the deferred pair where o = 1, the rows' pairs, the seed),
        so the encoder writes g straight into the decoder batch: no queue, no concatenation, no copy of g."""
        aside, batch = self.aside, self.dec_batch
        pos0 = aside.pos0 - o
        rows = batch.embd_rows(o + n)  # [o + n, n_embd]: g of the pairs' positions, the seed's last
        if o:
            rows[0] = self.pending_g
        self.encode(aside.feats, out=rows[o:])
        tok = self._seed_tok[:o + n]  # [o + n]: token[p + 1] at each position p, id_last at the seed's
        tok[:-1] = aside.tokens[1 - o:]
        tok[-1] = id_last
        self.pending_g = rows[-1].copy()
        self.pending_pos = pos0 + o + n - 1
        self._open = False  # the seed step writes the deferred pair
        self._drop_rows()
        self.draft_ctx.seq_rm(0, self.pending_pos, -1)
        batch.fill_embd(o + n, pos0, tok)
        return o + n - 1

    def _seed_draft_in_c(self, id_last: int, n: int, o: int, n_max: int, k: int, n_alt: int,
                         judge: NativeJudge) -> tuple[Draft, float]:
        """_seed_aside and the draft's steps in one C call (chain.c's seed_draft): the encoder's graph, the seed's batch
        and the steps without coming back to Python between them (each return from a graph into Python costs ~40 us
        cache-cold: bench/NOTES.md "verify-in-c"). The session's state moves as _seed_aside moves it, failed or not,
        once the seed's batch is made."""
        aside = self.aside
        pos0 = aside.pos0 - o
        tok = self._seed_tok[:o + n]  # [o + n]: token[p + 1] at each position p, id_last at the seed's
        tok[:-1] = aside.tokens[1 - o:]
        tok[-1] = id_last
        t = self._seed_turn = 1 - self._seed_turn
        pending = np.ascontiguousarray(self.pending_g, np.float32) if o else None  # [n_embd], held through the call
        try:
            return self._chain.seed_draft(aside.feats_addr, n, self._seed_tok_addr,
                                          pending.ctypes.data if o else 0, self._seed_g_addr[t], o,
                                          pos0, n_max, k, n_alt, judge)
        finally:
            if self._chain.seeded:
                self.pending_g = self._seed_g[t]  # a view, written again two seeds on (its readers here copy it)
                self.pending_pos = pos0 + o + n - 1
                self._open = False  # the seed step writes the deferred pair
                self._drop_rows()

    def _feedback(self, row: int) -> np.ndarray:
        """The next step's g from the decoder's row: its pre-norm hidden state (EAGLE 3.1 norm_output: the
        output norm of it), where EAGLE-3 a view of llama.cpp's buffer (copy it to keep it past the next graph).
        # [n_embd]"""
        h = self.draft_ctx.nextn_ith(row)
        return self.norms.feedback(h) if self.norms is not None else h

    def draft(self, id_last: int, n_max: int, judge: Callable[[list[float], int], int] | None = None,
              p_min: float = 0.0, sampler: RejectionSampler | None = None, n_alt: int = 0,
              native: Callable[[], NativeJudge] | None = None) -> Draft:
        """Draft up to n_max tokens that follow id_last (the target's newest token). After each step,
        `judge(confs, n_max)` (confs: the top probabilities so far) returns -1 to go on or j >= 0 to stop
        and keep the first j drafts; without a judge, drafting stops where the top probability falls
        under p_min. The Draft holds every step's top probability.

        Greedy drafts are the head's argmax. With a `sampler` (rejection sampling) each draft is drawn
        from the head's distribution q over the target vocab (its draft vocab mapped through d2t, zero
        elsewhere; the sampler's transform), and the Draft holds each step's q. n_alt > 0 (greedy drafts): the
        Draft also holds each step's n_alt runner-up tokens (the branches of a draft tree).

        `native` gives the judge as chain.c runs it (the same rule): where the head's graph chooses, the head is an
        EAGLE-3 one (no norm_output to apply in numpy) and chain.c builds here, the steps run in one C call."""
        if n_max <= 0:
            return Draft()
        if judge is None:
            judge = lambda confs, n: judge_p_min(confs, n, p_min)  # noqa: E731
        k = self.chooses_in_graph
        in_graph = k > 0
        if in_graph and sampler is not None:
            raise Eagle3Error("rejection sampling draws from the head's logits: choose_in_graph(0) first")
        if in_graph and n_alt >= k:
            raise Eagle3Error(f"{n_alt} runner-ups a step from a graph that chooses {k} tokens: "
                              f"choose_in_graph({n_alt + 1})")
        ctx = self.draft_ctx
        # in chain.c where it was built (an EAGLE-3 head: 3.1's norm_output is applied in numpy) and the head's calls
        # are not wrapped (Context.runner: an emulation); its refusals come before the seed touches the head's state
        steps_in_c = native is not None and in_graph and self._chain is not None and ctx.runner is None and \
            k <= chain.CHOICE_MAX
        if steps_in_c:
            native_judge = native()
            self._chain.prepare(n_max, k, n_alt, native_judge, self.judge_sees)
            n = len(self.aside)
            if n and not len(self._q_tok):  # _seed_aside's case (every cycle's): the seed too in the one C call
                o = int(self._open and self.pending_pos + 1 == self.aside.pos0)
                if o + n <= len(self._seed_tok):
                    out, t_steps = self._seed_draft_in_c(id_last, n, o, n_max, k, n_alt, native_judge)
                    self.t_steps += t_steps
                    return out
        row = self._seed(id_last)
        if steps_in_c:
            out, t_steps = self._chain.draft(row, self.pending_pos, n_max, k, n_alt, native_judge)
            self.t_steps += t_steps
            return out
        p = self.pending_pos
        out, confs, qs = [], [], []
        alts = Draft() if n_alt else None
        batch = self.dec_batch
        t_later = 0.0  # when the second step began (0: not yet)
        while True:
            ctx.decode(batch)
            if in_graph:
                token, conf = self._chosen(row, alts, n_alt)
            else:
                token, conf = self._choose(ctx.logits_ith(row), sampler, qs, alts, n_alt)
            out.append(token)
            confs.append(conf)
            keep = judge(confs, n_max)
            if keep >= 0:
                if t_later:
                    self.t_steps += time.perf_counter() - t_later
                if alts is None:
                    return Draft(out[:keep], confs, qs)
                return Draft(out[:keep], confs, qs, alts.alt_tokens, alts.alt_probs)
            t_later = t_later or time.perf_counter()
            p += 1
            batch.set_embd_one(self._feedback(row), p, token)
            row = 0

    def draft_tree(self, id_last: int, depth: int, topk: int, n_nodes: int) -> DraftTree:
        """EAGLE-2's dynamic draft tree after id_last (tree.py): the seed step's topk likeliest tokens are
        the first depth's candidates; then, depth after depth, the topk candidates of the depth likeliest
        to be reached (cumulative probability) run as one decoder batch, each over its own path, and their
        topk children join the candidates; the n_nodes likeliest candidates are the tree. It goes no deeper
        than n_nodes (no deeper node could be chosen) nor than the head's free cells allow. The head's cache
        holds the seed after it, as after draft()."""
        ctx = self.draft_ctx
        if self.chooses_in_graph:
            raise Eagle3Error("a draft tree reads the head's logits on several sequences: choose_in_graph(0) first")
        if ctx.n_seq_max < head_sequences(topk):
            raise Eagle3Error(f"a draft tree of top-{topk} needs a head context with {head_sequences(topk)} "
                              f"sequences (this one has {ctx.n_seq_max}): PairConfig(n_seq_max=...)")
        row = self._seed(id_last)
        pos0 = self.pending_pos
        depth = min(depth, n_nodes, 1 + max(ctx.n_ctx - pos0 - 1, 0) // topk)  # a depth takes topk cells
        cands = Expansion(id_last)
        seq_of = {0: 0}  # an expanded candidate's head sequence: its path's cells (the root: the prefix's)
        g_of = {}  # an expanded candidate's hidden state, [n_embd]: its children's g
        try:
            ctx.decode(self.dec_batch)
            g_of[0] = self._feedback(row).copy()
            cands.add_children(0, *self._top(ctx.logits_ith(row), topk))
            for d in range(1, depth):
                front = cands.likeliest(d, topk)  # [w]
                sets = 1 + (d % 2) * topk  # depths alternate between two sets of sequences
                for j, i in enumerate(front):
                    ctx.seq_rm(sets + j, -1, -1)  # a grandparent's path, copied into its child's already
                    ctx.seq_cp(seq_of[cands.parents[i]], sets + j)
                    seq_of[i] = sets + j
                g = np.stack([g_of[cands.parents[i]] for i in front])  # [w, n_embd]
                self.dec_batch.set_embd(g, np.full(len(front), pos0 + d, np.int32), [cands.tokens[i] for i in front],
                                        seq_ids=[seq_of[i] for i in front])
                ctx.decode(self.dec_batch)
                for r, i in enumerate(front):
                    g_of[i] = self._feedback(r).copy()
                    cands.add_children(i, *self._top(ctx.logits_ith(r), topk))
        finally:
            for s in range(1, head_sequences(topk)):
                ctx.seq_rm(s, -1, -1)
        return cands.best(n_nodes)

    def _top(self, logits: np.ndarray, k: int) -> tuple[list[int], list[float]]:
        """A draft step's k likeliest tokens and their probabilities, the likeliest first.
        # logits: [n_vocab], -inf outside the draft vocab"""
        alts = Draft()
        token, conf = self._choose(logits, None, [], alts, k - 1)
        return [token, *(alts.alt_tokens[0] if k > 1 else [])], [conf, *(alts.alt_probs[0] if k > 1 else [])]

    def accept(self, n_accepted: int) -> None:
        """The target kept n_accepted drafted tokens: drop the draft's speculative KV entries past the
        seed pair, so that the kept rows' pairs are rewritten from real target features."""
        if n_accepted < 0:
            raise Eagle3Error(f"accept({n_accepted}): the count of accepted tokens cannot be negative")
        if self.pending_pos >= 0:
            self.draft_ctx.seq_rm(0, self.pending_pos + 1, -1)

