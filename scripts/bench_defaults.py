#!/usr/bin/env python
"""Choose `generate`'s defaults (K = --draft-max, --draft-p-min) on our own prompts, not the benchmark's.

    python scripts/bench_defaults.py                       # SmolLM2 Q4_1 as shipped + the embedded head
    python scripts/bench_defaults.py --quants q4_1,q4_0    # also the Q4_0 requantization (upstream build)

For every prompt, target-only decoding and each (K, p_min) run back to back in one process; a
setting's speedup is the median over prompts of its time against target-only on the same prompt.
The prompts are the held-out evaluation prompts of scripts/train_smollm2.py (ours; no MT-bench or
HumanEval text), so tuning here does not tune on the benchmark.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_smollm2 import EVAL_PROMPTS  # noqa: E402

from eagle3_gguf.assets import default_head_path, smollm2_path  # noqa: E402
from eagle3_gguf.decode import Decoder, GenerateConfig  # noqa: E402
from eagle3_gguf.pair import PairConfig, load_pair  # noqa: E402
from eagle3_gguf.session import Eagle3Session  # noqa: E402
from eagle3_gguf.tokens import chat_tokens  # noqa: E402


@dataclass
class Setting:
    quant: str
    k: int
    p_min: float
    speedups: list[float]
    taus: list[float]
    identical: int
    n: int


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="1,2,3,4,6")
    ap.add_argument("--p-mins", default="0,0.3,0.5,0.7")
    ap.add_argument("--quants", default="q4_1")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--draft", type=Path, default=None, help="head GGUF (default: the embedded head)")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    p_mins = [float(p) for p in args.p_mins.split(",")]
    head = args.draft or default_head_path()
    results: list[Setting] = []
    for q in args.quants.split(","):
        target = Path(smollm2_path())
        if q == "q4_0":
            from build_upstream import requantized
            target = requantized(target, "Q4_0")
        grid = {(k, p): Setting(q, k, p, [], [], 0, 0) for k in ks for p in p_mins}
        with load_pair(target, head, PairConfig(n_ctx=2048, n_threads=args.threads)) as pair, \
                Eagle3Session(pair.target, pair.head) as sess, Decoder(pair.target, sess) as dec:
            for text in EVAL_PROMPTS:
                prompt = chat_tokens(pair.target_model, text)
                base = dec.generate(prompt, GenerateConfig(n_predict=args.n_predict), speculative=False)
                for (k, p), s in grid.items():
                    r = dec.generate(prompt, GenerateConfig(n_predict=args.n_predict, draft_max=k, draft_p_min=p))
                    s.speedups.append(base.stats.t_total / r.stats.t_total)
                    s.taus.append(r.stats.tau)
                    s.identical += r.tokens == base.tokens
                    s.n += 1
                print(f"[{q}] {text[:50]!r}: target {base.stats.tokens_per_second:.1f} tok/s", file=sys.stderr)
        results += grid.values()
    print("| target | K | p_min | speedup (median) | min–max | tau (median) | identical |")
    print("|---|---|---|---|---|---|---|")
    for s in sorted(results, key=lambda s: (s.quant, -statistics.median(s.speedups))):
        print(f"| {s.quant} | {s.k} | {s.p_min} | {statistics.median(s.speedups):.2f}x | "
              f"{min(s.speedups):.2f}–{max(s.speedups):.2f} | {statistics.median(s.taus):.2f} | {s.identical}/{s.n} |")


if __name__ == "__main__":
    main()
