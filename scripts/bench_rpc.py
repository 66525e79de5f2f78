#!/usr/bin/env python3
"""Benchmark: speculation over llama.cpp's RPC backend at several network latencies.

    python scripts/bench_rpc.py                       # MT-bench's first 20 prompts, 0 / 0.2 / 1 / 5 ms
    python scripts/bench_rpc.py --limit 5 --latencies 0,1
    python scripts/bench_rpc.py --servers 4 --tensor-split head   # the head's layers on servers of their own

For each latency, two rpc-servers (--servers; the pinned tree's ggml-rpc-server, `-t 2`; a set per latency, because
an rpc-server serves one client at a time) each behind a delay proxy (scripts/rpc_proxy.py: every message, each
way, waits the latency; none at 0), the SmolLM2 target split across them (llama.cpp's split, or --tensor-split as
generate takes it) and the shipped head on this machine. Per prompt and per latency, interleaved in one process:
target-only, then each contender (--contenders, of CONTENDERS: the adaptive policy with K <= 4 and <= 8, fixed
K=4 with p_min 0, and the adaptive policy with generate's tree caps), then target-only again; a contender's speed
is taken against the faster of the two target-only runs at the same latency (conservative: the faster of
two noisy runs is biased high) and against their mean, and the adaptive runs that drafted nothing are the
control for that bias. Every run's text is
compared with target-only's. The cost curves are calibrated fresh (a temporary EAGLE3_GGUF_CACHE), over each
latency's servers. The runs of a prompt at a latency are the library's measurement (eagle3_gguf/bench.py, as
`eagle3-gguf bench`). Writes results.json and results.md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_upstream import rpc_module, rpc_server_bin  # noqa: E402
from serving import free_port, kill_group, start_rpc_server, wait_listening  # noqa: E402
from eagle3_gguf.cli.common import split_from_flag  # noqa: E402
from eagle3_gguf.errors import Eagle3Error  # noqa: E402

SERVER_BIN, MODULE = rpc_server_bin(), rpc_module()  # resolved before EAGLE3_GGUF_CACHE changes (main)
CONTENDERS = {  # name -> GenerateConfig fields beside n_predict
    "adaptive K<=4": {},
    "adaptive K<=8": {"draft_max": 8},
    "fixed K=4": {"draft_max": 4, "draft_p_min": 0.0, "draft_policy": "fixed"},
    "adaptive K<=4 + trees 4x8": {"draft_topk": 4, "draft_nodes": 8},  # generate's default (config.ADAPTIVE_TREE)
}


@dataclass
class Run:
    tok_s: float
    tau: float
    drafts_per_cycle: float  # drafted tokens over verify cycles: the K the policy chose, on average
    identical: bool


@dataclass
class Prompt:
    id: str
    latency_ms: float
    target_only: float  # tok/s, the faster of the two runs (before and after the contenders)
    runs: dict[str, Run] = field(default_factory=dict)
    target_only_runs: list[float] = field(default_factory=list)  # both, in order

    def ratios(self, name: str) -> tuple[float, float]:
        """A contender's speed against the faster target-only run (conservative: the faster of two noisy runs
        is biased high) and against their mean."""
        tok_s = self.runs[name].tok_s
        return tok_s / self.target_only, tok_s / statistics.mean(self.target_only_runs)


def start_endpoint(latency_ms: float, threads: int, procs: list) -> str:
    """An rpc-server, behind a delay proxy when latency_ms > 0; its address for --rpc."""
    server, endpoint = start_rpc_server(SERVER_BIN, threads, lifetime=7200)
    procs.append(server)
    if latency_ms <= 0:
        return endpoint
    front = free_port()
    proxy = subprocess.Popen([sys.executable, str(Path(__file__).parent / "rpc_proxy.py"), "--listen", str(front),
                              "--to", endpoint, "--delay-ms", str(latency_ms), "--lifetime", "7200"],
                             start_new_session=True)
    procs.append(proxy)
    wait_listening(proxy, front)
    return f"127.0.0.1:{front}"


def bench(args) -> list[Prompt]:
    from eagle3_gguf.assets import default_head_path, smollm2_path
    from eagle3_gguf.bench import Bench, Contender, load_workloads
    from eagle3_gguf.decode import GenerateConfig
    from eagle3_gguf.pair import PairConfig

    latencies = [float(x) for x in args.latencies.split(",")]
    try:
        prompts = load_workloads(["mtbench"], args.limit)
    except Eagle3Error as e:
        raise SystemExit(f"error: {e}") from None
    procs: list[subprocess.Popen] = []
    benches: dict[float, Bench] = {}
    try:
        chosen = [Contender(name, GenerateConfig(n_predict=args.n_predict, **CONTENDERS[name]))
                  for name in args.contenders]
        for ms in latencies:
            servers = tuple(start_endpoint(ms, args.server_threads, procs) for _ in range(args.servers))
            config = PairConfig(n_ctx=2048, n_threads=args.threads, n_gpu_layers=-1, n_gpu_layers_draft=0,
                                rpc_servers=servers, rpc_backend=str(MODULE), tensor_split=args.tensor_split)
            benches[ms] = Bench(smollm2_path(), default_head_path(), config, chosen)
        out = []
        for p in prompts:
            for ms, b in benches.items():  # each prompt at every latency before the next prompt
                runs = list(b.measure(b.tokenize([p]), 1, args.n_predict))  # the library's: target-only first and last
                both = [runs[0].tok_s, runs[-1].tok_s]
                rec = Prompt(p.id, ms, max(both), {r.contender: Run(r.tok_s, r.tau, r.drafted / max(r.forwards - 1, 1),
                                                                    bool(r.identical)) for r in runs[1:-1]}, both)
                out.append(rec)
                print(f"{p.id} {ms:g} ms: target-only {rec.target_only:.1f} tok/s; " + "; ".join(
                    f"{n} {r.tok_s / rec.target_only:.2f}x K {r.drafts_per_cycle:.2f}" for n, r in rec.runs.items()),
                    file=sys.stderr, flush=True)
        return out
    finally:
        for b in benches.values():
            b.close()
        for proc in procs:
            kill_group(proc)


def table(prompts: list[Prompt], command: str) -> list[str]:
    lines = [f"`{command}`", "",
             "| latency per message | target-only tok/s (median) | contender | speed vs the faster target-only run "
             "(median of per-prompt ratios) | prompts faster | vs the mean of both | tau (median) | drafts per cycle "
             "(mean) | identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for ms in sorted({p.latency_ms for p in prompts}):
        at = [p for p in prompts if p.latency_ms == ms]
        base = statistics.median(p.target_only for p in at)
        for name in at[0].runs:
            faster, mean = zip(*(p.ratios(name) for p in at))
            lines.append(
                f"| {ms:g} ms | {base:.1f} | {name} | {statistics.median(faster):.3f}x | "
                f"{sum(r > 1 for r in faster)}/{len(at)} | {statistics.median(mean):.3f}x | "
                f"{statistics.median(p.runs[name].tau for p in at):.2f} | "
                f"{statistics.mean(p.runs[name].drafts_per_cycle for p in at):.2f} | "
                f"{sum(p.runs[name].identical for p in at)}/{len(at)} |")
    idle = [p.ratios(n) for p in prompts for n in p.runs
            if n.startswith("adaptive") and p.runs[n].drafts_per_cycle == 0]
    if idle:
        faster, mean = zip(*idle)
        lines += ["", f"Control: the {len(idle)} adaptive runs that drafted nothing (target-only in all but the "
                      f"policy's bookkeeping): median {statistics.median(faster):.3f}x the faster target-only run, "
                      f"{statistics.median(mean):.3f}x their mean."]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=20, help="MT-bench prompts (default 20: the first 20)")
    ap.add_argument("--latencies", default="0,0.2,1,5", help="ms per message, comma-separated")
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="this machine's threads (the head)")
    ap.add_argument("--server-threads", type=int, default=2, help="each rpc-server's threads")
    ap.add_argument("--servers", type=int, default=2, help="rpc-servers per latency (default 2)")
    ap.add_argument("--tensor-split", default=None,
                    help="the target's layers per server, as generate's --tensor-split (e.g. head); "
                         "default: llama.cpp's")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated, of: " + ", ".join(CONTENDERS))
    ap.add_argument("--out", type=Path, default=Path("bench/rpc-cpu"))
    args = ap.parse_args()
    args.contenders = args.contenders.split(",")
    unknown = [n for n in args.contenders if n not in CONTENDERS]
    if unknown:
        print(f"error: --contenders {', '.join(unknown)}: not one of {', '.join(CONTENDERS)}", file=sys.stderr)
        return 2
    if args.servers < 1:
        print(f"error: --servers must be at least 1 (got {args.servers})", file=sys.stderr)
        return 2
    try:
        args.tensor_split = split_from_flag(args.tensor_split)
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not (SERVER_BIN.exists() and MODULE.exists()):
        print("error: RPC parts not built: python scripts/build_upstream.py", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as cache:
        os.environ["EAGLE3_GGUF_CACHE"] = cache  # fresh cost curves, measured over each latency's servers
        prompts = bench(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps([asdict(p) for p in prompts], indent=1))
    command = "python scripts/bench_rpc.py " + " ".join(sys.argv[1:])
    (args.out / "results.md").write_text("\n".join(table(prompts, command.strip())) + "\n")
    print("\n".join(table(prompts, command.strip())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
