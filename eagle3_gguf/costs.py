"""What a cycle costs here: verifying n rows, a draft step, and the head's catch-up (`CostCurve`).

c(1..K_max+1) (each width warm) and d, and the switch s the first two verifies of a row count pay on top where it is
not the target's last decode's (llama.cpp's graph rebuilt; on CUDA the graph run uncaptured, then captured on the second
call: its share of s is the capture), so that a policy keeps its width unless another pays for the change (the cycle
after a check excepted: every width warm); measured at load (`measure`, a fraction of a second, cached per target file,
head file, threads, GPU layers and KV types in `~/.cache/eagle3-gguf/costs/`, `CostKey`; a corrupt or stale entry is
measured again) and refined online: one row's cost (a scale on the whole curve) from plain cycles, each larger row
count's from the cycles that verified that many, d from a draft's steps after its first (timed apart: the loop pays
more than a calibration of warm repeated drafts reads). policy.py decides from it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

CACHE_VERSION = 4  # 4: how drafts read the head; 3: the switch's capture apart; 2: warm verify costs and the switch; 1: sizes timed among others
EMA = 0.05  # weight of one new timing in the online cost refinement (scale, draft step, draft fixed cost)
SEEN_EMA = 0.1  # weight of one verify in its row count's running mean (a plain mean over the first ten)
SEEN_CAP = 16.0  # a row count's own timings outweigh the calibration at most SEEN_CAP : SEEN_PRIOR
SEEN_PRIOR = 2.0  # the scaled calibration counts as this many timings


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
    # how the draft steps were timed reading the head: the tokens its graph chose a step (choice.py), 0 where numpy
    # read its logits; where a run may do either, calibration times both and keeps the cheaper (Speculator)
    head_k: int = 0

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
                and ok(self.capture_s) and self.capture_s <= self.switch_s
                and isinstance(self.head_k, int) and self.head_k >= 0)


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

        return cls(file_ident(target), file_ident(head), n_threads, setup, n_batch,
                   f"{os.uname().machine}:{os.cpu_count()}:{cpu_model()}:{backend_fingerprint()}")

    @classmethod
    def for_contexts(cls, target, head, n_batch: int, reads: str = "") -> "CostKey":
        """The key of a target context and a head context (context.Context) verifying n_batch rows at most:
        the same set-up gives the same key on every surface. `reads`: what a verify reads back where it matters
        to the key (a cost curve: "graph" choices or "logits"; the graph's argmax costs more on a CPU)."""
        # ggml's switches in the environment pick kernels too (GGML_CPU_TILED_MM=0: K-quants without the tiled matmul)
        ggml = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("GGML_"))
        adapters = zip(target.adapters.paths, target.adapters.scales) if target.adapters is not None else ()
        # n_ubatch: a batch wider than it is computed as ubatches (the probe compares products up to it)
        setup = (f"kv {target.kv_types[0]}/{target.kv_types[1]} fa {target.flash_attn} ub {target.n_ubatch} "
                 f"repack {target.model.repack} on {target.model.placement} / {head.model.placement}"
                 + (f" env {ggml}" if ggml else "") + (f" reads {reads}" if reads else "")
                 + "".join(f" lora {file_ident(p)}x{scale!r}" for p, scale in adapters))
        return cls.for_files(target.model.path, head.model.path, target.n_threads, setup, n_batch)

    def path(self) -> Path:
        base = Path(os.environ.get("EAGLE3_GGUF_CACHE", Path.home() / ".cache" / "eagle3-gguf"))
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:20]
        return base / "costs" / f"{digest}.json"


def file_ident(p: str | Path) -> str:
    """A file as a key names it: its path, size and mtime (a file written again is another)."""
    st = Path(p).stat()
    return f"{Path(p).resolve()}:{st.st_size}:{st.st_mtime_ns}"


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
                          capture_s=float(data["capture_s"]), head_k=data["head_k"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not curve.valid(k_max):
        return None
    return CostCurve(curve.verify_s[:k_max + 1], curve.draft_step_s, curve.draft_fixed_s, "cache",
                     switch_s=curve.switch_s, capture_s=curve.capture_s, head_k=curve.head_k)


def save_costs(key: CostKey, curve: CostCurve) -> None:
    """Write the curve atomically; a cache that cannot be written is only a missed shortcut."""
    path = key.path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "key": asdict(key), "verify_s": curve.verify_s,
                                   "draft_step_s": curve.draft_step_s, "draft_fixed_s": curve.draft_fixed_s,
                                   "switch_s": curve.switch_s, "capture_s": curve.capture_s,
                                   "head_k": curve.head_k}))
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

