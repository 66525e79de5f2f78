#!/usr/bin/env python3
"""Benchmark: speculative sampling at temperature > 0, rejection against exact match and greedy.

    python scripts/bench_sampling.py --limit 20 --out bench/sampling-cpu

MT-bench first turns (chat template), SmolLM2 with the shipped head. For every prompt, back to back
(interleaved, so drift hits all alike; measured by the library, eagle3_gguf/bench.py): target-only and
speculative greedy decoding; then at each temperature of --temps, with the same seed (one per prompt):
target-only sampling, exact match ("match": greedy drafts, kept where the target's sample equals them) and
rejection sampling ("rejection": drafts from the head's q at the target's temperature times each scale of
--scales); target-only greedy again last. Reports tokens per target forward (tau, pooled: all tokens / all
forwards), draft acceptance, tok/s and the median of per-prompt speedups over target-only at the same
temperature (the library's per-prompt ratio). Writes results.md and results.json under --out.
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
from eagle3_gguf.bench import TARGET, Bench, Contender, PromptRun, load_workloads, per_prompt_ratio
from eagle3_gguf.decode import GenerateConfig
from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.native import install_log_callback
from eagle3_gguf.pair import PairConfig


@dataclass(frozen=True)
class Kind:
    """What a contender's name stands for here."""

    contender: str  # "target", "greedy", "match", "rejection"
    temp: float
    scale: float  # rejection: q's temperature / the target's; else 0


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


def contenders(args, temps: list[float], scales: list[float]) -> dict[str, tuple[Kind, Contender]]:
    """Greedy speculation, then at each temperature target-only, match and rejection at each scale (target-only
    greedy runs first and last: the library's reference)."""
    def spec(spec_sampling: str = "match", scale: float = 1.0) -> GenerateConfig:
        return GenerateConfig(n_predict=args.n_predict, draft_max=args.k, draft_p_min=args.p_min,
                              draft_policy=args.policy, spec_sampling=spec_sampling, draft_temp_scale=scale)

    def sampled(kind: Kind, config: GenerateConfig | None) -> tuple[Kind, Contender]:
        name = f"{kind.contender} T={kind.temp:g}" + (f" q={kind.scale:g}" if kind.contender == "rejection" else "")
        return kind, Contender(name, config, temperature=kind.temp, seed=args.seed)

    chosen = [(Kind("target", 0.0, 0.0), TARGET), (Kind("greedy", 0.0, 0.0), Contender("greedy", spec()))]
    for t in temps:
        chosen += [sampled(Kind("target", t, 0.0), None), sampled(Kind("match", t, 0.0), spec())]
        chosen += [sampled(Kind("rejection", t, sc), spec("rejection", sc)) for sc in scales]
    return {c.name: (kind, c) for kind, c in chosen}


def summarise(runs: list[PromptRun], kinds: dict[str, Kind]) -> list[Row]:
    """Pooled tau, acceptance and tok/s per contender; speedups as the library's per-prompt ratios against
    target-only (and against match) at the same temperature."""
    groups: dict[Kind, list[PromptRun]] = {}
    for r in runs:
        groups.setdefault(kinds[r.contender], []).append(r)
    base = {k.temp: rs for k, rs in groups.items() if k.contender == "target"}
    match = {k.temp: rs for k, rs in groups.items() if k.contender == "match"}
    rows = []
    for k in sorted(groups, key=lambda k: (k.temp, ["target", "greedy", "match", "rejection"].index(k.contender),
                                           k.scale)):
        rs = groups[k]
        tokens = sum(r.tokens for r in rs)
        drafted = sum(r.drafted for r in rs)
        python_s = sum(r.python_ms * max(r.forwards - 1, 1) for r in rs) / 1e3
        vs_match = _median(per_prompt_ratio(rs, match[k.temp])) if k.contender in ("match", "rejection") else 0.0
        rows.append(Row(k.contender, k.temp, k.scale, len({r.prompt_id for r in rs}), tokens,
                        tokens / sum(r.forwards for r in rs), sum(r.accepted for r in rs) / drafted if drafted else 0.0,
                        tokens / sum(r.seconds for r in rs), _median(per_prompt_ratio(rs, base.get(k.temp, []))),
                        1e3 * python_s / max(sum(r.forwards - 1 for r in rs), 1), vs_match))
    return rows


def _median(ratios: dict[str, float]) -> float:
    return statistics.median(ratios.values()) if ratios else 0.0


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
    kinds = contenders(args, temps, scales)
    try:
        prompts = load_workloads(["mtbench"], args.limit or None)[::args.every]
    except Eagle3Error as e:
        raise SystemExit(f"error: {e}") from None
    command = "python scripts/bench_sampling.py " + " ".join(sys.argv[1:])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    runs: list[PromptRun] = []
    t0 = time.perf_counter()
    names = {name: kind for name, (kind, _) in kinds.items()}
    with Bench(smollm2_path(), default_head_path(), PairConfig(n_ctx=2048, n_threads=args.threads),
               [c for name, (_, c) in kinds.items() if name != "target"]) as bench:
        bench.tokenize(prompts)
        per_prompt = bench.runs_per_prompt(1)
        for r in bench.measure(prompts, 1, args.n_predict):
            runs.append(r)
            if len(runs) % per_prompt == 0:
                print(f"{len(runs) // per_prompt}/{len(prompts)} prompts, {time.perf_counter() - t0:.0f}s",
                      file=sys.stderr)
                md = write(runs, names, args, command, commit, time.perf_counter() - t0)  # partial runs count
    print(md)


def write(runs: list[PromptRun], kinds: dict[str, Kind], args, command: str, commit: str, seconds: float) -> str:
    rows = summarise(runs, kinds)
    args.out.mkdir(parents=True, exist_ok=True)
    md = markdown(rows, args, command, commit, seconds)
    (args.out / "results.md").write_text(md)
    (args.out / "results.json").write_text(json.dumps(
        {"command": command, "commit": commit, "args": {k: str(v) for k, v in vars(args).items()},
         "rows": [asdict(r) for r in rows], "runs": [asdict(r) for r in runs]}, indent=1))
    return md


if __name__ == "__main__":
    main()
