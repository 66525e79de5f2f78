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
from .policy import (POLICIES, AdaptivePolicy, CostCurve, CostKey, DraftPolicy, FixedPolicy, load_costs,
                     measure, save_costs)
from .session import Eagle3Session
from .spec_sampling import (DEFAULT_DRAFT_TEMP_SCALE, SPEC_SAMPLING, RejectionSampler, Transform,
                            verify_match)
from .stats import RunResult, SpecStats, StageClock
from .tokens import detokenize, eog_check


@dataclass
class Sampler:
    """temperature 0 = greedy; otherwise llama.cpp's usual chain: top-k → top-p → min-p → temperature
    (spec_sampling.Transform), one seeded random stream."""

    temperature: float = 0.0
    seed: int = 0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def reset(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    @property
    def transform(self) -> Transform:
        return Transform(self.temperature, self.top_k, self.top_p, self.min_p)

    def pick(self, logits: np.ndarray) -> int:
        """One token from a row of logits.  # logits: [n_vocab]"""
        if self.temperature <= 0.0:
            return int(logits.argmax())  # the method: np.argmax adds ~6 us of dispatch to a cache-cold cycle
        return self.transform.dist(logits).sample(self.rng.random())

    def rejection(self, draft_scale: float) -> RejectionSampler:
        """Rejection sampling on this sampler's transform and random stream (temperature > 0)."""
        return RejectionSampler(self.transform, draft_scale, self.rng)


@dataclass
class GenerateConfig:
    n_predict: int = 128
    draft_max: int = 4  # K: the most tokens one cycle drafts
    draft_p_min: float = 0.0  # the fixed policy's stop rule
    draft_policy: str = "adaptive"  # "adaptive" (policy.AdaptivePolicy) or "fixed" (always K, p_min)
    # at temperature > 0: "match" (greedy drafts kept where the target's own sample equals them: the same
    # seed gives target-only's text) or "rejection" (drafts from the head's q, kept with probability
    # min(1, p/q): the target's distribution, more drafts kept; spec_sampling.py)
    spec_sampling: str = "match"
    draft_temp_scale: float = DEFAULT_DRAFT_TEMP_SCALE  # rejection: q's temperature = the target's x this

    def __post_init__(self) -> None:
        if self.spec_sampling not in SPEC_SAMPLING:
            raise Eagle3Error(f"unknown speculative sampling {self.spec_sampling!r}: choose one of "
                              f"{', '.join(SPEC_SAMPLING)}")
        if self.draft_temp_scale < 0.0:
            raise Eagle3Error(f"the draft temperature scale cannot be negative (got {self.draft_temp_scale})")


@dataclass(slots=True)
class Cycle:
    """One draft → verify cycle."""

    rows: list[int]  # [id_last, d1..dk]: what the target decoded
    out: list[int]  # the target's choices: the accepted drafts, then the cycle's own token
    n_acc: int  # accepted drafts


class Speculator:
    """The speculative cycle, the one both loops run (`Decoder.stream` here, `Eagle3Llama` in llama.py):
    the policy sets the draft budget, the head drafts (the policy judging each step), the target decodes
    [id_last, d1..dk] in one batch and `pick(rows, i)` chooses row by row while the choice equals the
    draft (and `stop` does not hold for it); rejected rows leave the target's cache, the kept rows are
    set aside for the head, and the policy learns the outcome and the timings. Without a session or
    policy the cycle is plain decoding of one row."""

    def __init__(self, target: Context, session: Eagle3Session | None, n_batch: int, cost_tag: str = ""):
        """cost_tag: what else the cost curve depends on (KV cache types, GPU layers), for its cache key."""
        self.target = target
        self.session = session
        self.batch = Batch(n_batch)
        self.seq = 0  # the target sequence this speculator decodes (slots.py runs one per sequence)
        self.row0 = 0  # where its rows start in the target's last batch (0 unless sequences share it)
        self._decode = target.decode  # decodes self.batch (slots.py: in a batch shared with other sequences)
        self.logits_ith = target.logits_ith  # row i of its rows
        self.k_limit = n_batch - 1  # drafts that fit in one verify batch
        self.cost_tag = cost_tag
        self.costs: CostCurve | None = None
        self._adaptive: AdaptivePolicy | None = None

    def close(self) -> None:
        self.batch.close()

    def clear_target(self) -> None:
        """Empty the target's cache of this speculator's sequence."""
        self.target.clear()

    def seq_rm(self, p0: int, p1: int = -1) -> bool:
        """Drop positions p0..p1 of this speculator's sequence from the target's cache."""
        return self.target.seq_rm(self.seq, p0, p1)

    def native_time(self) -> float:
        """Seconds spent in llama.cpp so far: the target's decodes and the head's."""
        draft = self.session.draft_ctx.t_native if self.session is not None else 0.0
        return self.target.t_native + draft

    # -- the policy ----------------------------------------------------------------------------------
    def needs_calibration(self, config: GenerateConfig) -> bool:
        k = min(config.draft_max, self.k_limit)
        return config.draft_policy == "adaptive" and (self.costs is None or self.costs.k_max < k)

    def policy_for(self, config: GenerateConfig) -> DraftPolicy:
        """The policy for a generation. The adaptive one persists (what it learnt carries over); its cost
        curve comes from the cache or a calibration, which CLEARS the target's and the head's caches:
        callers check needs_calibration() while the caches hold nothing they need."""
        k = min(config.draft_max, self.k_limit)
        if config.draft_policy == "fixed":
            policy: DraftPolicy = FixedPolicy(k, config.draft_p_min)
        elif config.draft_policy == "adaptive":
            if self.needs_calibration(config):
                self.costs = self.calibrate(k)
                self._adaptive = None
            if self._adaptive is None or self._adaptive.k_max != k:
                self._adaptive = AdaptivePolicy(self.costs, k, self.session.window)
            policy = self._adaptive
        else:
            raise Eagle3Error(f"unknown draft policy {config.draft_policy!r}: choose one of {', '.join(POLICIES)}")
        policy.begin()
        return policy

    def calibrate(self, k_max: int) -> CostCurve:
        """The cost curve from the cache, or measured now (a fraction of a second) and cached."""
        target, session = self.target, self.session
        key = CostKey.for_files(target.model.path, session.draft_ctx.model.path, target.n_threads,
                                self.cost_tag, self.batch.capacity)
        cached = load_costs(key, k_max)
        if cached is not None:
            return cached
        tok = 0  # any token: the cost of a row does not depend on which
        feats = np.zeros((2, session.extract.width), np.float32)  # [2, 3 * n_embd_tgt]

        def run_verify(n: int) -> float:
            self.batch.set([tok] * n, 0, logits="all")
            t = time.perf_counter()
            target.decode(self.batch)
            if target.greedy_sampling:  # what a cycle then reads: the graph's choices
                for i in range(n):
                    target.sampled_token(i)
            else:
                logits = target.logits(n)  # [n, n_vocab]
                for i in range(n):
                    int(np.argmax(logits[i]))
            t = time.perf_counter() - t
            self.seq_rm(0)
            return t

        def run_draft(steps: int) -> float:
            """A draft as a cycle runs it: the head first catches up on two kept rows."""
            session.reset()
            session.process([tok] * 3, 0, np.zeros((3, session.extract.width), np.float32))
            session.draft(tok, 1, lambda confs, n_max: len(confs))
            session.accept(0)
            session.keep([tok, tok], 3, feats)
            t = time.perf_counter()
            session.draft(tok, steps, lambda confs, n_max: len(confs) if len(confs) >= n_max else -1)
            return time.perf_counter() - t

        target.clear()
        try:
            curve = measure(run_verify, run_draft, k_max)
        finally:
            target.clear()
            session.reset()
        save_costs(key, curve)
        return curve

    def prefill(self, tokens: list[int], pos0: int, feed_head: bool, whole: bool = True, logits: str = "last",
                on_chunk: Callable[[list[int], int], None] | None = None) -> int:
        """Decode tokens at pos0.. in n_batch chunks (each chunk's rows go to the head when feed_head:
        all of them when `whole`, else only the last `window` rows, set aside for the first draft).
        `logits` is the batch's output rows ("last" or "all"); `on_chunk(chunk, pos)` runs right after each
        chunk's decode (the drop-in keeps llama-cpp-python's token and score arrays with it).
        Returns the size of the last chunk (its last row holds the next token's logits)."""
        n_batch = self.batch.capacity
        m = 0
        for i in range(0, len(tokens), n_batch):
            chunk = tokens[i:i + n_batch]
            m = len(chunk)
            self.batch.set(chunk, pos0 + i, logits=logits)
            self._decode(self.batch)
            if on_chunk is not None:
                on_chunk(chunk, pos0 + i)
            if feed_head and whole:
                self.session.process(chunk, pos0 + i)
            elif feed_head:
                self.session.keep(chunk, pos0 + i)
        return m

    def cycle(self, policy: "DraftPolicy | None", id_last: int, pos: int, k_cap: int,
              pick: Callable[[list[int], int], int], st: SpecStats,
              stop: Callable[[int], bool] | None = None, rejection: RejectionSampler | None = None) -> Cycle:
        """With `rejection`, the head draws its drafts from q and the rows are verified by rejection
        sampling (`pick` is not called); otherwise the drafts are the head's argmax and kept while
        `pick(rows, i)` equals them."""
        session = self.session if policy is not None else None
        k = policy.plan(min(k_cap, self.k_limit)) if session is not None else 0
        if k == 0 and rejection is None:
            # A plain cycle, the common one: it runs right after the target's graph has pushed everything
            # out of the caches, so it touches as little as it can (each step here costs microseconds).
            rows = [id_last]
            self.batch.set_one(id_last, pos)
            t = time.perf_counter()
            self._decode(self.batch)
            out = [pick(rows, 0)]
            t_verify = time.perf_counter() - t
            st.t_target += t_verify
            st.n_target_forwards += 1
            if session is not None:
                st.accept_hist[0] += 1  # st.record_cycle(0, 0)
                t = time.perf_counter()
                if policy.keep_rows:
                    session.keep(rows, pos)
                else:
                    session.skip(rows, pos)
                st.t_process += time.perf_counter() - t
                policy.observe_plain(t_verify)
            return Cycle(rows, out, 0)
        drafts: list[int] = []
        n_steps, t_draft = 0, 0.0
        if k > 0:
            t = time.perf_counter()
            if rejection is None:
                drafts = session.draft(id_last, k, policy.judge)
            else:
                drafts = session.draft(id_last, k, policy.judge, sampler=rejection)
            t_draft = time.perf_counter() - t
            n_steps = len(session.confs)
            st.t_draft += t_draft
        t = time.perf_counter()
        rows = [id_last] + drafts
        self.batch.set(rows, pos, logits="all")
        self._decode(self.batch)
        if rejection is not None:
            out = rejection.verify(drafts, session.qs if drafts else [], self.logits_ith, stop)
        else:
            out = verify_match(drafts, lambda i: pick(rows, i), stop)
        n_acc = len(out) - 1
        if n_acc < len(drafts):
            self.seq_rm(pos + n_acc + 1)
        t_verify = time.perf_counter() - t
        st.t_target += t_verify
        st.n_target_forwards += 1
        if session is not None:
            st.record_cycle(len(drafts), n_acc)
            t = time.perf_counter()
            if n_steps:
                session.accept(n_acc)
            if policy.keep_rows:
                session.keep(rows[:n_acc + 1], pos)
            else:
                session.skip(rows[:n_acc + 1], pos)
            st.t_process += time.perf_counter() - t
            policy.observe(session.confs if n_steps else [], len(drafts), n_acc, n_steps, t_verify, t_draft,
                           len(out))
        return Cycle(rows, out, n_acc)


def spec_sampling_label(temperature: float, spec_sampling: str, draft_temp_scale: float,
                        fallback: str = "") -> str:
    """How a run verifies drafts, for the statistics."""
    if temperature == 0.0:
        return "greedy"
    if spec_sampling == "rejection" and not fallback:
        return f"rejection (draft q at {draft_temp_scale:g}x the temperature)"
    return f"match (rejection needs a closed-form sampler; this one has {fallback})" if fallback else "match"


class Decoder:
    """Runs generations on a target context, with an Eagle3Session (speculative) or without (baseline)."""

    def __init__(self, target: Context, session: Eagle3Session | None = None, cost_tag: str = ""):
        self.target = target
        self.session = session
        self.model = target.model
        self.spec = Speculator(target, session, target.n_batch, cost_tag)
        self.stats = SpecStats()
        self.is_end = eog_check(self.model)  # remembers per token across generations

    def close(self) -> None:
        self.spec.close()

    def __enter__(self) -> "Decoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
        spec = speculative and self.session is not None and config.draft_max > 0
        target = self.target
        # greedy: the target's graph takes the argmax (no logits copied out, no numpy pass over them)
        target.set_greedy_sampling(sampler.temperature <= 0.0 and target.owned)
        policy = self.spec.policy_for(config) if spec else None
        st = self.stats = SpecStats(draft_max=policy.k_max if policy is not None else 0, n_prompt=len(prompt))
        sampler.reset()
        rejection = None
        if spec and sampler.temperature > 0.0 and config.spec_sampling == "rejection":
            rejection = sampler.rejection(config.draft_temp_scale)
        if spec:
            st.spec_sampling = spec_sampling_label(max(sampler.temperature, 0.0), config.spec_sampling,
                                                   config.draft_temp_scale)
        clock = StageClock(st, self.spec.native_time)
        target.clear()
        if spec:
            self.session.reset()
        m = self.spec.prefill(prompt, 0, feed_head=spec, whole=spec and policy.wants_prompt())
        if target.greedy_sampling:
            id_last = target.sampled_token(m - 1)
            sampled = target.sampled_token
            pick = lambda _rows, i: sampled(i)  # noqa: E731
        else:
            id_last = sampler.pick(target.logits_ith(m - 1))
            pick = lambda _rows, i: sampler.pick(target.logits_ith(i))  # noqa: E731
        clock.prefilled()  # the head's work on the prompt included
        n_ctx = target.n_ctx
        pos = len(prompt)  # position of id_last
        st.n_target_forwards = 1
        st.n_generated = 1  # an end-of-generation token counts as generated; it is not yielded
        is_end = self.is_end
        try:
            if is_end(id_last):
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
                k = min(config.n_predict - st.n_generated - 1, room)
                # an EOG token ends the cycle as its own token: drafts after it are not accepted
                cyc = self.spec.cycle(policy, id_last, pos, k, pick, st, stop=is_end, rejection=rejection)
                out, n_acc = cyc.out, cyc.n_acc
                pos += n_acc + 1
                id_last = out[-1]
                st.n_generated += len(out)
                if is_end(id_last):
                    st.stop_reason = "eos"
                    if len(out) > 1:
                        yield out[:-1]
                    return
                yield out
        finally:
            clock.finished()
            if policy is not None:
                st.policy = policy.finish_stats()

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
