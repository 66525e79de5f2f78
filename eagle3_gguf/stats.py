"""Speculation statistics: what happened in one run, as a dataclass, a table and JSON."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from .policy import PolicyStats


@dataclass(frozen=True)
class ExactReport:
    """The statistics' account of exactness: the mode, what the probe found, and whether the run kept to it."""

    mode: str  # DraftConfig.exact: "auto", "strict" or "off"
    probed: int = 0  # widths 1..probed examined (0: not probed)
    exact: int = 0  # widths 1..exact exact
    depths: tuple[int, ...] = ()
    source: str = ""  # "probed" or "cache"
    seconds: float = 0.0
    kept: bool = False  # every verify batch this run may decode is of an exact width (so is its output)
    rows_max: int = 0  # the widest verify batch the run may decode (1: plain decoding)
    parts_at: str = ""  # where the first inexact width parted, node by node (exactness.where_parts)

    def rows(self) -> list[tuple[str, str]]:
        """The statistics table's lines."""
        if self.mode == "off":
            return [("exact verify widths", "not probed (--exact off): output may part from target-only at near-ties")]
        found = f"1..{self.exact}" if self.exact > 1 else "1" if self.exact == 1 else "none"
        parts = f", width {self.exact + 1} parts" if self.exact < self.probed else ""
        how = f"probed in {self.seconds:.2f} s" if self.source == "probed" else "cached"
        depths = ", ".join(map(str, self.depths))
        if not self.kept:
            kept = "no: speculating past them (--exact auto where none above 1 is; --exact strict keeps to them)"
        elif self.rows_max <= 1:
            kept = "yes: plain decoding (--exact strict, none above 1 is exact)"
        else:
            kept = f"yes: verify batches of at most {self.rows_max} rows, so the output is target-only's"
        where = [("where it parts", self.parts_at)] if self.parts_at else []
        return [("exact verify widths", f"{found} of 1..{self.probed}{parts} ({how}; depths {depths})"), *where,
                ("kept to them", kept)]


def tokens_per_second(n_generated: int, seconds: float) -> float:
    """A run's speed: the tokens after the first over the generation's time (the first is chosen at the prompt's
    last row, in t_prefill: counting it overstated every speed by n/(n-1), and made -n 1 thousands of tok/s); 0
    where none came."""
    return (n_generated - 1) / seconds if n_generated > 1 and seconds > 0 else 0.0


@dataclass
class SpecStats:
    draft_max: int = 0  # K: the head's drafts per cycle at most
    lookup_max: int = 0  # L: a lookup draft's at most (0: no lookup drafts)
    n_prompt: int = 0
    n_generated: int = 0
    n_target_forwards: int = 0  # target decodes that produced a token: the prefill + one per verify cycle
    n_drafted: int = 0
    n_accepted: int = 0
    # M = max(K, L), the most drafts a cycle verifies
    accept_hist: list[int] = field(default_factory=list)  # [M + 1]: cycles that accepted 0..M drafts
    drafted_by_pos: list[int] = field(default_factory=list)  # [M]: drafts offered at position i
    accepted_by_pos: list[int] = field(default_factory=list)  # [M]: drafts accepted at position i
    # [M]: drafts at position i whose drafts before it were all accepted: P(draft i kept | drafts before it kept) is
    # accepted_by_pos[i] / reached_by_pos[i], whatever lengths the cycles drafted
    reached_by_pos: list[int] = field(default_factory=list)
    lookup_cycles: int = 0  # of the cycles above: those whose drafts came from prompt lookup (lookup.py)
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    tree_cycles: int = 0  # of the cycles above: those that verified a draft tree (tree.py)
    tree_nodes: int = 0  # the draft tokens those trees held (chains and branches)
    tree_branch_kept: int = 0  # tree cycles whose kept path left the chain for a branch
    verify_rows: list[int] = field(default_factory=list)  # [rows_max + 1]: verify cycles by the rows decoded (1: plain)
    t_prefill: float = 0.0
    t_target: float = 0.0  # verify decodes + choosing tokens
    t_target_native: float = 0.0  # of t_target: inside llama.cpp (the verify graphs)
    t_draft: float = 0.0  # Eagle3Session.draft
    t_draft_native: float = 0.0  # of t_draft: inside llama.cpp (the head's graphs; the rest is choosing tokens)
    t_lookup: float = 0.0  # lookup proposals and the policy's choice over them
    t_process: float = 0.0  # Eagle3Session.accept + process (encoder + decoder on kept rows)
    t_process_native: float = 0.0  # of t_process: inside llama.cpp
    t_total: float = 0.0  # generation after the prompt, everything included
    t_native: float = 0.0  # of t_total: inside llama.cpp (target + draft decodes and encodes)
    stop_reason: str = ""
    spec_sampling: str = ""  # how drafts were verified: greedy, match, or rejection (decode.spec_sampling_label)
    target_on: str = ""  # where the target ran: "CPU", or its GPU devices and layers offloaded (native.Placement)
    head_on: str = ""  # where the head ran (speculative runs)
    policy: PolicyStats | None = None  # what the drafting policy chose (speculative runs)
    exact: ExactReport | None = None  # the verify widths it kept to (speculative runs; exactness.py)

    def __post_init__(self) -> None:
        k = max(self.draft_max, self.lookup_max)
        self.accept_hist = self.accept_hist or [0] * (k + 1)
        self.drafted_by_pos = self.drafted_by_pos or [0] * k
        self.accepted_by_pos = self.accepted_by_pos or [0] * k
        self.reached_by_pos = self.reached_by_pos or [0] * k
        self._last_drafted = 0  # the last recorded cycle's drafts (cut_cycle); not a field

    def record_cycle(self, n_drafted: int, n_accepted: int) -> None:
        self.n_drafted += n_drafted
        self.n_accepted += n_accepted
        self.accept_hist[n_accepted] += 1
        for i in range(n_drafted):
            self.drafted_by_pos[i] += 1
        for i in range(n_accepted):
            self.accepted_by_pos[i] += 1
        for i in range(min(n_drafted, n_accepted + 1)):
            self.reached_by_pos[i] += 1
        self._last_drafted = n_drafted

    def record_rows(self, n: int) -> None:
        """A verify cycle decoded n rows (id_last, its drafts or tree, and a tree's kept branch redone)."""
        if n >= len(self.verify_rows):
            self.verify_rows += [0] * (n + 1 - len(self.verify_rows))
        self.verify_rows[n] += 1

    def record_lookup(self, n_drafted: int, n_accepted: int) -> None:
        """The cycle just recorded verified a lookup draft."""
        self.lookup_cycles += 1
        self.lookup_drafted += n_drafted
        self.lookup_accepted += n_accepted

    def record_tree(self, n_nodes: int, branch_kept: bool) -> None:
        """The cycle just recorded verified a draft tree of n_nodes (record_cycle counted its chain)."""
        self.tree_cycles += 1
        self.tree_nodes += n_nodes
        self.tree_branch_kept += branch_kept

    def cut_cycle(self, n_accepted: int, n_kept: int) -> None:
        """The last recorded cycle accepted n_accepted drafts, but the run ended after n_kept of them
        (a stop check, or the caller stopped reading): count it as a cycle that accepted n_kept."""
        self.n_accepted -= n_accepted - n_kept
        self.accept_hist[n_accepted] -= 1
        self.accept_hist[n_kept] += 1
        for i in range(n_kept, n_accepted):
            self.accepted_by_pos[i] -= 1
        for i in range(n_kept + 1, min(self._last_drafted, n_accepted + 1)):
            self.reached_by_pos[i] -= 1

    # -- derived figures -----------------------------------------------------------------------
    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens per target forward (prefill included)."""
        return self.n_generated / self.n_target_forwards if self.n_target_forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return tokens_per_second(self.n_generated, self.t_total)

    @property
    def t_overhead(self) -> float:
        return max(self.t_total - self.t_target - self.t_draft - self.t_process, 0.0)

    @property
    def t_python(self) -> float:
        """Wall time outside llama.cpp calls: the Python cost of the loop."""
        return max(self.t_total - self.t_native, 0.0)

    def per_cycle_ms(self, seconds: float) -> float:
        """`seconds` spread over the verify cycles (the prompt's forward left out), in ms."""
        return 1e3 * seconds / max(self.n_target_forwards - 1, 1)

    @property
    def python_per_cycle_ms(self) -> float:
        return self.per_cycle_ms(self.t_python)

    @property
    def t_draft_python(self) -> float:
        """Of t_python, the part inside drafting: choosing each draft step's token from the head's logits."""
        return max(self.t_draft - self.t_draft_native, 0.0)

    @property
    def t_verify_python(self) -> float:
        """Of t_python, the part around the verify graphs: choosing the target's tokens."""
        return max(self.t_target - self.t_target_native, 0.0)

    @property
    def t_process_python(self) -> float:
        """Of t_python, the part around processing the kept rows."""
        return max(self.t_process - self.t_process_native, 0.0)

    @property
    def python_by_stage(self) -> dict[str, float]:
        """t_python by the cycle's stage, in ms a cycle: drafting, verifying (choosing the target's tokens), processing
        the kept rows, and the rest (the policy, the statistics, the loop and its caller)."""
        stages = {"drafting": self.t_draft_python, "verifying": self.t_verify_python,
                  "processing": self.t_process_python}
        stages["the rest"] = max(self.t_python - sum(stages.values()), 0.0)
        return {name: self.per_cycle_ms(t) for name, t in stages.items()}

    def policy_rows(self) -> list[tuple[str, str]]:
        p = self.policy
        rows = [("draft policy", p.name),
                (f"{'chain ' if self.tree_cycles else ''}drafts verified 0..{len(p.chosen) - 1} (cycles)",
                 " ".join(str(x) for x in p.chosen))]
        if p.name == "adaptive":
            rows += [
                ("plain cycles / probes", f"{p.plain_cycles} / {p.probes}"
                 + (f" (and {p.lookup_probes} of lookups)" if p.lookup_probes else "")),
                (f"cost of 1..{len(p.cost_curve)} verify rows", " ".join(f"{x:.2f}" for x in p.cost_curve)
                 + f" x one row, +{p.switch_cost:.2f} where the row count changes"
                 + (f" ({p.capture_cost:.2f} of it on its second verify)" if p.capture_cost else "")
                 + f"; draft {p.draft_fixed_cost:.2f} + "
                 f"{p.draft_step_cost:.2f}/step ({p.cost_source}; {p.head_reads})"),
                ("predicted / realised", f"{p.predicted_tok_s:.1f} / {self.tokens_per_second:.1f} tok/s"),
            ]
        return rows

    def acceptance_by_pos(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_pos, self.drafted_by_pos)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, tau=self.tau, tokens_per_second=self.tokens_per_second,
                 t_overhead=self.t_overhead, t_python=self.t_python, python_per_cycle_ms=self.python_per_cycle_ms,
                 t_draft_python=self.t_draft_python, python_by_stage=self.python_by_stage,
                 acceptance_by_pos=self.acceptance_by_pos())
        return d

    def table(self) -> str:
        rows = [("ran on", f"target {self.target_on}" + (f"; head {self.head_on}" if self.head_on else ""))]
        rows += [
            ("prompt tokens", f"{self.n_prompt}"),
            ("generated tokens", f"{self.n_generated}"),
            ("target forwards", f"{self.n_target_forwards}"),
        ]
        if self.exact is not None:
            rows += self.exact.rows()
        if self.draft_max or self.lookup_max:
            rows += [
                ("drafted / accepted", f"{self.n_drafted} / {self.n_accepted}"
                 + (" (a tree counts the depth it reached: its tokens are under draft trees)" if self.tree_cycles else "")),
                ("of them from lookup", f"{self.lookup_drafted} / {self.lookup_accepted} ({self.lookup_cycles} cycles, "
                 f"{1e3 * self.t_lookup:.1f} ms looking up)"),
                ("acceptance rate", f"{self.acceptance_rate:.1%}"),
                ("tau (tokens/forward)", f"{self.tau:.2f}"),
                (f"accepted 0..{len(self.accept_hist) - 1} (cycles)", " ".join(str(x) for x in self.accept_hist)),
                ("acceptance by position", " ".join(f"{x:.2f}" for x in self.acceptance_by_pos())),
                ("verify rows (cycles)", "  ".join(f"{n}: {c}" for n, c in enumerate(self.verify_rows) if c)),
            ]
            if self.tree_cycles:
                rows.append(("draft trees", f"{self.tree_cycles} cycles, {self.tree_nodes / self.tree_cycles:.1f} "
                             f"tokens each ({self.tree_nodes} verified); a branch kept in {self.tree_branch_kept}"))
            if self.spec_sampling:
                rows.append(("verification", self.spec_sampling))
        if self.policy is not None:
            rows += self.policy_rows()
        t = self.t_total or 1e-9
        rows += [
            ("time: target / draft / process / other",
             f"{self.t_target:.2f}s {self.t_draft:.2f}s {self.t_process:.2f}s {self.t_overhead:.2f}s "
             f"({self.t_target / t:.0%} {self.t_draft / t:.0%} {self.t_process / t:.0%} {self.t_overhead / t:.0%})"),
            ("python per cycle", f"{self.python_per_cycle_ms:.2f} ms (outside llama.cpp: "
             + ", ".join(f"{name} {ms:.2f}" for name, ms in self.python_by_stage.items()) + ")"),
            ("prompt time", f"{self.t_prefill:.2f}s"),
            ("speed", f"{self.tokens_per_second:.1f} tok/s" if self.n_generated > 1 else
             "n/a (no token after the first, which the prompt's processing chose)"),
            ("stopped by", self.stop_reason),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


class StageClock:
    """A run's stage timing, written into its SpecStats: the prompt (t_prefill, from construction to
    prefilled()), then generation (t_total and, of it, t_native: `native()` is the seconds spent in
    llama.cpp so far)."""

    def __init__(self, st: SpecStats, native: Callable[[], float]):
        self.st, self.native = st, native
        self.t0 = time.perf_counter()
        self.native0 = 0.0

    def prefilled(self) -> None:
        self.st.t_prefill = time.perf_counter() - self.t0
        self.t0, self.native0 = time.perf_counter(), self.native()

    def finished(self) -> None:
        self.st.t_total = time.perf_counter() - self.t0
        self.st.t_native = self.native() - self.native0


@dataclass
class RunResult:
    tokens: list[int]
    text: str
    stats: SpecStats


@dataclass
class Comparison:
    """A speculative run beside a target-only run of the same prompt."""

    speculative: RunResult
    baseline: RunResult

    @property
    def identical(self) -> bool:
        return self.speculative.tokens == self.baseline.tokens

    @property
    def speedup(self) -> float:
        b = self.baseline.stats.tokens_per_second
        return self.speculative.stats.tokens_per_second / b if b else 0.0

    def to_json(self) -> str:
        return json.dumps({"speculative": self.speculative.stats.to_dict(), "baseline": self.baseline.stats.to_dict(),
                           "identical": self.identical, "speedup": self.speedup,
                           "text": self.speculative.text}, indent=2)
