"""The target's own answers to prompts (self-distillation's data), kept resumably in one .npz per prompt set.

The prompts are answered shortest first (`answer_order`); a file holds the answers to a prefix of that order,
the answer length cap and which GGUF answered (`gguf_identity`: a hash of its contents), so a later call, on this
machine or another, goes on after them and refuses a file made for other prompts, another cap or another target.
Two answerers write the same file:

- `self_distilled`: the torch target (torch_target.TorchTarget.generate), batch by batch: a GPU machine without
  llama.cpp;
- `llama_answers`: llama.cpp, with up to n_seq answers in flight (each in its own KV stream, a finished one
  replaced at once): where llama.cpp is, e.g. this CPU before a GPU session, so that the GPU's minutes train.

Both answer greedily with the target's own forward; at near-ties they may part (llama.cpp rounds activations to
8 bits for its dot products, the torch target does not): either is the target's text. Both return the records in
answer order: a prefix that more answers only extend, so a training run can pin the first n of them.
"""

from __future__ import annotations

import hashlib
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..errors import Eagle3Error
from ..gguf_file import TargetInfo, read_gguf
from .data import TokenRecords
from .streams import Stream, decode, round_groups

if TYPE_CHECKING:
    from .torch_target import TorchTarget

SAVE_EVERY_S = 60.0  # llama_answers: seconds between saves of the answered prefix where it grew
Progress = Callable[[int, int, float], None]  # (prompts answered, prompts, seconds)


def gguf_identity(path: str | Path) -> str:
    """Which GGUF answered (an answers file's `target`): its contents' sha256 (a target travels to a GPU machine
    under another name; SmolLM2's 98 MB hash in ~0.1 s)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return f"GGUF sha256 {digest.hexdigest()[:16]}"


def first_turns(records: TokenRecords, max_len: int) -> list[np.ndarray]:
    """Each conversation's opening as the target is asked it (its tokens before the first answer token: the
    chat template's first user turn and assistant header), where it is at most max_len tokens."""
    out = []
    for i in range(records.n_records):
        t, m = records.record(i)
        n = int(np.argmax(m)) if m.any() else 0
        if 0 < n <= max_len:
            out.append(t[:n])
    return out


def answer_order(prompts: list[np.ndarray]) -> list[int]:
    """The order prompts are answered in: shortest first, then by index."""
    return sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))


def _load(path: Path, prompts: list[np.ndarray], order: list[int], max_new: int, identity: str) -> list[np.ndarray]:
    """The answered records in `path` (prompt + answer each, in answer order), checked to answer a prefix of
    these prompts' order, with this cap, by this target; none when there is no file."""
    if not path.is_file():
        return []
    try:
        with np.load(path) as z:
            kept = TokenRecords(z["tokens"], z["starts"], z["mask"])
            kept_order, kept_new = list(z["order"]), int(z["max_new"])
            kept_by = str(z["target"]) if "target" in z else identity  # files from before the check
        if len(kept_order) != kept.n_records or kept.starts[-1] != len(kept.tokens):
            raise ValueError(f"{kept.n_records} records, {len(kept_order)} in its order")
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        raise Eagle3Error(f"{path}: not an answers file ({e}): delete it, or use another --out") from None
    if kept_new != max_new or kept_order != order[:len(kept_order)]:
        raise Eagle3Error(f"{path}: answers to other prompts or of another length: delete it, or use another --out")
    if kept_by != identity:
        raise Eagle3Error(f"{path}: answers of another target ({kept_by}, not {identity}): delete it, or use "
                          "another --out")
    out = []
    for i in range(kept.n_records):
        t, _ = kept.record(i)
        if not np.array_equal(t[:len(prompts[order[i]])], prompts[order[i]]):
            raise Eagle3Error(f"{path}: answers to other prompts: delete it, or use another --out")
        out.append(t)
    return out


def _save(path: Path, done: list[np.ndarray], prompts: list[np.ndarray], order: list[int], max_new: int,
          identity: str) -> None:
    """The answered prefix, written whole (a temporary file, then renamed: never half a file)."""
    records = _records(done, prompts, order)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, tokens=records.tokens, starts=records.starts, mask=records.mask,
             order=np.asarray(order[:len(done)], np.int64), max_new=max_new, target=identity)
    tmp.replace(path)


def _records(done: list[np.ndarray], prompts: list[np.ndarray], order: list[int]) -> TokenRecords:
    """Records of the answered prefix (each prompt + answer, the answer masked), in answer order."""
    masks = [np.arange(len(t)) >= len(prompts[order[i]]) for i, t in enumerate(done)]
    return TokenRecords.join(done, masks)


def _result(done: list[np.ndarray], prompts: list[np.ndarray], order: list[int]) -> tuple[TokenRecords, bool]:
    """What an answerer returns: the records in answer order (record j answers prompts[order[j]]: a prefix that
    more answers only extend, so a training run can pin the first n), and whether every prompt is answered."""
    return _records(done, prompts, order), len(done) == len(order)


def self_distilled(target: TorchTarget, prompts: list[np.ndarray], path: Path, max_new: int, batch_rows: int,
                   batch_tokens: int, max_seconds: float | None = None,
                   progress: Progress | None = None) -> tuple[TokenRecords, bool]:
    """The torch target's greedy answers to the prompts (shortest first, at most batch_rows a batch and
    batch_tokens of prompt and answer columns), kept in `path` after every batch (a rerun goes on after the
    answers there): the records in answer order and whether every prompt has its answer (`_result`). `progress`
    after every batch."""
    t0 = time.perf_counter()
    order = answer_order(prompts)
    done = _load(path, prompts, order, max_new, target.identity)
    while len(done) < len(order):
        if max_seconds is not None and time.perf_counter() - t0 >= max_seconds:
            break
        a = b = len(done)
        while b < len(order) and b - a < batch_rows and (b - a + 1) * (len(prompts[order[b]]) + max_new) <= max(
                batch_tokens, len(prompts[order[a]]) + max_new):  # a batch holds one prompt at least
            b += 1
        batch = [prompts[i] for i in order[a:b]]
        answered = target.generate(batch, max_new)
        done += [np.concatenate([p, answer]).astype(np.int32) for p, answer in zip(batch, answered)]
        _save(path, done, prompts, order, max_new, target.identity)
        if progress is not None:
            progress(len(done), len(order), time.perf_counter() - t0)
    return _result(done, prompts, order)


def llama_answers(model_path: str | Path, prompts: list[np.ndarray], path: Path, max_new: int, n_seq: int = 64,
                  n_threads: int | None = None, max_seconds: float | None = None,
                  progress: Progress | None = None) -> tuple[TokenRecords, bool]:
    """llama.cpp's greedy answers to the prompts, each up to max_new tokens and ending with the first
    end-of-generation token (kept), as the torch target's: up to n_seq in flight, taken shortest first, the
    answered prefix kept in `path` every SAVE_EVERY_S where it grew, and at the end (a rerun, here or with
    `self_distilled`, goes on after it; answers in flight when max_seconds passes are dropped). Returns as
    self_distilled does; `progress` every SAVE_EVERY_S and at the end."""
    from .. import tokens
    from ..batch import Batch
    from ..context import Context
    from ..native import Model

    t0 = time.perf_counter()
    identity = gguf_identity(model_path)
    order = answer_order(prompts)
    done = _load(path, prompts, order, max_new, identity)
    todo = order[len(done):]
    if not todo:
        return _result(done, prompts, order)
    n_seq = max(1, min(n_seq, len(todo)))
    per_seq = max(len(prompts[i]) for i in todo) + max_new + 1
    n_batch = max(per_seq, n_seq)
    info = TargetInfo.from_gguf(read_gguf(model_path))
    model = Model(model_path, repack=info.repack_exact)  # repacked only where a row is computed alike in any batch
    ctx = Context(model, n_ctx=n_seq * per_seq, n_batch=n_batch, n_threads=n_threads, n_seq_max=n_seq,
                  kv_unified=False)  # one KV stream per sequence (streams.py)
    batch = Batch(n_batch)
    is_eog = tokens.eog_check(model)
    answers: dict[int, np.ndarray] = {}  # by position in `order`, past the saved prefix
    streams = [Stream(s) for s in range(n_seq)]  # a stream's key: its prompt's position in `order`
    nxt, n_saved, saved_at = len(done), len(done), time.perf_counter()
    try:
        while not (max_seconds is not None and time.perf_counter() - t0 >= max_seconds):
            for s in streams:
                if not s.busy and nxt < len(order):
                    s.start(nxt, prompts[order[nxt]])
                    nxt += 1
            groups = round_groups(streams)
            if not groups:
                break
            for group in groups:
                decode(ctx, batch, group)
                for s in group:
                    if is_eog(s.tokens[-1]) or s.n_answer >= max_new:
                        answers[s.key] = np.asarray(s.tokens, np.int32)
                        s.stop(ctx)
            while len(done) in answers:
                done.append(answers.pop(len(done)))
            if time.perf_counter() - saved_at >= SAVE_EVERY_S:
                if len(done) > n_saved:  # the prefix grew
                    _save(path, done, prompts, order, max_new, identity)
                    n_saved = len(done)
                saved_at = time.perf_counter()
                if progress is not None:
                    progress(len(done), len(order), saved_at - t0)
    finally:
        for owner in (batch, ctx, model):
            owner.close()
    if len(done) > n_saved:
        _save(path, done, prompts, order, max_new, identity)
    if progress is not None:
        progress(len(done), len(order), time.perf_counter() - t0)
    return _result(done, prompts, order)
