"""Eagle3Session: the EAGLE-3 head's side of speculative decoding, over the native binding.

Lifecycle (the semantics of upstream's `common_speculative_impl_draft_eagle3`, written anew):

- `process(tokens, pos0)` after every target decode whose first `len(tokens)` rows the target kept:
  gather the three extracted layer inputs of those rows → draft encoder (`llama_process(ENCODE)`) → g;
  then the draft decoder stores the pairs (token[p+1], g[p]) at position p. The last row's pair needs
  the next token, which is not known yet: it is deferred (`pending_g` at `pending_pos`).
- `draft(id_last, n_max, p_min)`: seed step (id_last, pending_g) at pending_pos, then autoregressive
  steps that feed the draft's own pre-norm hidden state back in place of g.
- `accept(n_accepted)`: drop the draft's speculative KV entries (everything after the seed), so that
  the following `process` of the kept rows writes the pairs built from the target's real features.

Unlike upstream, rows the target rejected never reach the draft encoder or decoder.

Positions: the target holds token t_i at position i. The draft holds at position i the pair
(t_{i+1}, g_i), where g_i = fc(target features of t_i); its output there predicts t_{i+2}.
"""

from __future__ import annotations

import numpy as np

from .errors import Eagle3Error
from .extract import TargetFeatures
from .head_norms import HeadNorms
from .native import LLAMA_PROCESS_TYPE_DECODE, LLAMA_PROCESS_TYPE_ENCODE, BatchExt, Context


class Eagle3Session:
    def __init__(self, target: Context, draft: Context, target_layers: list[int] | None = None):
        self.target = target
        self.draft_ctx = draft
        self.layers = list(target_layers if target_layers is not None else draft.model.target_layer_ids())
        if len(self.layers) != 3:
            raise Eagle3Error(f"an EAGLE-3 head extracts exactly 3 target layers, this one names {self.layers}")
        self.extract = TargetFeatures(target, self.layers)
        self.norms = HeadNorms.for_model(draft.model)  # EAGLE 3.1 fc_norm / norm_output; None for EAGLE-3
        self.n_embd = draft.model.n_embd
        draft.set_nextn(True, masked=True)
        self.batch = BatchExt(draft)
        self.n_ubatch = draft.n_ubatch
        self.pending_g = np.zeros(self.n_embd, dtype=np.float32)  # [n_embd]
        self.pending_pos = -1
        self._queue: list[tuple[int, int, np.ndarray]] = []  # decoder pairs (token, pos, g) not yet run

    def close(self) -> None:
        self.batch.close()

    def __enter__(self) -> "Eagle3Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset(self) -> None:
        """Forget everything (new prompt): clears the draft KV and the deferred row."""
        self.draft_ctx.clear()
        self.pending_pos = -1
        self._queue.clear()

    def truncate(self, n: int) -> bool:
        """Keep the pairs at positions < n (a new prompt sharing n tokens with the old context); the
        next process() resumes at n, with no deferred row. False (and nothing kept) where the draft
        cache cannot cut there; reset() then."""
        self.flush()  # queued pairs reach the draft cache first, then the cut applies to all of them
        if not self.draft_ctx.seq_rm(0, n, -1):
            return False
        self.pending_pos = -1  # the pair at n - 1 is already in the draft cache
        return True

    # -- features --------------------------------------------------------------------------------
    def features(self, n_rows: int) -> np.ndarray:
        """The three extracted target layers of the last target decode's first n_rows rows,
        concatenated as the head's encoder expects.  # [n_rows, 3 * n_embd_tgt]"""
        feats = self.extract.gather(n_rows)
        if self.norms is not None:  # EAGLE 3.1 fc_norm, slice by slice
            feats = self.norms.apply_features(feats)
        return feats

    def encode(self, feats: np.ndarray) -> np.ndarray:
        """Run the head's encoder (fc) on feature rows.  # [n, 3 * n_embd_tgt] -> [n, n_embd]"""
        n = feats.shape[0]
        g = np.empty((n, self.n_embd), dtype=np.float32)  # [n, n_embd]
        base = self.draft_ctx.pos_max() + 1  # the encoder ignores positions; llama.cpp wants them after the KV
        for i in range(0, n, self.n_ubatch):
            chunk = feats[i:i + self.n_ubatch]
            self.batch.clear()
            for j, row in enumerate(chunk):
                self.batch.add_embd(row, base + j, output=True)
            self.draft_ctx.process(LLAMA_PROCESS_TYPE_ENCODE, self.batch)
            g[i:i + len(chunk)] = self.draft_ctx.nextn(len(chunk))
        return g

    # -- lifecycle -------------------------------------------------------------------------------
    def process(self, tokens: list[int], pos0: int, feats: np.ndarray | None = None) -> None:
        """Feed the head the rows the target kept: tokens at positions pos0.. (rows 0..n-1 of the
        target's last decode, unless `feats` is given).  # feats: [n, 3 * n_embd_tgt]

        The encoder runs now; the decoder pairs are queued and go to llama.cpp together with the next
        draft's seed step (one graph instead of two per cycle), or with the next process()."""
        n = len(tokens)
        if n == 0:
            return
        if feats is None:
            feats = self.features(n)
        g = self.encode(feats)  # [n, n_embd]
        self.flush()
        # complete the deferred pair when the draft has not already written it (draft() seeds it)
        if self.pending_pos >= 0 and self.pending_pos + 1 == pos0 and self.draft_ctx.pos_max() < self.pending_pos:
            self._queue.append((tokens[0], self.pending_pos, self.pending_g))
        for k in range(n - 1):
            self._queue.append((tokens[k + 1], pos0 + k, g[k]))
        self.pending_g = g[n - 1].copy()
        self.pending_pos = pos0 + n - 1

    def flush(self) -> None:
        """Run the queued decoder pairs now (draft() does this itself)."""
        if self._queue:
            self.batch.clear()
            self._add_queue(output=False)
            self.draft_ctx.process(LLAMA_PROCESS_TYPE_DECODE, self.batch)

    def _add_queue(self, output: bool) -> None:
        for token, pos, g in self._queue:
            self.batch.add_token(token, pos, g, output=output)
        self._queue.clear()

    def draft(self, id_last: int, n_max: int, p_min: float = 0.0) -> list[int]:
        """Draft up to n_max tokens that follow id_last (the target's newest token); stop early when
        the top draft probability falls under p_min."""
        if n_max <= 0:
            return []
        if self.pending_pos < 0:
            raise Eagle3Error("draft() before process(): feed the head the prompt first")
        ctx = self.draft_ctx
        ctx.seq_rm(0, self.pending_pos, -1)
        out: list[int] = []
        token, g, pos = id_last, self.pending_g, self.pending_pos
        self.batch.clear()
        # The queued pairs of the last process() ride along with the seed step. They are marked as
        # outputs too: the pinned eagle3 decoder graph has no output-row selection (no inp_out_ids),
        # so with outputs on a subset of rows llama.cpp hands back the first rows' logits, not the
        # marked ones. Its lm_head runs on every row anyway; the marks only cost the copy-out.
        self._add_queue(output=True)
        while True:
            row = self.batch.add_token(token, pos, g, output=True)
            ctx.process(LLAMA_PROCESS_TYPE_DECODE, self.batch)
            logits = ctx.logits_ith(row)  # [n_vocab]
            token = int(np.argmax(logits))
            if p_min > 0.0 and _top_prob(logits, token) < p_min:
                break
            out.append(token)
            if len(out) >= n_max:
                break
            g = ctx.nextn_ith(row).copy()  # [n_embd] pre-norm hidden state → next step's g
            if self.norms is not None:  # EAGLE 3.1 norm_output: output_norm(h) instead
                g = self.norms.feedback(g)
            pos += 1
            self.batch.clear()
        return out

    def accept(self, n_accepted: int) -> None:
        """The target kept n_accepted drafted tokens: drop the draft's speculative KV entries past the
        seed pair, so that process() of the kept rows rewrites them from real target features."""
        if n_accepted < 0:
            raise Eagle3Error(f"accept({n_accepted}): the count of accepted tokens cannot be negative")
        if self.pending_pos >= 0:
            self.draft_ctx.seq_rm(0, self.pending_pos + 1, -1)


def _top_prob(logits: np.ndarray, token: int) -> float:
    """Softmax probability of `token`.  # logits: [n_vocab], -inf outside the draft vocab"""
    top = logits[token]
    return float(1.0 / np.exp(logits - top).sum())
