#!/usr/bin/env python
"""What `serve --parallel N` could gain on this machine: aggregate decoding throughput with N sequences in
one target batch (one row per sequence per step, each its own KV sequence) against one sequence alone.

    python scripts/bench_parallel.py                      # SmolLM2 Q4_1, N = 1..4, 2 threads
    python scripts/bench_parallel.py --ns 1,2,4,8 --out bench/parallel-cpu

Plain greedy decoding, no head: the question is only whether llama.cpp decodes N rows of N sequences for
less than N times one row (on a CPU verification is compute-bound, on a GPU nearly free). Every round runs
each N once, interleaved, from the same prompts (our own, not benchmark text); a setting's figure is the
median over rounds. Aggregate tok/s = N * steps / seconds; per-sequence tok/s = steps / seconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eagle3_gguf.assets import smollm2_path  # noqa: E402
from eagle3_gguf.native import CACHE_TYPES, Batch, Context, Model, install_log_callback  # noqa: E402
from eagle3_gguf.tokens import chat_tokens  # noqa: E402

PROMPTS = [
    "Explain how a bicycle's gears make pedaling easier uphill.",
    "Write a short poem about a cat watching the rain.",
    "What are three tips for writing a clear email?",
    "Write a Python function that checks whether all elements of a list are unique.",
    "Describe the water cycle to a ten-year-old.",
    "List the planets of the solar system with one fact each.",
    "How does a refrigerator keep food cold?",
    "Give me a recipe for a simple tomato soup.",
]


def run(ctx: Context, batch: Batch, prompts: list[list[int]], steps: int) -> float:
    """Prefill each prompt into its own sequence, then `steps` steps of one greedy row per sequence in one
    batch. Returns the seconds the steps took."""
    ctx.clear()
    last = []
    for s, p in enumerate(prompts):
        batch.set_rows(np.asarray(p, np.int32), np.arange(len(p), dtype=np.int32), np.full(len(p), s, np.int32),
                       np.arange(len(p)) == len(p) - 1)
        ctx.decode(batch)
        last.append(int(np.argmax(ctx.logits_ith(len(p) - 1))))
    n = len(prompts)
    pos = np.asarray([len(p) for p in prompts], np.int32)  # [n]
    seqs = np.arange(n, dtype=np.int32)  # [n]
    t = time.perf_counter()
    for _ in range(steps):
        batch.set_rows(np.asarray(last, np.int32), pos, seqs, np.ones(n, bool))
        ctx.decode(batch)
        logits = ctx.logits(n)  # [n, n_vocab]
        last = [int(np.argmax(logits[i])) for i in range(n)]
        pos += 1
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=None, help="target GGUF (default: SmolLM2-135M Q4_1)")
    ap.add_argument("--ns", default="1,2,3,4", help="sequences per batch")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write results.md and results.json here")
    args = ap.parse_args()
    install_log_callback()
    ns = [int(x) for x in args.ns.split(",")]
    target = args.target or smollm2_path()
    model = Model(target)
    # one KV stream of 1024 cells per sequence (a slot), the V cache in bf16 as serve has it
    ctx = Context(model, n_ctx=1024 * max(ns), n_batch=512, n_threads=args.threads, n_seq_max=max(ns),
                  kv_unified=False, type_v=CACHE_TYPES["bf16"])
    batch = Batch(512)
    prompts = [chat_tokens(model, p) for p in PROMPTS]
    seconds: dict[int, list[float]] = {n: [] for n in ns}
    try:
        for n in ns:  # warm-up: llama.cpp sizes its graphs for each batch shape once
            run(ctx, batch, prompts[:n], 4)
        for r in range(args.rounds):
            for n in ns:
                seconds[n].append(run(ctx, batch, [prompts[(r + i) % len(prompts)] for i in range(n)], args.steps))
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    finally:
        batch.close()
        ctx.close()
        model.close()
    one = statistics.median(args.steps / s for s in seconds[ns[0]])
    rows = []
    for n in ns:
        per_seq = statistics.median(args.steps / s for s in seconds[n])
        rows.append({"n": n, "per_sequence_tok_s": per_seq, "aggregate_tok_s": n * per_seq,
                     "aggregate_vs_one": n * per_seq / one, "step_cost_vs_one": one / per_seq})
    command = "python scripts/bench_parallel.py " + " ".join(sys.argv[1:])
    lines = [f"# Parallel sequences in one batch: `{command}`", "",
             f"{platform.machine()}, {args.threads} threads, {target.name}, {args.steps} greedy steps, median of "
             f"{args.rounds} interleaved rounds.", "",
             "| sequences | step cost (x one) | per sequence tok/s | aggregate tok/s | aggregate (x one) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['n']} | {r['step_cost_vs_one']:.2f} | {r['per_sequence_tok_s']:.1f} | {r['aggregate_tok_s']:.1f} "
              f"| {r['aggregate_vs_one']:.2f}x |" for r in rows]
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text("\n".join(lines) + "\n")
        (args.out / "results.json").write_text(json.dumps({"command": command, "rows": rows, "seconds": seconds},
                                                          indent=1))


if __name__ == "__main__":
    main()
