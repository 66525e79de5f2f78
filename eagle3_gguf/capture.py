"""Layer inputs of targets whose pinned graph has no `t_layer_inp` hook (qwen2, gemma3, phi3, ...).

Every such graph names its residual stream after each layer `l_out-{il}` (the input of layer il + 1).
`LayerCapture` asks llama.cpp's scheduler for those tensors through the context's eval callback
(`cb_eval`), and the callback copies each out as it is computed, one ubatch after another, into buffers
shaped as llama.cpp's own layer-input rows. The callback is the 40 lines of C in capture.c, compiled
once with the system compiler into the cache (a Python callback runs for every node of every graph:
~0.5 us each, 10% of a SmolLM2 step). The layer-0 input (the embeddings, scaled in some graphs) and the
final output are not captured: heads read neither at these architectures' usual depths.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
from llama_cpp import llama_cpp as C

from .cbuild import library
from .errors import Eagle3Error
from .gguf_file import TargetInfo
from .native import sibling_library

CAPTURE_SLOTS, CAPTURE_NAME = 4, 64  # capture.c's, ggml's GGML_MAX_NAME
_SOURCE = Path(__file__).with_name("capture.c")


class _Capture(ctypes.Structure):
    """capture.c's `struct capture`."""

    _fields_ = [("get_name", ctypes.c_void_p), ("nbytes", ctypes.c_void_p), ("tensor_get", ctypes.c_void_p),
                ("n", ctypes.c_int), ("names", (ctypes.c_char * CAPTURE_NAME) * CAPTURE_SLOTS),
                ("dst", ctypes.c_void_p * CAPTURE_SLOTS), ("cap", ctypes.c_size_t * CAPTURE_SLOTS),
                ("off", ctypes.c_size_t * CAPTURE_SLOTS), ("overflow", ctypes.c_int)]


def graph_name(lid: int) -> str:
    """The graph tensor holding layer `lid`'s input: the output of layer lid - 1."""
    return f"l_out-{lid - 1}"


def _compiled() -> ctypes.CDLL:
    """capture.c, built once per source version and machine into the cache (cbuild.py)."""
    return library(_SOURCE, "capturing this target's hidden states", _Capture)


class LayerCapture:
    """Buffers for the inputs of `layers` (each >= 1) over up to `n_rows` batch rows, and the eval callback
    that fills them: pass `callback` and `user_data` as a context's cb_eval / cb_eval_user_data, `reset()`
    before each decode and `check()` after it; the buffer at `address(lid)` then holds that decode's rows of
    layer lid in the order llama.cpp computed them: batch order with a unified KV cache, ubatch order otherwise
    (llama.cpp's hook restores batch order; split sequences of unequal lengths into separate decodes, as train's
    data generation does)."""

    def __init__(self, layers: list[int], n_embd: int, n_rows: int):
        wanted = sorted(set(layers))
        if not wanted or wanted[0] < 1 or len(wanted) > CAPTURE_SLOTS:
            raise Eagle3Error(f"layer ids {layers}: a captured target gives the inputs of layers 1.. (at most "
                              f"{CAPTURE_SLOTS}); reconvert the head with --layer-ids")
        base = sibling_library("ggml-base")
        if base is None:
            raise Eagle3Error("no libggml-base beside libllama: hidden states cannot be captured")
        self.layers, self.n_embd = wanted, n_embd
        self.buffers = {lid: np.zeros((n_rows, n_embd), np.float32) for lid in wanted}  # [n_rows, n_embd] each
        c = self._struct = _Capture()
        c.get_name = ctypes.cast(base.ggml_get_name, ctypes.c_void_p)
        c.nbytes = ctypes.cast(base.ggml_nbytes, ctypes.c_void_p)
        c.tensor_get = ctypes.cast(base.ggml_backend_tensor_get, ctypes.c_void_p)
        c.n = len(wanted)
        for i, lid in enumerate(wanted):
            c.names[i].value = graph_name(lid).encode()
            c.dst[i] = self.buffers[lid].ctypes.data
            c.cap[i] = self.buffers[lid].nbytes
        # bool (*ggml_backend_sched_eval_callback)(struct ggml_tensor * t, bool ask, void * user_data)
        self.callback = ctypes.cast(_compiled().eagle3_capture, C.ggml_backend_sched_eval_callback)
        self.user_data = ctypes.cast(ctypes.pointer(c), ctypes.c_void_p)

    def reset(self) -> None:
        c = self._struct
        for i in range(c.n):
            c.off[i] = 0
        c.overflow = 0

    def check(self) -> None:
        """After a decode: every layer's rows arrived and fitted."""
        c = self._struct
        if c.overflow:
            raise Eagle3Error("a decode held more rows than the capture buffers (n_batch): raise them")
        missing = [lid for i, lid in enumerate(self.layers) if not c.off[i]]
        if missing:
            raise Eagle3Error(f"this target's graph computed no '{graph_name(missing[0])}': its hidden states cannot "
                              "be captured")

    def address(self, lid: int) -> int:
        """Where layer lid's rows lie (context.Context reads them there, as it reads llama.cpp's own)."""
        return self.buffers[lid].ctypes.data


def capture_for(target: TargetInfo, layers: list[int], n_rows: int) -> LayerCapture | None:
    """What a context of `target` needs to give `layers`' inputs: a LayerCapture where its graph has no hook,
    None where llama.cpp's hook does (TargetInfo.require_extraction refuses the rest)."""
    return LayerCapture(layers, target.n_embd, n_rows) if target.captured else None
