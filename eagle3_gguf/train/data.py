"""Training data: for every token its id and the three layer-input features the session extracts at
inference (same `TargetFeatures` code path), in one of two regimes:

- self-distillation (`generate_data`): the target answers our prompts greedily;
- teacher-forced (`teacher_forced_data`): recorded conversations (e.g. ShareGPT's, sharegpt.py) are
  prefilled in batches of rows; besides the features, the target's own next-token distribution at
  every position is kept as top-k soft labels. No sequential generation.

Self-distillation answers n_seq prompts at once through one target context, each in its own KV stream
(streams.py): a new prompt's prefill is decoded alone, the running answers one row each, together.
Finished sequences are written to shards of `shard_NNNNN.npz`:

    tokens   [n_tok] int32        prompt + answer tokens of the shard's records, concatenated
    feats    [n_tok, 3 * n_embd]  float16 (float32 in a shard holding a row past float16's range: see
                                   `stored`); row j = features of token j (the last row of a record is 0:
                                   its token was never decoded)
    starts   [n_rec + 1] int64    record boundaries in tokens/feats
    n_prompt [n_rec] int32        prompt length of each record (labels before it are not the target's)
  teacher-forced shards also hold
    mask      [n_tok] bool         token j is part of an answer: predicting it trains the head
    topk_ids  [n_tok, k] int32     the target's k most likely next tokens after token j, best first
    topk_logp [n_tok, k] float16   their log-probabilities (over the full vocab)

`manifest.json` lists the shards and how many prompts are done; a rerun resumes after them. In
self-distillation data the target's next-token choice is the next token itself (greedy decoding), so no
logits are stored. `max_bytes` caps the shards on disk (the run stops once they reach it), `max_seconds`
the wall time of one call (both resume like an interrupted run).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..errors import Eagle3Error
from ..gguf_file import TargetInfo, read_gguf
from .prompts import Prompt
from .streams import Stream, decode, round_groups

# llama.cpp is imported where data is made, not where it is read: a machine with torch and no llama-cpp-python
# trains on torch_target's data
if TYPE_CHECKING:
    from ..batch import Batch
    from ..capture import LayerCapture
    from ..context import Context
    from ..extract import TargetFeatures
    from ..native import Model

MANIFEST = "manifest.json"


@dataclass
class DataConfig:
    layers: list[int]
    n_seq: int = 8  # sequences in flight
    max_new: int = 256  # answer tokens per prompt
    max_prompt: int = 256  # longer prompts are skipped
    shard_tokens: int = 65536  # a shard is written once it holds this many tokens
    n_threads: int | None = None
    max_bytes: int | None = None  # disk budget of the shards: stop once they take this much
    max_seconds: float | None = None  # stop after this long (resumable)
    n_gpu_layers: int = 0  # target layers offloaded by a GPU build of llama.cpp
    chat: bool = True  # self: prompts through the target's chat template, else raw text after BOS
    # teacher-forced only
    max_tokens: int = 2048  # tokens per record (longer records are cut; the rest is causal, so unchanged)
    n_batch: int = 512  # rows per target decode (one record's chunk)
    topk: int = 8  # soft labels kept per position


@dataclass
class TokenRecords:
    """Tokenized records before the target has seen them (teacher-forced input)."""

    tokens: np.ndarray  # [n_tok] int32
    starts: np.ndarray  # [n_rec + 1] int64
    mask: np.ndarray  # [n_tok] bool: answer tokens (predicting them trains the head)

    @property
    def n_records(self) -> int:
        return len(self.starts) - 1

    def record(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.starts[i], self.starts[i + 1]
        return self.tokens[a:b], self.mask[a:b]

    def teachable(self, i: int, max_tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Record i cut to max_tokens, or None where no answer token follows its first: what a teacher-forced
        data set keeps of it (teacher_forced_data, torch_target.OnlineData)."""
        t, m = self.record(i)
        t, m = t[:max_tokens], m[:max_tokens]
        return (t, m) if len(t) >= 3 and m[1:].any() else None

    def head(self, n: int) -> "TokenRecords":
        """The first n records."""
        n = min(n, self.n_records)
        end = int(self.starts[n])
        return TokenRecords(self.tokens[:end], self.starts[:n + 1], self.mask[:end])

    @staticmethod
    def join(tokens: list[np.ndarray], masks: list[np.ndarray]) -> "TokenRecords":
        starts = np.cumsum([0] + [len(t) for t in tokens]).astype(np.int64)
        return TokenRecords(np.concatenate(tokens).astype(np.int32) if tokens else np.zeros(0, np.int32), starts,
                            np.concatenate(masks).astype(bool) if masks else np.zeros(0, bool))


@dataclass
class Manifest:
    target: str
    layers: list[int]
    n_embd: int
    n_vocab: int
    prompts_source: str
    n_prompts_done: int = 0
    done_after: list[int] = field(default_factory=list)  # prompt indices >= n_prompts_done already on disk
    n_tokens: int = 0
    n_answer_tokens: int = 0
    seconds: float = 0.0
    shards: list[str] = field(default_factory=list)
    kind: str = "self"  # "self" (greedy answers) or "teacher" (teacher-forced, with top-k soft labels)
    topk: int = 0
    n_bytes: int = 0  # shard bytes on disk
    capped: bool = False  # stopped at the disk budget (max_bytes)
    feats_dtype: str = "float16"  # "float32" once a shard holds a row float16 cannot (`stored`)

    def save(self, out: Path) -> None:
        tmp = out / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(out / MANIFEST)

    @staticmethod
    def load(out: Path) -> "Manifest | None":
        path = out / MANIFEST
        return Manifest(**json.loads(path.read_text())) if path.is_file() else None


@dataclass
class Progress:
    n_prompts_done: int
    n_prompts: int
    n_tokens: int  # decoded this run (prompt + answer)
    n_answer_tokens: int  # generated this run
    seconds: float

    @property
    def tok_per_s(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Slot(Stream):
    feats: list[np.ndarray] = field(default_factory=list)  # [rows, 3 * n_embd_tgt] per decode of this answer

    def start(self, key: int, prompt: list[int]) -> None:
        super().start(key, prompt)
        self.feats = []


@dataclass
class _Record:
    tokens: np.ndarray  # [n] int32
    feats: np.ndarray  # [n, 3 * n_embd_tgt] float16 or float32 (`stored`)
    n_prompt: int
    n_labels: int  # answer tokens
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # teacher-forced: mask, topk_ids, topk_logp

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.feats.nbytes + sum(a.nbytes for a in self.extra.values())


class _ShardWriter:
    def __init__(self, out: Path, manifest: Manifest):
        self.out, self.manifest = out, manifest
        self.records: list[_Record] = []
        self.n_tok = 0
        self.n_bytes = 0  # buffered
        self.done: set[int] = set()  # finished prompt indices not yet flushed

    def add(self, index: int, tokens: list[int] | np.ndarray, feats: np.ndarray, n_prompt: int,
            n_labels: int | None = None, **extra: np.ndarray) -> None:
        tokens = np.asarray(tokens, np.int32)
        rec = _Record(tokens, feats, n_prompt, len(tokens) - n_prompt if n_labels is None else n_labels, extra)
        self.records.append(rec)
        self.n_tok += len(tokens)
        self.n_bytes += rec.nbytes
        self.done.add(index)

    def over_budget(self, config: "DataConfig", t0: float) -> bool:
        """The disk budget (shards written + buffered) or this call's time budget is spent."""
        if config.max_bytes is not None and self.manifest.n_bytes + self.n_bytes >= config.max_bytes:
            self.manifest.capped = True
            return True
        return config.max_seconds is not None and time.perf_counter() - t0 >= config.max_seconds

    def flush(self, first_pending: int) -> None:
        """Write the buffered records; `first_pending` = lowest prompt index not finished (resume point)."""
        if self.records:
            name = f"shard_{len(self.manifest.shards):05d}.npz"
            starts = np.cumsum([0] + [len(r.tokens) for r in self.records]).astype(np.int64)
            extra = {k: np.concatenate([r.extra[k] for r in self.records]) for k in self.records[0].extra}
            if any(r.feats.dtype == np.float32 for r in self.records):
                self.manifest.feats_dtype = "float32"
            np.savez(self.out / name, tokens=np.concatenate([r.tokens for r in self.records]),
                     feats=np.concatenate([r.feats for r in self.records]), starts=starts,
                     n_prompt=np.asarray([r.n_prompt for r in self.records], np.int32), **extra)
            self.manifest.shards.append(name)
            self.manifest.n_tokens += int(starts[-1])
            self.manifest.n_answer_tokens += int(sum(r.n_labels for r in self.records))
            self.manifest.n_bytes += (self.out / name).stat().st_size
        finished = set(self.manifest.done_after) | self.done
        self.manifest.n_prompts_done = first_pending
        self.manifest.done_after = sorted(i for i in finished if i >= first_pending)
        self.done = set()
        self.manifest.save(self.out)
        self.records, self.n_tok, self.n_bytes = [], 0, 0


def stored(feats: np.ndarray) -> np.ndarray:
    """Rows as kept on disk: float16 (half of float32's bytes) where every value fits, else float32. Gemma 3's
    residual stream reaches ~1e5 in one channel at BOS (a massive activation), past float16's 65504."""
    fits = np.abs(feats).max(initial=0.0) <= np.finfo(np.float16).max
    return feats.astype(np.float16 if fits else np.float32)


def _step(ctx: Context, extract: TargetFeatures, batch: Batch, group: list[_Slot], writer: _ShardWriter,
          config: DataConfig, n_ctx_seq: int, is_eog: Callable[[int], bool]) -> tuple[int, int]:
    """Decode the group (streams.decode), keep its rows' features; finished records go to the writer. Returns
    (rows, new tokens)."""
    starts = decode(ctx, batch, group)
    feats = extract.gather(starts[-1])  # [n_rows, 3 * n_embd_tgt]
    for slot, a, b in zip(group, starts, starts[1:]):
        slot.feats.append(stored(feats[a:b]))
        if is_eog(slot.tokens[-1]) or slot.n_answer >= config.max_new or len(slot.tokens) >= n_ctx_seq - 1:
            f = np.concatenate(slot.feats + [np.zeros((1, feats.shape[1]), np.float16)])
            writer.add(slot.key, slot.tokens, f, slot.n_prompt)  # f: [n_tok, 3 * n_embd_tgt]
            slot.stop(ctx)
    return starts[-1], len(group)


def _open_manifest(out: Path, target_path: str | Path, model: Model, config: DataConfig, prompts_source: str,
                   kind: str) -> Manifest:
    """The data folder's manifest, new or checked for resuming with the same layers, prompts and kind."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest.load(out)
    if manifest is None:
        return Manifest(str(target_path), list(config.layers), model.n_embd, model.n_vocab, prompts_source,
                        kind=kind, topk=config.topk if kind == "teacher" else 0)
    if manifest.layers != list(config.layers) or manifest.n_embd != model.n_embd:
        raise Eagle3Error(f"{out}: existing data was made with layers {manifest.layers} for hidden size "
                          f"{manifest.n_embd}: use another output folder")
    if prompts_source and manifest.prompts_source and manifest.prompts_source != prompts_source:
        raise Eagle3Error(f"{out}: existing data answers other prompts ({manifest.prompts_source}): resume with "
                          "the same prompt mix and --prompt-format, or use another output folder")
    if manifest.kind != kind:
        raise Eagle3Error(f"{out}: existing data is {manifest.kind} data, not {kind}: use another output folder")
    manifest.capped = False  # a new budget may allow more
    return manifest


def _finish(manifest: Manifest, out: Path, t0: float, *owners) -> None:
    """Book this call's time and save the manifest (also when interrupted); free the native objects."""
    manifest.seconds += time.perf_counter() - t0
    manifest.save(out)
    for owner in owners:
        owner.close()


def _open_target(target_path: str | Path, config: "DataConfig", n_batch: int) -> tuple[Model, LayerCapture | None]:
    """The target as inference loads it (pair.load_pair): refused where its states cannot be read, repacked only
    where that keeps rows exact, and the eval callback an unhooked graph needs (capture.py)."""
    from ..capture import capture_for
    from ..native import Model

    target = TargetInfo.from_gguf(read_gguf(target_path))
    target.require_extraction()
    capture = capture_for(target, config.layers, n_batch)
    return Model(target_path, n_gpu_layers=config.n_gpu_layers, repack=target.repack_exact), capture


def generate_data(target_path: str | Path, prompts: list[Prompt], out: str | Path, config: DataConfig,
                  prompts_source: str = "", progress: Callable[[Progress], None] | None = None) -> Manifest:
    """Generate (or resume) the data set in `out`. Prompts are consumed in order; the manifest's
    `n_prompts_done` counts a prefix of `prompts` whose answers are all on disk."""
    from ..batch import Batch
    from ..context import Context
    from ..extract import TargetFeatures
    from ..tokens import chat_tokens, eog_check, tokenize

    out = Path(out)
    S = config.n_seq
    n_ctx = S * (config.max_prompt + config.max_new + 8)
    n_batch = max(config.max_prompt, S)
    model, capture = _open_target(target_path, config, n_batch)  # before anything is written
    manifest = _open_manifest(out, target_path, model, config, prompts_source, "self")
    ctx = Context(model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=config.n_threads, n_seq_max=S,
                  kv_unified=False, capture=capture)  # one KV stream per sequence (streams.py)
    extract = TargetFeatures(ctx, config.layers)
    batch = Batch(n_batch)
    writer = _ShardWriter(out, manifest)
    slots = [_Slot(s) for s in range(S)]
    is_eog = eog_check(model)
    next_index = manifest.n_prompts_done
    skip = set(manifest.done_after)
    t0 = time.perf_counter()
    run_tokens = run_answer = 0
    stop = writer.over_budget(config, t0)  # a rerun at a spent disk budget adds nothing
    try:
        while not stop:
            for slot in slots:  # refill idle slots
                while not slot.busy and next_index < len(prompts):
                    if next_index in skip:
                        next_index += 1
                        continue
                    text = prompts[next_index].text
                    toks = chat_tokens(model, text) if config.chat else tokenize(model, text)
                    if len(toks) <= config.max_prompt:
                        slot.start(next_index, toks)
                    else:
                        writer.done.add(next_index)
                    next_index += 1
            groups = round_groups(slots)
            if not groups:
                break
            for group in groups:
                n_rows, n_new = _step(ctx, extract, batch, group, writer, config, n_ctx // S, is_eog)
                run_tokens += n_rows
                run_answer += n_new
            stop = writer.over_budget(config, t0)
            if writer.n_tok >= config.shard_tokens or stop:
                pending = [s.key for s in slots if s.busy]  # unfinished ones are redone on resume
                writer.flush(min(pending) if pending else next_index)
            if progress is not None:
                progress(Progress(next_index - sum(s.busy for s in slots), len(prompts), run_tokens,
                                  run_answer, time.perf_counter() - t0))
            if stop:
                break
        if not stop:
            writer.flush(next_index)
    finally:
        _finish(manifest, out, t0, batch, ctx, model)
    return manifest


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely tokens per row, best first, and their log-probabilities over the whole vocab
    (torch's kernels when torch is installed: ~2x numpy's on 2 threads, and they use every core).
    logits: [n, n_vocab] -> ids [n, k] int32, logp [n, k] float16"""
    logits = np.asarray(logits, np.float32)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        t = torch.from_numpy(logits)  # no copy
        val, idx = torch.topk(t, k, dim=1)
        return idx.numpy().astype(np.int32), (val - torch.logsumexp(t, dim=1, keepdim=True)).numpy().astype(np.float16)
    idx = np.argpartition(logits, -k, axis=1)[:, -k:]  # [n, k], unordered
    val = np.take_along_axis(logits, idx, 1)
    order = np.argsort(-val, axis=1, kind="stable")
    idx, val = np.take_along_axis(idx, order, 1), np.take_along_axis(val, order, 1)
    top = val[:, :1]  # [n, 1]: the row maximum
    lse = top + np.log(np.exp(logits - top).sum(1, keepdims=True))  # [n, 1]
    return idx.astype(np.int32), (val - lse).astype(np.float16)


def teacher_forced_data(target_path: str | Path, records: TokenRecords, out: str | Path, config: DataConfig,
                        source: str = "", progress: Callable[[Progress], None] | None = None) -> Manifest:
    """Prefill each record (cut to `max_tokens`) through the target in chunks of `n_batch` rows and keep,
    for every token, its 3 layer features and the target's top-k next tokens (data set in `out`, resumable:
    records are taken in order; the manifest's `n_prompts_done` counts a prefix on disk). Records with no
    answer token within `max_tokens` are skipped."""
    from ..batch import Batch
    from ..context import Context
    from ..extract import TargetFeatures

    out = Path(out)
    if config.topk < 1:
        raise Eagle3Error(f"top-k {config.topk}: teacher-forced data keeps at least 1 label per position")
    n_batch = min(config.n_batch, config.max_tokens)
    model, capture = _open_target(target_path, config, n_batch)  # before anything is written
    manifest = _open_manifest(out, target_path, model, config, source, "teacher")
    if manifest.topk != config.topk:
        model.close()
        raise Eagle3Error(f"{out}: existing data keeps the top {manifest.topk} tokens, not {config.topk}: resume "
                          "with the same top-k, or use another output folder")
    ctx = Context(model, n_ctx=config.max_tokens + 8, n_batch=n_batch, n_ubatch=n_batch, n_threads=config.n_threads,
                  capture=capture)
    extract = TargetFeatures(ctx, config.layers)
    batch = Batch(n_batch)
    writer = _ShardWriter(out, manifest)
    index = manifest.n_prompts_done
    t0 = time.perf_counter()
    run_tokens = run_labels = 0
    stop = writer.over_budget(config, t0)  # a rerun at a spent disk budget adds nothing
    try:
        while index < records.n_records and not stop:
            kept = records.teachable(index, config.max_tokens)
            if kept is not None:
                tokens, mask = kept
                ctx.clear()
                feats, ids, logp = [], [], []
                for a in range(0, len(tokens), n_batch):
                    if a and config.max_seconds is not None and time.perf_counter() - t0 >= config.max_seconds:
                        break  # out of time inside a long record: it is redone on resume
                    chunk = tokens[a:a + n_batch]
                    batch.set(chunk, a, logits="all")
                    ctx.decode(batch)
                    feats.append(stored(extract.gather(len(chunk))))  # [n_chunk, 3 * n_embd_tgt]
                    top = top_k(ctx.logits(len(chunk)), config.topk)  # [n_chunk, k] each
                    ids.append(top[0])
                    logp.append(top[1])
                else:
                    n_labels = int(mask[1:].sum())
                    writer.add(index, tokens, np.concatenate(feats), int(np.argmax(mask)), n_labels, mask=mask.copy(),
                               topk_ids=np.concatenate(ids), topk_logp=np.concatenate(logp))
                    run_tokens += len(tokens)
                    run_labels += n_labels
                    index += 1
            else:
                writer.done.add(index)
                index += 1
            stop = writer.over_budget(config, t0)
            if writer.n_tok >= config.shard_tokens or stop:
                writer.flush(index)
            if progress is not None:
                progress(Progress(index, records.n_records, run_tokens, run_labels, time.perf_counter() - t0))
        writer.flush(index)
    finally:
        _finish(manifest, out, t0, batch, ctx, model)
    return manifest


@dataclass
class Dataset:
    """All shards in memory: records as (tokens, feats, n_prompt), and, when any folder is teacher-forced,
    answer masks and top-k soft labels for every record (self-distillation records get their greedy
    next token as a one-hot top-k and the answer mask n_prompt gives)."""

    tokens: np.ndarray  # [n_tok] int32
    feats: np.ndarray  # [n_tok, 3 * n_embd_tgt] float16, or float32 where a folder's manifest says so
    starts: np.ndarray  # [n_rec + 1] int64
    n_prompt: np.ndarray  # [n_rec] int32
    manifest: Manifest | None  # None: records a torch_target.OnlineData computed for one batch
    mask: np.ndarray | None = None  # [n_tok] bool: predicting token j trains the head
    topk_ids: np.ndarray | None = None  # [n_tok, k] int32: the target's top-k after token j (-1: none)
    topk_logp: np.ndarray | None = None  # [n_tok, k] float16: their log-probabilities (-inf: none)

    @property
    def n_records(self) -> int:
        return len(self.n_prompt)

    def record(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        a, b = self.starts[i], self.starts[i + 1]
        return self.tokens[a:b], self.feats[a:b], int(self.n_prompt[i])

    def label_positions(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Where record i trains the head and on what: positions m (>= 1) whose token the head learns to
        predict, and the target's greedy token there (the next token itself in self-distillation data,
        top-1 of the target's distribution in teacher-forced data).  # [n_lab] int64, [n_lab] int64"""
        a, b = int(self.starts[i]), int(self.starts[i + 1])
        if self.mask is None:
            m = np.arange(max(int(self.n_prompt[i]), 1), b - a)
            return m, self.tokens[a + m].astype(np.int64)
        m = np.flatnonzero(self.mask[a + 1:b]) + 1
        return m, self.topk_ids[a + m - 1, 0].astype(np.int64)

    def label_counts(self, n_vocab: int, records: list[int] | None = None) -> np.ndarray:
        """How often each target token is a training label (in these records; default all).  # [n_vocab] int64"""
        counts = np.zeros(n_vocab, dtype=np.int64)
        for r in range(self.n_records) if records is None else records:
            np.add.at(counts, self.label_positions(r)[1], 1)
        return counts

    def select(self, records: list[int]) -> tuple["Dataset", list[int]]:
        """The records a batch reads, as the Dataset that holds them and their indices there: this one, on disk
        (torch_target.OnlineData computes them)."""
        return self, records


def load_dataset(path: str | Path | list[str | Path]) -> Dataset:
    """The records of one data folder, or of several concatenated in order (e.g. a balanced run and a
    prose run of the same target and layers, or self-distilled and teacher-forced data); the manifest is
    the first folder's. Arrays are allocated once and filled shard by shard."""
    paths = [Path(p) for p in (path if isinstance(path, list) else [path])]
    manifests: list[Manifest] = []
    for path in paths:
        manifest = Manifest.load(path)
        if manifest is None or not manifest.shards:
            raise Eagle3Error(f"{path}: no training data here (no {MANIFEST} with shards)")
        first = (manifests or [manifest])[0]
        if (manifest.layers, manifest.n_embd) != (first.layers, first.n_embd):
            raise Eagle3Error(f"{path}: its data has layers {manifest.layers} and hidden size {manifest.n_embd}, "
                              f"the first folder's {first.layers} and {first.n_embd}: they cannot train one head")
        manifests.append(manifest)
    shards = [(path / name, m.kind == "teacher") for path, m in zip(paths, manifests) for name in m.shards]
    n_tok, n_rec = 0, 0
    for name, _ in shards:
        with np.load(name) as z:
            n_tok += len(z["tokens"])
            n_rec += len(z["n_prompt"])
    k = max(m.topk for m in manifests)
    width = 3 * manifests[0].n_embd
    dtype = np.float32 if any(m.feats_dtype == "float32" for m in manifests) else np.float16
    data = Dataset(np.zeros(n_tok, np.int32), np.zeros((n_tok, width), dtype), np.zeros(n_rec + 1, np.int64),
                   np.zeros(n_rec, np.int32), manifests[0])
    if k:
        data.mask = np.zeros(n_tok, bool)
        data.topk_ids = np.full((n_tok, k), -1, np.int32)
        data.topk_logp = np.full((n_tok, k), -np.inf, np.float16)
    base = r0 = 0
    for name, teacher in shards:
        with np.load(name) as z:
            tokens, starts, n_prompt = z["tokens"], z["starts"], z["n_prompt"]
            n, nr = len(tokens), len(n_prompt)
            data.tokens[base:base + n] = tokens
            data.feats[base:base + n] = z["feats"]
            data.starts[r0 + 1:r0 + nr + 1] = starts[1:] + base
            data.n_prompt[r0:r0 + nr] = n_prompt
            if teacher:
                data.mask[base:base + n] = z["mask"]
                kk = z["topk_ids"].shape[1]
                data.topk_ids[base:base + n, :kk] = z["topk_ids"]
                data.topk_logp[base:base + n, :kk] = z["topk_logp"]
            elif k:  # greedy data: the next token is the target's choice, with probability 1
                rel = np.arange(n) - np.repeat(starts[:-1], np.diff(starts))  # position within its record
                data.mask[base:base + n] = rel >= np.repeat(n_prompt, np.diff(starts))
                last = np.zeros(n, bool)
                last[starts[1:] - 1] = True
                data.topk_ids[base:base + n - 1, 0] = np.where(last[:-1], -1, tokens[1:])
                data.topk_logp[base:base + n, 0] = np.where(last, -np.inf, 0.0)
        base += n
        r0 += nr
    return data
