#!/usr/bin/env python3
"""Issue 14, item 2: which training data buys the most draft quality per CPU-hour of data making?

Three regimes, each given the same wall time to make data with the same data model (the Q4_0
requantization of SmolLM2, the fastest here), then a head trained from scratch on it for the same
wall time with the same settings, converted like the shipped head and measured on the benchmarks:

    self-ours         the target answers our own templated prompts (train/prompts.py, "balanced": today's path)
    self-sharegpt     the target answers ShareGPT's first user turns (real requests, its own answers)
    teacher-sharegpt  ShareGPT's recorded conversations teacher-forced: features of every token and the
                      target's top-8 next tokens at every answer position (soft labels), no generation

The ShareGPT regimes read the same conversations in the same order (same filters, benchmark check and
training split). Each head gets its own draft vocab of 8192 from its own data. Measured with
scripts/bench.py: SmolLM2 Q4_1, fixed K=4, p_min 0, greedy, 128 tokens, the first --limit prompts of
MT-bench and HumanEval: tau, acceptance by draft position, speedup; the shipped head beside them.

    python scripts/data_regimes.py --data-minutes 15 --train-minutes 10 --limit 20

Item 3's ablations train other variants on one regime's data, each for the same wall time:

    python scripts/data_regimes.py --regimes teacher-sharegpt --variants base,u7,hard,v4k,lr3e-4,e31

Everything lands in runs/regimes/<regime>/<variant>/ (gitignored; every stage resumes where it stopped);
the table is printed and written to runs/regimes/regimes.md. The benchmark prompts never enter the data.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from build_upstream import requantized  # noqa: E402
from train_smollm2 import BATCH_TOKENS, DRAFT_VOCAB, LAYERS, N_FF, N_SEQ, THREADS, TORCH_THREADS, UNROLL, log  # noqa: E402

from eagle3_gguf.native import install_log_callback  # noqa: E402

RUN = ROOT / "runs" / "regimes"  # --out
REGIMES = ("self-ours", "self-sharegpt", "teacher-sharegpt")
N_PROMPTS = 8000  # more prompts than any regime answers in its budget here: the clock decides
N_CONVERSATIONS = 4000


@dataclass(frozen=True)
class Variant:
    """How one head is trained on a regime's data (issue 14 item 3: each ablation changes one thing)."""

    name: str
    unroll: int = UNROLL  # training-time-test steps
    soft_labels: bool = True  # the target's top-8 where the data has it (teacher-forced), else its greedy token
    draft_vocab: int = DRAFT_VOCAB
    lr: float = 1e-3
    eagle31: bool = False  # fc_norm + norm_output, exported in the speculators layout
    train_scale: float = 1.0  # times --train-minutes (long teacher-forced records train at fewer rows/s)


VARIANTS = {v.name: v for v in (Variant("base"), Variant("u7", unroll=7), Variant("hard", soft_labels=False),
                                Variant("v4k", draft_vocab=4096), Variant("v16k", draft_vocab=16384),
                                Variant("lr3e-4", lr=3e-4), Variant("lr3e-3", lr=3e-3),
                                Variant("e31", eagle31=True), Variant("t2x", train_scale=2.0))}


@dataclass
class Made:
    regime: str
    seconds: float
    n_records: int
    n_tokens: int
    n_label_tokens: int  # the positions that train the head (generated, or recorded answer tokens)


def make_data(run: Path, regime: str, data_model: Path, minutes: float) -> Made:
    """The regime's data in run/<regime>/data, made (or topped up) until `minutes` of data making are spent."""
    from eagle3_gguf.benchmarks import contamination_texts
    from eagle3_gguf.native import Model
    from eagle3_gguf.train.data import DataConfig, Manifest, generate_data, teacher_forced_data
    from eagle3_gguf.train.prompts import build_prompts, source
    from eagle3_gguf.train.sharegpt import FilterConfig, first_prompts, prepare, sharegpt_path

    out = run / regime / "data"
    done = Manifest.load(out)
    left = minutes * 60 - (done.seconds if done else 0.0)
    if left > 5:
        filters = FilterConfig(max_tokens=2048)
        cfg = DataConfig(layers=LAYERS, n_seq=N_SEQ, max_new=256, n_threads=THREADS, max_seconds=left, topk=8)
        if regime == "self-ours":
            generate_data(data_model, build_prompts(N_PROMPTS, 0, "balanced"), out, cfg,
                          prompts_source=source("balanced", 0))
        elif regime == "self-sharegpt":
            prompts = first_prompts(sharegpt_path(), filters, contamination_texts(), limit=N_PROMPTS)
            generate_data(data_model, prompts, out, cfg, prompts_source="sharegpt first user turns, train split")
        else:
            with Model(data_model) as model:
                prep = prepare(model, sharegpt_path(), run / "sharegpt", filters, contamination_texts(),
                               limit=N_CONVERSATIONS)
            teacher_forced_data(data_model, prep.train, out, cfg, source="sharegpt train split, max_tokens 2048")
    m = Manifest.load(out)
    return Made(regime, m.seconds, m.n_prompts_done, m.n_tokens, m.n_answer_tokens)


def train(run: Path, regime: str, v: Variant, minutes: float) -> Path:
    """A head trained from scratch on the regime's data for `minutes` as `v` says, converted:
    run/<regime>/<variant>/head.gguf."""
    import torch

    from eagle3_gguf.assets import smollm2_path
    from eagle3_gguf.train.data import load_dataset
    from eagle3_gguf.train.export import convert_to_gguf, export_checkpoint, read_target, read_token_embeddings
    from eagle3_gguf.train.loop import TrainConfig, train_head
    from eagle3_gguf.train.model import HeadConfig
    from eagle3_gguf.train.vocab import cached_draft_vocab

    out = run / regime / v.name
    gguf = out / "head.gguf"
    if gguf.is_file():
        return gguf
    target = Path(smollm2_path())
    tgt = read_target(target)
    data = load_dataset(run / regime / "data")
    vocab = cached_draft_vocab(data, tgt.n_vocab, v.draft_vocab, run / regime / f"vocab-{v.draft_vocab}.npz")
    log(f"{regime}/{v.name}: draft vocab {vocab.size} covers {vocab.coverage:.1%} of its labels")
    head_cfg = HeadConfig.for_target(tgt, vocab.size, N_FF, eagle31=v.eagle31)
    tcfg = TrainConfig(n_unroll=v.unroll, epochs=8.0, batch_tokens=BATCH_TOKENS, lr=v.lr, n_threads=TORCH_THREADS,
                       max_minutes=minutes * v.train_scale, ckpt_every=25, bf16=True, soft_labels=v.soft_labels)
    embed = torch.from_numpy(read_token_embeddings(tgt))  # [n_vocab, n_embd]
    head, res = train_head(data, vocab, head_cfg, embed, out / "train", tcfg, resume=True)
    ev = res.evals[-1] if res.evals else None
    log(f"{regime}/{v.name}: {res.steps} steps in {res.seconds:.0f} s; held-out top-1 by step "
        + (" / ".join(f"{t:.1%}" for t in ev.top1) if ev else "-"))
    ckpt = export_checkpoint(head, vocab, LAYERS, tgt.n_layer, out / "checkpoint", verifier=target.name)
    return convert_to_gguf(ckpt, tgt, gguf, LAYERS, outtype="q8_0", fc_type="q4_0",
                           name=f"{target.stem}-eagle3-{regime}-{v.name}").out


def measure(out: Path, head: Path, limit: int) -> list[dict]:
    """bench.py's rows for this head (run in out/): fixed K=4, p_min 0, Q4_1, the first `limit` prompts of
    each workload."""
    if not (out / "results.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--draft", str(head), "--ks", "4",
                        "--p-mins", "0", "--quants", "q4_1", "--no-upstream", "--limit", str(limit),
                        "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    rows = json.loads((out / "results.json").read_text())["rows"]
    return [r for r in rows if r["contender"] == "ours"]


def table(made: dict[str, Made], rows: dict[str, list[dict]]) -> str:
    lines = ["| head | data: minutes / records / label tokens | workload | tau | accepted at position 1 / 2 / 3 / 4 "
             "| speedup | identical |", "|---|---|---|---|---|---|---|"]
    for name, rs in rows.items():
        m = made.get(name.split("/")[0])
        data = f"{m.seconds / 60:.1f} / {m.n_records} / {m.n_label_tokens:,}" if m else "shipped"
        for r in sorted(rs, key=lambda r: r["workload"], reverse=True):
            pos = " / ".join(f"{a:.0%}" for a in r["accept_by_pos"])
            lines.append(f"| {name} | {data} | {r['workload']} | {r['tau']:.2f} | {pos} | {r['speedup']:.2f}x "
                         f"| {r['identical']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-minutes", type=float, default=15.0, help="data making per regime")
    ap.add_argument("--train-minutes", type=float, default=10.0, help="training per regime")
    ap.add_argument("--limit", type=int, default=20, help="benchmark prompts per workload")
    ap.add_argument("--regimes", default=",".join(REGIMES))
    ap.add_argument("--variants", default="base", help=f"training variants: {', '.join(VARIANTS)}")
    ap.add_argument("--out", default=str(RUN), help="run folder")
    args = ap.parse_args()
    run = Path(args.out)
    install_log_callback()
    from eagle3_gguf.assets import default_head_path, smollm2_path

    regimes = [r for r in args.regimes.split(",") if r]
    variants = [v for v in args.variants.split(",") if v]
    for asked, known, what in ((regimes, REGIMES, "regime"), (variants, VARIANTS, "variant")):
        unknown = sorted(set(asked) - set(known))
        if unknown or not asked:
            print(f"error: unknown {what} {', '.join(unknown) or '(none)'}: choose from {', '.join(known)}",
                  file=sys.stderr)
            return 2
    data_model = requantized(Path(smollm2_path()), "Q4_0")
    made: dict[str, Made] = {}
    rows: dict[str, list[dict]] = {"shipped": measure(run / "shipped", Path(default_head_path()), args.limit)}
    for regime in regimes:
        t0 = time.monotonic()
        made[regime] = make_data(run, regime, data_model, args.data_minutes)
        log(f"{regime}: data {asdict(made[regime])} ({time.monotonic() - t0:.0f} s this call)")
        for name in variants:
            head = train(run, regime, VARIANTS[name], args.train_minutes)
            rows[f"{regime}/{name}"] = measure(run / regime / name, head, args.limit)
    text = table(made, rows)
    (run / "regimes.md").write_text(text + "\n")
    (run / "regimes.json").write_text(json.dumps({"args": vars(args), "made": {k: asdict(v) for k, v in made.items()},
                                                  "rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
