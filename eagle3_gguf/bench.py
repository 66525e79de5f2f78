"""Benchmarks: contenders interleaved per prompt on one loaded pair, measured the one way every figure here is.

`eagle3-gguf bench` and the developers' scripts (scripts/bench*.py) measure through this module; benchreport.py
summarises and renders what it measures. The method:

- Every prompt runs every contender back to back in one process, on one pair of contexts: target-only first,
  then each contender, then target-only again (drift over a prompt's runs hits all alike, and the two
  target-only runs bracket it). `repeat` rounds do that again.
- A prompt's speed is tokens generated after the prompt over the generation's time (the prefill not counted,
  as everywhere in bench/). Its ratio to target-only is, in each round, the contender's fastest run against
  target-only's fastest run of that round (another process or a clock dip only ever slows a run down, as
  timeit takes the best of its repeats), then the median over rounds (`per_prompt_ratio`).
- Each contender decodes with its own Runner (sharing the contexts and the head session, unless it brings a
  session of its own), so what its policy learns carries over from prompt to prompt as in a long-lived process,
  and interleaving does not reset it. With `rotate` the contenders' order turns by one each prompt.
- Greedy runs are compared token for token with the round's first target-only run (`identical`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from . import benchmarks
from .config import ADAPTIVE_TREE, COMMAND_LINE, LIBRARY, MAX_DRAFT_MAX
from .decode import GenerateConfig, Runner, Sampler
from .errors import Eagle3Error
from .pair import Pair, PairConfig, load_pair
from .costs import CostCurve, cpu_model
from .session import Eagle3Session
from .stats import ExactReport, RunResult, SpecStats, tokens_per_second
from .tokens import Message, apply_chat_template, tokenize


@dataclass(frozen=True)
class Contender:
    """One way of decoding a prompt: a GenerateConfig (None: target-only), greedy unless `temperature`."""

    name: str
    config: GenerateConfig | None = None
    flags: str = ""  # the generate flags that select it, for the advice
    temperature: float = 0.0  # > 0: sampled with the seed `seed` + the prompt's index (one seed per prompt)
    seed: int = 0
    # a contender outside this process (scripts/bench.py's upstream llama.cpp): the prompt → its statistics
    external: Callable[["BenchPrompt"], SpecStats] | None = None
    # a head session of its own, made on the loaded pair (scripts/replay.py's replayed acceptance); None: the
    # bench's session
    session: Callable[[Pair], Eagle3Session] | None = None
    head_choice: str = "auto"  # whether the head's graph chooses its drafts' tokens: Speculator.head_choice
    graph_picks: bool = True  # False: greedy runs read the target's logits where its graph would pick (Runner)

    @property
    def speculative(self) -> bool:
        return self.config is not None and self.config.draft_max > 0


TARGET = Contender("target", None, "--draft-max 0")  # the reference: first and last in every round


def named_contenders(n_predict: int) -> dict[str, Contender]:
    """The contenders `bench --contenders` names (besides `kN`: fixed K=N at the command line's p_min)."""
    base = GenerateConfig(n_predict=n_predict, draft_p_min=COMMAND_LINE.draft_p_min)
    default = dataclasses.replace(base, draft_topk=ADAPTIVE_TREE.draft_topk, draft_nodes=ADAPTIVE_TREE.draft_nodes)
    return {
        "target": TARGET,
        "default": Contender("default", default, "generate's defaults"),
        "lookup": Contender("lookup", dataclasses.replace(base, draft_head=False), "--draft-head off"),
        "head": Contender("head", dataclasses.replace(default, draft_lookup=False), "--draft-lookup off"),
        "tree": Contender("tree", dataclasses.replace(base, draft_policy="fixed", draft_topk=4, draft_nodes=8),
                          "--draft-policy fixed --draft-topk 4 --draft-nodes 8"),
        **{f"k{k}": fixed_k(k, n_predict) for k in (1, 2, 4)},
    }


def fixed_k(k: int, n_predict: int) -> Contender:
    config = GenerateConfig(n_predict=n_predict, draft_max=k, draft_policy="fixed",
                            draft_p_min=COMMAND_LINE.draft_p_min)
    return Contender(f"k{k}", config, f"--draft-policy fixed --draft-max {k}")


DEFAULT_CONTENDERS = ("default", "k2", "lookup", "head")


def contenders_from(names: Iterable[str], n_predict: int, exact: str = "auto") -> list[Contender]:
    """Contenders by name, each verifying under `exact` (config.EXACT_MODES); target-only is always measured (it is
    the reference), so it is left out here."""
    known = named_contenders(n_predict)
    out: list[Contender] = []
    for name in names:
        m = re.fullmatch(r"k(\d+)", name)
        if name in known:
            c = known[name]
        elif m and 1 <= int(m.group(1)) <= MAX_DRAFT_MAX:
            c = fixed_k(int(m.group(1)), n_predict)
        else:
            raise Eagle3Error(f"--contenders: unknown contender '{name}' (valid: {', '.join(known)}, or kN for any "
                              f"fixed K from 1 to {MAX_DRAFT_MAX})")
        if c.name != TARGET.name and c.name not in (o.name for o in out):
            out.append(dataclasses.replace(c, config=dataclasses.replace(c.config, exact=exact)))
    return out


# -- prompts ---------------------------------------------------------------------------------------------

@dataclass
class BenchPrompt:
    workload: str
    id: str
    text: str  # the user message
    tokens: list[int] = field(default_factory=list)  # as the target reads it (chat template where it has one)
    rendered: str = ""  # the text the target reads, for contenders outside this process (Contender.external)


def load_workloads(names: Iterable[str], limit: int | None) -> list[BenchPrompt]:
    """The named workloads' prompts (benchmarks.WORKLOADS), `limit` each, taken in turns (the first prompt of
    each workload, then the second of each...) so that a run cut short still covers every workload."""
    sources = {name: benchmarks.source(name) for name in names}  # every name checked before any download
    sets = [[BenchPrompt(name, p.id, p.text) for p in benchmarks.load(source, limit)]
            for name, source in sources.items()]
    return [p for turn in zip_longest_skip(sets) for p in turn]


def zip_longest_skip(sets: list[list]) -> Iterator[list]:
    """The i-th items of every list that has one, for i = 0, 1, ..."""
    for i in range(max((len(s) for s in sets), default=0)):
        yield [s[i] for s in sets if i < len(s)]


def read_prompt_file(path: Path, what: str = "") -> str:
    """-f's file as UTF-8 text: a file, or a pipe (`-f <(...)`); `what`: what its lines hold, for the error."""
    if path.is_dir():
        raise Eagle3Error(f"{path} is a directory: -f takes a text file")
    if not path.exists():
        raise Eagle3Error(f"{path}: no such prompt file")
    try:
        return path.read_text(encoding="utf-8-sig")  # a BOM, as some Windows editors write, is no prompt text
    except UnicodeDecodeError:
        raise Eagle3Error(f"{path}: not UTF-8 text{what}") from None
    except OSError as e:
        raise Eagle3Error(f"{path}: cannot read it ({e.strerror})") from None


def load_jsonl(path: Path, limit: int | None = None) -> list[BenchPrompt]:
    """A user's prompts: one per line, a JSON object with "text" (and optionally "id"; default: the line's number)
    or a JSON string. The workload is named for the file."""
    lines = read_prompt_file(path, " (one JSON object or string a line)").splitlines()
    out, seen = [], {}  # id -> its line
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            raise Eagle3Error(f"{path}:{n}: not JSON (one object with \"text\", or a string, a line)") from None
        text = item if isinstance(item, str) else item.get("text") if isinstance(item, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise Eagle3Error(f"{path}:{n}: no prompt text (a line is {{\"text\": \"...\"}} or a JSON string)")
        pid = str(item.get("id", n) if isinstance(item, dict) else n)
        if pid in seen:  # runs are told apart by their prompt's id: two would be measured as one
            raise Eagle3Error(f"{path}:{n}: the id {pid} is line {seen[pid]}'s too: give each prompt its own id (a line "
                              "without one has its line number)")
        seen[pid] = n
        out.append(BenchPrompt(path.stem, pid, text))
    if not out:
        raise Eagle3Error(f"{path}: no prompts in it")
    return out[:limit] if limit else out


# -- one run's record ------------------------------------------------------------------------------------

@dataclass
class PromptRun:
    """One contender's run on one prompt, in one round."""

    workload: str
    prompt_id: str
    contender: str
    round: int
    n_prompt: int
    tokens: int  # generated
    seconds: float  # the generation after the prompt
    forwards: int  # target forwards (the prefill's included)
    drafted: int = 0
    accepted: int = 0
    drafted_by_pos: list[int] = field(default_factory=list)  # [M]: drafts offered at position i
    accepted_by_pos: list[int] = field(default_factory=list)  # [M]
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    tree_cycles: int = 0
    branch_kept: int = 0  # tree cycles whose kept path left the chain for a branch
    chosen: list[int] = field(default_factory=list)  # [K + 1]: cycles that verified 0..K drafts (a policy's)
    probes: int = 0
    python_ms: float = 0.0  # per cycle, outside llama.cpp
    draft_s: float = 0.0  # in the head's draft steps
    prefill_s: float = 0.0
    identical: bool | None = None  # the same tokens as the round's first target-only run (greedy runs)
    stopped: str = ""  # why the run ended (SpecStats.stop_reason)

    @property
    def tok_s(self) -> float:
        return tokens_per_second(self.tokens, self.seconds)

    @property
    def tau(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    @classmethod
    def of(cls, st: SpecStats, p: BenchPrompt, contender: str, rnd: int, identical: bool | None) -> "PromptRun":
        pol = st.policy
        return cls(p.workload, p.id, contender, rnd, st.n_prompt, st.n_generated, st.t_total, st.n_target_forwards,
                   st.n_drafted, st.n_accepted, list(st.drafted_by_pos), list(st.accepted_by_pos), st.lookup_drafted,
                   st.lookup_accepted, st.tree_cycles, st.tree_branch_kept, list(pol.chosen) if pol else [],
                   pol.probes if pol else 0, st.python_per_cycle_ms, st.t_draft, st.t_prefill, identical,
                   st.stop_reason)


# -- the per-prompt ratio --------------------------------------------------------------------------------

def fastest(runs: Iterable, key=lambda r: r.prompt_id) -> dict:
    """tok/s of each prompt (or each `key`): its fastest run.  # key -> tok/s"""
    speed: dict = {}
    for r in runs:
        speed[key(r)] = max(speed.get(key(r), 0.0), r.tok_s)
    return speed


def per_prompt_ratio(runs: Iterable, base: Iterable) -> dict[str, float]:
    """Each prompt's speed against the reference's (target-only's), robust both ways: in every round the
    contender's fastest run against the reference's fastest run of the same round, then the median over
    rounds (a lucky or unlucky round does not decide the prompt). Runs of one workload.  # prompt id -> ratio"""
    by_round = lambda r: (r.prompt_id, r.round)  # noqa: E731
    ours, ref = fastest(runs, by_round), fastest(base, by_round)
    rounds: dict[str, list[float]] = {}
    for (pid, rnd), v in ours.items():
        if ref.get((pid, rnd)):
            rounds.setdefault(pid, []).append(v / ref[(pid, rnd)])
    return {pid: statistics.median(v) for pid, v in rounds.items()}


def whole_prompts(runs: list[PromptRun], per_prompt: int) -> list[PromptRun]:
    """The runs of the prompts whose every run is there (a run cut short drops its prompt)."""
    count: dict[tuple[str, str], int] = {}
    for r in runs:
        count[(r.workload, r.prompt_id)] = count.get((r.workload, r.prompt_id), 0) + 1
    return [r for r in runs if count[(r.workload, r.prompt_id)] >= per_prompt]


# -- the measurement -------------------------------------------------------------------------------------

@dataclass
class Setup:
    """What the figures were measured on: the header of a report."""

    target: str  # file names
    head: str
    machine: str  # the CPU's model and cores
    target_on: str  # native.Placement: "CPU" or the GPU devices and layers offloaded
    head_on: str
    threads: int
    chat_template: bool  # the prompts went through the target's chat template (else raw text)
    n_predict: int
    exact: dict[str, ExactReport]  # per speculative contender: what the exactness probe found and kept
    verify_cost: list[float]  # [K + 1]: verifying 1..K+1 rows, in one-row units (the calibrated curve)
    draft_step: float  # a head draft step, in one-row units
    draft_fixed: float  # what a drafting cycle costs besides its steps (the head's catch-up), in one-row units
    row_ms: float  # one row's verify (a plain target step), milliseconds

    @classmethod
    def of(cls, pair: Pair, costs: CostCurve, exact: dict[str, ExactReport], chat: bool, n_predict: int) -> "Setup":
        one = costs.verify(1)
        machine = f"{cpu_model() or platform.processor() or platform.machine()}, {os.cpu_count()} cores"
        return cls(pair.target_model.path.name, pair.head_model.path.name, machine, str(pair.target_model.placement),
                   str(pair.head_model.placement), pair.target.n_threads, chat, n_predict, exact, costs.relative(),
                   costs.draft_step_s / one, costs.draft_fixed_s / one, 1e3 * one)


class RunHooks:
    """What a benchmark does around each run in this process; these do nothing. scripts/bench_scale.py
    replays acceptance: before a run it hands the contender's session the round's target-only text, after it
    leaves the replay's own time out of the run."""

    def before(self, c: Contender, p: BenchPrompt, index: int, reference: list[int]) -> None:
        """Before contender c runs prompt p (the `index`-th); `reference`: the round's target-only tokens."""

    def after(self, c: Contender, p: BenchPrompt, run: PromptRun, result: RunResult) -> PromptRun:
        """The record of the run that just ended (`result`: the Runner's); what measure() yields."""
        return run


NO_HOOKS = RunHooks()


class Bench:
    """A loaded pair and a Runner per contender: prepare() once, then measure() prompts."""

    def __init__(self, target_path: Path, head_path: Path, pair_config: PairConfig, contenders: list[Contender]):
        seqs = max((c.config.tree_sequences for c in contenders if c.config is not None), default=1)
        self.chat = True  # every prompt so far went through the chat template
        self.stopped = ""  # why measure() stopped before the last prompt
        self.setup: Setup | None = None  # prepare()'s
        self._open = ExitStack()  # closes the runners (each before its own session), the session, the pair
        with self._open as opening:  # a failure half-way closes what was opened
            self.pair = opening.enter_context(load_pair(target_path, head_path, dataclasses.replace(
                pair_config, n_seq_max=max(pair_config.n_seq_max, seqs))))
            self.session = opening.enter_context(Eagle3Session(self.pair.target, self.pair.head))
            self.sessions: dict[str, Eagle3Session] = {}  # the contenders' own (Contender.session)
            self.runners: dict[str, Runner] = {}
            self.contenders: list[Contender] = []
            self.add([TARGET, *contenders])  # into `opening` (self._open until the next line)
            self._open = opening.pop_all()

    def add(self, contenders: list[Contender]) -> None:
        """More contenders, before prepare(): a Runner each (target-only decodes through one with the session
        too: it turns the head's feature extraction off for plain runs, so target-only pays exactly what plain
        decoding costs). Their trees must fit the sequences the pair was loaded with."""
        if self.setup is not None:
            raise Eagle3Error("Bench.add: contenders join before prepare() (their probes and costs come first)")
        for c in contenders:
            if c.config is not None and c.config.tree_sequences > self.pair.target.n_seq_max:
                raise Eagle3Error(f"Bench.add: contender {c.name} needs {c.config.tree_sequences} sequences, the pair "
                                  f"was loaded with {self.pair.target.n_seq_max}")
            if c.external is None:
                session = self.session
                if c.session is not None:
                    session = self.sessions[c.name] = self._open.enter_context(c.session(self.pair))
                self.runners[c.name] = self._open.enter_context(Runner(self.pair.target, session, c.graph_picks))
                self.runners[c.name].spec.head_choice = c.head_choice
            if c.name != TARGET.name:
                self.contenders.append(c)

    def close(self) -> None:
        self._open.close()

    def __enter__(self) -> "Bench":
        return self

    def __exit__(self, *exc) -> None:
        self._open.close()

    def tokenize(self, prompts: list[BenchPrompt]) -> list[BenchPrompt]:
        """Each prompt as the target reads it: its chat template where its GGUF has one, raw text otherwise."""
        model = self.pair.target_model
        for p in prompts:
            try:  # as chat_tokens: the template writes its own BOS
                p.rendered = apply_chat_template(model, [Message("user", p.text)])
                p.tokens = tokenize(model, p.rendered, add_special=False)
            except Eagle3Error:  # no template (a base model, Gemma 3 270M): the text as it is
                p.rendered, p.tokens, self.chat = p.text, tokenize(model, p.text), False
            if len(p.tokens) + 1 >= self.pair.target.n_ctx:
                raise Eagle3Error(f"{p.workload} prompt {p.id} has {len(p.tokens)} tokens, the context only "
                                  f"{self.pair.target.n_ctx}: raise -c")
        return prompts

    def prepare(self, n_predict: int) -> Setup:
        """The exactness probe and the cost calibration for every contender (cached per set-up), before any
        timing (they also warm the target's graphs up): what the report's header says."""
        exact = {c.name: self.runners[c.name].prepare(c.config, Sampler(c.temperature)) for c in self.contenders
                 if c.speculative}
        spec = self.runners[TARGET.name].spec
        costs = spec.calibrate(min(LIBRARY.draft_lookup_max, spec.k_fit))  # the widest default draft that fits
        self.setup = Setup.of(self.pair, costs, exact, self.chat, n_predict)
        return self.setup

    def measure(self, prompts: list[BenchPrompt], repeat: int = 1, n_predict: int = 128,
                deadline: float | None = None, hooks: RunHooks = NO_HOOKS, rotate: bool = False) -> Iterator[PromptRun]:
        """Every prompt's runs in order (target-only, each contender, target-only; `repeat` rounds), one at a
        time, after prepare() where it has not run. `deadline` (time.monotonic()): no prompt starts that would be
        expected to end past it (at least one runs); `stopped` then says so. `rotate`: the i-th prompt's
        contenders start at the i-th (order effects spread over all)."""
        if self.setup is None:
            self.prepare(n_predict)
        per_prompt: list[float] = []
        plain = GenerateConfig(n_predict=n_predict)
        for i, p in enumerate(prompts):
            if deadline is not None and per_prompt and time.monotonic() + statistics.mean(per_prompt) > deadline:
                self.stopped = f"time limit: {i} of {len(prompts)} prompts measured"
                return
            t0 = time.monotonic()
            turn = i % len(self.contenders) if rotate and self.contenders else 0
            order = [TARGET, *self.contenders[turn:], *self.contenders[:turn], TARGET]
            for rnd in range(repeat):
                reference: list[int] = []  # the round's first target-only run: what the others are compared with
                for n, c in enumerate(order):
                    if c.external is not None:
                        yield PromptRun.of(c.external(p), p, c.name, rnd, None)
                        continue
                    hooks.before(c, p, i, reference)
                    sampler = Sampler(c.temperature, c.seed + i)
                    r = self.runners[c.name].generate(p.tokens, c.config or plain, sampler, speculative=c.speculative)
                    if n == 0:
                        reference = r.tokens
                    same = r.tokens == reference if c.temperature == 0.0 and n > 0 else None
                    yield hooks.after(c, p, PromptRun.of(r.stats, p, c.name, rnd, same), r)
            per_prompt.append(time.monotonic() - t0)

    def runs_per_prompt(self, repeat: int) -> int:
        return repeat * (len(self.contenders) + 2)
