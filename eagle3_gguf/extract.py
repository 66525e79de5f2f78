"""The target's three hidden-state features, as EAGLE-3 reads them: the same code path for the
session at inference and for training-data capture, so both see identical features."""

from __future__ import annotations

import functools

import numpy as np

from .context import Context
from .errors import Eagle3Error


class TargetFeatures:
    """Turns on extraction of the given layer inputs on a target context and gathers them.

    Layer ids follow the GGUF's input-of-layer convention: id i < n_layer is the input of layer i;
    id == n_layer is the final hidden state (read through the target's nextn output).
    """

    def __init__(self, target: Context, layers: list[int]):
        self.target = target
        self.layers = list(layers)
        self.n_layer = target.model.n_layer
        self.n_embd = target.model.n_embd
        for lid in self.layers:
            if 0 <= lid < self.n_layer:
                target.set_layer_inp(lid, True)
            elif lid == self.n_layer:
                target.set_nextn(True, masked=False)
            else:
                raise Eagle3Error(f"target layer id {lid} is outside 0..{self.n_layer} for this target")
        self.row0 = 0  # where this sequence's rows start in the last decode (slots share a target batch)
        # per layer: where its rows come from and which columns of a feature row they fill (gather() runs
        # once a cycle, right after the target's graph: it looks up as little as it can)
        self._parts = [(functools.partial(target.layer_inp, lid) if lid < self.n_layer else target.nextn,
                        slice(i * self.n_embd, (i + 1) * self.n_embd)) for i, lid in enumerate(self.layers)]

    def enable(self, on: bool) -> None:
        """Extract the layer inputs on the target's next decodes, or not: a decode without them costs less
        where the target's layers sit on RPC servers (each one is fetched over the network: 1-row decodes
        3-8% faster at 1 ms per message, 0.6% locally), and switching costs llama.cpp one graph reservation
        (~4.5 ms locally, ~12 ms at 1 ms per message), so a run switches at its start only. The final hidden
        state (nextn) stays: llama.cpp sizes its buffer per decode. The target holds the state: another
        session on it (a benchmark's contenders) may have switched it."""
        for lid in self.layers:
            if lid < self.n_layer and self.target.extracts_layer_inp(lid) != on:
                self.target.set_layer_inp(lid, on)

    @property
    def enabled(self) -> bool:
        """The layer inputs are extracted on every decode (enable())."""
        return all(self.target.extracts_layer_inp(lid) for lid in self.layers if lid < self.n_layer)

    @property
    def width(self) -> int:
        return len(self.layers) * self.n_embd

    def gather(self, n_rows: int, rows: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of the last target decode (the first n_rows from row0, or the given row indices past row0),
        the layers concatenated in order, into `out` when given.  # [n_rows or len(rows), 3 * n_embd_tgt]"""
        n_out = n_rows if rows is None else len(rows)
        if out is None:
            out = np.empty((n_out, self.width), np.float32)
        r0 = self.row0
        for rows_of, cols in self._parts:
            full = rows_of(r0 + n_rows)  # [row0 + n_rows, n_embd_tgt]
            if r0:
                full = full[r0:]
            out[:, cols] = full if rows is None else full[rows]
        return out

    def gather_one(self, dst: int) -> None:
        """gather(1) into the float32 feature row at address `dst` (3 * n_embd_tgt wide), for the one row a
        plain cycle sets aside."""
        self.target.copy_row(self.row0, self.layers, dst)
