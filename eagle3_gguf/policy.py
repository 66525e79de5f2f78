"""Cost-aware drafting: how many tokens to draft, decided before and during every cycle.

A cycle that verifies j drafts costs the target c(j+1) (one batch of j+1 rows), plus, when it drafts,
e (the head catching up on the rows kept last cycle, and the graph calls' fixed cost) and j draft
steps of d each, and emits 1 + P_1 + ... + P_j tokens on average, where P_m is the chance that the first m
drafts are all accepted. Decoding maximises tokens per second, a ratio; the policy maximises the
equivalent difference E - R·T per cycle, where R is the rate to beat (Dinkelbach's rule for ratio
objectives): the best of target-only speed 1/c(1) and the rate the run has realised so far. So a draft
token is worth its cost only when its chance of being emitted beats R times what it adds to the cycle.

- `CostCurve`: c(1..K_max+1) (each width warm) and d, and the switch s the first two verifies of a row count pay on
  top where it is not the target's last decode's (llama.cpp's graph rebuilt; on CUDA the graph run uncaptured, then
  captured on the second call: its share of s is the capture), so that a policy keeps its width unless another pays
  for the change (the cycle after a check excepted: every width warm); measured at load (`calibrate`, a fraction of
  a second, cached per target file, head file, threads, GPU layers and KV types in `~/.cache/eagle3-gguf/costs/`; a
  corrupt or stale entry is measured again) and refined online: one row's cost (a scale on the whole curve)
  from plain cycles, each larger row count's from the cycles that verified that many, d from a draft's steps after
  its first (timed apart: the loop pays more than a calibration of warm repeated drafts reads).
- `Acceptance`: P(draft accepted | earlier drafts accepted, the head's top probability) by draft
  position, from counts in confidence bins with a prior (a calibrated head's confidence), pooled
  across positions while a position has few counts; and the expected acceptance of a step not yet
  drafted (the running mean of that estimate at each position), for planning ahead.
- `AdaptivePolicy.plan()` picks the draft budget before the cycle from the expected acceptances:
  0 when no length can pay, and then the cycle is plain decoding (the head is not run; the session
  keeps the rows and catches up on the next draft). While it plans 0 it probes now and then (one
  draft step, whose confidence may start drafting again), backing off while probes find nothing that
  makes drafting pay. While it drafts, it decodes one cycle plainly now and then (backing off while
  the timing confirms the scale), so that plain decoding's price stays measured. On a frozen curve
  (costs as given: a test's) nothing is learnt from timings: a cycle's time is the curve's price of it,
  and no plain cycle is timed.
- `AdaptivePolicy.judge(confs)` runs after every draft step with the confidences so far: keep
  drafting, or stop and verify the first j drafts (a confident prefix; it generalises p_min).

`FixedPolicy` is the old behaviour (always K, stop under p_min) for benchmarks and `--draft-policy fixed`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .draft import CATCH_UP_WINDOW, Draft, NativeJudge, judge_p_min
from .lookup import N_MAX, Lookup, LookupAcceptance
from .tree import DraftTree, branch_candidates, chain_tree, with_branches

CACHE_VERSION = 3  # 3: the switch's capture apart; 2: warm verify costs and the switch; 1: sizes timed among others
N_BINS = 10  # confidence bins over [0, 1]
PRIOR_COUNT = 4.0  # pseudo-counts of each prior
EMA = 0.05  # weight of one new timing in the online cost refinement (scale, draft step, draft fixed cost)
SEEN_EMA = 0.1  # weight of one verify in its row count's running mean (a plain mean over the first ten)
SEEN_CAP = 16.0  # a row count's own timings outweigh the calibration at most SEEN_CAP : SEEN_PRIOR
SEEN_PRIOR = 2.0  # the scaled calibration counts as this many timings
LOOKAHEAD_EMA = 0.5  # weight of one draft step in a position's expected acceptance (stretches are short)
RATE_EMA = 0.1  # weight of one cycle in the realised rate
PROBE_MIN, PROBE_MAX = 4, 64  # plain cycles between probes: reset on success, doubled on failure
LOOKUP_PROBE_MIN = 16  # long matches declined before one is verified anyway (AdaptivePolicy.lookup), doubled to
# PROBE_MAX while such probes miss
CHECK_MIN, CHECK_MAX = 8, 256  # drafting cycles between plain ones that time one row: doubled while it holds
CHECK_TOL = 0.1  # a plain cycle within 10% of its predicted time confirms the scale


# ------------------------------------------------------------------------------------------------
# costs
# ------------------------------------------------------------------------------------------------

@dataclass
class CostCurve:
    verify_s: list[float]  # [K_max + 1]: seconds to verify n = 1..K_max+1 rows (index n - 1), as calibrated
    draft_step_s: float  # seconds per draft step as calibrated (head decode of one row, plus reading it); see step_s
    draft_fixed_s: float = 0.0  # seconds a drafting cycle costs besides its steps (the head's catch-up)
    source: str = "measured"  # "measured", "cache" or "given"
    # Online refinement. `scale`: real seconds per calibrated second, from plain cycles (one row, no draft
    # step): a machine that slows down or speeds up as a whole (load, clocks, a longer context), or a
    # calibration taken while the machine was busy. `seen_s`: what verifying n >= 2 rows has really cost
    # in the cycles that did it, `seen_n` how often (capped): there the verify follows the head's graphs
    # (the target's weights colder) and a change of batch shape, and costs more than back-to-back rows at
    # position 0 (2 rows: 1.45-1.6x a plain cycle against 1.36x calibrated, SmolLM2 Q4_1 on 2 cores). Each
    # figure moves only with its own timings: were two-row verifies to move the scale, a policy that
    # verifies two rows every cycle could not tell whether two rows or all rows cost more, and would price
    # plain decoding wrong (AdaptivePolicy times a plain cycle now and then to keep the scale current).
    # frozen: the curve is taken as stated and nothing is learnt from timings (a test that fixes every cost the
    # policy's choices depend on: AdaptivePolicy then prices each cycle by the curve instead of the clock)
    frozen: bool = False
    # what the first two verifies of a row count cost on top where it is not the target's last decode's (calibrated
    # seconds): llama.cpp reuses a graph only for the same batch shape, and ggml-cuda replays its captured CUDA graph
    # only while shapes repeat (8B's shape on an H200: one row 3.86 ms warm, +1.3 then +4.4 ms; bench/NOTES.md)
    switch_s: float = 0.0
    # the switch's share that the second call of the new count pays (ggml-cuda's warm-up captures the graph then:
    # 4.4 of 5.7 ms at 8B's shape on an H200; 0 on a CPU)
    capture_s: float = 0.0
    scale: float = 1.0
    scale_n: float = 0.0  # plain cycles timed (capped)
    seen_s: list[float] = field(default_factory=list)  # [K_max + 1]: real seconds, a running mean per n
    seen_n: list[float] = field(default_factory=list)  # [K_max + 1]
    now_s: list[float] = field(default_factory=list)  # [K_max + 1]: the refined curve, calibrated seconds
    # a draft step as the loop pays it (calibrated seconds; 0: draft_step_s, until a draft of two steps or more is
    # timed): calibration times warm drafts repeated, while in the loop each follows the target's graph (on an H200
    # at 8B's head 0.52 ms a step against 0.43 calibrated, enough to draft 3 where 2 paid more)
    step_s: float = 0.0
    step_n: float = 0.0  # drafts whose later steps were timed (capped)

    def __post_init__(self) -> None:
        if len(self.seen_s) != len(self.verify_s):
            self.seen_s, self.seen_n = [0.0] * len(self.verify_s), [0.0] * len(self.verify_s)
        self.step_s = self.step_s or self.draft_step_s
        self._refresh()

    def _refresh(self) -> None:
        """now_s: each row count's own timings, weighed against the scaled calibration by how many there
        were; n + 1 rows never cost less than n (a row count seldom seen is priced at least like the
        largest one below it)."""
        now = [self.verify_s[0]]
        for t, seen, w in zip(self.verify_s[1:], self.seen_s[1:], self.seen_n[1:]):
            x = t if w == 0 else (w * seen / self.scale + SEEN_PRIOR * t) / (w + SEEN_PRIOR)
            now.append(max(x, now[-1]))
        self.now_s = now
        self._refreshed_at = self.scale  # the scale now_s was computed with

    @property
    def k_max(self) -> int:
        return len(self.verify_s) - 1

    def verify(self, n: int) -> float:
        """Real seconds to verify n rows, now, right after a decode of as many."""
        return self.scale * self.now_s[n - 1]

    def paid(self, run: int) -> float:
        """Real seconds on top for the run-th verify in a row of one row count: the switch's first share, then
        the capture, then nothing."""
        return self.scale * (self.switch_s - self.capture_s if run == 1 else self.capture_s if run == 2 else 0.0)

    def relative(self) -> list[float]:
        """The verify costs, as refined, in single-row units.  # [K_max + 1]"""
        return [t / self.now_s[0] for t in self.now_s]

    def observe_verify(self, n: int, seconds: float) -> None:
        """A verify of n rows took `seconds`; one row only from a plain cycle (after a draft step the
        target's weights are colder: that is the draft's cost, not plain decoding's)."""
        if self.frozen:
            return
        if n == 1:
            self.scale += max(EMA, 1.0 / (self.scale_n + 2.0)) * (seconds / self.verify_s[0] - self.scale)
            self.scale_n = min(self.scale_n + 1.0, SEEN_CAP)
            if abs(self.scale - self._refreshed_at) > 0.01 * self._refreshed_at:  # else now_s moves < 1%
                self._refresh()
        else:
            i, w = n - 1, self.seen_n[n - 1]
            self.seen_s[i] += max(SEEN_EMA, 1.0 / (w + 1.0)) * (seconds - self.seen_s[i])
            self.seen_n[i] = min(w + 1.0, SEEN_CAP)
            self._refresh()

    def observe_draft(self, steps: int, seconds: float, later_s: float | None = None) -> None:
        """A draft of `steps` took `seconds`, `later_s` of them the steps after the first (None: not timed apart, a
        tree): those price a step (the calibration counting as SEEN_PRIOR timings), the rest is fixed cost."""
        if steps <= 0 or self.frozen:
            return
        if later_s is not None and steps >= 2:
            self.step_n = min(self.step_n + 1.0, SEEN_CAP)
            x = later_s / self.scale / (steps - 1)
            self.step_s += max(EMA, 1.0 / (self.step_n + SEEN_PRIOR)) * (x - self.step_s)
        fixed = max(seconds / self.scale - steps * self.step_s, 0.0)
        self.draft_fixed_s += EMA * (fixed - self.draft_fixed_s)

    def valid(self, k_max: int) -> bool:
        ok = lambda x: isinstance(x, float) and math.isfinite(x) and 0.0 <= x < 10.0  # noqa: E731
        return (len(self.verify_s) >= k_max + 1 and all(ok(t) and t > 0 for t in self.verify_s)
                and ok(self.draft_step_s) and self.draft_step_s > 0 and ok(self.draft_fixed_s) and ok(self.switch_s)
                and ok(self.capture_s) and self.capture_s <= self.switch_s)


@dataclass(frozen=True)
class CostKey:
    """What a cost curve depends on: the files, how they run, and where."""

    target: str  # path, size, mtime
    head: str
    n_threads: int
    setup: str  # the rest of how they run: KV cache types, flash attention, devices and layers offloaded
    n_batch: int
    machine: str  # CPU, core count and llama.cpp's backends and CPU features

    @classmethod
    def for_files(cls, target: Path, head: Path, n_threads: int, setup: str, n_batch: int) -> "CostKey":
        from .native import backend_fingerprint  # here: the CLI imports this module before it needs llama.cpp

        def ident(p: Path) -> str:
            st = Path(p).stat()
            return f"{Path(p).resolve()}:{st.st_size}:{st.st_mtime_ns}"

        return cls(ident(target), ident(head), n_threads, setup, n_batch,
                   f"{os.uname().machine}:{os.cpu_count()}:{cpu_model()}:{backend_fingerprint()}")

    @classmethod
    def for_contexts(cls, target, head, n_batch: int, reads: str = "") -> "CostKey":
        """The key of a target context and a head context (context.Context) verifying n_batch rows at most:
        the same set-up gives the same key on every surface. `reads`: what a verify reads back where it matters
        to the key (a cost curve: "graph" choices or "logits"; the graph's argmax costs more on a CPU)."""
        # ggml's switches in the environment pick kernels too (GGML_CPU_TILED_MM=0: K-quants without the tiled matmul)
        ggml = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("GGML_"))
        # n_ubatch: a batch wider than it is computed as ubatches (the probe compares products up to it)
        setup = (f"kv {target.kv_types[0]}/{target.kv_types[1]} fa {target.flash_attn} ub {target.n_ubatch} "
                 f"repack {target.model.repack} on {target.model.placement} / {head.model.placement}"
                 + (f" env {ggml}" if ggml else "") + (f" reads {reads}" if reads else ""))
        return cls.for_files(target.model.path, head.model.path, target.n_threads, setup, n_batch)

    def path(self) -> Path:
        base = Path(os.environ.get("EAGLE3_GGUF_CACHE", Path.home() / ".cache" / "eagle3-gguf"))
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:20]
        return base / "costs" / f"{digest}.json"


def cpu_model() -> str:
    """The CPU's model name: two CPUs with the same features (llama.cpp's system info) can price rows apart
    (SmolLM2 Q4_1, 2 cores: two rows 1.6-1.75x one row on an Intel Xeon, 2.0x on an AMD EPYC)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def load_costs(key: CostKey, k_max: int) -> CostCurve | None:
    """The cached curve for `key`, or None when there is none, it is corrupt, stale or too short."""
    try:
        data = json.loads(key.path().read_text())
        if data.get("version") != CACHE_VERSION or data.get("key") != asdict(key):
            return None
        curve = CostCurve([float(t) for t in data["verify_s"]], float(data["draft_step_s"]),
                          float(data["draft_fixed_s"]), "cache", switch_s=float(data["switch_s"]),
                          capture_s=float(data["capture_s"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not curve.valid(k_max):
        return None
    return CostCurve(curve.verify_s[:k_max + 1], curve.draft_step_s, curve.draft_fixed_s, "cache",
                     switch_s=curve.switch_s, capture_s=curve.capture_s)


def save_costs(key: CostKey, curve: CostCurve) -> None:
    """Write the curve atomically; a cache that cannot be written is only a missed shortcut."""
    path = key.path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "key": asdict(key), "verify_s": curve.verify_s,
                                   "draft_step_s": curve.draft_step_s, "draft_fixed_s": curve.draft_fixed_s,
                                   "switch_s": curve.switch_s, "capture_s": curve.capture_s}))
        os.replace(tmp, path)
    except OSError:
        pass


DENSE_ROWS = 8  # measure() times every verify size up to this many rows
RUN = 3  # measure() times each size this many times in a row: after a change of shape, again (CUDA captures), warm


def measure(run_verify: Callable[[int], float], run_draft: Callable[[int], float], k_max: int,
            reps: int = 3, dense_rows: int = DENSE_ROWS) -> CostCurve:
    """The cost curve: run_verify(n) is seconds to verify n = 1..k_max+1 rows, run_draft(steps) those of a draft of
    that many steps, the head's catch-up included.

    Each size is timed RUN times in a row, the sizes in turn, `reps` times (drift hits all alike): a size's warm
    cost is the least of its repeated calls (interference only adds time), and what its first two calls cost beyond
    two warm ones is what a change of shape costs (llama.cpp builds the graph again; ggml-cuda runs it uncaptured,
    then captures it); the curve's switch is the median of that over the sizes, its capture the median of what the
    second call alone costs beyond a warm one. Past `dense_rows` rows (long lookup
    drafts) every dense_rows // 2-th size down from the last is timed and the rest interpolated: there the curve is
    close to a line. Drafts of 1 and max(k_max, 2) steps are timed after a warm-up each, `reps` + 2 times: the step
    cost is the slope of their least times, the fixed cost its intercept."""
    if dense_rows < 2:
        raise ValueError(f"dense_rows must be at least 2 (got {dense_rows})")
    sizes = sorted({*range(1, min(k_max + 1, dense_rows) + 1), *range(k_max + 1, dense_rows, -(dense_rows // 2))})
    runs: dict[int, list[list[float]]] = {n: [] for n in sizes}  # [reps][RUN] per size
    for _ in range(reps):
        for n in sizes:
            runs[n].append([run_verify(n) for _ in range(RUN)])
    steps = max(k_max, 2)
    run_draft(1), run_draft(steps)
    one = min(run_draft(1) for _ in range(reps + 2))
    many = min(run_draft(steps) for _ in range(reps + 2))
    step = max((many - one) / (steps - 1), 1e-6)
    warm = {n: min(min(r[1:]) for r in rs) for n, rs in runs.items()}
    switch = sorted(max(min(r[0] for r in rs) + min(r[1] for r in rs) - 2.0 * warm[n], 0.0)
                    for n, rs in runs.items())
    capture = sorted(max(min(r[1] for r in rs) - warm[n], 0.0) for n, rs in runs.items())
    verify = [_interpolate(warm, n) for n in range(1, k_max + 2)]
    for n in range(1, len(verify)):  # n + 1 rows cost no less than n, and no more than n + 1 single rows
        verify[n] = min(max(verify[n], verify[n - 1]), (n + 1) * verify[0])
    s = switch[len(switch) // 2]
    return CostCurve(verify, step, max(one - step, 0.0), "measured", switch_s=s,
                     capture_s=min(capture[len(capture) // 2], s))


def _interpolate(timed: dict[int, float], n: int) -> float:
    """timed[n], or the line between the timed sizes on either side of n."""
    if n in timed:
        return timed[n]
    lo = max(m for m in timed if m < n)
    hi = min(m for m in timed if m > n)
    return timed[lo] + (timed[hi] - timed[lo]) * (n - lo) / (hi - lo)


# ------------------------------------------------------------------------------------------------
# acceptance
# ------------------------------------------------------------------------------------------------

def _bin(conf: float) -> int:
    return min(int(conf * N_BINS), N_BINS - 1)


class Acceptance:
    """Online P(accept | position, confidence) and the expected acceptance of the next step. The counts are arrays of
    doubles (a list's speed in Python) that chain.c's judge reads and updates in place (native_judge)."""

    def __init__(self, k_max: int, lookahead_prior: float = 0.5):
        self.k_max = k_max
        mids = [(b + 0.5) / N_BINS for b in range(N_BINS)]
        self.pool_hits = array("d", [PRIOR_COUNT * m for m in mids])  # [N_BINS], prior: a calibrated head
        self.pool_seen = array("d", [PRIOR_COUNT] * N_BINS)
        self.hits = array("d", [0.0] * (k_max * N_BINS))  # [K_max * N_BINS]: position i's bins at i * N_BINS
        self.seen = array("d", [0.0] * (k_max * N_BINS))
        self.lookahead = array("d", [lookahead_prior] * k_max)  # [K_max]: expected acceptance of a step not yet drafted

    def prob(self, i: int, conf: float) -> float:
        """Chance that draft i (0-based) is accepted, given drafts 0..i-1 were, at this confidence."""
        b = _bin(conf)
        pooled = self.pool_hits[b] / self.pool_seen[b]
        at = i * N_BINS + b
        return (self.hits[at] + PRIOR_COUNT * pooled) / (self.seen[at] + PRIOR_COUNT)

    def native_judge(self, **kw) -> NativeJudge:
        """AdaptivePolicy.judge's rule over these arrays, for chain.c (kw: the policy's `done` and `changed`)."""
        return NativeJudge(hits=self.hits, seen=self.seen, pool_hits=self.pool_hits, pool_seen=self.pool_seen,
                           lookahead=self.lookahead, prior=PRIOR_COUNT, ema=LOOKAHEAD_EMA, **kw)

    def saw_step(self, i: int, p: float) -> None:
        """Draft step i was run and its estimate is p: move the position's expectation towards it."""
        self.lookahead[i] += LOOKAHEAD_EMA * (p - self.lookahead[i])

    def observe(self, confs: list[float], n_verified: int, n_accepted: int) -> None:
        """Drafts 0..n_verified-1 (confidences `confs`) were verified and the first n_accepted kept: each
        draft up to and including the first rejected one is an observation; later ones are not."""
        for i in range(min(n_accepted + 1, n_verified)):
            b = _bin(confs[i])
            ok = 1.0 if i < n_accepted else 0.0
            self.hits[i * N_BINS + b] += ok
            self.seen[i * N_BINS + b] += 1.0
            self.pool_hits[b] += ok
            self.pool_seen[b] += 1.0


class BranchAcceptance:
    """Online P(the target takes a runner-up token | its parent is reached), by the head's probability of it:
    the chance a draft tree's branch is kept (tree.py). Prior: the head's probability itself."""

    def __init__(self):
        mids = [(b + 0.5) / N_BINS for b in range(N_BINS)]
        self.hits = [PRIOR_COUNT * m for m in mids]  # [N_BINS]
        self.seen = [PRIOR_COUNT] * N_BINS

    def prob(self, p: float) -> float:
        b = _bin(p)
        return self.hits[b] / self.seen[b]

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        """The tree was verified and `path` kept: each branch whose parent was reached is an observation."""
        reached = {0, *path}
        for node in range(tree.chain + 1, len(tree.tokens)):
            parent = tree.parents[node]
            if parent in reached:
                b = _bin(tree.probs[node] / tree.probs[parent])
                self.hits[b] += node in path
                self.seen[b] += 1.0


# ------------------------------------------------------------------------------------------------
# policies
# ------------------------------------------------------------------------------------------------

@dataclass
class PolicyStats:
    """What the policy chose, for the run's statistics."""

    name: str = "fixed"
    chosen: list[int] = field(default_factory=list)  # [M + 1]: cycles that verified 0..M drafts (M: max(K, L))
    trace: list[int] = field(default_factory=list)  # [n_cycles]: drafts verified, cycle by cycle
    probes: int = 0
    lookup_probes: int = 0  # long matches verified though not expected to pay (AdaptivePolicy.lookup)
    plain_cycles: int = 0  # cycles that ran no draft step at all
    predicted_tokens: float = 0.0  # the policy's expectation of the emitted tokens, summed over cycles
    predicted_s: float = 0.0  # ... and of the cycles' time
    cost_curve: list[float] = field(default_factory=list)  # [M + 1] verify cost in single-row units
    draft_step_cost: float = 0.0  # a draft step in single-row units
    draft_fixed_cost: float = 0.0  # a drafting cycle's fixed cost (the head's catch-up), likewise
    switch_cost: float = 0.0  # what the first two verifies of a new row count cost on top, likewise
    capture_cost: float = 0.0  # the second one's share of it, likewise
    cost_source: str = ""

    @property
    def predicted_tok_s(self) -> float:
        return self.predicted_tokens / self.predicted_s if self.predicted_s > 0 else 0.0


class FixedPolicy:
    """Always draft up to k; stop when the head's top probability falls under p_min (upstream's rule)."""

    name = "fixed"

    keep_rows = True  # the head reads every cycle's rows

    def __init__(self, k: int, p_min: float = 0.0, topk: int = 1, nodes: int = 0):
        """topk > 1: a draft tree of depth k, EAGLE-2's dynamic expansion of topk tokens per depth, its nodes
        likeliest candidates verified (Eagle3Session.draft_tree; p_min does not cut it)."""
        self.k = self.k_max = k
        self.lookup_max = 0  # verifies no lookup drafts
        self.p_min = p_min
        self._native = NativeJudge(p_min=p_min)  # judge() as chain.c runs it
        self.n_alt = 0  # runner-up tokens the head reports per chain step (the adaptive policy's branches)
        self.expand = topk if topk > 1 else 0  # a tree's tokens per depth (0: chains)
        self.nodes = nodes
        self.stats = PolicyStats("fixed", [0] * (k + 1))

    def begin(self) -> None:
        self.stats = PolicyStats("fixed", [0] * (self.k + 1))

    def finish_stats(self) -> PolicyStats:
        return self.stats

    def plan(self, k_cap: int) -> int:
        return min(self.k, k_cap)

    def wants_prompt(self) -> bool:
        return True

    def lookup(self, found: Lookup, k_cap: int) -> int:
        """The fixed policy always drafts with the head: lookup drafts are the adaptive policy's choice."""
        return 0

    def observe_tree(self, tree: DraftTree, path: list[int]) -> None:
        pass

    def judge(self, confs: list[float], n_max: int) -> int:
        """-1: draft another step; j >= 0: stop and verify the first j drafts."""
        return judge_p_min(confs, n_max, self.p_min)

    def native_judge(self) -> NativeJudge:
        """judge() as chain.c runs it (one for every draft: it does not change)."""
        return self._native

    def observe(self, confs: list[float], n_verified: int, n_accepted: int, n_drafted: int,
                t_verify: float, t_draft: float, n_emitted: int, n_rows: int | None = None,
                t_steps: float | None = None) -> None:
        self.stats.chosen[n_verified] += 1
        self.stats.trace.append(n_verified)
        if n_drafted == 0:
            self.stats.plain_cycles += 1

    def observe_plain(self, t_verify: float) -> None:
        """observe() of a plain cycle (one row, no draft step)."""
        self.observe([], 0, 0, 0, t_verify, 0.0, 1)


class AdaptivePolicy:
    """Draft the length that maximises expected tokens per second (module doc)."""

    name = "adaptive"

    def __init__(self, costs: CostCurve, k_max: int, window: int = CATCH_UP_WINDOW, lookup_max: int = 0,
                 topk: int = 1, nodes: int = 0):
        """k_max: the head's drafts per cycle at most; lookup_max: a lookup draft's (0: none); topk, nodes: a
        draft tree's caps (topk 1: chains). window: how many of the latest rows the head catches up on after
        plain cycles (the session's)."""
        rows = max(k_max, lookup_max, nodes)
        if costs.k_max < rows:
            raise ValueError(f"the cost curve covers {costs.k_max} drafts, the policy needs {rows}")
        self.costs = costs
        self.k_max = k_max
        self.lookup_max = lookup_max
        self.n_alt = topk - 1  # runner-up tokens the head reports per chain step (tree branches)
        self.expand = 0  # no dynamic trees: a branch costs this policy a verify row, never a head row
        self.branches = max(nodes - k_max, 0)  # a tree's branches at most
        self.shape = (k_max, lookup_max, topk, nodes)
        self.branch_acc = BranchAcceptance()
        self.window = window
        # whether the head should keep this cycle's rows (set by plan()): it drafts, or a probe comes
        # before they would fall out of its catch-up window anyway (copying them costs a plain cycle ~1%)
        self.keep_rows = True
        self.acc = Acceptance(k_max)
        self._native = self.acc.native_judge(done=self._judged, changed=self._changed)  # chain.c's, over acc's
        self.lookup_acc = LookupAcceptance(max(lookup_max, 1))
        self.rate = 1.0 / costs.verify(1)  # realised tokens/s, a running mean
        self.probe_wait = PROBE_MIN  # plain cycles until the next probe
        self.probe_gap = PROBE_MIN
        self.lookup_wait = LOOKUP_PROBE_MIN  # long matches to decline until the next lookup probe
        self.lookup_gap = LOOKUP_PROBE_MIN
        self.lookup_probing = False
        self.probing = False
        self.drafting = False
        self.checking = False  # a plain cycle while drafting pays, to time one row
        self.since_plain = 0  # drafting cycles since the last plain one
        self.check_gap = CHECK_MIN
        self._pred: tuple[float, float] = (1.0, costs.now_s[0])  # expected tokens, calibrated seconds
        # _pays(): the break-even rate, for the curve (now_s), draft costs, expectations and cap it was
        # computed from (plan() runs it every cycle; between drafts none of these move but the scale)
        self._star_now: list[float] | None = None
        self._star_cap = 0
        self._r_star = 0.0
        # the target's last decode's rows (0: none yet in this text, its prompt's) and how many decodes in a row had
        # them: a verify of another count pays the curve's switch, the second of a count its capture; _prices() is the
        # curve as this cycle pays it, for those
        self.last_rows = 0
        self.run = 0
        # the cycle after a check prices every width warm: returning to any width pays the switch alike (priced as a
        # change, the return never paid where a switch outweighs a cycle's gain: bench/NOTES.md, scale-gpu, 9th)
        self._after_check = False
        self._prices_of: tuple[list[float] | None, int, float] = (None, -1, 0.0)
        self._prices_now: list[float] = costs.now_s
        # A plain streak (plan()): plain cycles left that plan() need not weigh, and the timings of the
        # streak's cycles, learnt at its end
        self._streak = 0
        self._deferring = False
        self._pending: list[tuple[float, int]] = []  # (seconds, its place in a run of one row count: _decoded)
        self.stats = PolicyStats("adaptive", [0] * (max(k_max, lookup_max) + 1), cost_source=costs.source)

    def begin(self) -> None:
        """A new generation: fresh statistics; what was learnt (costs, acceptance, how long probes have
        been finding nothing) stays. A new text may read differently: its first cycle probes, and what lookup drafts
        earned on earlier texts counts half (LookupAcceptance.forget)."""
        self._learn_streak()
        self.stats = PolicyStats("adaptive", [0] * (max(self.k_max, self.lookup_max) + 1), cost_source=self.costs.source)
        self.probe_wait = 1
        self.last_rows = self.run = 0
        self._after_check = False
        self.lookup_acc.forget()

    # -- the rate to beat -----------------------------------------------------------------------------
    def _r(self) -> float:
        """Tokens per calibrated second that a cycle must beat (costs are in calibrated seconds)."""
        return max(self.rate * self.costs.scale, 1.0 / self.costs.now_s[0])

    def _prices(self) -> list[float]:
        """What verifying 1..K_max+1 rows costs this cycle, calibrated seconds: the curve, plus the whole switch for
        every row count but the last decode's, and the capture for that one where it ran once so far. So a policy
        that drafts keeps its width unless another pays for the change, and one that decodes plainly starts drafting
        only where a draft pays for it. The cycle after a check: every width warm.  # [K_max + 1]"""
        costs = self.costs
        if self._after_check:
            return costs.now_s
        last = self.last_rows
        cap = costs.capture_s if self.run == 1 else 0.0
        if self._prices_of[0] is not costs.now_s or self._prices_of[1:] != (last, cap):
            s = costs.switch_s
            self._prices_now = ([t + (s if n != last else cap) for n, t in enumerate(costs.now_s, 1)] if s
                                else costs.now_s)
            self._prices_of = (costs.now_s, last, cap)
        return self._prices_now

    # -- before the cycle ------------------------------------------------------------------------------
    def plan(self, k_cap: int) -> int:
        """The draft budget for this cycle: 0 (plain decoding) unless some length is expected to pay,
        or a probe is due. Sets keep_rows for the end of the cycle.

        A plain streak: where no length can pay even against plain decoding's own rate (the break-even rate
        is at most 1 / c(1), which the rate to beat never falls under), only a move of the curve could
        change that, and the curve moves only with the timings. So the plain cycles up to the next probe's
        catch-up window run as one streak: plan() and observe_plain() only count and keep the timing, and
        the policy learns the timings at the streak's end, in order, ending where learning them cycle by
        cycle would have; the streak decides with the curve as it was at its start. A cycle's Python runs
        cache-cold after the target's graph: this took plan + observe of a plain cycle from ~17 us to ~3.5
        (SmolLM2 + the shipped head, 2-core Intel, measured)."""
        if self._streak > 0:
            self._streak -= 1
            return 0
        if self._deferring:
            self._learn_streak()
        k_cap = min(k_cap, self.k_max)
        self.probing = self.checking = False
        if k_cap <= 0:
            self.keep_rows = self.drafting or self.probe_wait <= self.window
            return 0
        if self._pays(k_cap):
            self.probe_wait = self.probe_gap = PROBE_MIN
            self.drafting = self.keep_rows = True
            # time one row again: its cost is learnt from plain cycles only (a frozen curve learns nothing)
            if self.since_plain >= self.check_gap and not self.costs.frozen:
                self.checking = True
                return 0
            return k_cap
        self.drafting = False
        self.probe_wait -= 1
        self.keep_rows = self.probe_wait <= self.window
        if self.probe_wait > 0:
            if not self.keep_rows:
                self._streak = self._streak_length()
                self.probe_wait -= self._streak
                self._deferring = self._streak > 0
            return 0
        self.probing = True
        self.stats.probes += 1
        return k_cap

    def _pays(self, k_cap: int) -> bool:
        """Whether some draft length j <= k_cap is expected to beat plain decoding: E_j - R·T_j > 1 - R·c(1)
        for the expected acceptances, i.e. R under the break-even rate max_j (E_j - 1) / (T_j - c(1)).
        That rate moves only with the curve, the draft costs, the expectations and the cap (cached: a plain
        cycle then costs two multiplications here); R moves every cycle."""
        prices = self._prices()
        if self._star_now is not prices or self._star_cap != k_cap:
            self._r_star = self._break_even(k_cap)
            self._star_now, self._star_cap = prices, k_cap
        return self._r() < self._r_star

    def _streak_length(self) -> int:
        """How many more cycles are surely plain without weighing them: those before the next probe's
        catch-up window opens, where no length pays even at plain decoding's rate; else none."""
        if self._r_star * self.costs.now_s[0] > 1.0:
            return 0
        return self.probe_wait - self.window - 1

    def _break_even(self, k_cap: int) -> float:
        """The rate R under which some draft length j <= k_cap pays (math.inf: one pays at any rate)."""
        star = 0.0
        for gain, extra in self._head_drafts(k_cap):
            if extra <= 0.0:
                if gain > 0.0 or extra < 0.0:
                    return math.inf
            else:
                star = max(star, gain / extra)
        return star

    def _changed(self) -> None:
        """The expectations or the draft costs moved: the break-even rate is computed again."""
        self._star_now = None

    def wants_prompt(self) -> bool:
        """Whether the head should read the whole prompt: only when drafting is expected to pay. Otherwise
        it takes the prompt's last `window` rows, enough for a probe (reading a prompt of a few hundred
        rows costs the head one or two target steps)."""
        return self._pays(self.k_max)

    def lookup(self, found: Lookup, k_cap: int) -> int:
        """How many of a lookup draft's tokens to verify this cycle (0: none): the length whose expected
        tokens beat, at the rate to beat, both plain decoding and the head's best planned draft. A lookup
        draft costs its verify rows only (no draft step).

        A lookup probe: the LOOKUP_PROBE_MIN-th long match declined in a row is verified anyway, at its least losing
        length. Nothing is learnt of matches that are never verified, and one early miss at the first position (a
        copy not yet in step) could price every later match of a text under the rows where they are dear: the README
        demo then ran at 0.96x in place of 1.2x, every copy declined (2 cores; bench/NOTES.md, lookup-probe)."""
        k = min(len(found.tokens), k_cap, self.lookup_max)
        if k <= 0:
            return 0
        r, c = self._r(), self._prices()
        head = max((gain - r * extra for gain, extra in self._head_drafts(min(k_cap, self.k_max))), default=-math.inf)
        floor = 1.0 - r * c[0] + max(0.0, head)  # plain decoding, or the head's best planned draft
        best_j, best_v, best_gain, reach, gain = 0, -math.inf, 0.0, 1.0, 0.0  # the best length, paying or not
        for j in range(1, k + 1):
            reach *= self.lookup_acc.prob(found.n, j - 1)
            gain += reach
            v = 1.0 + gain - r * c[j]
            if v > best_v:
                best_j, best_v, best_gain = j, v, gain
        pays = best_v > floor
        if found.n >= N_MAX:
            self.lookup_wait = self.lookup_gap if pays else self.lookup_wait - 1
            if self.lookup_wait <= 0:
                pays = self.lookup_probing = True
                self.stats.lookup_probes += 1
        if not pays:
            return 0
        self._pred = (1.0 + best_gain, c[best_j])
        return best_j

    def tree(self, id_last: int, draft: Draft, room: int) -> DraftTree | None:
        """The draft as a tree: each runner-up, the likeliest to be kept first, while the tokens it is expected
        to add (reaching its parent, at the chain's calibrated acceptances, times the chance the target takes
        it there) beat what its verify row costs at the rate to beat, now and, if kept, again next cycle (a
        kept branch is decoded again); at most `nodes` tokens, and `room` (the rows that fit). None: the chain
        alone."""
        if not self.n_alt or not draft.tokens:
            return None
        acc, branch = self.acc, self.branch_acc
        chain = chain_tree(id_last, draft, acc.prob)
        r, c = self._r(), self._prices()
        n, chosen = len(draft.tokens), []
        for b in branch_candidates(chain, draft, lambda _d, reach, p: reach * branch.prob(p)):
            if len(chosen) >= self.branches or n >= room:
                break
            row = r * (c[n + 1] - c[n])  # one more verify row, in tokens at the rate to beat
            if b.weight * (1.0 - row) <= row:
                break
            chosen.append(b)
            n += 1
        if not chosen:
            return None
        self._pred = (self._pred[0] + sum(b.weight for b in chosen), self._pred[1] + c[n] - c[len(draft.tokens)])
        return with_branches(chain, chosen)

    def observe_tree(self, tree: DraftTree, path: list[int]) -> None:
        self.branch_acc.observe(tree, path)

    def _head_drafts(self, k_cap: int) -> list[tuple[float, float]]:
        """For a head draft of j = 1..k_cap at the expected acceptances: (E_j - 1, T_j - c(1)), the drafts
        expected to be emitted and what the cycle costs beyond a plain one (draft steps and catch-up included)."""
        c, d, e = self._prices(), self.costs.step_s, self.costs.draft_fixed_s
        out, reach, gain = [], 1.0, 0.0
        for j in range(1, k_cap + 1):
            reach *= self.acc.lookahead[j - 1]
            gain += reach
            out.append((gain, c[j] + e + j * d - c[0]))
        return out

    # -- during the draft ------------------------------------------------------------------------------
    def judge(self, confs: list[float], n_max: int) -> int:
        """After draft step i = len(confs) (confidences so far): -1 to draft another step, or j >= 0 to
        stop and verify the first j drafts. Steps not drafted yet are expected to go as the last one did
        (acceptance runs in stretches), which is also what the plan of the next cycle learns."""
        i = len(confs)
        acc, r, c, d = self.acc, self._r(), self._prices(), self.costs.step_s
        # stopping now: the best prefix j <= i of what was drafted (the draft steps are spent either way)
        reach, gain = 1.0, 0.0
        best_j, best_v, best_gain = 0, -r * c[0], 0.0
        for j in range(1, i + 1):
            reach *= acc.prob(j - 1, confs[j - 1])
            gain += reach
            v = gain - r * c[j]
            if v > best_v:
                best_j, best_v, best_gain = j, v, gain
        acc.saw_step(i - 1, acc.prob(i - 1, confs[-1]))
        ahead = [acc.prob(j, confs[-1]) for j in range(i, self.k_max)]  # [K_max - i]
        for j, p in enumerate(ahead):
            acc.saw_step(i + j, p)
        self._changed()
        # drafting on to j > i, each further step at the last step's acceptance
        for j in range(i + 1, n_max + 1):
            reach *= ahead[j - i - 1]
            gain += reach
            if gain - r * (c[j] + (j - i) * d) > best_v:
                return -1
        self._pred = (1.0 + best_gain, c[best_j] + self.costs.draft_fixed_s + i * d)
        return best_j

    def native_judge(self) -> NativeJudge:
        """judge() as chain.c runs it, at this cycle's prices; _judged() takes what its last call decided."""
        j = self._native
        j.r, j.prices, j.step_s = self._r(), self._prices(), self.costs.step_s
        return j

    def _judged(self, steps: int, keep: int, best_gain: float) -> None:
        """What judge() leaves behind after its last call (steps drafted, keep verified), from chain.c's judge."""
        self._changed()
        self._pred = (1.0 + best_gain, self._prices()[keep] + self.costs.draft_fixed_s + steps * self.costs.step_s)

    # -- after the cycle ------------------------------------------------------------------------------
    def observe(self, confs: list[float], n_verified: int, n_accepted: int, n_drafted: int,
                t_verify: float, t_draft: float, n_emitted: int, n_rows: int | None = None,
                t_steps: float | None = None) -> None:
        """The cycle's outcome: drafts verified and accepted, and its timings (seconds; t_steps: the draft's steps
        after the first, where timed apart). n_rows: the rows its verify decoded, where that is not n_verified + 1
        (a tree's branches, a kept branch decoded again)."""
        rows = n_verified + 1 if n_rows is None else n_rows
        if n_drafted == 0 and rows == 1:
            self.observe_plain(t_verify)
            return
        st, costs = self.stats, self.costs
        run = self._decoded(rows)
        st.chosen[n_verified] += 1
        st.trace.append(n_verified)
        # judge() set the prediction of a drafting cycle (to the one-row reset at the end when it did not run)
        st.predicted_tokens += self._pred[0]
        st.predicted_s += self._pred[1] * costs.scale
        if n_verified:
            self.acc.observe(confs, n_verified, n_accepted)
        self.since_plain += 1
        if rows > 1:
            self._observe_rows(rows, t_verify, run)
        costs.observe_draft(n_drafted, t_draft, t_steps)
        self._changed()
        t = self._priced(rows, n_drafted, run) if costs.frozen else t_verify + t_draft
        if t > 0:
            self.rate += RATE_EMA * (n_emitted / t - self.rate)
        if self.probing:
            # A probe that makes drafting pay (the next plan drafts) resets the back-off; one that does not
            # backs off, even where it got a draft accepted: a weak head often gets the first one, and a probe
            # costs most of a target step (the head catches up on its window, and the target's verify
            # graph changes shape twice), so probing every few cycles on such acceptances lost 3-6% of
            # target-only speed (measured, SmolLM2 + the shipped head, 2-core Intel).
            if self._pays(self.k_max):
                self.probe_gap = PROBE_MIN
            else:
                self.probe_gap = min(2 * self.probe_gap, PROBE_MAX)
            self.probe_wait = self.probe_gap
        self._pred = (1.0, self.costs.now_s[0])

    def observe_lookup(self, n: int, n_verified: int, n_accepted: int, t_verify: float, n_emitted: int,
                       n_rows: int | None = None) -> None:
        """A lookup cycle's outcome (a match of n tokens proposed n_verified drafts; no draft step; n_rows as
        for observe)."""
        st, costs = self.stats, self.costs
        st.chosen[n_verified] += 1
        st.trace.append(n_verified)
        st.predicted_tokens += self._pred[0]
        st.predicted_s += self._pred[1] * costs.scale
        self.lookup_acc.observe(n, n_verified, n_accepted)
        if self.lookup_probing:
            self.lookup_probing = False
            whole = n_accepted == n_verified
            self.lookup_gap = LOOKUP_PROBE_MIN if whole else min(2 * self.lookup_gap, PROBE_MAX)
            self.lookup_wait = self.lookup_gap
        rows = n_verified + 1 if n_rows is None else n_rows
        run = self._decoded(rows)
        self._observe_rows(rows, t_verify, run)
        self._changed()
        if costs.frozen:
            t_verify = self._priced(rows, 0, run)
        if t_verify > 0:
            self.rate += RATE_EMA * (n_emitted / t_verify - self.rate)
        self._pred = (1.0, costs.now_s[0])

    def _decoded(self, rows: int) -> int:
        """The target's verify decoded `rows` rows: its place in a run of decodes of that many (1: the width changed,
        2: the second in a row, ggml-cuda's capture)."""
        self.run = self.run + 1 if rows == self.last_rows else 1
        self.last_rows = rows
        self._after_check = False  # the cycle after a check has been priced warm (set by _learn_plain)
        return self.run

    def _observe_rows(self, rows: int, t_verify: float, run: int) -> None:
        """A verify of `rows` rows took t_verify, the run-th of that count in a row (the curve learns the sizes it
        covers, each at its warm cost: the switch and its capture are the curve's apart)."""
        if rows <= self.costs.k_max + 1:
            self.costs.observe_verify(rows, self._warm(t_verify, run))

    def _warm(self, t_verify: float, run: int) -> float:
        """A verify's seconds less the share of the switch it paid (at least a quarter of them: a switch priced above
        what one costs now must not make verifies look free; a CUDA capture alone can outcost the rows)."""
        return max(t_verify - self.costs.paid(run), 0.25 * t_verify) if run <= 2 else t_verify

    def _priced(self, rows: int, n_drafted: int, run: int) -> float:
        """A cycle's seconds by the curve (a frozen curve's stand-in for its timing): `rows` verify rows (more
        than the curve covers, a kept branch decoded again, at its last price), the share of the switch the run-th
        verify of that count in a row pays, and n_drafted draft steps."""
        c = self.costs
        t = c.verify(min(rows, c.k_max + 1)) + c.paid(run)
        return t + c.scale * (c.draft_fixed_s + n_drafted * c.step_s) if n_drafted else t

    def observe_plain(self, t_verify: float) -> None:
        """A plain cycle's outcome (one row emitted, no draft step): the common case, kept short (it runs
        cache-cold after the target's graph); in a plain streak only its timing is kept (plan())."""
        run = self._decoded(1)
        if self._deferring:
            self._pending.append((t_verify, run))
            return
        self._learn_plain(t_verify, run)

    def _learn_streak(self) -> None:
        """The plain streak is over: learn its cycles' timings, in order."""
        pending, self._pending = self._pending, []
        self._deferring, self._streak = False, 0
        for t, run in pending:
            self._learn_plain(t, run)

    def _learn_plain(self, t_verify: float, run: int) -> None:
        st, costs = self.stats, self.costs
        st.chosen[0] += 1
        st.trace.append(0)
        st.plain_cycles += 1
        one = costs.verify(1)
        st.predicted_tokens += 1.0
        st.predicted_s += one + costs.paid(run)
        warm = self._warm(t_verify, run)
        if self.checking:
            ok = abs(warm / one - 1.0) < CHECK_TOL
            self.check_gap = min(2 * self.check_gap, CHECK_MAX) if ok else CHECK_MIN
            self.checking, self._after_check = False, True  # one cycle, whether plan() or a lookup decides it
        self.since_plain = 0
        costs.observe_verify(1, warm)
        if costs.frozen:
            t_verify = self._priced(1, 0, run)
        if t_verify > 0:
            self.rate += RATE_EMA * (1.0 / t_verify - self.rate)

    def finish_stats(self) -> PolicyStats:
        self._learn_streak()
        st = self.stats
        st.cost_curve = self.costs.relative()
        st.draft_step_cost = self.costs.step_s / self.costs.now_s[0]
        st.draft_fixed_cost = self.costs.draft_fixed_s / self.costs.now_s[0]
        st.switch_cost = self.costs.switch_s / self.costs.now_s[0]
        st.capture_cost = self.costs.capture_s / self.costs.now_s[0]
        return st


DraftPolicy = FixedPolicy | AdaptivePolicy
POLICIES = ("adaptive", "fixed")
