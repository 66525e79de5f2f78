#!/usr/bin/env python
"""What keeping to exact verify widths costs: generate's default as it runs (--exact auto: the run keeps to the widths
the exactness probe found exact) beside the same with --exact off (every width, as before the probe), interleaved
per prompt with target-only (the library's measurement, eagle3_gguf/bench.py, as `eagle3-gguf bench`).

    python scripts/bench_exact.py --workloads chat,code --limit 0 --out bench/exact-cpu   # all 80 + 164 prompts

Where every width is exact (SmolLM2 on CPU) the two contenders run the same cycles and the figures differ by noise
only; where some are not (Gemma 3 Q4_K_M: from 8 rows), auto's cap shows in its ratio and its identity column.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from eagle3_gguf.assets import default_head_path, smollm2_path
from eagle3_gguf.bench import TARGET, Bench, Contender, load_workloads, named_contenders, whole_prompts
from eagle3_gguf.benchreport import Report, advice, summarize
from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.native import install_log_callback
from eagle3_gguf.pair import PairConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", type=Path, default=None, help="target GGUF (default: SmolLM2 Q4_1)")
    ap.add_argument("--draft", type=Path, default=None, help="head GGUF (default: the embedded head)")
    ap.add_argument("--workloads", default="chat,code")
    ap.add_argument("--limit", type=int, default=0, help="prompts per workload (0: all)")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="folder for results.md and results.json")
    args = ap.parse_args()
    install_log_callback()  # llama.cpp's log stays quiet
    default = named_contenders(args.n_predict)["default"]
    contenders = [dataclasses.replace(default, name="auto", config=dataclasses.replace(default.config, exact="auto")),
                  Contender("off", dataclasses.replace(default.config, exact="off"), "--exact off")]
    try:
        prompts = load_workloads(args.workloads.split(","), args.limit or None)
        with Bench(args.model or smollm2_path(), args.draft or default_head_path(), PairConfig(n_threads=args.threads),
                   contenders) as bench:
            bench.tokenize(prompts)
            setup = bench.prepare(args.n_predict)
            runs = list(bench.measure(prompts, 1, args.n_predict))
    except Eagle3Error as e:
        raise SystemExit(f"error: {e}") from None
    runs = whole_prompts(runs, len(contenders) + 2)
    rows = summarize(runs, [TARGET.name, *(c.name for c in contenders)])
    report = Report(setup, runs, rows, advice(rows, setup, {c.name: c.flags for c in contenders}))
    print(report.table(), end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(f"python scripts/bench_exact.py {' '.join(_given(args))}\n\n```\n"
                                             f"{report.table()}```\n")
        (args.out / "results.json").write_text(report.to_json())


def _given(args: argparse.Namespace) -> list[str]:
    """The command line's flags that differ from their defaults, for the record."""
    out = [f"--workloads {args.workloads}", f"--limit {args.limit}", f"-n {args.n_predict}", f"-t {args.threads}"]
    for flag, value in (("-m", args.model), ("--draft", args.draft), ("--out", args.out)):
        if value is not None:
            out.append(f"{flag} {value}")
    return out


if __name__ == "__main__":
    main()
