"""Self-distillation data: the target answers our prompts greedily; for every token we keep its id and
the three layer-input features the session extracts at inference (same `TargetFeatures` code path).

Several sequences are in flight at once through one target context (n_seq_max = S, unified KV cache):
each step decodes one batch holding the new prompts' prefill rows and one row per running answer.
Finished sequences are written to shards of `shard_NNNNN.npz`:

    tokens   [n_tok] int32        prompt + answer tokens of the shard's records, concatenated
    feats    [n_tok, 3 * n_embd]  float16; row j = features of token j (the last row of a record is 0:
                                   its token was never decoded)
    starts   [n_rec + 1] int64    record boundaries in tokens/feats
    n_prompt [n_rec] int32        prompt length of each record (labels before it are not the target's)

`manifest.json` lists the shards and how many prompts are done; a rerun resumes after them.
The target's next-token choice is the next token itself (greedy decoding), so no logits are stored.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import Eagle3Error
from ..extract import TargetFeatures
from ..native import Batch, Context, Model
from ..tokens import chat_tokens, is_eog
from .prompts import Prompt

MANIFEST = "manifest.json"


@dataclass
class DataConfig:
    layers: list[int]
    n_seq: int = 8  # sequences in flight
    max_new: int = 256  # answer tokens per prompt
    max_prompt: int = 256  # longer prompts are skipped
    shard_tokens: int = 65536  # a shard is written once it holds this many tokens
    n_threads: int | None = None


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
class _Slot:
    seq: int
    index: int = -1  # prompt index; -1 when idle
    tokens: list[int] = field(default_factory=list)
    feats: list[np.ndarray] = field(default_factory=list)
    n_prompt: int = 0
    n_fed: int = 0  # tokens already decoded


class _ShardWriter:
    def __init__(self, out: Path, manifest: Manifest):
        self.out, self.manifest = out, manifest
        self.records: list[tuple[np.ndarray, np.ndarray, int]] = []
        self.n_tok = 0
        self.done: set[int] = set()  # finished prompt indices not yet flushed

    def add(self, index: int, tokens: list[int], feats: np.ndarray, n_prompt: int) -> None:
        self.records.append((np.asarray(tokens, np.int32), feats, n_prompt))
        self.n_tok += len(tokens)
        self.done.add(index)

    def flush(self, first_pending: int) -> None:
        """Write the buffered records; `first_pending` = lowest prompt index not finished (resume point)."""
        if self.records:
            name = f"shard_{len(self.manifest.shards):05d}.npz"
            starts = np.cumsum([0] + [len(t) for t, _, _ in self.records]).astype(np.int64)
            np.savez(self.out / name, tokens=np.concatenate([t for t, _, _ in self.records]),
                     feats=np.concatenate([f for _, f, _ in self.records]), starts=starts,
                     n_prompt=np.asarray([p for _, _, p in self.records], np.int32))
            self.manifest.shards.append(name)
            self.manifest.n_tokens += int(starts[-1])
            self.manifest.n_answer_tokens += int(sum(len(t) - p for t, _, p in self.records))
        finished = set(self.manifest.done_after) | self.done
        self.manifest.n_prompts_done = first_pending
        self.manifest.done_after = sorted(i for i in finished if i >= first_pending)
        self.done = set()
        self.manifest.save(self.out)
        self.records, self.n_tok = [], 0


def _step(model: Model, ctx: Context, extract: TargetFeatures, batch: Batch, group: list[_Slot],
          writer: _ShardWriter, config: DataConfig, n_ctx_seq: int) -> tuple[int, int]:
    """Decode every slot's tokens not yet decoded (output on each slot's last row), keep their features,
    append the target's greedy choice; finished records go to the writer. Returns (rows, new tokens)."""
    rows_tok, rows_pos, rows_seq, rows_out, spans = [], [], [], [], []
    for slot in group:
        new = slot.tokens[slot.n_fed:]
        start = len(rows_tok)
        rows_tok += new
        rows_pos += range(slot.n_fed, slot.n_fed + len(new))
        rows_seq += [slot.seq] * len(new)
        rows_out += [False] * (len(new) - 1) + [True]
        spans.append((slot, start, len(new)))
    batch.set_rows(np.asarray(rows_tok, np.int32), np.asarray(rows_pos, np.int32), np.asarray(rows_seq, np.int32),
                   np.asarray(rows_out))
    ctx.decode(batch)
    feats = extract.gather(len(rows_tok)).astype(np.float16)  # [n_rows, 3 * n_embd_tgt]
    for slot, start, n in spans:
        slot.feats.append(feats[start:start + n])
        slot.n_fed += n
        choice = int(np.argmax(ctx.logits_ith(start + n - 1)))  # row index in the batch
        slot.tokens.append(choice)
        n_answer = len(slot.tokens) - slot.n_prompt
        if is_eog(model, choice) or n_answer >= config.max_new or len(slot.tokens) >= n_ctx_seq - 1:
            f = np.concatenate(slot.feats + [np.zeros((1, feats.shape[1]), np.float16)])
            writer.add(slot.index, slot.tokens, f, slot.n_prompt)  # f: [n_tok, 3 * n_embd_tgt]
            ctx.seq_rm(slot.seq, 0, -1)
            slot.index = -1
    return len(rows_tok), len(spans)


def generate_data(target_path: str | Path, prompts: list[Prompt], out: str | Path, config: DataConfig,
                  prompts_source: str = "", progress: Callable[[Progress], None] | None = None) -> Manifest:
    """Generate (or resume) the data set in `out`. Prompts are consumed in order; the manifest's
    `n_prompts_done` counts a prefix of `prompts` whose answers are all on disk."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = Model(target_path)
    manifest = Manifest.load(out)
    if manifest is None:
        manifest = Manifest(str(target_path), list(config.layers), model.n_embd, model.n_vocab, prompts_source)
    elif manifest.layers != list(config.layers) or manifest.n_embd != model.n_embd:
        raise Eagle3Error(f"{out}: existing data was made with layers {manifest.layers} for hidden size "
                          f"{manifest.n_embd}: use another output folder")
    elif prompts_source and manifest.prompts_source and manifest.prompts_source != prompts_source:
        raise Eagle3Error(f"{out}: existing data answers other prompts ({manifest.prompts_source}): resume with "
                          "the same prompt mix, or use another output folder")
    S = config.n_seq
    n_ctx = S * (config.max_prompt + config.max_new + 8)
    n_batch = max(config.max_prompt, S)
    ctx = Context(model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=config.n_threads, n_seq_max=S,
                  kv_unified=False)  # a row attends over its own sequence only: 2.5x the tok/s of one cache
    extract = TargetFeatures(ctx, config.layers)
    batch = Batch(n_batch)
    writer = _ShardWriter(out, manifest)
    slots = [_Slot(s) for s in range(S)]
    next_index = manifest.n_prompts_done
    skip = set(manifest.done_after)
    t0 = time.perf_counter()
    run_tokens = run_answer = 0
    try:
        while True:
            for slot in slots:  # refill idle slots
                while slot.index < 0 and next_index < len(prompts):
                    if next_index in skip:
                        next_index += 1
                        continue
                    toks = chat_tokens(model, prompts[next_index].text)
                    if len(toks) <= config.max_prompt:
                        slot.index, slot.tokens, slot.feats, slot.n_prompt, slot.n_fed = next_index, toks, [], \
                            len(toks), 0
                    else:
                        writer.done.add(next_index)
                    next_index += 1
            active = [s for s in slots if s.index >= 0]
            if not active:
                break
            # A new prompt's prefill is decoded on its own; the running answers (one row each, in sequence
            # order) together. Per-sequence KV streams keep rows in batch order only this way (see Context).
            running = [s for s in active if len(s.tokens) - s.n_fed == 1]
            groups = [[s] for s in active if len(s.tokens) - s.n_fed > 1] + ([running] if running else [])
            for group in groups:
                n_rows, n_new = _step(model, ctx, extract, batch, group, writer, config, n_ctx // S)
                run_tokens += n_rows
                run_answer += n_new
            if writer.n_tok >= config.shard_tokens:
                pending = [s.index for s in slots if s.index >= 0]
                writer.flush(min(pending) if pending else next_index)
            if progress is not None:
                progress(Progress(next_index - sum(s.index >= 0 for s in slots), len(prompts), run_tokens,
                                  run_answer, time.perf_counter() - t0))
        writer.flush(next_index)
    finally:
        manifest.seconds += time.perf_counter() - t0
        manifest.save(out)
        batch.close()
        ctx.close()
        model.close()
    return manifest


@dataclass
class Dataset:
    """All shards in memory: records as (tokens, feats, n_prompt)."""

    tokens: np.ndarray  # [n_tok] int32
    feats: np.ndarray  # [n_tok, 3 * n_embd_tgt] float16
    starts: np.ndarray  # [n_rec + 1] int64
    n_prompt: np.ndarray  # [n_rec] int32
    manifest: Manifest

    @property
    def n_records(self) -> int:
        return len(self.n_prompt)

    def record(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        a, b = self.starts[i], self.starts[i + 1]
        return self.tokens[a:b], self.feats[a:b], int(self.n_prompt[i])


def load_dataset(path: str | Path | list[str | Path]) -> Dataset:
    """The records of one data folder, or of several concatenated in order (e.g. a balanced run and a
    prose run of the same target and layers); the manifest is the first folder's."""
    paths = [Path(p) for p in (path if isinstance(path, list) else [path])]
    toks, feats, starts, n_prompt = [], [], [np.zeros(1, np.int64)], []
    base = 0
    first = None
    for path in paths:
        manifest = Manifest.load(path)
        if manifest is None or not manifest.shards:
            raise Eagle3Error(f"{path}: no training data here (no {MANIFEST} with shards)")
        if first is None:
            first = manifest
        elif (manifest.layers, manifest.n_embd) != (first.layers, first.n_embd):
            raise Eagle3Error(f"{path}: its data has layers {manifest.layers} and hidden size {manifest.n_embd}, "
                              f"the first folder's {first.layers} and {first.n_embd}: they cannot train one head")
        for name in manifest.shards:
            with np.load(path / name) as z:
                toks.append(z["tokens"])
                feats.append(z["feats"])
                starts.append(z["starts"][1:] + base)
                n_prompt.append(z["n_prompt"])
                base += len(z["tokens"])
    return Dataset(np.concatenate(toks), np.concatenate(feats), np.concatenate(starts), np.concatenate(n_prompt),
                   first)
