"""Generations on a target context, speculative or target-only: the CLI's and the benchmarks' surface of the
one run (speculator.Speculator.run), with a seeded numpy sampler.

Greedy output equals target-only decoding. At temperature > 0 the "match" rule draws one random number per
emitted token, in order, like the target-only sampler with the same seed (so the same seed gives the same
text); "rejection" draws the drafts, the accept tests and the residual tokens from the same stream, so its
text follows the target's distribution but not target-only's draws (spec_sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .config import DraftConfig
from .context import Context
from .errors import Eagle3Error
from .session import Eagle3Session
from .spec_sampling import RejectionSampler, Transform
from .speculator import RunHooks, Speculator
from .stats import ExactReport, RunResult, SpecStats
from .tokens import detokenize


CONTEXT_FULL = "context full"  # a run's stop_reason where the context held no more rows


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


@dataclass(frozen=True)
class GenerateConfig(DraftConfig):
    """A Runner's generation: the drafting knobs (config.DraftConfig) and how many tokens to generate."""

    n_predict: int = 128


def spec_sampling_label(temperature: float, spec_sampling: str, draft_temp_scale: float,
                        fallback: str = "") -> str:
    """How a run verifies drafts, for the statistics."""
    if temperature == 0.0:
        return "greedy"
    if spec_sampling == "rejection" and not fallback:
        return f"rejection (draft q at {draft_temp_scale:g}x the temperature)"
    return f"match (rejection needs a closed-form sampler; this one has {fallback})" if fallback else "match"


def greedy_in_graph(target: Context) -> bool:
    """Whether greedy runs take the argmax in the target's graph (llama.cpp's backend sampling) rather than from
    the logits: where the output layer runs on a local GPU, which then copies no verify row's logits to the host
    (but those of a draft tree's rows the choice, sequence 0's, passes over: RunHooks.pick_tree).
    Not on a CPU, where ggml's argmax is a scalar loop: a row cost 0.6 ms more at a 128k vocab and 0.2 ms at
    SmolLM2's 49k than reading the logits (bench/NOTES.md, "Python at real vocab sizes"); nor over RPC, where
    each sampled row is read back with a round trip of its own, the logits with one for all rows."""
    p = target.model.placement
    return p.offloaded == p.n_layers and not p.remote


class _RunnerHooks(RunHooks):
    """How a Runner picks tokens (the graph's argmax, or its Sampler) and where it stops."""

    def __init__(self, target: Context, sampler: Sampler, n_predict: int):
        self.n_predict = n_predict
        self.n_ctx = target.n_ctx
        pick, logits_ith = sampler.pick, target.logits_ith
        if target.greedy_sampling:  # the graph's choices: no logits copied out, no numpy pass over them
            sampled, chosen = target.sampled_token, target.chosen_token

            def pick_tree(_rows, _pos, i: int) -> int:
                tok = chosen(i)
                return tok if tok is not None else pick(logits_ith(i))

            self.pick = lambda _rows, _pos, i: sampled(i)  # noqa: E731
            self.pick_tree = pick_tree
        else:
            self.pick = self.pick_tree = lambda _rows, _pos, i: pick(logits_ith(i))  # noqa: E731

    def first_token(self, row: int) -> int:
        return self.pick(None, 0, row)

    def budget(self, pos: int, st: SpecStats) -> int | None:
        if st.n_generated >= self.n_predict:
            st.stop_reason = "length"
            return None
        room = self.n_ctx - pos - 1  # rows that fit after id_last
        if room < 0:
            st.stop_reason = CONTEXT_FULL
            return None
        return min(self.n_predict - st.n_generated - 1, room)


class Runner:
    """Runs generations on a target context, with an Eagle3Session (speculative) or without (baseline)."""

    def __init__(self, target: Context, session: Eagle3Session | None = None, graph_picks: bool = True):
        """The session stays the caller's: closing the Runner leaves it open. graph_picks False: greedy runs read
        the logits even where the target's graph would pick (a benchmark's twin)."""
        self.target = target
        self.graph_picks = graph_picks
        self.model = target.model
        self.spec = Speculator(target, session, owns_session=False)
        self.stats = SpecStats()

    @property
    def session(self) -> Eagle3Session | None:
        return self.spec.session

    def close(self) -> None:
        self.spec.close()

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- generation ------------------------------------------------------------------------------------
    def _choose(self, sampler: Sampler) -> None:
        """Let the target's graph pick greedy runs' tokens where it pays (greedy_in_graph), else read the logits."""
        target = self.target
        target.set_greedy_sampling(sampler.temperature <= 0.0 and target.owned and self.graph_picks
                                   and greedy_in_graph(target))

    def check_prompt(self, prompt: list[int]) -> None:
        """That the prompt leaves the context room for a token (stream checks it; a caller can before prepare)."""
        if len(prompt) >= self.target.n_ctx:
            raise Eagle3Error(f"the prompt has {len(prompt)} tokens, the context only {self.target.n_ctx}: raise -c")

    def prepare(self, config: GenerateConfig, sampler: Sampler | None = None) -> ExactReport:
        """Speculator.prepare for runs with `sampler` (default: greedy): the exactness probe and the cost curve now,
        the verify rows read as those runs will read them."""
        self._choose(sampler or Sampler())
        return self.spec.prepare(config)

    def stream(self, prompt: list[int], config: GenerateConfig, sampler: Sampler,
               speculative: bool = True) -> Iterator[list[int]]:
        """Yield the new tokens of each cycle; `self.stats` is up to date after every yield."""
        self.check_prompt(prompt)
        speculative = speculative and self.session is not None and config.draft_max > 0
        target = self.target
        self._choose(sampler)
        sampler.reset()
        rejection = None
        if speculative and sampler.temperature > 0.0 and config.spec_sampling == "rejection":
            rejection = sampler.rejection(config.draft_temp_scale)
        label = spec_sampling_label(max(sampler.temperature, 0.0), config.spec_sampling, config.draft_temp_scale)
        run = self.spec.run(prompt, _RunnerHooks(target, sampler, config.n_predict),
                            config if speculative else None, rejection, label)
        st = self.stats = run.stats
        is_end = self.spec.is_end
        try:
            for cyc in run:
                if is_end(cyc.out[-1]):
                    st.stop_reason = "eos"
                    if len(cyc.out) > 1:
                        yield cyc.out[:-1]
                    return
                yield cyc.out
        finally:
            run.close()

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
