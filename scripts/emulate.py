"""Emulation: a pair's llama.cpp calls padded to what a lent GPU measured, so that a CPU can weigh drafting policies.

A lent GPU is rare and short; what its call brings back (bench/scale-gpu/results.json) holds the physics of each shape:
the verify curve, the switch (what a verify's first two calls cost on top after a decode of other rows: llama.cpp
rebuilds the graph, ggml-cuda runs it uncaptured, and on the second call of the same shape captures it again), the
head's graphs alone and right after a change.
`Emulation` sets itself as each context's runner (context.Context.runner): it runs the real call (the tiny synthetic
pair's, on this CPU: tokens, caches and text are real), then spins until the call has taken what the GPU took for a
call of that kind and width: the first call of a shape adds what a call right after another shape cost there, the
second the rest of the switch (ggml-cuda's capture: its warm-up runs a changed graph once uncaptured and captures it
on the next call of the same shape, vendor ggml-cuda.cu, ggml_backend_cuda_graph_compute). So a policy's choices meet
the GPU's prices, at the tiny shape's acceptance (the replay's profile).

It emulates the graphs, not what a GPU machine's Python and copies cost around them: against the H200's own run it
read about 13% fast for every contender alike (bench/NOTES.md, "emulated-h200"). Compare contenders within one run.
A CPU slower than the GPU host's (its tiny head's graph alone outlasting the GPU's) emulates it in slow motion: every
price times `slowdown`, the host's Python slower about as much. The spin counts as the context's native time, so that
the statistics' Python is this host's own.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from eagle3_gguf.errors import Eagle3Error


@dataclass
class Prices:
    """Milliseconds a call takes on the emulated machine, warm, and what a change of shape adds."""

    verify_ms: list[float]  # [ROWS]: a target decode of 1..ROWS rows, repeated
    first_ms: float  # a target decode after one of other rows, on top (the switch's first share)
    head_decode_ms: float  # the head's decoder, repeated (launch-bound on a GPU: any width)
    head_encode_ms: float  # its encoder
    head_switch_ms: float  # either, after a call of another shape, on top
    capture_ms: float = 0.0  # the target's second call of a shape in a row, on top (ggml-cuda captures it)

    def scaled(self, factor: float) -> "Prices":
        """Every price times `factor` (a slower machine of the same physics)."""
        return Prices(**{f.name: [factor * t for t in v] if isinstance(v := getattr(self, f.name), list) else factor * v
                         for f in fields(self)})

    def target(self, n: int) -> float:
        """A warm target decode of n rows (a prompt past the curve: along its last slope)."""
        v = self.verify_ms
        return v[n - 1] if n <= len(v) else v[-1] + (v[-1] - v[-2]) * (n - len(v))


def prices_of(results: Path, shape: str) -> Prices:
    """The prices of `shape` ("llama-8b:q4_k_m") in a bench_scale results.json. Results from before the curve was
    timed warm (no switch_ms) had each width timed after another: their curve is shifted down to the warm row. Results
    with the warm curve split the switch (a width's first two calls beyond two warm ones) into the first call's share
    (a 1-row decode right after 2 rows, Parts) and the capture."""
    try:
        data = json.loads(Path(results).read_text())
        name, _, qtype = shape.partition(":")
        res = next(r for r in data["shapes"] if (r["shape"], r["qtype"]) == (name, qtype))
        ph, parts = res["physics"], res["physics"]["parts"]
        head = parts["head_decode_ms"]
        head_switch = max(parts["head_decode_after_ms"] - head, 0.0)
        first = max(parts["target_row_after_ms"] - parts["target_row_ms"], 0.0)
        if "switch_ms" not in ph:
            shift = ph["verify_ms"][0] - parts["target_row_ms"]
            return Prices([t - shift for t in ph["verify_ms"]], first, head, parts["head_encode_ms"], head_switch)
        s = ph["switch_ms"]
        first = s - ph["capture_ms"] if "capture_ms" in ph else min(first, s)  # the capture measured apart, or not
        return Prices(ph["verify_ms"], first, head, parts["head_encode_ms"], head_switch, s - first)
    except StopIteration:
        raise Eagle3Error(f"--emulate: {results} holds no shape {shape}") from None
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise Eagle3Error(f"--emulate: {results}: not a bench_scale results.json with physics ({e})") from None


@dataclass
class Runner:
    """One context's runner: the real call, then a spin to the emulated time."""

    prices: Prices
    is_target: bool
    ctx: object = None  # the context.Context whose calls these are: the spin is its native time (None: a test's)
    last: tuple[str, int] = ("", 0)  # the previous call's graph and rows
    run: int = 0  # calls of that shape in a row, the previous one included
    calls: int = 0
    over: int = 0  # calls whose real time exceeded the emulated one (the emulation is then off)

    def __call__(self, call, graph, *args) -> int:
        t0 = time.perf_counter()
        rc = call(graph, *args)
        end = t0 + self.price(getattr(graph, "__name__", str(graph)), args[-1].n_tokens) / 1e3  # the batch: last
        now = time.perf_counter()
        if now > end:
            self.over += 1
        while (t := time.perf_counter()) < end:
            pass
        if self.ctx is not None and t > now:
            self.ctx.t_native += t - now  # the GPU's time, not this host's Python
        return rc

    def price(self, graph: str, n: int) -> float:
        """Milliseconds this call of `graph` on n rows takes on the emulated machine, after the calls before it."""
        p, shape = self.prices, (graph, n)
        changed = shape != self.last
        self.run = 1 if changed else self.run + 1
        self.last, self.calls = shape, self.calls + 1
        if self.is_target:
            return p.target(n) + (p.first_ms if changed else p.capture_ms if self.run == 2 else 0.0)
        return (p.head_encode_ms if "encode" in graph else p.head_decode_ms) + (p.head_switch_ms if changed else 0.0)


@dataclass
class Emulation:
    prices: Prices
    source: str  # "results.json:shape"
    runners: list[Runner] = field(default_factory=list)

    def attach(self, target, head) -> None:
        """Emulate the prices on these contexts (context.Context) from now on."""
        for ctx, is_target in ((target, True), (head, False)):
            r = Runner(self.prices, is_target, ctx)
            ctx.runner = r
            self.runners.append(r)

    def overruns(self) -> str:
        """How often a real call took longer than the emulated one (then the emulation reads slow)."""
        return ", ".join(f"{'target' if r.is_target else 'head'} {r.over} of {r.calls}" for r in self.runners)


def parse(spec: str, slowdown: float = 1.0) -> Emulation:
    """--emulate RESULTS.json:SHAPE:TYPE, every price times `slowdown` (--emulate-slowdown)."""
    path, _, shape = spec.partition(":")
    if not shape or ":" not in shape:
        raise Eagle3Error(f"--emulate {spec}: give RESULTS.json:SHAPE:TYPE, e.g. bench/scale-gpu/results.json:"
                          "llama-8b:q4_k_m")
    if not (math.isfinite(slowdown) and slowdown >= 1.0):
        raise Eagle3Error(f"--emulate-slowdown {slowdown}: a factor of at least 1 (the emulated GPU host slower)")
    return Emulation(prices_of(Path(path), shape).scaled(slowdown),
                     spec + (f" x{slowdown:g}" if slowdown != 1.0 else ""))
