"""The speculative loop: draft → verify in one target batch → keep the longest agreeing prefix.

The target decodes [id_last, d1..dK] with logits for every row. Row i holds the target's own choice
after d1..di; drafts are accepted while they equal that choice, and the choice at the first
disagreement (or after the last draft) is the cycle's own token. Rejected rows leave the target's
KV cache; only the kept rows reach the head. Each emitted token is the target's own choice, so the
text is the target's: greedy output equals target-only decoding, and sampled output draws exactly
one random number per emitted token, in order, like the target-only sampler with the same seed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .errors import Eagle3Error
from .native import Batch, Context
from .session import Eagle3Session
from .stats import RunResult, SpecStats
from .tokens import detokenize, is_eog


@dataclass
class Sampler:
    """temperature 0 = greedy; otherwise llama.cpp's usual chain: top-k → top-p → min-p → temperature."""

    temperature: float = 0.0
    seed: int = 0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def reset(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def pick(self, logits: np.ndarray) -> int:
        """One token from a row of logits.  # logits: [n_vocab]"""
        if self.temperature <= 0.0:
            return int(np.argmax(logits))
        k = min(self.top_k, logits.size) if self.top_k > 0 else logits.size
        cand = np.argpartition(-logits, k - 1)[:k] if k < logits.size else np.arange(logits.size)  # [k]
        cand = cand[np.argsort(-logits[cand], kind="stable")]
        z = logits[cand].astype(np.float64)
        p = np.exp(z - z[0])
        p /= p.sum()
        keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1) if self.top_p < 1.0 else k
        keep = max(1, min(keep, k))
        keep = max(1, int(np.sum(p[:keep] >= self.min_p * p[0])))
        z = z[:keep] / self.temperature
        q = np.exp(z - z[0])
        q /= q.sum()
        u = self.rng.random()
        return int(cand[min(int(np.searchsorted(np.cumsum(q), u, side="right")), keep - 1)])


@dataclass
class GenerateConfig:
    n_predict: int = 128
    draft_max: int = 4  # K
    draft_p_min: float = 0.0


@dataclass
class Cycle:
    """One draft → verify cycle, before the head is told the outcome."""

    rows: list[int]  # [id_last, d1..dk]: what the target decoded
    out: list[int]  # the target's choices: the accepted drafts, then the cycle's own token
    n_acc: int  # accepted drafts


def verify(target: Context, session: Eagle3Session | None, batch: Batch, id_last: int, pos: int, k: int,
           p_min: float, pick: Callable[[list[int], int], int], st: SpecStats,
           stop: Callable[[int], bool] | None = None) -> Cycle:
    """Draft up to k tokens after id_last (at position pos), decode [id_last, d1..dk] in one target batch
    and pick the target's choice row by row (`pick(rows, i)`) while it equals the draft (and `stop` does not
    hold for it); the rejected rows leave the target's cache. Timing goes to `st`."""
    drafts: list[int] = []
    if k > 0 and session is not None:
        t = time.perf_counter()
        drafts = session.draft(id_last, k, p_min)
        st.t_draft += time.perf_counter() - t
    t = time.perf_counter()
    rows = [id_last] + drafts
    batch.set(rows, pos, logits="all")
    target.decode(batch)
    out: list[int] = []
    for i in range(len(rows)):
        choice = pick(rows, i)
        out.append(choice)
        if i >= len(drafts) or drafts[i] != choice or (stop is not None and stop(choice)):
            break
    n_acc = len(out) - 1
    if n_acc < len(drafts):
        target.seq_rm(0, pos + n_acc + 1, -1)
    st.t_target += time.perf_counter() - t
    st.n_target_forwards += 1
    return Cycle(rows, out, n_acc)


def tell_head(session: Eagle3Session, cycle: Cycle, pos: int, st: SpecStats) -> None:
    """The head keeps the accepted rows: its draft chain is cut back, the kept pairs are queued."""
    st.record_cycle(len(cycle.rows) - 1, cycle.n_acc)
    t = time.perf_counter()
    session.accept(cycle.n_acc)
    session.process(cycle.rows[:cycle.n_acc + 1], pos)
    st.t_process += time.perf_counter() - t


class Decoder:
    """Runs generations on a target context, with an Eagle3Session (speculative) or without (baseline)."""

    def __init__(self, target: Context, session: Eagle3Session | None = None):
        self.target = target
        self.session = session
        self.model = target.model
        self.n_batch = target.n_batch
        self.batch = Batch(self.n_batch)
        self.stats = SpecStats()

    def close(self) -> None:
        self.batch.close()

    def __enter__(self) -> "Decoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers -------------------------------------------------------------------------------------
    def _prefill(self, prompt: list[int]) -> np.ndarray:
        """Decode the prompt in n_batch chunks; feed each chunk to the head.  Returns the last logits row."""
        self.target.clear()
        if self.session is not None:
            self.session.reset()
        for i in range(0, len(prompt), self.n_batch):
            chunk = prompt[i:i + self.n_batch]
            self.batch.set(chunk, i, logits="last")
            self.target.decode(self.batch)
            if self.session is not None:
                self.session.process(chunk, i)
        return self.target.logits_ith(len(chunk) - 1)  # [n_vocab]

    def _native_time(self) -> float:
        draft = self.session.draft_ctx.t_native if self.session is not None else 0.0
        return self.target.t_native + draft

    def _check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise Eagle3Error("the prompt is empty")
        if len(prompt) >= self.target.n_ctx:
            raise Eagle3Error(f"the prompt has {len(prompt)} tokens, the context only {self.target.n_ctx}: raise -c")

    # -- generation ------------------------------------------------------------------------------------
    def stream(self, prompt: list[int], config: GenerateConfig, sampler: Sampler,
               speculative: bool = True) -> Iterator[list[int]]:
        """Yield the new tokens of each cycle; `self.stats` is up to date after every yield."""
        self._check_prompt(prompt)
        spec = speculative and self.session is not None
        k_max = config.draft_max if spec else 0
        st = self.stats = SpecStats(draft_max=k_max, n_prompt=len(prompt))
        sampler.reset()
        t0 = time.perf_counter()
        logits = self._prefill(prompt)
        st.t_prefill = time.perf_counter() - t0
        t_start = time.perf_counter()
        native0 = self._native_time()
        n_ctx = self.target.n_ctx
        pos = len(prompt)  # position of id_last
        id_last = sampler.pick(logits)
        st.n_target_forwards = 1
        st.n_generated = 1  # an end-of-generation token counts as generated; it is not yielded
        try:
            if is_eog(self.model, id_last):
                st.stop_reason = "eos"
                return
            yield [id_last]
            while True:
                if st.n_generated >= config.n_predict:
                    st.stop_reason = "length"
                    return
                room = n_ctx - pos - 1  # rows that fit after id_last
                if room < 0:
                    st.stop_reason = "context full"
                    return
                k = min(k_max, config.n_predict - st.n_generated - 1, room)
                # an EOG token ends the cycle as its own token: drafts after it are not accepted
                cyc = verify(self.target, self.session, self.batch, id_last, pos, k, config.draft_p_min,
                             lambda _rows, i: sampler.pick(self.target.logits_ith(i)), st,
                             stop=lambda tok: is_eog(self.model, tok))
                out, n_acc = cyc.out, cyc.n_acc
                if spec:
                    tell_head(self.session, cyc, pos, st)
                pos += n_acc + 1
                id_last = out[-1]
                if is_eog(self.model, id_last):
                    st.n_generated += len(out)
                    out = out[:-1]
                    st.stop_reason = "eos"
                    if out:
                        yield out
                    return
                st.n_generated += len(out)
                yield out
        finally:
            st.t_total = time.perf_counter() - t_start
            st.t_native = self._native_time() - native0

    def generate(self, prompt: list[int], config: GenerateConfig, sampler: Sampler | None = None,
                 speculative: bool = True, on_tokens: Callable[[list[int]], None] | None = None) -> RunResult:
        tokens: list[int] = []
        sampler = sampler or Sampler()
        try:
            for new in self.stream(prompt, config, sampler, speculative):
                tokens.extend(new)
                if on_tokens is not None:
                    on_tokens(new)
        except KeyboardInterrupt:
            self.stats.stop_reason = "interrupted"
            raise PartialResult(RunResult(tokens, detokenize(self.model, tokens), self.stats)) from None
        return RunResult(tokens, detokenize(self.model, tokens), self.stats)


class PartialResult(KeyboardInterrupt):
    """Ctrl-C during generate(): carries what was generated so far."""

    def __init__(self, result: RunResult):
        super().__init__("interrupted")
        self.result = result
