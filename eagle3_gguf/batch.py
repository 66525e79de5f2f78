"""`Batch` (a llama_batch whose arrays are numpy arrays owned here) and `BatchExt` (a llama_batch_ext): the
rows a `Context` runs through llama_decode / llama_encode and llama_process.
"""

from __future__ import annotations

import ctypes

import numpy as np
from llama_cpp import llama_cpp as C

from .context import Context
from .errors import Eagle3Error
from .native import _Owner


class Batch(_Owner):
    """A llama_batch whose arrays are numpy arrays owned here, so that filling it costs a few numpy
    copies, not a Python call per row. Rows carry token ids, or embedding rows (`n_embd` > 0), or both:
    llama.cpp turns a batch with both into a llama_batch_ext whose entries hold a token and an
    embedding row each (the EAGLE-3 head's decoder input), and a batch of embedding rows given to
    `llama_encode` into its encoder input."""

    def __init__(self, capacity: int, n_embd: int = 0, n_seq_max: int = 1):
        """n_seq_max: the most sequence ids one row may carry (set_tree)."""
        self.capacity = capacity
        self.n_embd = n_embd
        self._token = np.zeros(capacity, np.int32)  # [capacity]
        self._pos = np.zeros(capacity, np.int32)  # [capacity]
        self._n_seq = np.ones(capacity, np.int32)  # [capacity]
        self._seqs = np.zeros((capacity, n_seq_max), np.int32)  # [capacity, n_seq_max]: a row's sequence ids
        self._seq = self._seqs[:, 0]  # [capacity]: the first (most rows' only) sequence id
        self._logits = np.zeros(capacity, np.int8)  # [capacity]
        self._embd = np.zeros((capacity, n_embd), np.float32) if n_embd else None  # [capacity, n_embd]
        i32, f32 = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float)
        addr, stride = self._seqs.ctypes.data, self._seqs.strides[0]
        self._seq_ptrs = (i32 * capacity)(*(ctypes.cast(addr + stride * i, i32) for i in range(capacity)))
        self.struct = C.llama_batch()
        self._token_ptr = self._token.ctypes.data_as(i32)
        self.struct.token = self._token_ptr
        self.struct.pos = self._pos.ctypes.data_as(i32)
        self.struct.n_seq_id = self._n_seq.ctypes.data_as(i32)
        self.struct.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(i32))
        self.struct.logits = self._logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.struct.embd = None
        self._embd_ptr = self._embd.ctypes.data_as(f32) if n_embd else None
        self._ramp = np.arange(capacity, dtype=np.int32)  # [capacity]: 0, 1, 2, ... for positions
        self._carries = "token"  # what the struct's pointers carry now: "token", "embd" or "both"
        self._seq_dirty = 0  # rows whose sequence id set_rows may have left other than 0
        self.ptr = True  # the arrays live as long as this object

    def _free(self, _ptr) -> None:
        pass

    def _fit(self, n: int) -> None:
        if not 0 < n <= self.capacity:
            raise Eagle3Error(f"batch of {n} tokens does not fit capacity {self.capacity}")
        self._live()

    def set(self, tokens, pos0: int, *, logits: str = "last") -> int:
        """Fill with `tokens` of sequence 0 at positions pos0.. ; logits for "all" rows, the "last" one,
        or "none". Called once per cycle, right after a decode has pushed everything else out of the
        caches: it touches only what changed (one row is the common case)."""
        n = len(tokens)
        self._fit(n)
        if n == 1:
            self._token[0] = tokens[0]
            self._pos[0] = pos0
            self._logits[0] = logits != "none"
        else:
            self._token[:n] = tokens
            np.add(self._ramp[:n], pos0, out=self._pos[:n])
            self._logits[:n] = logits == "all"
            if logits == "last":
                self._logits[n - 1] = 1
        self._point("token", n)
        return n

    def set_one(self, token: int, pos: int) -> None:
        """One token of sequence 0 at `pos`, its logits wanted: set(..., logits="all") for the plain cycle,
        which runs cache-cold after the target's graph (12-15 us through set(), measured)."""
        if self._carries != "token" or self._seq_dirty:
            self.set([token], pos, logits="all")
            return
        self._token[0] = token
        self._pos[0] = pos
        self._logits[0] = 1
        self.struct.n_tokens = 1

    def _point(self, carries: str, n: int, seq_ids: bool = False) -> None:
        """Point the struct at token ids, embedding rows or both, for n rows; sequence ids back to 0 unless
        set_rows wrote others (`seq_ids`)."""
        if self._carries != carries:
            self.struct.token = self._token_ptr if carries != "embd" else None
            self.struct.embd = self._embd_ptr if carries != "token" else None
            self._carries = carries
        if seq_ids:
            self._seq_dirty = max(self._seq_dirty, n)
        elif self._seq_dirty:
            self._seq[:self._seq_dirty] = 0
            self._n_seq[:self._seq_dirty] = 1
            self._seq_dirty = 0
        self.struct.n_tokens = n

    def set_rows(self, tokens, pos, seq_ids, outputs) -> int:
        """Several sequences in one batch (one seq id per row).  # tokens, pos, seq_ids, outputs: [n] each"""
        n = len(tokens)
        self._fit(n)
        self._token[:n] = tokens
        self._pos[:n] = pos
        self._seq[:n] = seq_ids
        self._n_seq[:n] = 1
        self._logits[:n] = np.asarray(outputs, dtype=np.int8)
        self._point("token", n, seq_ids=True)
        return n

    def set_tree(self, tokens, pos, seq_sets: list[list[int]]) -> int:
        """Rows that may belong to several sequences each (a draft tree: a row attends the cells of every
        sequence it carries), every row an output.  # tokens, pos: [n]; seq_sets: [n] lists"""
        n = len(tokens)
        self._fit(n)
        if max(map(len, seq_sets)) > self._seqs.shape[1]:
            raise Eagle3Error(f"a row carries {max(map(len, seq_sets))} sequences; this batch holds {self._seqs.shape[1]}")
        self._token[:n] = tokens
        self._pos[:n] = pos
        for i, seqs in enumerate(seq_sets):
            self._n_seq[i] = len(seqs)
            self._seqs[i, :len(seqs)] = seqs
        self._logits[:n] = 1
        self._point("token", n, seq_ids=True)
        return n

    @property
    def n_rows(self) -> int:
        """Rows the batch holds now."""
        return self.struct.n_tokens

    def put_rows(self, src: "Batch", at: int, seq: int) -> int:
        """Copy `src`'s token rows (one sequence's) to rows at.. of this batch, as sequence `seq`; returns
        their number. Several calls fill a batch of several sequences; finish_rows(n) then hands it over."""
        n = src.n_rows
        if at + n > self.capacity:
            raise Eagle3Error(f"batch of {at + n} tokens does not fit capacity {self.capacity}")
        self._token[at:at + n] = src._token[:n]
        self._pos[at:at + n] = src._pos[:n]
        self._logits[at:at + n] = src._logits[:n]
        self._seq[at:at + n] = seq
        self._n_seq[at:at + n] = 1
        return n

    def finish_rows(self, n: int) -> None:
        """The batch put_rows filled: n rows of token ids with their own sequence ids."""
        self._fit(n)
        self._point("token", n, seq_ids=True)

    def set_embd(self, rows: np.ndarray, pos, tokens=None, seq_ids=None, outputs: bool = True) -> int:
        """Embedding rows (with tokens: token + embedding entries) at positions `pos`, of sequence 0 or of `seq_ids`
        (one a row), every row an output or (outputs False) none: the pinned eagle3 graphs have no output-row
        selection, so the first outputs' rows are handed back whichever rows were marked.
        # rows: [n, n_embd]; pos, tokens, seq_ids: [n]"""
        n = rows.shape[0]
        self._fit(n)
        if rows.shape[1] != self.n_embd:
            raise Eagle3Error(f"embedding rows of width {rows.shape[1]} in a batch of width {self.n_embd}")
        self._embd[:n] = rows
        self._pos[:n] = pos
        self._logits[:n] = outputs
        if tokens is not None:
            self._token[:n] = tokens
        if seq_ids is not None:
            self._seq[:n] = seq_ids
            self._n_seq[:n] = 1
        self._point("both" if tokens is not None else "embd", n, seq_ids=seq_ids is not None)
        return n

    def embd_rows(self, n: int) -> np.ndarray:
        """Rows 0..n-1's embedding slots, for a caller to write in place before fill_embd(n, ...).
        # [n, n_embd] (view)"""
        self._fit(n)
        return self._embd[:n]

    def fill_embd(self, n: int, pos0: int, tokens: np.ndarray) -> None:
        """Token + embedding entries of sequence 0 at positions pos0.., every row an output, their embedding rows
        already written through embd_rows(n): set_embd without copying the rows.  # tokens: [n]"""
        self._fit(n)
        self._token[:n] = tokens
        np.add(self._ramp[:n], pos0, out=self._pos[:n])
        self._logits[:n] = 1
        self._point("both", n)

    def point_embd(self, n: int) -> None:
        """n rows of embedding rows of sequence 0, for C to fill (chain.c's seed: the encoder's input)."""
        self._fit(n)
        self._point("embd", n)

    def point_both(self, n: int) -> None:
        """n rows of token + embedding entries of sequence 0, for C to fill (chain.c's seed: the decoder's)."""
        self._fit(n)
        self._point("both", n)

    def set_embd_one(self, row: np.ndarray, pos: int, token: int) -> None:
        """One token + embedding entry at `pos`, an output: set_embd(row[None], [pos], [token]) for a draft
        step, without the arrays made per call.  # row: [n_embd]"""
        if self._carries != "both" or self._seq_dirty:
            self.set_embd(row[None], np.array([pos], np.int32), np.array([token], np.int32))
            return
        self._embd[0] = row
        self._pos[0] = pos
        self._token[0] = token
        self._logits[0] = 1
        self.struct.n_tokens = 1


class BatchExt(_Owner):
    """A llama_batch_ext (token ids and/or embedding rows per entry), for llama_process."""

    def __init__(self, ctx: Context):
        ptr = C.llama_batch_ext_init(ctx._live())
        if not ptr:
            raise Eagle3Error("llama_batch_ext_init failed")
        self.ptr = ptr
        self.n = 0

    def _free(self, ptr) -> None:
        C.llama_batch_ext_free(ptr)

    def clear(self) -> None:
        C.llama_batch_ext_clear(self._live())
        self.n = 0

    def _check(self, ok, what: str) -> None:
        if (isinstance(ok, bool) and not ok) or (not isinstance(ok, bool) and ok < 0):
            raise Eagle3Error(f"llama_batch_ext: {what} failed ({ok})")

    def add_embd(self, row: np.ndarray, pos: int, *, output: bool = True, seq_id: int = 0) -> int:
        """Add an entry carrying only an embedding row (the EAGLE-3 encoder input)."""
        row = np.ascontiguousarray(row, dtype=np.float32)  # [n_embd_inp]
        embd = C.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.size)
        idx = C.llama_batch_ext_add_embd(self._live(), seq_id, embd)
        self._check(idx, "add_embd")
        self._finish(idx, pos, output)
        return idx

    def add_token(self, token: int, pos: int, embd: np.ndarray | None = None, *, output: bool = True,
                  seq_id: int = 0) -> int:
        """Add a token entry, optionally carrying an embedding row too (EAGLE-3 decoder: token + g)."""
        idx = C.llama_batch_ext_add_token(self._live(), seq_id, int(token))
        self._check(idx, "add_token")
        if embd is not None:
            row = np.ascontiguousarray(embd, dtype=np.float32)  # [n_embd]
            e = C.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.size)
            self._check(bool(C.llama_batch_ext_set_embd_token(self.ptr, idx, e)), "set_embd_token")
        self._finish(idx, pos, output)
        return idx

    def _finish(self, idx: int, pos: int, output: bool) -> None:
        p = ctypes.c_int32(pos)
        self._check(bool(C.llama_batch_ext_set_pos(self.ptr, idx, ctypes.byref(p))), "set_pos")
        self._check(bool(C.llama_batch_ext_set_output_logits(self.ptr, idx, output)), "set_output")
        self.n += 1
