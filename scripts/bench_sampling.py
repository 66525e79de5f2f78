#!/usr/bin/env python3
"""Benchmark: speculative sampling at temperature > 0, rejection against exact match and greedy.

    python scripts/bench_sampling.py --limit 20 --out bench/sampling-cpu

MT-bench first turns (chat template), SmolLM2 with the shipped head. For every prompt, back to back
(interleaved, so drift hits all alike): target-only and speculative greedy decoding; then at each
temperature of --temps, with the same seed: target-only sampling, exact match ("match": greedy drafts,
kept where the target's sample equals them) and rejection sampling ("rejection": drafts from the head's
q at the target's temperature times each scale of --scales). Reports tokens per target forward (tau,
pooled: all tokens / all forwards), draft acceptance, tok/s and the median of per-prompt speedups over
target-only at the same temperature. Writes results.md and results.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3_gguf.assets import default_head_path, smollm2_path
from eagle3_gguf.benchmarks import load
from eagle3_gguf.decode import GenerateConfig, Runner, Sampler
from eagle3_gguf.native import install_log_callback
from eagle3_gguf.pair import PairConfig, load_pair
from eagle3_gguf.session import Eagle3Session
from eagle3_gguf.tokens import Message, apply_chat_template, tokenize


@dataclass
class Run:
    prompt_id: str
    contender: str  # "target", "greedy", "match", "rejection"
    temp: float
    scale: float  # rejection: q's temperature / the target's; else 0
    tokens: int
    forwards: int
    drafted: int
    accepted: int
    seconds: float
    python_s: float  # of seconds: outside llama.cpp (the loop, sampling, rejection math)


@dataclass
class Row:
    contender: str
    temp: float
    scale: float
    prompts: int
    tokens: int
    tau: float  # all tokens / all target forwards
    acceptance: float  # all accepted / all drafted
    tok_s: float  # all tokens / all seconds
    speedup: float  # median over prompts of tok/s against target-only at the same temperature
    python_ms: float  # Python time per target forward after the prefill (outside llama.cpp)
    vs_match: float  # median over prompts of tok/s against match at the same temperature (0: no match run)

    @property
    def name(self) -> str:
        if self.contender == "rejection":
            return f"rejection (q at {self.scale:g}x T)"
        return self.contender


def run_one(decoder: Runner, prompt: list[int], pid: str, contender: str, temp: float, scale: float,
            args) -> Run:
    config = GenerateConfig(n_predict=args.n_predict, draft_max=args.k, draft_p_min=args.p_min,
                            draft_policy=args.policy,
                            spec_sampling="rejection" if contender == "rejection" else "match",
                            draft_temp_scale=scale if contender == "rejection" else 1.0)
    r = decoder.generate(prompt, config, Sampler(temp, args.seed + int(pid) if pid.isdigit() else args.seed),
                         speculative=contender != "target")
    st = r.stats
    return Run(pid, contender, temp, scale if contender == "rejection" else 0.0, st.n_generated,
               st.n_target_forwards, st.n_drafted, st.n_accepted, st.t_total, st.t_python)


def median_ratio(rs: list[Run], ref: dict[tuple[str, float], float]) -> float:
    """Median over prompts of a run's tok/s against the reference contender's on the same prompt and
    temperature (0 when there is none)."""
    ratios = [r.tokens / r.seconds / ref[(r.prompt_id, r.temp)] for r in rs if (r.prompt_id, r.temp) in ref]
    return statistics.median(ratios) if ratios else 0.0


def summarise(runs: list[Run]) -> list[Row]:
    base = {(r.prompt_id, r.temp): r.tokens / r.seconds for r in runs if r.contender == "target"}
    match = {(r.prompt_id, r.temp): r.tokens / r.seconds for r in runs if r.contender == "match"}
    keys = sorted({(r.contender, r.temp, r.scale) for r in runs},
                  key=lambda k: (k[1], ["target", "greedy", "match", "rejection"].index(k[0]), k[2]))
    rows = []
    for c, t, s in keys:
        rs = [r for r in runs if (r.contender, r.temp, r.scale) == (c, t, s)]
        tokens = sum(r.tokens for r in rs)
        drafted = sum(r.drafted for r in rs)
        rows.append(Row(c, t, s, len(rs), tokens, tokens / sum(r.forwards for r in rs),
                        sum(r.accepted for r in rs) / drafted if drafted else 0.0,
                        tokens / sum(r.seconds for r in rs), median_ratio(rs, base),
                        1e3 * sum(r.python_s for r in rs) / max(sum(r.forwards - 1 for r in rs), 1),
                        median_ratio(rs, match) if c in ("match", "rejection") else 0.0))
    return rows


def markdown(rows: list[Row], args, command: str, commit: str, seconds: float) -> str:
    lines = [
        "# Speculative sampling at temperature > 0: rejection vs exact match vs greedy",
        "",
        f"`{command}` at {commit}, {platform.machine()} with {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d')}, {seconds / 60:.0f} minutes, {args.threads or 'default'} thread(s).",
        "",
        f"MT-bench first turns ({rows[0].prompts} prompts, chat template), SmolLM2-135M-Instruct Q4_1 + the shipped "
        f"head, {args.n_predict} tokens, draft policy {args.policy} K={args.k}"
        + (f" p_min {args.p_min:g}" if args.policy == "fixed" else "")
        + ", llama.cpp's default sampler cuts (top-k 40, top-p 0.95, min-p 0.05); one seed per prompt, the "
          "same for every contender. tau = tokens per target forward (all tokens / all forwards, prefill "
          "included); acceptance = kept drafts / drafted; speedup = median over prompts of tok/s against "
          "target-only at the same temperature; vs match = median over prompts of tok/s against match on the "
          "same prompt and temperature (the two rules side by side).",
        "",
        "| T | contender | tau | acceptance | tok/s | speedup | vs match | python ms / forward |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.temp:g} | {r.name} | {r.tau:.3f} | {r.acceptance:.3f} | {r.tok_s:.1f} | "
                     f"{r.speedup:.2f}x | {f'{r.vs_match:.3f}x' if r.vs_match else ''} | {r.python_ms:.2f} |")
    best = {}
    for r in rows:
        if r.contender == "rejection":
            best.setdefault(r.scale, []).append(r.tau)
    if best:
        lines += ["", "Draft temperature scale (rejection), tau by temperature: " + "; ".join(
            f"{s:g}x: " + ", ".join(f"{x:.3f}" for x in v) for s, v in sorted(best.items()))]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=20, help="MT-bench prompts (0: all 80)")
    ap.add_argument("--every", type=int, default=1,
                    help="take every Nth of them (2: 40 prompts, 5 per category, MT-bench being in category order)")
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--temps", default="0.7,1.0")
    ap.add_argument("--scales", default="0,0.5,0.75,1.0", help="rejection: q's temperature / the target's")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--p-min", type=float, default=0.0)
    ap.add_argument("--policy", default="fixed", choices=["fixed", "adaptive"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench/sampling-cpu"))
    args = ap.parse_args()
    install_log_callback()
    temps = [float(x) for x in args.temps.split(",")]
    scales = [float(x) for x in args.scales.split(",")]
    prompts = load("mtbench", args.limit or None)[::args.every]
    command = "python scripts/bench_sampling.py " + " ".join(sys.argv[1:])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    runs: list[Run] = []
    t0 = time.perf_counter()
    with load_pair(smollm2_path(), default_head_path(), PairConfig(n_ctx=2048, n_threads=args.threads)) as pair, \
            Eagle3Session(pair.target, pair.head) as session, \
            Runner(pair.target, session) as decoder:
        model = pair.target_model
        for n, p in enumerate(prompts):
            toks = tokenize(model, apply_chat_template(model, [Message("user", p.text)]), add_special=False)
            runs.append(run_one(decoder, toks, p.id, "target", 0.0, 0.0, args))
            runs.append(run_one(decoder, toks, p.id, "greedy", 0.0, 0.0, args))
            for t in temps:
                runs.append(run_one(decoder, toks, p.id, "target", t, 0.0, args))
                runs.append(run_one(decoder, toks, p.id, "match", t, 0.0, args))
                for s in scales:
                    runs.append(run_one(decoder, toks, p.id, "rejection", t, s, args))
            print(f"{n + 1}/{len(prompts)} prompts, {time.perf_counter() - t0:.0f}s", file=sys.stderr)
            md = write(runs, args, command, commit, time.perf_counter() - t0)  # after every prompt: partial runs count
    print(md)


def write(runs: list[Run], args, command: str, commit: str, seconds: float) -> str:
    rows = summarise(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    md = markdown(rows, args, command, commit, seconds)
    (args.out / "results.md").write_text(md)
    (args.out / "results.json").write_text(json.dumps(
        {"command": command, "commit": commit, "args": {k: str(v) for k, v in vars(args).items()},
         "rows": [asdict(r) for r in rows], "runs": [asdict(r) for r in runs]}, indent=1))
    return md


if __name__ == "__main__":
    main()
