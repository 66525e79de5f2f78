#!/usr/bin/env python3
"""Benchmark at scale: what speculation gives a target of 8B's shape, with acceptance replayed.

    python scripts/bench_scale.py --tiny                               # the tiny shape on this CPU, in seconds
    python scripts/bench_scale.py -ngl all --out DIR                   # Llama-3.1-8B's shape (Q4_K_M, Q4_0), then 1.5B
    python scripts/bench_scale.py --target T.gguf --head H.gguf        # a pair on disk
    python scripts/bench_scale.py --tiny --emulate bench/scale-gpu/results.json:llama-8b:q4_k_m   # at an H200's prices

Per shape (scripts/synthetic.py makes the pair into --work unless it is there already):
- the physics: the target's verify cost for 1..17 rows (every size timed, warm, and what a change of width adds:
  costs.measure), the head's draft
  step and catch-up (Speculator.calibrate), and the exact verify widths (the exactness probe, 1..17 rows);
- the speed of target-only and each contender (the default adaptive policy as `generate` runs it, fixed K = 2 and
  4, a 4x4x8 tree) at each replayed acceptance profile (scripts/replay.py: the head's real draft steps run, its
  tokens are the profile's; verification is the target's), interleaved per prompt through eagle3_gguf.bench:
  target-only first and last in every round (as greedy runs pick: the argmax in llama.cpp's graph on a GPU, from
  the logits on a CPU, decode.greedy_in_graph) and, as a contender, reading the logits; a prompt's ratio is, per
  round, each contender's fastest run against the faster target-only mode's, the median over rounds
  (bench.per_prompt_ratio), the replay's own time left out;
- the ceiling from the curve: what the contender's own cycles would give if each cost exactly the curve's price
  (its verify rows, draft steps and catch-ups) and nothing else, against target-only at one row's price a token:
  tokens x t(1 row) / sum over cycles of (t(verify rows) + steps x draft step + catch-up); achieved/ceiling is the
  share of it the run kept (the rest is Python, cold caches, the sampler).
Where a goal is missed (the default policy at the 3.09 profile: 2x target-only, 80% of the ceiling, Python at most
3% of a cycle; stated for 8B on an H100/H200), the table says which part of a cycle took the time; beside the goals,
the bound the curve alone sets at the goal's profile (the best chain were drafting free, and at the head's prices).

A table (markdown) on stdout; --out DIR writes results.md and results.json after every shape, so that a run cut
short keeps what finished. Prompts are seeded token ids (the synthetic text is noise; acceptance is replayed).
The runs are eagle3_gguf.bench's (Bench, per_prompt_ratio), with replaying heads as the contenders' sessions.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import logging
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

# llama.cpp's library before numpy, gguf and the rest: on the lent GPU's image a process that had loaded numpy (or
# sentencepiece, or tokenizers) first segfaulted in llama.cpp's tokenizer set-up at model load (bench/NOTES.md)
import llama_cpp  # noqa: I001
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import emulate  # noqa: E402
import replay  # noqa: E402
import synthetic  # noqa: E402
from eagle3_gguf.batch import Batch  # noqa: E402
from eagle3_gguf.bench import (TARGET, Bench, BenchPrompt, Contender, PromptRun, RunHooks, fastest,  # noqa: E402
                                per_prompt_ratio)
from eagle3_gguf.context import Context  # noqa: E402
from eagle3_gguf.decode import GenerateConfig, Runner  # noqa: E402
from eagle3_gguf.errors import Eagle3Error  # noqa: E402
from eagle3_gguf.gguf_file import read_gguf  # noqa: E402
from eagle3_gguf.native import Model, enable_llama_log, install_log_callback, pass_llama_debug  # noqa: E402
from eagle3_gguf.pair import Pair, PairConfig, load_pair  # noqa: E402
from eagle3_gguf.costs import CostCurve  # noqa: E402
from eagle3_gguf.speculator import Speculator  # noqa: E402
from eagle3_gguf.stats import SpecStats  # noqa: E402

ROWS = 17  # verify widths measured: 1..17
PART_RUNS = 24  # Parts: runs of each graph timed alone
PROFILE_LINES = 30  # --profile: the costliest functions kept per contender
TREE_ROWS = 9  # the default's widest head draft: a chain of 4 and 4 runner-ups, after id_last
GOAL_SPEEDUP, GOAL_CEILING, GOAL_PYTHON = 2.0, 0.80, 0.03
GOAL_PROFILE, GOAL_CONTENDER = "vllm-8b", "adaptive (default)"
# the default on the physics' curve, frozen: its choices turn on acceptance alone (no timing learnt), so beside the
# default it tells what the loop's timings made of the policy from what the replayed acceptance did
FROZEN = f"{GOAL_CONTENDER}, curve frozen"
# Speculator.head_choice "on" and "off", beside the default's "auto" (the cheaper at calibration): the head's tokens
# chosen in its graph against numpy reading its logits
IN_GRAPH, HEAD_LOGITS = ", head's choice in its graph", ", head's logits read"
LLAMA_LINES = ("graph: nodes", "layers to GPU", "model buffer size", "compute buffer size", "sched copies",
               "cannot be used with preferred buffer type")
LOGITS_READ = "target-only, logits read"
LOGITS_TWIN = ", target's logits read"  # a contender's twin reading the target's logits where its graph would pick
DEEPER = ", --draft-max 8"
DEFAULT_SHAPES = ("llama-8b:q4_k_m", "llama-8b:f16", "llama-8b:q4_0")
HEAD_TYPES = ("q8_0", "f16", "q4_0")  # --head-types' default: convert's --outtype default first


def contenders(n_predict: int, exact: str) -> list[Contender]:
    """The default adaptive policy as `generate` runs it (trees capped at 4 / 8), the same on the physics' curve frozen
    (FROZEN), with the head's tokens chosen in its graph (IN_GRAPH: no logits read back, no numpy over them) and read
    from its logits (HEAD_LOGITS: the default takes the cheaper at calibration), reading the target's logits where
    its graph would pick (LOGITS_TWIN: decode.greedy_in_graph), and free to draft 8 (DEEPER: where verify rows cost
    little, generate's cap of 4 may bind), fixed chains of 2 (also IN_GRAPH) and 4 (p_min 0), and EAGLE-2's dynamic
    tree 4 deep, top-4, 8 tokens."""
    g = lambda **kw: GenerateConfig(n_predict=n_predict, exact=exact, **kw)  # noqa: E731
    return [Contender(GOAL_CONTENDER, g(draft_topk=4, draft_nodes=8)),
            Contender(FROZEN, g(draft_topk=4, draft_nodes=8)),
            Contender(f"{GOAL_CONTENDER}{LOGITS_TWIN}", g(draft_topk=4, draft_nodes=8), graph_picks=False),
            Contender(f"{GOAL_CONTENDER}{DEEPER}", g(draft_max=8, draft_topk=4, draft_nodes=8)),
            Contender(f"{GOAL_CONTENDER}{IN_GRAPH}", g(draft_topk=4, draft_nodes=8), head_choice="on"),
            Contender(f"{GOAL_CONTENDER}{HEAD_LOGITS}", g(draft_topk=4, draft_nodes=8), head_choice="off"),
            Contender("fixed K=2", g(draft_policy="fixed", draft_max=2)),
            Contender(f"fixed K=2{IN_GRAPH}", g(draft_policy="fixed", draft_max=2), head_choice="on"),
            Contender("fixed K=4", g(draft_policy="fixed", draft_max=4)),
            Contender("tree 4x4x8", g(draft_policy="fixed", draft_max=4, draft_topk=4, draft_nodes=8))]


def logits_read(n_predict: int) -> Contender:
    """Target-only reading the logits (TARGET picks as greedy runs do: in the graph where the output layer is on a
    GPU, decode.greedy_in_graph)."""
    return Contender(LOGITS_READ, GenerateConfig(n_predict=n_predict, draft_max=0), graph_picks=False)


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------

@dataclass
class Physics:
    verify_ms: list[float]  # [ROWS]: one verify batch of 1..ROWS rows
    draft_step_ms: float
    catch_up_ms: float  # a drafting cycle's fixed cost: the head catching up on the kept rows
    switch_ms: float  # a width's first two verifies after a decode of other rows, on top (verify_ms: each repeated)
    exact_widths: int  # verify widths 1..exact_widths compute every row as a lone row does
    probed: int
    probe_s: float
    calibrate_s: float
    parts: Parts | None = None
    capture_ms: float = 0.0  # the switch's share that the second verify of the new width pays (ggml-cuda captures)
    parts_at: str = ""  # where the first inexact width parted (exactness.where_parts)


@dataclass
class Parts:
    """A cycle's graphs each timed alone (medians of PART_RUNS, run and synchronised): set beside the draft step and
    the per-run times, they tell llama.cpp's cost of a graph from what the loop around it adds."""

    head_decode_ms: float  # a 1-row decoder graph on the head, the same graph each time
    head_encode_ms: float  # the head's encoder (fc) on 2 rows of features
    target_row_ms: float  # a 1-row target decode with the head's features extracted (a cycle's)
    target_plain_ms: float  # the same without them (target-only's)
    # The same 1-row graphs, each run right after one of 2 rows, as a cycle runs them: ggml-cuda replays a captured
    # CUDA graph only while the graph's shapes repeat (warm-up, ggml_backend_cuda_graph_compute), so on CUDA the
    # gap to the figures above is what changing shapes costs; on a CPU the two should match.
    head_decode_after_ms: float = 0.0
    target_row_after_ms: float = 0.0
    # a 5-row target decode (fixed K=4's verify) repeated: beside the curve's 5 rows, timed among other widths
    target_verify5_ms: float = 0.0
    # the head's 1-row decoder with its matrices in each type made (--head-types), the run's head first
    head_types: list[HeadTypeCost] = field(default_factory=list)
    # a one-step draft as a cycle runs it (its seed step, the token and its probability read), the token chosen from
    # the logits by numpy or in the head's graph (Eagle3Session.choose_in_graph), alone or with 3 runner-ups (the
    # default's; in the graph ggml_top_k, a sort of the whole row at CUDA 13.0)
    draft_logits1_ms: float = 0.0
    draft_graph1_ms: float = 0.0
    draft_logits4_ms: float = 0.0
    draft_graph4_ms: float = 0.0
    # the 5-row verify split where the loop waits: llama_decode's return (the host's work: graph build, launches)
    # and then llama_synchronize's wait (the device finishing). On a CPU the graph runs inside llama_decode, so the
    # wait is ~0; where it is not, Python placed between the two runs free, hidden behind the device.
    target_verify5_return_ms: float = 0.0
    target_verify5_wait_ms: float = 0.0


@dataclass
class HeadTypeCost:
    """The head's 1-row decoder graph with its matrices in one type (fc stays Q4_0): what convert's --outtype buys."""

    head_type: str
    mib: float  # the file
    decode_ms: float  # median of PART_RUNS, the types interleaved


@dataclass
class Outcome:
    """One contender at one profile over the prompts (target-only: profile "")."""

    contender: str
    profile: str
    speedup: list[float] = field(default_factory=list)  # [prompts]: fastest run / target-only's fastest
    tok_s: list[float] = field(default_factory=list)  # [prompts]: the fastest run's
    tokens: int = 0  # generated by the verify cycles (after the prompt's own token), all prompts
    cycles: int = 0  # verify cycles, all prompts
    drafted_by_pos: list[int] = field(default_factory=list)
    accepted_by_pos: list[int] = field(default_factory=list)
    reached_by_pos: list[int] = field(default_factory=list)  # drafts at i whose drafts before it were all kept
    identical: int = 0
    resyncs: int = 0  # replays that had to find target-only's text again after the run's text parted from it
    tree_cycles: int = 0
    lookup_cycles: int = 0
    t_total: float = 0.0  # seconds, all prompts (the fastest round's), the replay's own left out
    t_target: float = 0.0
    t_draft: float = 0.0
    t_process: float = 0.0
    t_python: float = 0.0
    t_draft_python: float = 0.0  # of t_python: choosing the drafts' tokens (the replay's own left out)
    t_verify_python: float = 0.0  # of t_python: around the verify graphs (choosing the target's tokens)
    t_process_python: float = 0.0  # of t_python: around processing the kept rows
    curve_s: float = 0.0  # what the cycles cost at the curve's prices
    head_runs: int = 0  # the head's decoder runs: draft steps and catch-ups (the replayed sessions')

    @property
    def median(self) -> float:
        return statistics.median(self.speedup) if self.speedup else 0.0

    @property
    def tau(self) -> float:
        """Tokens per verify cycle (the prompt's forward left out)."""
        return self.tokens / self.cycles if self.cycles else 0.0

    def acceptance(self) -> list[float]:
        """P(draft i kept | drafts 0..i-1 kept), by position, up to the last position drafted (SpecStats'
        reached_by_pos: right for cycles of any lengths, as the adaptive policy drafts)."""
        return [a / r for a, r in zip(self.accepted_by_pos, self.reached_by_pos) if r]

    def ceiling(self, t1: float) -> float:
        """Speed against target-only at t(1 row) a token, were each cycle to cost its price on the curve."""
        return self.tokens * t1 / self.curve_s if self.curve_s else 0.0

    def per_cycle_ms(self) -> dict[str, float]:
        n = max(self.cycles, 1)
        other = self.t_total - self.t_target - self.t_draft - self.t_process
        return {"verify": 1e3 * self.t_target / n, "draft": 1e3 * self.t_draft / n,
                "process": 1e3 * self.t_process / n, "other": 1e3 * max(other, 0.0) / n,
                "python": 1e3 * self.t_python / n, "python drafting": 1e3 * self.t_draft_python / n,
                "python verifying": 1e3 * self.t_verify_python / n,
                "python processing": 1e3 * self.t_process_python / n,
                "python, the rest": 1e3 * max(self.t_python - self.t_draft_python - self.t_verify_python
                                              - self.t_process_python, 0.0) / n,
                "draft per head run": 1e3 * self.t_draft / self.head_runs if self.head_runs else 0.0}


@dataclass
class ShapeResult:
    shape: str
    qtype: str
    target: str
    head: str
    head_type: str  # its matrices' (synthetic.HEAD_TYPES; "given" for --head)
    target_mib: float
    head_mib: float
    made_s: float  # 0: the files were there already
    load_s: float
    device: str
    threads: int
    head_device: str = ""
    emulated: str = ""  # --emulate's RESULTS.json:SHAPE:TYPE: the pair's calls ran at those prices (emulate.py)
    llama_log: list[str] = field(default_factory=list)  # llama.cpp's lines on where the graphs run (LLAMA_LINES)
    physics: Physics | None = None
    outcomes: list[Outcome] = field(default_factory=list)
    goals: list[str] = field(default_factory=list)
    prompts: int = 0  # prompts measured (every contender ran on each)
    first_s: float = 0.0  # seconds from loading to the first prompt measured: --budget's guess for the next shape
    stopped: str = ""  # why fewer than --prompts were (the time budget, an interrupt)


# ------------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------------

def measure_physics(runner: Runner, exact: str, heads: list[HeadBeside]) -> Physics:
    """The probe, and the curve for 1..ROWS rows, every size timed (calibrate interpolates past 8 by default), read
    as greedy runs read them (the target's graph picks on a GPU), on target-only's runner (the bench's session)."""
    spec = runner.spec
    choice, spec.head_choice = spec.head_choice, "off"  # its draft step reads the head's logits (Parts times both)
    try:
        found = runner.prepare(GenerateConfig(draft_policy="fixed", draft_max=ROWS - 1, draft_lookup=False,
                                              exact="auto" if exact == "off" else exact))
        t = time.perf_counter()
        curve = spec.calibrate(ROWS - 1, dense_rows=ROWS)
        calibrate_s = time.perf_counter() - t
    finally:
        spec.head_choice = choice
    return Physics([1e3 * s for s in curve.verify_s], 1e3 * curve.draft_step_s, 1e3 * curve.draft_fixed_s,
                   1e3 * curve.switch_s, found.exact, found.probed, found.seconds, calibrate_s, time_parts(spec, heads),
                   1e3 * curve.capture_s, found.parts_at)


def time_parts(spec: Speculator, heads: list[HeadBeside]) -> Parts:
    """Parts: each graph PART_RUNS times at successive positions, the caches cleared after; `heads`: the head in each
    type made, the run's own first (its context is the session's), timed in turn."""
    target, session = spec.target, spec.session
    head, extract = session.draft_ctx, session.extract
    dec, enc, one = Batch(1, session.n_embd), Batch(2, extract.width), Batch(1)
    two, pair, five = Batch(2, session.n_embd), Batch(2), Batch(5)
    g = np.zeros(session.n_embd, np.float32)  # [n_embd]
    g2, tok2 = np.zeros((2, session.n_embd), np.float32), np.zeros(2, np.int32)  # [2, n_embd], [2]
    feats = np.zeros((2, extract.width), np.float32)  # [2, 3 * n_embd_tgt]
    was = extract.enabled

    def median_ms(run: Callable[[int], None], clear: Callable[[], None],
                  before: Callable[[int], None] | None = None) -> float:
        """The median time of run(i); before(i), where given, runs untimed ahead of each."""
        took = []
        for i in range(PART_RUNS):
            if before is not None:
                before(i)
            t = time.perf_counter()
            run(i)
            took.append(time.perf_counter() - t)
        clear()
        return 1e3 * statistics.median(took)

    def head_step(i: int) -> None:
        dec.set_embd_one(g, i, 0)
        head.decode(dec)

    def encode(i: int) -> None:
        enc.set_embd(feats, np.arange(2, dtype=np.int32))  # the encoder writes no cache: any positions
        head.encode(enc)

    def target_row(i: int) -> None:
        one.set([0], i)
        target.decode(one)

    # the interleaved runs: 2 rows at positions 3i, 3i + 1, then the timed row at 3i + 2 (a cache's positions must
    # follow on)
    def head_pair(i: int) -> None:
        two.set_embd(g2, np.array([3 * i, 3 * i + 1], np.int32), tok2)
        head.decode(two)

    def head_step_after(i: int) -> None:
        head_step(3 * i + 2)

    def target_pair(i: int) -> None:
        pair.set([0, 0], 3 * i)
        target.decode(pair)

    def target_row_after(i: int) -> None:
        target_row(3 * i + 2)

    def target_verify5(i: int) -> None:
        five.set([0] * 5, 5 * i, logits="all")
        target.decode(five)

    def verify5_split() -> tuple[float, float]:
        """Medians of llama_decode's return and then llama_synchronize's wait, the 5-row verify each time."""
        ret, wait = [], []
        for i in range(PART_RUNS):
            five.set([0] * 5, 5 * i, logits="all")
            t0 = time.perf_counter()
            rc = llama_cpp.llama_decode(target.ptr, five.struct)
            t1 = time.perf_counter()
            llama_cpp.llama_synchronize(target.ptr)
            t2 = time.perf_counter()
            if rc != 0:
                raise Eagle3Error(f"a 5-row verify failed (rc={rc})")
            ret.append(t1 - t0)
            wait.append(t2 - t1)
        target.clear()
        return 1e3 * statistics.median(ret), 1e3 * statistics.median(wait)

    def one_step_draft(n_alt: int) -> Callable[[int], None]:
        def run(i: int) -> None:  # the seed step again at the same position: the same graph each time
            session.draft(0, 1, lambda confs, n_max: 1, n_alt=n_alt)
            session.accept(0)
        return run

    def draft_reads() -> list[float]:
        """One-step drafts, top 1 then with 3 runner-ups, each from the logits then chosen in the graph."""
        session.process([0] * 3, 0, np.zeros((3, extract.width), np.float32))
        took = []
        for k in (1, 4):
            for in_graph in (False, True):
                session.choose_in_graph(k if in_graph else 0)
                took.append(median_ms(one_step_draft(k - 1), lambda: None))
        session.choose_in_graph(0)
        session.reset()
        return took

    try:
        session.reset()
        target.clear()
        step = median_ms(head_step, head.clear)
        step_after = median_ms(head_step_after, head.clear, head_pair)
        fc = median_ms(encode, head.clear)
        reads = draft_reads()
        extract.enable(True)
        row = median_ms(target_row, target.clear)
        row_after = median_ms(target_row_after, target.clear, target_pair)
        verify5 = median_ms(target_verify5, target.clear)
        split = verify5_split()
        extract.enable(False)
        plain = median_ms(target_row, target.clear)
        types = time_head_types(heads, session.n_embd)
    finally:
        extract.enable(was)
        session.choose_in_graph(0)
        session.reset()
        for b in (dec, enc, one, two, pair, five):
            b.close()
    return Parts(step, fc, row, plain, step_after, row_after, verify5, types, *reads, *split)


def time_head_types(heads: list[HeadBeside], n_embd: int) -> list[HeadTypeCost]:
    """The 1-row decoder of each head, one decode of each in turn per round (PART_RUNS rounds): their medians; none
    where only the run's own head was made."""
    if len(heads) < 2:
        return []
    dec, g = Batch(1, n_embd), np.zeros(n_embd, np.float32)  # [n_embd]
    took: list[list[float]] = [[] for _ in heads]
    try:
        for i in range(PART_RUNS):
            for h, t in zip(heads, took):
                dec.set_embd_one(g, i, 0)
                start = time.perf_counter()
                h.ctx.decode(dec)
                t.append(time.perf_counter() - start)
    finally:
        for h in heads:
            h.ctx.clear()
        dec.close()
    return [HeadTypeCost(h.head_type, h.path.stat().st_size / 2**20, 1e3 * statistics.median(t))
            for h, t in zip(heads, took)]


class LlamaLines(logging.Handler):
    """llama.cpp's log lines that say where the graphs run (LLAMA_LINES), kept while a pair loads: the number of
    graph splits shows an op that fell back to the CPU."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.logger = logging.getLogger("eagle3_gguf.llama_cpp")  # eagle3_gguf.native's (install_log_callback)

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage().strip()
        if any(k in text for k in LLAMA_LINES):
            self.lines.append(text)

    def __enter__(self) -> "LlamaLines":
        self.level = self.logger.level
        if not self.logger.isEnabledFor(logging.DEBUG):  # "cannot be used with preferred buffer type" is a DEBUG line
            self.logger.setLevel(logging.DEBUG)
        self.debug = pass_llama_debug(True)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)
        pass_llama_debug(self.debug)


class Resync:
    """Target-only's text after a context the run reached where its text parted from the truth (a verify width
    that is not exact): plain decoding on a second context of the same target, made the first time it is needed."""

    def __init__(self, pair: Pair, n_ctx: int, threads: int):
        self.pair, self.n_ctx, self.threads = pair, n_ctx, threads
        self.runner: Runner | None = None

    def __call__(self, tokens: list[int], n: int) -> list[int]:
        if self.runner is None:
            t = self.pair.target
            self.ctx = Context(self.pair.target_model, n_ctx=self.n_ctx, n_threads=self.threads, type_k=t.kv_types[0],
                               type_v=t.kv_types[1], flash_attn=t.flash_attn)
            self.runner = Runner(self.ctx)
        return self.runner.generate(tokens, GenerateConfig(n_predict=n), speculative=False).tokens

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.ctx.close()


@dataclass
class ScaleRun(PromptRun):
    """A run as bench.Bench records it (its seconds without the replay's own), with what the ceiling takes."""

    stats: SpecStats | None = None
    steps: int = 0  # the head's decoder runs in drafts
    cycles: int = 0  # drafting cycles (each with a catch-up)
    t_aside: float = 0.0
    resyncs: int = 0


class ReplayHooks(RunHooks):
    """Bench's hooks for replayed heads: before a run, its session replays the profile against the prompt and the
    round's target-only text; after it, the replay's own time leaves the run's and its head steps are kept."""

    def __init__(self, n_ctx: int, threads: int):
        self.n_ctx, self.threads = n_ctx, threads
        self.resync: Resync | None = None
        self.sessions: dict[str, replay.ReplaySession] = {}

    def session(self, profile: replay.Profile):
        """Contender.session: a replaying head for `profile` on the bench's pair."""
        def make(pair: Pair) -> replay.ReplaySession:
            if self.resync is None:
                self.resync = Resync(pair, self.n_ctx, self.threads)
            return replay.ReplaySession(pair.target, pair.head, truth=[], profile=profile, resync=self.resync)
        return make

    def attach(self, bench: Bench) -> None:
        self.sessions = bench.sessions

    def before(self, c: Contender, p: BenchPrompt, index: int, reference: list[int]) -> None:
        if c.name in self.sessions:
            self.sessions[c.name].replay(p.tokens + reference, seed=index)

    def after(self, c: Contender, p: BenchPrompt, run: PromptRun, result) -> ScaleRun:
        fields = {f.name: getattr(run, f.name) for f in dataclasses.fields(PromptRun)}
        s = self.sessions.get(c.name)
        if s is None:
            return ScaleRun(**fields, stats=result.stats)
        fields["seconds"] = run.seconds - s.t_aside
        return ScaleRun(**fields, stats=result.stats, steps=s.steps, cycles=s.cycles, t_aside=s.t_aside,
                        resyncs=s.resyncs)

    def close(self) -> None:
        if self.resync is not None:
            self.resync.close()


class ProfileHooks(RunHooks):
    """ReplayHooks with cProfile on around each named contender's runs (the replay's set-up left out)."""

    def __init__(self, inner: ReplayHooks, names: list[str]):
        self.inner = inner
        self.profiles = {name: cProfile.Profile() for name in names}

    def before(self, c: Contender, p: BenchPrompt, index: int, reference: list[int]) -> None:
        self.inner.before(c, p, index, reference)
        if c.name in self.profiles:
            self.profiles[c.name].enable()

    def after(self, c: Contender, p: BenchPrompt, run: PromptRun, result) -> ScaleRun:
        if c.name in self.profiles:
            self.profiles[c.name].disable()
        return self.inner.after(c, p, run, result)


def profile_prompt(bench: Bench, hooks: ReplayHooks, tokens: list[int], n_predict: int, tag: str,
                   out: Path) -> Path:
    """One more prompt, every contender run and none counted, with cProfile on around target-only's, the goals'
    contender's and fixed K=4's runs at the goals' profile: each one's PROFILE_LINES costliest functions by own
    time, one after another, in out/profile-<tag>.txt (one file: a lent call brings 8 back). A graph call's native
    time is its caller's own time (Context._call: ctypes calls are not profiled apart)."""
    names = [n for n in (TARGET.name, f"{GOAL_PROFILE} | {GOAL_CONTENDER}", f"{GOAL_PROFILE} | fixed K=4")
             if n in bench.runners]
    ph = ProfileHooks(hooks, names)
    for _ in bench.measure([BenchPrompt("synthetic", "profiled", "", tokens)], n_predict=n_predict, hooks=ph):
        pass
    text = io.StringIO()
    text.write(f"# {tag}: one prompt of {len(tokens)} tokens, {n_predict} new, not counted; cProfile, own time first\n")
    for name, prof in ph.profiles.items():
        text.write(f"\n## {'target-only' if name == TARGET.name else name}\n")
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(PROFILE_LINES)
    path = out / f"profile-{tag}.txt"
    path.write_text(text.getvalue())
    return path


def frozen_curve(ph: Physics) -> CostCurve:
    """The physics' cost curve, frozen: a policy on it prices every cycle as the curve says and learns no timing."""
    return CostCurve([ms / 1e3 for ms in ph.verify_ms], ph.draft_step_ms / 1e3, ph.catch_up_ms / 1e3, "given",
                     frozen=True, switch_s=ph.switch_ms / 1e3, capture_s=ph.capture_ms / 1e3)


def measure_speeds(bench: Bench, hooks: ReplayHooks, prompts: list[list[int]], runs: list[Contender],
                   profiles: list[replay.Profile], rounds: int, res: ShapeResult, deadline: float | None,
                   on_prompt: Callable[[], None]) -> None:
    """Target-only and every contender at every profile through eagle3_gguf's benchmark runner (bench.Bench):
    interleaved per prompt, target-only first and last, the contenders between in an order that rotates with the
    prompt. Target-only runs as greedy runs pick (decode.greedy_in_graph) and, as a contender, reading the
    logits; a prompt's ratio is a contender's fastest run against the faster of them (bench.per_prompt_ratio).
    res.outcomes holds the prompts measured so far, on_prompt() is called after each; no prompt starts that would
    end past `deadline` (time.monotonic()), and an interrupt (Ctrl-C, SIGINT) drops the prompt it cut."""
    n_predict = runs[0].config.n_predict
    named = {f"{p.name} | {c.name}": (p, c) for p in profiles for c in runs}  # the bench's contender names
    bench.add([logits_read(n_predict)] + [dataclasses.replace(c, name=name, session=hooks.session(p))
                                          for name, (p, c) in named.items()])
    for name, (_, c) in named.items():
        if c.name == FROZEN:  # its policy takes this curve as it is (the curve covers 17 rows: no calibration)
            bench.runners[name].spec.costs = frozen_curve(res.physics)
    hooks.attach(bench)
    items = [BenchPrompt("synthetic", str(i), "", tokens) for i, tokens in enumerate(prompts)]
    per_prompt = bench.runs_per_prompt(rounds)
    done: list[ScaleRun] = []
    try:
        for r in bench.measure(items, repeat=rounds, n_predict=n_predict, deadline=deadline, hooks=hooks,
                               rotate=True):
            done.append(r)
            if len(done) % per_prompt == 0:
                mine = done[-per_prompt:]
                base = fastest(x for x in mine if x.contender in (TARGET.name, LOGITS_READ))[r.prompt_id]
                print(f"prompt {r.prompt_id}: target-only {base:.1f} tok/s; " + "; ".join(
                    f"{name} {v / base:.2f}x" for name, v in fastest(mine, key=lambda x: x.contender).items()
                    if name in named), file=sys.stderr, flush=True)
                res.prompts = len(done) // per_prompt
                res.outcomes = outcomes(done, items[:res.prompts], named, res.physics)
                on_prompt()
        res.stopped = bench.stopped
    except KeyboardInterrupt:  # decode's PartialResult too: the prompt it cut is left out
        res.stopped = f"interrupted: {res.prompts} of {len(items)} prompts measured"


def outcomes(done: list[ScaleRun], items: list[BenchPrompt], named: dict, physics: Physics) -> list[Outcome]:
    """Each contender's Outcome over the prompts in `items` (every run of them in `done`)."""
    base = [r for r in done if r.contender in (TARGET.name, LOGITS_READ)]
    verify_s = [ms / 1e3 for ms in physics.verify_ms]
    step_s, catch_s = physics.draft_step_ms / 1e3, physics.catch_up_ms / 1e3
    outs = [Outcome("target-only", ""), Outcome(LOGITS_READ, "")]
    outs += [Outcome(c.name, p.name) for p, c in named.values()]
    for o, name in zip(outs, [TARGET.name, LOGITS_READ, *named]):
        mine = [r for r in done if r.contender == name]
        ratios = per_prompt_ratio(mine, base)
        for p in items:
            of_prompt = [r for r in mine if r.prompt_id == p.id]
            best = max(of_prompt, key=lambda r: r.tok_s)
            _add(o, best, ratios[p.id], all(r.identical is not False for r in of_prompt), verify_s, step_s, catch_s)
    return outs


def _add(o: Outcome, r: ScaleRun, ratio: float, identical: bool, verify_s: list[float], step_s: float,
         catch_s: float) -> None:
    """One prompt's fastest run into its Outcome (its seconds and draft time without the replay's)."""
    st = r.stats
    o.speedup.append(ratio)
    o.tok_s.append(r.tok_s)
    o.tokens += st.n_generated - 1
    o.cycles += st.n_target_forwards - 1
    _add_by_pos(o.drafted_by_pos, st.drafted_by_pos)
    _add_by_pos(o.accepted_by_pos, st.accepted_by_pos)
    _add_by_pos(o.reached_by_pos, st.reached_by_pos)
    o.identical += identical
    o.resyncs += r.resyncs
    o.tree_cycles += st.tree_cycles
    o.lookup_cycles += st.lookup_cycles
    o.t_total += r.seconds
    o.t_target += st.t_target
    o.t_draft += st.t_draft - r.t_aside
    o.t_process += st.t_process
    o.t_python += max(st.t_python - r.t_aside, 0.0)
    o.t_draft_python += max(st.t_draft_python - r.t_aside, 0.0)
    o.t_verify_python += st.t_verify_python
    o.t_process_python += st.t_process_python
    o.curve_s += sum(c * verify_s[min(n, len(verify_s)) - 1] for n, c in enumerate(st.verify_rows) if c) \
        + r.steps * step_s + r.cycles * catch_s
    o.head_runs += r.steps + r.cycles


def _add_by_pos(total: list[int], more: list[int]) -> None:
    """Add a run's counts by draft position into `total`, in place (longer where the run drafted further)."""
    total += [0] * (len(more) - len(total))
    for i, x in enumerate(more):
        total[i] += x


def prompt_tokens(target: Path, n: int, length: int, seed: int) -> list[list[int]]:
    """Seeded prompts of the target tokenizer's normal tokens (no control or padding tokens)."""
    types = np.asarray(read_gguf(target).get("tokenizer.ggml.token_type"))  # [n_vocab]
    normal = np.flatnonzero(types == synthetic.TOKEN_NORMAL)  # [n_normal]
    rng = np.random.default_rng(seed)
    return [rng.choice(normal, length).tolist() for _ in range(n)]


@dataclass
class HeadBeside:
    """One of the shape's heads, loaded against the run's target for Parts (the run's own: the pair's context)."""

    head_type: str
    path: Path
    ctx: Context
    model: Model | None = None  # None: the run's own head, the pair's to close

    def close(self) -> None:
        if self.model is not None:
            self.ctx.close()
            self.model.close()


def heads_beside(pair: Pair, made: synthetic.Made, config: PairConfig) -> list[HeadBeside]:
    """The run's head, then each other type made, loaded beside it (the target's model and context shared)."""
    out = [HeadBeside(made.head_types[0], made.head, pair.head)]
    try:
        for head_type, path in zip(made.head_types[1:], made.heads[1:]):
            other = load_pair(made.target, path, config, target_model=pair.target_model, target_ctx=pair.target)
            out.append(HeadBeside(head_type, path, other.head, other.head_model))
    except BaseException:
        for h in out:
            h.close()
        raise
    return out


def bench_shape(made: synthetic.Made, args, results: list[ShapeResult], deadline: float | None) -> ShapeResult:
    """One shape's physics and speeds, appended to `results` (written after each prompt where --out is given)."""
    target, head = made.target, made.head
    runs = contenders(args.n_predict, args.exact)
    profiles = [replay.parse_profile(p) for p in args.profiles.split(",")]
    n_seq = max(c.config.tree_sequences for c in [*runs, logits_read(args.n_predict)])
    n_ctx = max(1024, args.prompt_len + args.n_predict + 64)  # the probe reaches 257 + 17 rows deep
    config = PairConfig(n_ctx=n_ctx, n_threads=args.threads, n_gpu_layers=args.ngl, n_gpu_layers_draft=args.ngl,
                        n_seq_max=n_seq)
    hooks = ReplayHooks(n_ctx, args.threads)
    t = time.perf_counter()
    with LlamaLines() as llama_lines:
        bench = Bench(target, head, config, [])
    with bench:
        try:
            load_s = time.perf_counter() - t
            pair = bench.pair
            res = ShapeResult(made.shape, made.qtype, str(target), str(head), made.head_types[0],
                              target.stat().st_size / 2**20, head.stat().st_size / 2**20, made.seconds, load_s,
                              str(pair.target_model.placement), pair.target.n_threads, str(pair.head_model.placement),
                              llama_log=llama_lines.lines)
            results.append(res)
            emulation = None
            if args.emulate:
                emulation = emulate.parse(args.emulate, args.emulate_slowdown)
                emulation.attach(pair.target, pair.head)
                res.emulated = emulation.source
            heads = heads_beside(pair, made, config)
            try:
                res.physics = measure_physics(bench.runners[TARGET.name], args.exact, heads)
            finally:
                for h in heads:
                    h.close()
            print(physics_lines(res.physics), file=sys.stderr, flush=True)
            write(results, args)
            if args.exact == "auto" and res.physics.exact_widths < TREE_ROWS:
                # the probe caps the default's trees and K=4's chains: what speculating past it would give, beside
                runs += [Contender(f"{c.name}, --exact off", dataclasses.replace(c.config, exact="off"))
                         for c in runs if c.name in (GOAL_CONTENDER, "fixed K=4")]
            prompts = prompt_tokens(target, args.prompts, args.prompt_len, args.seed)

            def on_prompt() -> None:
                res.first_s = res.first_s or time.perf_counter() - t
                res.goals = goals(res)
                write(results, args)

            t_speeds = time.monotonic()
            measure_speeds(bench, hooks, prompts, runs, profiles, args.rounds, res, deadline, on_prompt)
            if emulation is not None:
                res.emulated = f"{emulation.source}; real calls past the emulated time: {emulation.overruns()}"
            per_prompt = (time.monotonic() - t_speeds) / max(res.prompts, 1)
            if args.profile and len(results) == 1 and res.prompts and not res.stopped.startswith(
                    "interrupted") and (deadline is None or time.monotonic() + per_prompt < deadline):
                path = profile_prompt(bench, hooks, prompts[0], args.n_predict, f"{made.shape}-{made.qtype}",
                                      Path(args.out))
                print(f"wrote {path}", file=sys.stderr, flush=True)
        finally:
            hooks.close()  # its context before the pair's
    res.goals = goals(res)
    return res


# ------------------------------------------------------------------------------------------------
# Reporting
# ------------------------------------------------------------------------------------------------

def goals(res: ShapeResult) -> list[str]:
    """Each goal of the default policy at the 3.09 profile, met or not, and where missed what a cycle spent."""
    o = next((o for o in res.outcomes if (o.profile, o.contender) == (GOAL_PROFILE, GOAL_CONTENDER)), None)
    if o is None or res.physics is None:
        return []
    t1 = res.physics.verify_ms[0] / 1e3
    ceiling = o.ceiling(t1)
    share = o.t_python / o.t_total if o.t_total else 0.0
    checks = [(f"speed >= {GOAL_SPEEDUP:g}x target-only", o.median >= GOAL_SPEEDUP, f"{o.median:.2f}x"),
              (f"achieved >= {GOAL_CEILING:.0%} of the ceiling", ceiling > 0 and o.median / ceiling >= GOAL_CEILING,
               f"{o.median / ceiling:.0%} of {ceiling:.2f}x" if ceiling else "no ceiling"),
              (f"Python <= {GOAL_PYTHON:.0%} of a cycle", share <= GOAL_PYTHON, f"{share:.1%}")]
    out = [f"{'met' if ok else 'MISSED'}: {what} ({got})" for what, ok, got in checks]
    b = bound(res.physics, replay.PROFILES[GOAL_PROFILE])
    out.append(f"the curve bounds any chain at {GOAL_PROFILE} to {b.free:.2f}x (K={b.free_k}) with drafting free, "
               f"{b.head:.2f}x (K={b.head_k}) at the head's step and catch-up"
               + (f": {GOAL_SPEEDUP:g}x needs a flatter verify curve on this device and type"
                  if b.free < GOAL_SPEEDUP else ""))
    if not all(ok for _, ok, _ in checks):
        ms = o.per_cycle_ms()
        out.append("a cycle's time (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items())
                   + f"; one verify row on the curve {res.physics.verify_ms[0]:.3f}")
    return out


@dataclass
class Bound:
    """The best speed any chain of drafts can reach at a profile on the physics' curve (against target-only at one
    row's price a token), were nothing but the verify rows to cost (free) or the verify rows and the head's step and
    catch-up (head): what the device's curve allows, whatever the loop around it does."""

    free: float
    free_k: int
    head: float
    head_k: int


def bound(ph: Physics, profile: replay.Profile) -> Bound:
    """Bound over chains of 0..ROWS-1 drafts: tau(k) x t(1 row) / (t(k + 1 rows) [+ k x step + catch-up])."""
    t1 = ph.verify_ms[0]
    free = [(profile.tau(k) * t1 / ph.verify_ms[k], k) for k in range(len(ph.verify_ms))]
    head = [(profile.tau(k) * t1 / (ph.verify_ms[k] + (k * ph.draft_step_ms + ph.catch_up_ms if k else 0.0)), k)
            for k in range(len(ph.verify_ms))]
    (f, fk), (h, hk) = max(free), max(head)
    return Bound(f, fk, h, hk)


def physics_lines(ph: Physics) -> str:
    rel = " ".join(f"{t / ph.verify_ms[0]:.2f}" for t in ph.verify_ms)
    return "\n".join([f"- verify cost, 1..{ROWS} rows: {' '.join(f'{t:.2f}' for t in ph.verify_ms)} ms",
                      f"  ({rel} x one row, each width repeated; +{ph.switch_ms:.2f} ms over a width's first two "
                      f"verifies after a decode of other rows, {ph.capture_ms:.2f} of it the second's; "
                      f"{ph.calibrate_s:.1f} s to measure)",
                      f"- head: draft step {ph.draft_step_ms:.3f} ms ({ph.draft_step_ms / ph.verify_ms[0]:.2f} x one "
                      f"row), catch-up {ph.catch_up_ms:.3f} ms",
                      f"- exact verify widths: 1..{ph.exact_widths} of 1..{ph.probed} (probed in {ph.probe_s:.1f} s)"
                      + (f"; width {ph.exact_widths + 1} parts first at {ph.parts_at}" if ph.parts_at else "")]
                     + ([f"- each graph alone: the head's 1-row decoder {ph.parts.head_decode_ms:.3f} ms, its encoder "
                         f"on 2 rows {ph.parts.head_encode_ms:.3f} ms; a 1-row target decode "
                         f"{ph.parts.target_row_ms:.3f} ms with the features extracted, "
                         f"{ph.parts.target_plain_ms:.3f} ms without",
                         f"- the same 1-row graphs right after one of 2 rows (a cycle's order): the head's "
                         f"{ph.parts.head_decode_after_ms:.3f} ms, the target's {ph.parts.target_row_after_ms:.3f} ms",
                         f"- a 5-row target verify repeated: {ph.parts.target_verify5_ms:.3f} ms (median; the curve's, "
                         f"the least of its repeated runs: {ph.verify_ms[4]:.3f} ms); llama_decode returns after "
                         f"{ph.parts.target_verify5_return_ms:.3f} ms, then llama_synchronize waits "
                         f"{ph.parts.target_verify5_wait_ms:.3f} ms (what Python between the two would run hidden)",
                         f"- a one-step draft, its token read from the logits / chosen in the head's graph: "
                         f"{ph.parts.draft_logits1_ms:.3f} / {ph.parts.draft_graph1_ms:.3f} ms; with 3 runner-ups "
                         f"{ph.parts.draft_logits4_ms:.3f} / {ph.parts.draft_graph4_ms:.3f} ms"]
                        if ph.parts else [])
                     + ([f"- the head's 1-row decoder by the type of its matrices: "
                         + ", ".join(f"{h.head_type} ({h.mib:.0f} MiB) {h.decode_ms:.3f} ms"
                                     for h in ph.parts.head_types)]
                        if ph.parts and ph.parts.head_types else []))


def table(results: list[ShapeResult]) -> str:
    lines = ["# Benchmark at scale: synthetic targets, replayed acceptance", ""]
    for res in results:
        ph = res.physics
        lines += [f"## {res.shape} {res.qtype} on {res.device} ({res.threads} threads)"
                  + (f", emulating {res.emulated} (emulate.py)" if res.emulated else ""), "",
                  f"- files: target {res.target_mib:.0f} MiB, head {res.head_mib:.0f} MiB ({res.head_type})"
                  + (f", made in {res.made_s:.1f} s" if res.made_s else ", made before")
                  + f"; loaded in {res.load_s:.1f} s; the head on {res.head_device or '?'}"]
        lines += [f"- llama.cpp: {line}" for line in res.llama_log]
        if ph is not None:
            lines.append(physics_lines(ph))
        lines.append(f"- prompts measured: {res.prompts}" + (f" ({res.stopped})" if res.stopped else ""))
        lines += ["", "| profile | contender | tok/s | speedup, median (min) | tau | kept by position, conditional "
                  "| identical | resyncs | ceiling | achieved / ceiling | Python ms / cycle (share) "
                  "| of it: drafting / verifying / processing / the rest "
                  "| per cycle ms: verify / draft / process / other | draft ms per head run |",
                  "|" + "---|" * 14]
        t1 = ph.verify_ms[0] / 1e3 if ph else 0.0
        n = len(res.outcomes[0].speedup) if res.outcomes else 0
        for o in res.outcomes:
            ms = o.per_cycle_ms()
            ceil = o.ceiling(t1) if o.profile else 0.0
            lines.append(
                f"| {o.profile or '-'} | {o.contender} | {statistics.median(o.tok_s) if o.tok_s else 0:.1f} | "
                f"{o.median:.2f}x ({min(o.speedup, default=0):.2f}x) | {o.tau:.2f} | "
                f"{' '.join(f'{a:.2f}' for a in o.acceptance())} | {o.identical}/{n} | {o.resyncs} | "
                + (f"{ceil:.2f}x | {o.median / ceil:.0%}" if ceil else " | ")
                + f" | {ms['python']:.3f} ({o.t_python / o.t_total if o.t_total else 0:.1%}) | "
                f"{ms['python drafting']:.3f} / {ms['python verifying']:.3f} / {ms['python processing']:.3f} / "
                f"{ms['python, the rest']:.3f} | "
                f"{ms['verify']:.2f} / {ms['draft']:.2f} / {ms['process']:.2f} / {ms['other']:.2f} | "
                f"{ms['draft per head run']:.3f} |")
        if res.goals:
            lines += ["", f"Goals ({GOAL_CONTENDER} at {GOAL_PROFILE}; stated for llama-8b on an H100/H200):", ""]
            lines += [f"- {g}" for g in res.goals]
        lines.append("")
    return "\n".join(lines)


def to_json(results: list[ShapeResult], args) -> dict:
    out = []
    for res in results:
        d = asdict(res)
        t1 = res.physics.verify_ms[0] / 1e3 if res.physics else 0.0
        for od, o in zip(d["outcomes"], res.outcomes):
            od.update(median_speedup=o.median, tau=o.tau, acceptance=o.acceptance(), per_cycle_ms=o.per_cycle_ms(),
                      ceiling=o.ceiling(t1) if o.profile else None)
        out.append(d)
    return {"args": vars(args), "profiles": {p.name: asdict(p) for p in replay.PROFILES.values()}, "shapes": out}


def write(results: list[ShapeResult], args) -> None:
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.md").write_text(table(results))
        (out / "results.json").write_text(json.dumps(to_json(results, args), indent=2))


# ------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------

def ensure_pair(work: Path, shape: str, qtype: str, args) -> synthetic.Made:
    """The synthetic pair in `work` (each of --head-types' heads), made now where missing; its seconds 0 where all
    were there already."""
    head_types = tuple(args.head_types.split(","))
    target = work / f"synthetic-{shape}-{qtype}.gguf"
    heads = [synthetic.head_path(work, shape, t) for t in head_types]
    if target.is_file() and all(h.is_file() for h in heads):
        return synthetic.Made(shape, qtype, target, heads, head_types, target.stat().st_size,
                              heads[0].stat().st_size, 0.0)
    made = synthetic.make_pair(work, shape, qtype, args.tokenizer or synthetic.default_tokenizer(), args.jobs,
                               head_types=head_types)
    print(f"made {made.target.name} ({made.target_bytes / 2**20:.0f} MiB) and "
          f"{', '.join(h.name for h in made.heads)} in {made.seconds:.1f} s", file=sys.stderr)
    return made


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny shape on this machine's CPU (unless --shapes names "
                    "others): 4 prompts of 32 tokens, 64 new, 1 thread (the test suite's and the lent call's dry run)")
    ap.add_argument("--shapes", help=f"SHAPE:TYPE,... (scripts/synthetic.py's; default {','.join(DEFAULT_SHAPES)})")
    ap.add_argument("--target", help="a target GGUF to measure instead (with --head)")
    ap.add_argument("--head", help="its EAGLE-3 head")
    ap.add_argument("--work", help="folder for the synthetic models (default: a temporary one, removed after)")
    ap.add_argument("--tokenizer", help="GGUF whose tokenizer the synthetic targets pad (default: SmolLM2's)")
    ap.add_argument("--head-types", default=",".join(HEAD_TYPES), help="the synthetic head's matrices: the first "
                    "type drafts in every run, and Parts times the head's 1-row decoder in each (any of "
                    f"{', '.join(synthetic.HEAD_TYPES)}; default {','.join(HEAD_TYPES)}: convert's default first)")
    ap.add_argument("--profiles", default=",".join(replay.PROFILES), help="replayed acceptance profiles: names "
                    f"({', '.join(replay.PROFILES)}) or rates such as 0.8/0.7/0.6")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each contender per prompt (the fastest counts)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-ngl", "--n-gpu-layers", dest="ngl", default="0", help="the target's and the head's layers on "
                    "the GPU: a number or 'all'")
    ap.add_argument("--exact", default="auto", choices=("auto", "strict", "off"), help="the contenders' --exact")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="threads writing synthetic models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write results.md and results.json here (after every prompt)")
    ap.add_argument("--budget", type=float, default=0, help="seconds for the whole run: no prompt starts that would "
                    "end past them, no shape that would not reach its first prompt (0: no limit)")
    ap.add_argument("--profile", action="store_true", help="after the first shape's prompts, one more (not "
                    "counted) with cProfile on around target-only, the default and fixed K=4 at the goals' profile: "
                    "profile-SHAPE-TYPE.txt beside results.md (needs --out; skipped where --budget has no room for it)")
    ap.add_argument("--emulate", metavar="RESULTS.json:SHAPE:TYPE", help="pad the pair's llama.cpp calls to the "
                    "prices a GPU measured for that shape (emulate.py), e.g. bench/scale-gpu/results.json:llama-8b:"
                    "q4_k_m: a CPU weighs the contenders at a GPU's costs")
    ap.add_argument("--emulate-slowdown", type=float, default=1.0, metavar="S", help="--emulate's prices times S: a "
                    "CPU slower than the GPU host's (its tiny head's graph outlasts the GPU's: the table's overruns) "
                    "emulates it in slow motion (default 1)")
    ap.add_argument("-v", "--verbose", action="store_true", help="let llama.cpp's log through (stderr)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.shapes = args.shapes or "tiny:q4_k_m"
        args.prompts, args.n_predict, args.prompt_len = 4, 64, 32
        args.threads = args.threads or 1  # 2 threads on 2 busy cores spin at llama.cpp's barriers (probe: 83 s vs 0.2)
    args.shapes = args.shapes or ",".join(DEFAULT_SHAPES)
    return args


def check_args(args) -> str | None:
    """The first bad input, as one line (None: all good)."""
    if (args.target is None) != (args.head is None):
        return "--target and --head go together"
    if args.profile and not args.out:
        return "--profile writes its files beside results.md: give --out DIR"
    for t in (args.target, args.head, args.tokenizer):
        if t is not None and not Path(t).is_file():
            return f"{t}: no such file"
    head_types = args.head_types.split(",")
    if any(t not in synthetic.HEAD_TYPES for t in head_types) or len(set(head_types)) < len(head_types):
        return f"--head-types {args.head_types}: name distinct types of {', '.join(synthetic.HEAD_TYPES)}"
    for item in args.shapes.split(","):
        shape, _, qtype = item.partition(":")
        if shape not in synthetic.SHAPES or qtype not in synthetic.FILE_TYPES:
            return (f"--shapes {item}: name SHAPE:TYPE with SHAPE one of {', '.join(synthetic.SHAPES)} and TYPE one of "
                    f"{', '.join(synthetic.TYPES)}")
    if min(args.prompts, args.n_predict, args.prompt_len, args.rounds, args.jobs) < 1 or args.n_predict < 8:
        return "--prompts, --prompt-len, --rounds and --jobs must be at least 1, -n at least 8"
    if args.budget < 0:
        return "--budget: seconds, at least 0 (0: no limit)"
    try:
        args.ngl = -1 if args.ngl == "all" else int(args.ngl)
        for p in args.profiles.split(","):
            replay.parse_profile(p)
        if args.emulate:
            emulate.parse(args.emulate, args.emulate_slowdown)
        elif args.emulate_slowdown != 1.0:
            return "--emulate-slowdown scales --emulate's prices: give --emulate too"
    except ValueError:
        return f"-ngl {args.ngl}: a number or 'all'"
    except Eagle3Error as e:
        return str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    install_log_callback()  # llama.cpp's log into Python's logging: quiet unless -v
    if args.verbose:
        logging.basicConfig(level=logging.DEBUG, format="%(message)s")
        enable_llama_log(True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    # cost curves and probes measured here (every size of the curve timed), not a run's from the user's cache; an
    # emulated run's in a folder of its own, removed after: the cache keys know the files, not the prices emulated
    cache = Path(tempfile.mkdtemp(prefix="cache-emulated-", dir=work)) if args.emulate else work / "cache"
    os.environ["EAGLE3_GGUF_CACHE"] = str(cache)
    results: list[ShapeResult] = []
    deadline = time.monotonic() + args.budget if args.budget else None
    try:
        if args.target:
            given = synthetic.Made("given", Path(args.target).stem, Path(args.target), [Path(args.head)], ("given",),
                                   Path(args.target).stat().st_size, Path(args.head).stat().st_size, 0.0)
            pairs = [(given.shape, given.qtype, lambda: given)]
        else:
            pairs = [(s, q, lambda s=s, q=q: ensure_pair(work, s, q, args))
                     for s, _, q in (item.partition(":") for item in args.shapes.split(","))]
        for shape, qtype, make in pairs:
            need = results[-1].first_s if results else 0.0  # to load, measure the physics and one prompt
            if deadline is not None and time.monotonic() + need > deadline:
                print(f"{shape} {qtype}: not measured, {max(deadline - time.monotonic(), 0):.0f} s of --budget left "
                      f"(the last shape's first prompt came after {need:.0f} s)", file=sys.stderr)
                continue
            res = bench_shape(make(), args, results, deadline)
            write(results, args)
            print(table([res]), flush=True)
            if res.stopped.startswith("interrupted"):
                return 130
    except KeyboardInterrupt:  # outside a prompt (loading, the physics): what finished is written already
        print("interrupted", file=sys.stderr)
        return 130
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
        elif args.emulate:
            shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
