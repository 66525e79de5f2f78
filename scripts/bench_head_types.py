#!/usr/bin/env python3
"""Benchmark: what the type of a head's matrices (convert's --outtype) costs a draft step and acceptance.

    python scripts/bench_head_types.py --out bench/head-types-cpu          # both parts, ~25 min on 2 cores
    python scripts/bench_head_types.py --skip-acceptance --shape llama-8b  # the draft step only, a minute

- **The draft step**: a synthetic pair of `--shape` (scripts/synthetic.py: the target in --target-type, the head
  in each of q8_0, f16 and q4_0, the same d2t) loaded once; the head's 1-row decoder in each type, one decode of
  each in turn per round (bench_scale.time_head_types, the medians), beside a 1-row target decode for scale.
- **Acceptance**: a real head (default: the shipped one) with its matrices re-encoded in each type from the values
  it stores (fc, norms and d2t kept as they are), each drafting fixed K=4 chains (p_min 0, no lookup drafts) on the
  same MT-bench and HumanEval prompts with the target (default: SmolLM2 Q4_1). Greedy, so tokens per target forward
  and the drafts kept are exact counts, not timings; every run's text must be target-only's.
Writes results.md and results.json under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import llama_cpp  # noqa: F401,I001  llama.cpp's library before numpy's (bench/NOTES.md, scale-gpu)
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scale  # noqa: E402,I001
import synthetic  # noqa: E402
from gguf import GGMLQuantizationType as GT  # noqa: E402
from gguf import GGUFReader  # noqa: E402

from eagle3_gguf import keys  # noqa: E402
from eagle3_gguf.assets import default_head_path, smollm2_path  # noqa: E402
from eagle3_gguf.batch import Batch  # noqa: E402
from eagle3_gguf.bench import PromptRun, load_workloads  # noqa: E402
from eagle3_gguf.convert.quantize import Encoded, dequantize, encode  # noqa: E402
from eagle3_gguf.convert.writer import PlannedTensor, write_gguf  # noqa: E402
from eagle3_gguf.decode import GenerateConfig, Runner  # noqa: E402
from eagle3_gguf.errors import Eagle3Error  # noqa: E402
from eagle3_gguf.gguf_file import read_gguf_metadata  # noqa: E402
from eagle3_gguf.native import install_log_callback  # noqa: E402
from eagle3_gguf.pair import PairConfig, load_pair  # noqa: E402
from eagle3_gguf.session import Eagle3Session  # noqa: E402
from eagle3_gguf.tokens import chat_tokens  # noqa: E402

TYPES = bench_scale.HEAD_TYPES  # convert's default first
MATRIX_TYPES = (GT.F16, GT.Q8_0, GT.Q4_0)  # what re-encoding touches: the layer's matrices and lm_head (fc aside)
TARGET_ROWS = 8  # 1-row target decodes timed for scale


@dataclass
class StepCost:
    head_type: str
    mib: float
    decode_ms: float
    of_target_row: float  # the decode against a 1-row target decode


@dataclass
class DraftSteps:
    target_row_ms: float  # a 1-row target decode, median of TARGET_ROWS
    steps: list[StepCost]


@dataclass
class Acceptance:
    head_type: str
    mib: float
    workload: str
    prompts: int
    tokens: int
    forwards: int
    drafted: int
    accepted: int
    identical: int  # runs whose text was target-only's
    tau_by_prompt: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0


def reencode(src: Path, out: Path, head_type: str) -> Path:
    """src with its float or Q8_0/Q4_0 matrices (fc aside) re-encoded as head_type from the values stored; the
    metadata, fc, norms and d2t as they are."""
    to = synthetic.HEAD_TYPES[head_type][0]
    meta = read_gguf_metadata(src)
    arch = next(kv.value for kv in meta.kvs if kv.key == keys.KEY_ARCHITECTURE)
    kvs = [kv for kv in meta.kvs if kv.key != keys.KEY_ARCHITECTURE]
    plans = []
    for t in GGUFReader(src).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order
        stored = GT(t.tensor_type)
        raw = np.asarray(t.data)
        if stored in MATRIX_TYPES and t.name != keys.T_FC and len(shape) == 2:
            x = dequantize(raw.view(np.uint8).reshape(shape[0], -1), stored, shape[-1])  # [rows, n]
            plans.append(PlannedTensor(t.name, shape, to, lambda x=x, n=t.name: encode(x, to, n)))
        else:
            plans.append(PlannedTensor(t.name, shape, stored, lambda r=raw, s=stored: Encoded(r, s, 0.0)))
    write_gguf(out, arch, kvs, plans)
    return out


def step_costs(args, work: Path) -> DraftSteps:
    made = synthetic.make_pair(work, args.shape, args.target_type, smollm2_path(), jobs=args.jobs, head_types=TYPES)
    config = PairConfig(n_ctx=512, n_threads=args.threads)
    with load_pair(made.target, made.head, config) as pair:
        heads = bench_scale.heads_beside(pair, made, config)
        try:
            costs = bench_scale.time_head_types(heads, pair.head.model.n_embd)
        finally:
            for h in heads:
                h.close()
        one, took = Batch(1), []
        for i in range(TARGET_ROWS):
            one.set([0], i)
            t = time.perf_counter()
            pair.target.decode(one)
            took.append(time.perf_counter() - t)
        one.close()
    row_ms = 1e3 * statistics.median(took)
    return DraftSteps(row_ms, [StepCost(c.head_type, c.mib, c.decode_ms, c.decode_ms / row_ms) for c in costs])


def acceptance(args, work: Path) -> list[Acceptance]:
    prompts = load_workloads(["mtbench", "humaneval"], args.limit)
    config = GenerateConfig(n_predict=args.n_predict, draft_policy="fixed", draft_max=4, draft_p_min=0.0,
                            draft_lookup=False)
    out: list[Acceptance] = []
    truth: dict[str, list[int]] = {}
    for head_type in TYPES:
        head = reencode(Path(args.head), work / f"head-{head_type}.gguf", head_type)
        with load_pair(args.target, head, PairConfig(n_ctx=2048, n_threads=args.threads)) as pair, \
                Eagle3Session(pair.target, pair.head) as session, Runner(pair.target, session) as runner:
            rows = {w: Acceptance(head_type, head.stat().st_size / 2**20, w, 0, 0, 0, 0, 0, 0)
                    for w in ("mtbench", "humaneval")}
            for p in prompts:
                tokens = chat_tokens(pair.target_model, p.text)
                key = f"{p.workload}/{p.id}"
                if key not in truth:
                    truth[key] = runner.generate(tokens, GenerateConfig(n_predict=args.n_predict),
                                                 speculative=False).tokens
                r = runner.generate(tokens, config)
                run, row = PromptRun.of(r.stats, p, head_type, 0, r.tokens == truth[key]), rows[p.workload]
                row.prompts += 1
                row.tokens, row.forwards = row.tokens + run.tokens, row.forwards + run.forwards
                row.drafted, row.accepted = row.drafted + run.drafted, row.accepted + run.accepted
                row.identical += bool(run.identical)
                row.tau_by_prompt[p.id] = run.tau
            out += rows.values()
        print(f"{head_type}: " + ", ".join(f"{a.workload} {a.tokens_per_forward:.4f}" for a in rows.values()),
              file=sys.stderr, flush=True)
    return out


def table(args, draft: DraftSteps, acc: list[Acceptance]) -> str:
    lines = ["# Benchmark: the type of a head's matrices (convert --outtype)", ""]
    if draft.steps:
        lines += [f"## The draft step: {args.shape}'s head, target {args.target_type}, {args.threads} threads", "",
                  f"A 1-row target decode: {draft.target_row_ms:.1f} ms (median of {TARGET_ROWS}).", "",
                  "| head matrices | file MiB | 1-row decoder ms | of a target row |", "|---|---|---|---|"]
        lines += [f"| {s.head_type} | {s.mib:.0f} | {s.decode_ms:.2f} | {s.of_target_row:.3f} |" for s in draft.steps]
        lines.append("")
    if acc:
        base = {a.workload: a for a in acc if a.head_type == TYPES[0]}
        lines += [f"## Acceptance: {Path(args.head).name} re-encoded, target {Path(args.target).name}, fixed K=4", "",
                  "| head matrices | file MiB | workload | prompts | tokens / forward | accepted / drafted | accepted "
                  f"| per-prompt tau against {TYPES[0]}: median (min, max) | identical |", "|" + "---|" * 9]
        for a in acc:
            ratios = [a.tau_by_prompt[k] / v for k, v in base[a.workload].tau_by_prompt.items() if v]
            lines.append(f"| {a.head_type} | {a.mib:.1f} | {a.workload} | {a.prompts} | {a.tokens_per_forward:.4f} | "
                         f"{a.accepted / max(a.drafted, 1):.4f} | {a.accepted} | {statistics.median(ratios):.3f} "
                         f"({min(ratios):.3f}, {max(ratios):.3f}) | {a.identical}/{a.prompts} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-8b", help=f"the draft step's shape: {', '.join(synthetic.SHAPES)}")
    ap.add_argument("--target-type", default="q4_0", help=f"its target's type: {', '.join(synthetic.TYPES)}")
    ap.add_argument("--head", default=str(default_head_path()), help="the real head re-encoded for acceptance")
    ap.add_argument("--target", default=str(smollm2_path()), help="its target")
    ap.add_argument("--limit", type=int, default=40, help="prompts per workload (MT-bench, HumanEval)")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=2, help="threads writing the synthetic models")
    ap.add_argument("--skip-acceptance", action="store_true")
    ap.add_argument("--work", help="folder for the models (default: a temporary one)")
    ap.add_argument("--out", help="write results.md and results.json here")
    args = ap.parse_args()
    known = args.shape in synthetic.SHAPES and args.target_type in synthetic.TYPES
    if not known or min(args.limit, args.threads) < 1:
        print(f"error: --shape is one of {', '.join(synthetic.SHAPES)}, --target-type one of "
              f"{', '.join(synthetic.TYPES)}, --limit and -t at least 1", file=sys.stderr)
        return 2
    install_log_callback()  # llama.cpp's log into Python's logging: quiet
    try:
        with tempfile.TemporaryDirectory(prefix="head-types-") as tmp:
            work = Path(args.work or tmp)
            work.mkdir(parents=True, exist_ok=True)
            draft = step_costs(args, work)
            print(table(args, draft, []), file=sys.stderr, flush=True)
            acc = [] if args.skip_acceptance else acceptance(args, work)
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = table(args, draft, acc)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.md").write_text(text)
        accepted = [asdict(a) | {"tokens_per_forward": a.tokens_per_forward} for a in acc]
        (out / "results.json").write_text(json.dumps({"args": vars(args), "draft_step": asdict(draft),
                                                      "acceptance": accepted}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
