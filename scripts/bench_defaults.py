#!/usr/bin/env python
"""Choose `generate`'s defaults (K = --draft-max, --draft-p-min) on our own prompts, not the benchmark's.

    python scripts/bench_defaults.py                       # SmolLM2 Q4_1 as shipped + the embedded head
    python scripts/bench_defaults.py --quants q4_1,q4_0    # also the Q4_0 requantization (upstream build)

For every prompt, target-only decoding and each (K, p_min) run back to back in one process, target-only
again last (the library's measurement, eagle3_gguf/bench.py, as `eagle3-gguf bench`); a setting's speedup
is the median over prompts of its speed against target-only's faster run on the same prompt.
The prompts (EVAL_PROMPTS below) are our own held-out prompts, not training prompts and no MT-bench or
HumanEval text, so tuning here does not tune on the benchmark.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eagle3_gguf.assets import default_head_path, smollm2_path  # noqa: E402
from eagle3_gguf.bench import Bench, BenchPrompt, Contender, PromptRun, per_prompt_ratio  # noqa: E402
from eagle3_gguf.decode import GenerateConfig  # noqa: E402
from eagle3_gguf.native import install_log_callback  # noqa: E402
from eagle3_gguf.pair import PairConfig  # noqa: E402

# Our own held-out evaluation prompts: not training prompts (eagle3_gguf/train/prompts.py), not benchmark text.
EVAL_PROMPTS = [
    "Write a Python function that returns the number of words in a string that start with a capital letter. "
    "Include a docstring.",
    "Explain how a bicycle's gears make pedaling easier uphill.",
    "Write a short poem about a cat watching the rain.",
    "Tom has 12 oranges. He gives 3 to his sister and buys 7 more. How many oranges does he have now?",
    "What are three tips for writing a clear email?",
    "Write a Python function that checks whether all elements of a list are unique.",
]


@dataclass
class Setting:
    quant: str
    k: int
    p_min: float
    speedups: list[float]
    taus: list[float]
    identical: int
    n: int


def run_grid(quants: list[str], ks: list[int], p_mins: list[float], head: Path, n_predict: int = 128,
             threads: int = 2) -> list[Setting]:
    """Target-only and every (K, p_min) back to back on each prompt, per target quantization, measured by the
    library (eagle3_gguf/bench.py: target-only first and last, a setting's speedup its per-prompt ratio)."""
    results: list[Setting] = []
    for q in quants:
        target = Path(smollm2_path())
        if q == "q4_0":
            from build_upstream import requantized
            target = requantized(target, "Q4_0")
        grid = {(k, p): Setting(q, k, p, [], [], 0, 0) for k in ks for p in p_mins}
        contenders = [Contender(f"K={k} p_min={p:g}", GenerateConfig(n_predict=n_predict, draft_max=k, draft_p_min=p,
                                                                     draft_policy="fixed")) for k, p in grid]
        prompts = [BenchPrompt("ours", str(i), text) for i, text in enumerate(EVAL_PROMPTS)]
        runs: list[PromptRun] = []
        with Bench(target, head, PairConfig(n_ctx=2048, n_threads=threads), contenders) as bench:
            bench.tokenize(prompts)
            for r in bench.measure(prompts, 1, n_predict):
                runs.append(r)
                if r.contender == "target" and r.identical is not None:  # the prompt's last run
                    print(f"[{q}] {EVAL_PROMPTS[int(r.prompt_id)][:50]!r}: target {r.tok_s:.1f} tok/s", file=sys.stderr)
        base = [r for r in runs if r.contender == "target"]
        for c, s in zip(contenders, grid.values()):
            rs = [r for r in runs if r.contender == c.name]
            s.speedups = list(per_prompt_ratio(rs, base).values())
            s.taus = [r.tau for r in rs]
            s.identical, s.n = sum(bool(r.identical) for r in rs), len(rs)
        results += grid.values()
    return results


def table(results: list[Setting]) -> str:
    out = ["| target | K | p_min | speedup (median) | min–max | tau (median) | identical |",
           "|---|---|---|---|---|---|---|"]
    for s in sorted(results, key=lambda s: (s.quant, -statistics.median(s.speedups))):
        out.append(f"| {s.quant} | {s.k} | {s.p_min} | {statistics.median(s.speedups):.2f}x | "
                   f"{min(s.speedups):.2f}–{max(s.speedups):.2f} | {statistics.median(s.taus):.2f} | "
                   f"{s.identical}/{s.n} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="1,2,3,4,6")
    ap.add_argument("--p-mins", default="0,0.3,0.5,0.7")
    ap.add_argument("--quants", default="q4_1")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--draft", type=Path, default=None, help="head GGUF (default: the embedded head)")
    args = ap.parse_args()
    install_log_callback()  # llama.cpp's log goes to the (silent) eagle3_gguf.llama_cpp logger
    results = run_grid(args.quants.split(","), [int(k) for k in args.ks.split(",")],
                       [float(p) for p in args.p_mins.split(",")], args.draft or default_head_path(),
                       args.n_predict, args.threads)
    print(table(results), end="")


if __name__ == "__main__":
    main()
