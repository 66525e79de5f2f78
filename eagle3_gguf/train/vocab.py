"""The draft vocabulary: the N target tokens the target chooses most often in the training data.

`d2t` follows the SafeAILab convention (int64 offsets: target id = i + d2t[i]); `t2d` is a bool
mask over the target vocab. Draft ids are the selected target ids in ascending order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import Eagle3Error
from .data import Dataset

if TYPE_CHECKING:
    from .torch_target import OnlineData


@dataclass
class DraftVocab:
    ids: np.ndarray  # [N] int64, ascending target ids
    n_vocab: int  # the target's
    coverage: float  # share of the answer tokens in the data that the draft vocab contains

    @classmethod
    def load(cls, path: Path, n_vocab: int) -> "DraftVocab":
        z = np.load(path)
        return cls(z["ids"], n_vocab, float(z["coverage"]))

    def save(self, path: Path) -> None:
        np.savez(path, ids=self.ids, coverage=self.coverage)

    @property
    def size(self) -> int:
        return len(self.ids)

    @property
    def d2t(self) -> np.ndarray:
        """[N] int64 offsets: target id = i + d2t[i]"""
        return self.ids - np.arange(self.size, dtype=np.int64)

    @property
    def t2d(self) -> np.ndarray:
        """[n_vocab] bool"""
        mask = np.zeros(self.n_vocab, dtype=bool)
        mask[self.ids] = True
        return mask

    def target_to_draft(self) -> np.ndarray:
        """[n_vocab] int64: the draft id of each target id, -1 outside the draft vocab"""
        m = np.full(self.n_vocab, -1, dtype=np.int64)
        m[self.ids] = np.arange(self.size)
        return m


def answer_token_counts(data: Dataset | OnlineData, n_vocab: int) -> np.ndarray:
    """How often each target token is a training label (the target's own choice).  # [n_vocab]"""
    return data.label_counts(n_vocab)


def build_draft_vocab(counts: np.ndarray, size: int) -> DraftVocab:
    """The `size` most frequent tokens (ties: lower id first); unseen tokens fill up if needed."""
    n_vocab = len(counts)
    if not 0 < size <= n_vocab:
        raise Eagle3Error(f"--draft-vocab {size}: must be between 1 and the target vocab ({n_vocab})")
    order = np.lexsort((np.arange(n_vocab), -counts))  # by count desc, then id asc
    ids = np.sort(order[:size]).astype(np.int64)
    cov = float(counts[ids].sum()) / max(int(counts.sum()), 1)
    return DraftVocab(ids, n_vocab, cov)


def cached_draft_vocab(data: Dataset | OnlineData, n_vocab: int, size: int, path: Path) -> DraftVocab:
    """build_draft_vocab over `data`'s labels, made once and kept at `path`: a resumed run reads it back."""
    if path.is_file():
        return DraftVocab.load(path, n_vocab)
    vocab = build_draft_vocab(answer_token_counts(data, n_vocab), size)
    vocab.save(path)
    return vocab


@dataclass
class HeldOutCounts:
    """The labels of all records but every `every`-th (fit) and of those left out (test)."""

    fit: np.ndarray  # [n_vocab] int64
    test: np.ndarray  # [n_vocab] int64

    @classmethod
    def of(cls, data: Dataset | OnlineData, n_vocab: int, every: int = 10) -> "HeldOutCounts":
        return cls(data.label_counts(n_vocab, [r for r in range(data.n_records) if r % every]),
                   data.label_counts(n_vocab, list(range(0, data.n_records, every))))

    @property
    def all(self) -> np.ndarray:
        return self.fit + self.test

    def coverage(self, sizes: list[int]) -> dict[int, float]:
        """Coverage measured honestly: vocabularies built from the fit records, measured on the answers of the
        left-out ones (what an unseen prompt's answer looks like)."""
        total = max(int(self.test.sum()), 1)
        return {n: float(self.test[build_draft_vocab(self.fit, n).ids].sum()) / total for n in sizes}

