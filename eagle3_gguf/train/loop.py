"""Training-time test: unroll the head for several steps on its own hidden states (EAGLE-3), with a
loss against the target's choice restricted to the draft vocab.

A record of n tokens (prompt + answer) gives rows i = 0..n-3: step j at row i reads the real features
of token i (through g at step 0, the head's own h after), the token t[i+1+j], and predicts
t[i+2+j]. Only answer positions count (i+2+j >= n_prompt, or the data's answer mask); labels whose
target token is outside the draft vocab are left out of the loss but count as misses in the top-1
agreement. The label is the target's greedy token (hard), or, where the data holds the target's top-k
distribution (teacher-forced data) and `soft_labels` is on, that distribution restricted to the draft
vocab and renormalized (soft: cross-entropy against it, i.e. KL up to the target's entropy). Top-1
agreement is always measured against the target's greedy token.

AdamW, linear warmup then cosine decay, gradient clipping, checkpoint/resume (`ckpt.pt` in the run
folder), device auto (cuda / mps / cpu). Library code: reports through the `progress` callback.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..config import check_threads
from ..errors import Eagle3Error
from . import check_values
from .data import Dataset
from .model import Eagle3Head, HeadConfig
from .vocab import DraftVocab

if TYPE_CHECKING:
    from .torch_target import OnlineData

CKPT = "ckpt.pt"


@dataclass
class TrainConfig:
    n_unroll: int = 4  # training-time-test steps (>= the K you will draft with)
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs when set
    batch_tokens: int = 4096  # padded rows per optimizer step
    lr: float = 1e-3
    warmup: float = 0.05  # share of the steps
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    clip: float = 0.5
    step_decay: float = 0.8  # loss weight of unrolled step j: step_decay ** j
    held_out: float = 0.05  # share of the records kept for evaluation
    seed: int = 0
    device: str = "auto"
    n_threads: int | None = None
    max_minutes: float | None = None  # training wall-time budget: the schedule decays by then, then stops
    ckpt_every: int = 200  # optimizer steps
    bf16: bool = False  # bf16 autocast (fp32 master weights) on GPUs and CPUs with AVX512-BF16/AMX; fp32 elsewhere
    init_from: str | None = None  # start from this ckpt.pt's or head GGUF's weights (same head config and draft
    #                               vocab), with a fresh optimizer and schedule: fine-tuning on new data
    soft_labels: bool = True  # learn the target's top-k distribution where the data has one
    pause_after_s: float | None = None  # this call stops (checkpointed) after this long; resuming continues the
    #                                     same schedule: training in steps shorter than a machine's call limit

    def __post_init__(self) -> None:
        """Each bad value one error line, naming `train`'s flag, before any data is made."""
        check_values(at_least_1=(("--unroll", self.n_unroll), ("--batch-tokens", self.batch_tokens),
                                 ("--steps", self.max_steps)),
                     positive=(("--epochs", self.epochs), ("--max-minutes", self.max_minutes)))
        if not 0 <= self.lr < math.inf:  # (0: the weights stay as loaded, init_from's check)
            raise Eagle3Error(f"--lr must be a number, 0 or more (got {self.lr})")
        check_threads(self.n_threads)


@dataclass
class EvalResult:
    loss: list[float]  # per unrolled step
    top1: list[float]  # per unrolled step: share of target tokens the head's argmax agrees with
    n_labels: list[int]


@dataclass
class TrainReport:
    step: int
    total_steps: int
    epoch: float
    loss: float
    lr: float
    tok_per_s: float  # rows (positions) per second, counting all unrolled steps once
    seconds: float
    eval: EvalResult | None = None


@dataclass
class TrainResult:
    steps: int
    seconds: float
    device: str
    evals: list[EvalResult] = field(default_factory=list)
    final_loss: float = float("nan")
    stopped_early: bool = False
    paused: bool = False  # stopped at pause_after_s with steps left: resume to continue


def _autocast(device: torch.device, enabled: bool):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled and _bf16_is_native(device))


def _bf16_is_native(device: torch.device) -> bool:
    """bf16 autocast pays on a GPU and on CPUs with bf16 math (AVX512-BF16 or AMX); elsewhere torch emulates it:
    a training step took 3.2x as long as in fp32 on a 2-core AVX512 Xeon without them (2026-11-25)."""
    if device.type != "cpu":
        return True
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if all(p is None for p in probes):  # a torch without the probes: do as asked
        return True
    return any(p is not None and p() for p in probes)


def _mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def pick_device(name: str = "auto") -> torch.device:
    """The torch device `name` names (auto: CUDA, else MPS, else the CPU), one that this torch can use."""
    if name != "auto":
        usable = {"cpu": lambda: True, "cuda": torch.cuda.is_available, "mps": _mps_available}
        try:
            device = torch.device(name)
        except RuntimeError:
            device = None
        if device is None or device.type not in usable:
            raise Eagle3Error(f"--device {name}: one of auto, cpu, cuda (cuda:N), mps")
        if not usable[device.type]():
            raise Eagle3Error(f"--device {name}: this torch sees no {device.type} device (--device auto picks what it "
                              "has)")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise Eagle3Error(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if _mps_available():
        return torch.device("mps")
    return torch.device("cpu")


# ------------------------------------------------------------------------------------------------
# Batches
# ------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    feats: torch.Tensor  # [B, T, 3 * n_embd_tgt]
    tokens: torch.Tensor  # [B, T + K]: tokens[:, m] = t[m + 1]
    labels: torch.Tensor  # [K, B, T] draft ids; -1 no label, -2 target token outside the draft vocab
    soft_ids: torch.Tensor | None = None  # [K, B, T, k] draft ids of the target's top-k (-1: none / outside)
    soft_p: torch.Tensor | None = None  # [K, B, T, k] their probabilities, renormalized over the draft vocab


def split_records(data: Dataset | OnlineData, held_out: float, seed: int) -> tuple[list[int], list[int]]:
    """Records with at least 3 tokens, split into (train, held-out) by a seeded shuffle."""
    ids = [r for r in range(data.n_records) if data.starts[r + 1] - data.starts[r] >= 3]
    random.Random(seed).shuffle(ids)
    n_eval = max(1, int(round(len(ids) * held_out))) if len(ids) > 1 else 0
    return ids[n_eval:], ids[:n_eval]


def make_batches(data: Dataset | OnlineData, records: list[int], batch_tokens: int,
                 rng: random.Random | None) -> list[list[int]]:
    """Group records of similar length so that B * T_max <= batch_tokens; shuffled when rng is given."""
    by_len = sorted(records, key=lambda r: data.starts[r + 1] - data.starts[r])
    batches, cur, t_max = [], [], 0
    for r in by_len:
        n = int(data.starts[r + 1] - data.starts[r]) - 2
        if cur and max(t_max, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, t_max = [], 0
        cur.append(r)
        t_max = max(t_max, n)
    if cur:
        batches.append(cur)
    if rng is not None:
        rng.shuffle(batches)
    return batches


def soft_targets(ids: np.ndarray, logp: np.ndarray, t2d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The target's top-k restricted to the draft vocab and renormalized there.
    ids [n, k] target ids (-1: none), logp [n, k] -> draft ids [n, k] (-1: dropped), probabilities [n, k]"""
    d = np.where(ids >= 0, t2d[np.maximum(ids, 0)], -1)
    p = np.where(d >= 0, np.exp(logp.astype(np.float32)), 0.0)
    return d, p / np.maximum(p.sum(1, keepdims=True), 1e-20)


def collate(data: Dataset | OnlineData, records: list[int], t2d: np.ndarray, n_unroll: int, device: torch.device,
            soft: bool = True) -> Batch:
    """t2d: [n_vocab] draft id of each target id, -1 outside. Soft labels where the data has them and
    `soft` is on."""
    data, records = data.select(records)
    K = n_unroll
    T = max(int(data.starts[r + 1] - data.starts[r]) - 2 for r in records)
    B = len(records)
    width = data.feats.shape[1]
    feats = np.zeros((B, T, width), np.float32)  # [B, T, 3 * n_embd_tgt]
    toks = np.zeros((B, T + K + 1), np.int64)  # [B, T + K + 1]: t[m]
    labs = np.full((B, T + K + 2), -1, np.int64)  # [B, T + K + 2]: label for predicting t[m]
    k = data.topk_ids.shape[1] if soft and data.topk_ids is not None else 0
    s_ids = np.full((B, T + K + 2, k), -1, np.int64)  # [B, T + K + 2, k]
    s_p = np.zeros((B, T + K + 2, k), np.float32)
    for b, r in enumerate(records):
        tokens, f, _ = data.record(r)
        n = len(tokens)
        feats[b, :n - 2] = f[:n - 2]
        m = min(n, T + K + 1)
        toks[b, :m] = tokens[:m]
        where, target = data.label_positions(r)  # [n_lab] each
        d = t2d[target]
        labs[b, where] = np.where(d >= 0, d, -2)
        if k:
            rows = data.starts[r] + where - 1  # the distribution after token m-1 predicts token m
            s_ids[b, where], s_p[b, where] = soft_targets(data.topk_ids[rows], data.topk_logp[rows], t2d)
    labels = np.stack([labs[:, 2 + j:2 + j + T] for j in range(K)])  # [K, B, T]
    batch = Batch(torch.from_numpy(feats).to(device), torch.from_numpy(toks[:, 1:]).to(device),
                  torch.from_numpy(labels).to(device))
    if k:
        batch.soft_ids = torch.from_numpy(np.stack([s_ids[:, 2 + j:2 + j + T] for j in range(K)])).to(device)
        batch.soft_p = torch.from_numpy(np.stack([s_p[:, 2 + j:2 + j + T] for j in range(K)])).to(device)
    return batch


# ------------------------------------------------------------------------------------------------
# Loss, evaluation
# ------------------------------------------------------------------------------------------------


def step_losses(head: Eagle3Head, hs: list[torch.Tensor], b: Batch, metrics: bool = False
                ) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """Per unrolled step: mean CE over in-vocab labels (against the soft targets when the batch has them)
    and, with `metrics` (evaluation only: they cost an argmax and a device sync per step), # of top-1
    agreements and # of target labels. The lm_head runs only on rows that have an in-vocab label (most
    of the cost)."""
    losses, hits, counts = [], [], []
    for j, h in enumerate(hs):
        lab = b.labels[j]  # [B, T]
        ok = lab >= 0
        lg = head.logits(h[ok])  # [n_ok, V']
        if not ok.any():
            losses.append(h.sum() * 0.0)
        elif b.soft_ids is not None:
            ids, p = b.soft_ids[j][ok], b.soft_p[j][ok]  # [n_ok, k] each; p is 0 where ids is -1
            logq = F.log_softmax(lg.float(), dim=-1).gather(1, ids.clamp(min=0))  # [n_ok, k]
            losses.append(-(p * logq).sum(1).mean())
        else:
            losses.append(F.cross_entropy(lg.float(), lab[ok]))
        if metrics:
            hits.append(int((lg.argmax(-1) == lab[ok]).sum()))
            counts.append(int((lab != -1).sum()))
    return losses, hits, counts


@torch.no_grad()
def evaluate(head: Eagle3Head, data: Dataset | OnlineData, records: list[int], t2d: np.ndarray, n_unroll: int,
             batch_tokens: int, device: torch.device, bf16: bool = False, soft: bool = True) -> EvalResult:
    head.eval()
    tot_loss = np.zeros(n_unroll)
    n_loss = np.zeros(n_unroll)
    hits = np.zeros(n_unroll)
    counts = np.zeros(n_unroll)
    for recs in make_batches(data, records, batch_tokens, None):
        b = collate(data, recs, t2d, n_unroll, device, soft)
        with _autocast(device, bf16):
            losses, h, c = step_losses(head, head.unroll(b.feats, b.tokens, n_unroll), b, metrics=True)
        for j in range(n_unroll):
            k = int((b.labels[j] >= 0).sum())
            tot_loss[j] += float(losses[j]) * k
            n_loss[j] += k
            hits[j] += h[j]
            counts[j] += c[j]
    head.train()
    return EvalResult([float(x) for x in tot_loss / np.maximum(n_loss, 1)],
                      [float(x) for x in hits / np.maximum(counts, 1)], [int(x) for x in counts])


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------


def lr_at(frac: float, step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup over the first `warmup` share of the run, then cosine down to min_lr_ratio at its end;
    `frac` is the share of the run done (steps or, under max_minutes, wall time, whichever is further), so
    a time budget that ends the run early ends its warmup early too, and the decay still reaches the end."""
    warm = max(1, int(total * cfg.warmup))
    w = warm / total
    if frac < w:  # by steps, or by the budget's clock where it runs ahead
        return cfg.lr * min(1.0, max((step + 1) / warm, frac / w))
    t = min(1.0, max(0.0, (frac - w) / max(1e-9, 1 - w)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def load_checkpoint(path: Path, device: torch.device, head_config: HeadConfig, vocab: DraftVocab) -> dict:
    """A ckpt.pt's state, after checking it holds a head of this shape and draft vocab."""
    state = torch.load(path, map_location=device, weights_only=False)
    if state["head_config"] != head_config.to_dict() or not np.array_equal(state["vocab_ids"], vocab.ids):
        raise Eagle3Error(f"{path}: checkpoint was trained with another head config or draft vocab")
    return state


def initial_weights(path: Path, device: torch.device, head_config: HeadConfig, vocab: DraftVocab) -> dict:
    """The weights a fine-tune starts from: a ckpt.pt's, or a head GGUF's (dequantized: export.read_head_gguf),
    after checking they are a head of this shape and draft vocab."""
    if path.suffix != ".gguf":
        return load_checkpoint(path, device, head_config, vocab)["model"]
    from .export import read_head_gguf

    h = read_head_gguf(path)
    if h.config != head_config or not np.array_equal(h.vocab.ids, vocab.ids):
        raise Eagle3Error(f"{path}: head GGUF has another head config or draft vocab than this training")
    return {k: torch.from_numpy(v).to(device) for k, v in h.state.items()}


def train_head(data: Dataset | OnlineData, vocab: DraftVocab, head_config: HeadConfig, embed: torch.Tensor,
               run_dir: str | Path, cfg: TrainConfig, resume: bool = False,
               progress: Callable[[TrainReport], None] | None = None) -> tuple[Eagle3Head, TrainResult]:
    """Train (or resume) a head in `run_dir`; returns the trained head and what happened."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.n_threads:
        torch.set_num_threads(cfg.n_threads)
    device = pick_device(cfg.device)
    torch.manual_seed(cfg.seed)
    head = Eagle3Head(head_config, embed).to(device)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    t2d = vocab.target_to_draft()
    train_ids, eval_ids = split_records(data, cfg.held_out, cfg.seed)
    if not train_ids:
        raise Eagle3Error("no training records: generate more data (--prompts)")
    n_batches = len(make_batches(data, train_ids, cfg.batch_tokens, None))
    total = cfg.max_steps or max(1, int(math.ceil(cfg.epochs * n_batches)))
    step, result = 0, TrainResult(0, 0.0, str(device))
    ckpt_path = run_dir / CKPT
    if resume and ckpt_path.is_file():
        state = load_checkpoint(ckpt_path, device, head_config, vocab)
        head.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        total = max(total, state.get("total", total))
        result.evals = [EvalResult(**e) for e in state.get("evals", [])]
        result.seconds = state.get("seconds", 0.0)
    elif cfg.init_from:
        head.load_state_dict(initial_weights(Path(cfg.init_from), device, head_config, vocab))

    def save() -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"model": head.state_dict(), "opt": opt.state_dict(), "step": step, "total": total,
                    "head_config": head_config.to_dict(), "vocab_ids": vocab.ids, "train_config": asdict(cfg),
                    "evals": [asdict(e) for e in result.evals], "seconds": result.seconds}, tmp)
        tmp.replace(ckpt_path)

    t_start = time.perf_counter()
    seconds0 = result.seconds
    epoch = step // n_batches
    rows_done, t_rows = 0, time.perf_counter()
    loss_ema, lr = float("nan"), cfg.lr
    head.train()
    while step < total:
        rng = random.Random(cfg.seed * 1000 + epoch)
        batches = make_batches(data, train_ids, cfg.batch_tokens, rng)
        for bi, recs in enumerate(batches):
            if epoch * n_batches + bi < step:  # resuming inside an epoch: skip what was done
                continue
            if step >= total:
                break
            elapsed = time.perf_counter() - t_start
            frac = step / total
            if cfg.max_minutes is not None:
                frac = max(frac, (seconds0 + elapsed) / (cfg.max_minutes * 60))
            if frac >= 1.0 and cfg.max_minutes is not None and step < total:
                result.stopped_early = True
                break
            if cfg.pause_after_s is not None and elapsed >= cfg.pause_after_s:
                result.paused = True
                break
            b = collate(data, recs, t2d, cfg.n_unroll, device, cfg.soft_labels)  # online: the target's forward
            lr = lr_at(frac, step, total, cfg)
            for grp in opt.param_groups:
                grp["lr"] = lr
            with _autocast(device, cfg.bf16):
                losses, _, _ = step_losses(head, head.unroll(b.feats, b.tokens, cfg.n_unroll), b)
                loss = sum(cfg.step_decay ** j * l for j, l in enumerate(losses))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.clip)
            opt.step()
            step += 1
            lv = float(loss.detach())
            loss_ema = lv if math.isnan(loss_ema) else 0.95 * loss_ema + 0.05 * lv
            rows_done += b.feats.shape[0] * b.feats.shape[1]
            result.seconds = seconds0 + time.perf_counter() - t_start
            if progress is not None:
                progress(TrainReport(step, total, step / n_batches, loss_ema, lr,
                                     rows_done / max(time.perf_counter() - t_rows, 1e-9), result.seconds))
            if step % cfg.ckpt_every == 0:
                save()
        if result.paused:
            break
        if eval_ids:  # end of an epoch (or of the run)
            ev = evaluate(head, data, eval_ids, t2d, cfg.n_unroll, cfg.batch_tokens, device, cfg.bf16,
                          cfg.soft_labels)
            result.evals.append(ev)
            if progress is not None:
                progress(TrainReport(step, total, step / n_batches, loss_ema, lr, 0.0, result.seconds, ev))
        save()
        epoch += 1
        if result.stopped_early:
            break
    result.steps = step
    result.final_loss = loss_ema
    result.seconds = seconds0 + time.perf_counter() - t_start
    save()
    return head, result
