#!/usr/bin/env python3
"""How fast can lookup drafts make a workload on this machine, at best? (issue 33's bound)

    python scripts/lookup_bound.py --workload codeedit --limit 40 --out bench/lookup-bound

Per prompt, the target's greedy text (target-only, SmolLM2 Q4_1 unless --target), then a replay of the
cycles over that text with this machine's calibrated cost curve c(n) (verify n rows, in one-row units; the
adaptive policy's, from the cost cache or measured now). Greedy acceptance needs no target: a draft token is
kept exactly when it is the text's next token. Three drafters, each cycle's cost c(rows):

- `policy`: our LookupIndex's proposal, verified as long as AdaptivePolicy.lookup chooses (its acceptance
  learnt online as in a run, across the prompts in order), else a plain row. The head is left out (on this
  workload it adds ~nothing on a CPU), as are Python and the head's catch-up: an upper bound on the real run.
- `oracle`: the same proposal, verifying exactly the tokens it will get right where that pays
  ((a + 1) / c(a + 1) > 1): a policy that knows the future.
- `any source`: the best continuation anywhere before (the longest run of the context that matches what
  comes next), verified as the oracle does: a perfect index and a perfect policy.

Speed = tokens / the sum of the cycles' costs; medians over prompts. The point is the ceiling: where even
`any source` stays under a goal, no lookup policy reaches it on this machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3_gguf.assets import default_head_path, smollm2_path  # noqa: E402
from eagle3_gguf.bench import TARGET, Bench, load_workloads  # noqa: E402
from eagle3_gguf.config import DraftConfig  # noqa: E402
from eagle3_gguf.decode import GenerateConfig  # noqa: E402
from eagle3_gguf.errors import Eagle3Error  # noqa: E402
from eagle3_gguf.lookup import LookupIndex  # noqa: E402
from eagle3_gguf.pair import PairConfig  # noqa: E402
from eagle3_gguf.costs import CostCurve, cpu_model  # noqa: E402
from eagle3_gguf.policy import AdaptivePolicy  # noqa: E402

DRAFTERS = ("policy", "oracle", "any source")


@dataclass
class Text:
    id: str
    prompt: list[int]
    out: list[int]  # the target's greedy continuation


def texts(target: Path, head: Path, workload: str, limit: int, n_predict: int,
          lookup_max: int) -> tuple[list[Text], CostCurve]:
    """The target's greedy texts, and the adaptive policy's calibrated curve for lookup drafts of lookup_max."""
    out = []
    try:
        prompts = load_workloads([workload], limit)
    except Eagle3Error as e:
        raise SystemExit(f"error: {e}") from None
    with Bench(target, head, PairConfig(n_ctx=4096, n_threads=2), []) as bench:
        dec = bench.runners[TARGET.name]  # the library's prompts (chat template) and its target-only runner
        for p in bench.tokenize(prompts):
            r = dec.generate(p.tokens, GenerateConfig(n_predict=n_predict), speculative=False)
            out.append(Text(p.id, p.tokens, r.tokens))
        costs = dec.spec.policy_for(DraftConfig(draft_max=4, draft_lookup_max=lookup_max)).costs
    return out, costs


def _kept(proposal: list[int], text: list[int], p: int) -> int:
    """How many leading tokens of a proposal at output position p the target keeps (greedy)."""
    a = 0
    while a < len(proposal) and p + a < len(text) and proposal[a] == text[p + a]:
        a += 1
    return a


def _best_source(seq: list[int], future: list[int]) -> int:
    """The longest run of seq that matches the start of future."""
    best = 0
    first = future[0] if future else None
    for i, t in enumerate(seq):
        if t == first:
            best = max(best, _kept(seq[i:i + len(future)], future, 0))
    return best


def replay(t: Text, drafter: str, c: list[float], cap: int, policy: AdaptivePolicy | None) -> float:
    """Tokens per one-row cost of the text's cycles with this drafter (c: verify n rows, index n - 1)."""
    index = LookupIndex()
    index.extend(t.prompt)
    p, cost = 0, 0.0
    while p < len(t.out):
        n_drafts, kept = 0, 0
        if drafter == "any source":
            a = _best_source(index.tokens, t.out[p:p + cap])
            n_drafts = kept = a if a and (a + 1) / c[a] > 1.0 else 0
        else:
            found = index.propose(cap)
            if found is not None:
                a = _kept(found.tokens, t.out, p)
                if drafter == "oracle":
                    n_drafts = kept = a if a and (a + 1) / c[a] > 1.0 else 0
                else:
                    n_drafts = policy.lookup(found, cap)
                    kept = min(a, n_drafts)
                    if n_drafts:
                        policy.observe_lookup(found.n, n_drafts, kept, c[n_drafts] * policy.costs.verify_s[0],
                                              kept + 1)
            if drafter == "policy" and n_drafts == 0:
                policy.observe_plain(policy.costs.verify_s[0])
        cost += c[n_drafts]
        n = min(kept + 1, len(t.out) - p)
        index.extend(t.out[p:p + n])
        p += n
    return len(t.out) / cost


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="codeedit", help="mtbench, humaneval, codeedit, extract")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--lookup-max", type=int, default=16, help="a lookup draft's tokens at most (generate's default)")
    ap.add_argument("--target", type=Path, default=None, help="target GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--draft", type=Path, default=None, help="its head, for the cost curve (default: the shipped one)")
    ap.add_argument("--out", type=Path, default=None, help="folder for results.json and results.md")
    args = ap.parse_args()
    ts, costs = texts(args.target or smollm2_path(), args.draft or default_head_path(), args.workload, args.limit,
                      args.n_predict, args.lookup_max)
    c = costs.relative()  # [lookup_max + 1]
    policy = AdaptivePolicy(CostCurve(costs.verify_s, costs.draft_step_s, costs.draft_fixed_s, "given"), 4,
                            lookup_max=args.lookup_max)
    speeds = {d: [replay(t, d, c, args.lookup_max, policy if d == "policy" else None) for t in ts] for d in DRAFTERS}
    lines = [f"`python scripts/lookup_bound.py --workload {args.workload} --limit {args.limit} --n-predict "
             f"{args.n_predict} --lookup-max {args.lookup_max}` on {cpu_model() or platform.processor()}, "
             f"2 threads; verify cost by rows: " + " ".join(f"{n + 1}:{x:.2f}" for n, x in enumerate(c)), "",
             "| drafter | median speed (one-row units) | mean | prompts >= 1.30x |", "|---|---|---|---|"]
    for d, xs in speeds.items():
        lines.append(f"| {d} | {statistics.median(xs):.3f}x | {statistics.mean(xs):.3f}x | "
                     f"{sum(x >= 1.3 for x in xs)}/{len(xs)} |")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text("\n".join(lines) + "\n")
        (args.out / "results.json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "curve": c,
             "prompts": [{"id": t.id, "n_prompt": len(t.prompt), "n_out": len(t.out),
                          **{d: speeds[d][i] for d in DRAFTERS}} for i, t in enumerate(ts)]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
