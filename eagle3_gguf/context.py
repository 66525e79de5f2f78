"""`Context`, the owner of a llama_context (an EAGLE-3 head's is paired with its target's through `ctx_other`):
its KV cache, the graph calls (llama_decode, llama_process, llama_encode), the logits or the tokens the graph
chose (choice.py's `GraphChoice`, the sampler chain a Context holds for it), and the hidden states the staging API
extracts.

The staging functions it calls (native.py's `_bind`) and the logits getters that hand back addresses
(native.py's `_address_twin`) are bound here, on the libllama native.py binds.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
from llama_cpp import llama_cpp as C

from .choice import GraphChoice
from .choice import available as choice_available
from .config import check_threads
from .errors import DecodeError, Eagle3Error
from .native import Model, _address_twin, _bind, _Owner, _type_name, default_threads, require_ext

if TYPE_CHECKING:
    from .batch import Batch, BatchExt

ctx_p = C.llama_context_p_ctypes

LLAMA_PROCESS_TYPE_ENCODE = 0
LLAMA_PROCESS_TYPE_DECODE = 1

# ------------------------------------------------------------------------------------------------
# A context's bindings: the staging API (src/llama-ext.h), resolved by mangled name, and the logits getters
# ------------------------------------------------------------------------------------------------

# LLAMA_API void llama_set_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid, bool value);
llama_set_embeddings_layer_inp = _bind(
    "llama_set_embeddings_layer_inp", [ctx_p, ctypes.c_uint32, ctypes.c_bool], None)

# The getters of float buffers return their address as an int (c_void_p): Context._view finds its cached
# numpy view by address, without building a ctypes pointer object every call.

# LLAMA_API float * llama_get_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid);
llama_get_embeddings_layer_inp = _bind(
    "llama_get_embeddings_layer_inp", [ctx_p, ctypes.c_uint32], ctypes.c_void_p)

# LLAMA_API void llama_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
llama_set_embeddings_nextn = _bind(
    "llama_set_embeddings_nextn", [ctx_p, ctypes.c_bool, ctypes.c_bool], None)

# LLAMA_API float * llama_get_embeddings_nextn(struct llama_context * ctx);
llama_get_embeddings_nextn = _bind(
    "llama_get_embeddings_nextn", [ctx_p], ctypes.c_void_p)

# LLAMA_API float * llama_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);
llama_get_embeddings_nextn_ith = _bind(
    "llama_get_embeddings_nextn_ith", [ctx_p, ctypes.c_int32], ctypes.c_void_p)

# LLAMA_API float * llama_get_logits(struct llama_context * ctx);
llama_get_logits_addr = _address_twin("llama_get_logits", [ctx_p])

# LLAMA_API float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
llama_get_logits_ith_addr = _address_twin("llama_get_logits_ith", [ctx_p, ctypes.c_int32])


NO_LOGITS = "no logits: this context chooses tokens in the graph (set_graph_choice)"


def decode_failure(rc: int) -> str:
    """What llama_decode's nonzero rc means (llama.h), in one line."""
    if rc == 1:
        return "llama_decode found no room in the KV cache (rc=1): the context is full: raise -c"
    if rc == -1:
        return ("llama_decode refused the batch (rc=-1): a token id outside the vocabulary, a position out of order "
                "or a sequence id past the context's")
    if rc == 2:
        return "llama_decode was aborted (rc=2)"
    return f"llama_decode failed (rc={rc}): llama.cpp's log (-v, verbose=True) says why"


@dataclass(frozen=True)
class Adapters:
    """The LoRA adapters a target context computes with (llama-cpp-python's Llama owns their handles): a context of
    the same set-up sets them too (the exactness probe's), and the cost key names their files and scales (they
    change what a row costs and which rows are exact)."""
    handles: tuple  # llama_adapter_lora_p, each
    paths: tuple[str, ...]
    scales: tuple[float, ...]

    def set_on(self, ctx) -> None:
        # LLAMA_API int32_t llama_set_adapters_lora(struct llama_context * ctx, struct llama_adapter_lora ** adapters,
        #                                           size_t n_adapters, float * scales);
        n = len(self.handles)
        if C.llama_set_adapters_lora(ctx, (C.llama_adapter_lora_p_ctypes * n)(*self.handles), n,
                                     (ctypes.c_float * n)(*self.scales)):
            raise Eagle3Error(f"llama.cpp could not set the LoRA adapters {', '.join(self.paths)} on a context of the "
                              "target")


class Context(_Owner):
    """A llama_context; `ctx_other` pairs an EAGLE-3 head with its target."""

    def __init__(self, model: Model, *, n_ctx: int = 2048, n_batch: int = 512, n_ubatch: int | None = None,
                 n_threads: int | None = None, ctx_other: "Context | None" = None, n_seq_max: int = 1,
                 kv_unified: bool = True, type_k: int | None = None, type_v: int | None = None,
                 flash_attn: int | None = None, borrowed=None, capture=None, adapters: Adapters | None = None):
        """kv_unified=False gives every sequence its own KV stream (n_ctx / n_seq_max cells): a row attends
        over its own sequence only, but llama.cpp then orders a batch's rows by sequence id in its ubatches
        (so layer-input rows come out in that order: keep batches sorted by sequence). type_k/type_v: the
        KV cache's ggml types (`cache_type`); llama.cpp's default is f16 for both. flash_attn: llama.cpp's
        flash_attn_type (default: auto). borrowed: a llama_context someone else owns (`llama_cpp.Llama._ctx.ctx`)
        to wrap, made with these settings; close() won't free it. capture: a capture.LayerCapture whose eval
        callback gives the layer inputs of a graph without llama.cpp's hook (set_layer_inp then reads it).
        adapters: the LoRA adapters it computes with (set here unless borrowed, whose owner has set them)."""
        self.model = model
        self.ctx_other = ctx_other  # keeps the target alive while the head borrows from it
        threads = n_threads or default_threads()
        if threads != -1:  # ggml's default count, as llama-cpp-python's Llama(n_threads=-1) hands it on
            check_threads(threads, "n_threads")
        rows = min(n_ctx, n_batch) if n_ctx > 0 else n_batch  # llama.cpp's n_batch, the most outputs a decode has
        if borrowed is None and n_seq_max > rows:  # llama.cpp reserves an output row per sequence: a GGML abort
            raise Eagle3Error(f"a context of {rows} batch rows cannot serve {n_seq_max} sequences (llama.cpp reserves "
                              f"an output row for each): raise -c and the batch to at least {n_seq_max}, or use fewer "
                              "(a draft tree's: --draft-topk, --draft-nodes)")
        params = C.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_ubatch or n_batch, n_batch)
        params.n_seq_max = n_seq_max
        params.n_outputs_max_per_seq = 0  # any row of a batch may be an output (llama.cpp's default: 1), also
        # with a backend sampler attached (set_greedy_sampling), which checks this bound on every decode
        params.kv_unified = kv_unified
        if type_k is not None:
            params.type_k = type_k
        if type_v is not None:
            params.type_v = type_v
        if flash_attn is not None:
            params.flash_attn_type = flash_attn
        params.n_threads = threads
        params.n_threads_batch = threads
        params.no_perf = True
        if ctx_other is not None:
            params.ctx_other = ctx_other._live()
        self._capture = capture  # kept alive with the context: llama.cpp calls into it
        if capture is not None:
            params.cb_eval = capture.callback
            params.cb_eval_user_data = capture.user_data
        # what the cost of a row depends on besides the files and threads (costs.CostKey)
        self.kv_types = (int(params.type_k), int(params.type_v))
        self.flash_attn = int(params.flash_attn_type)
        self._owned = borrowed is None
        ptr = borrowed if borrowed is not None else C.llama_init_from_model(model._live(), params)
        if not ptr:
            cache = "" if type_k is None and type_v is None else (
                f", KV cache {_type_name(params.type_k)}/{_type_name(params.type_v)}")
            raise Eagle3Error(f"{model.path}: llama.cpp could not create a context (n_ctx={n_ctx}{cache}; "
                              "-v shows why)")
        self.ptr = ptr
        self.adapters = adapters
        if adapters is not None and self._owned:
            try:
                adapters.set_on(ptr)
            except Eagle3Error:
                C.llama_free(ptr)
                raise
        # how this context's graphs are called: runner(graph_call) in this thread by default; slots.Engine
        # passes its own, which runs every graph on one thread
        self.runner: Callable[..., int] | None = None
        self.t_native = 0.0  # seconds spent inside llama_decode / llama_process (for overhead figures)
        self._views: dict[tuple, np.ndarray] = {}
        self._layer_inp: set[int] = set()
        self._nextn = False
        self._decoded = False
        self._choice: GraphChoice | None = None  # the graph chooses tokens (set_graph_choice)

    def _free(self, ptr) -> None:
        if self._owned:
            C.llama_free(ptr)
        if self._choice is not None:  # after the context: it held the sampler
            self._choice.close()
            self._choice = None

    @property
    def n_ctx(self) -> int:
        return C.llama_n_ctx(self._live())

    @property
    def n_seq_max(self) -> int:
        return C.llama_n_seq_max(self._live())

    @property
    def n_batch(self) -> int:
        return C.llama_n_batch(self._live())

    @property
    def n_threads(self) -> int:
        return C.llama_n_threads(self._live())

    @property
    def n_ubatch(self) -> int:
        return C.llama_n_ubatch(self._live())

    # -- memory (KV cache) -----------------------------------------------------------------------
    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        return bool(C.llama_memory_seq_rm(C.llama_get_memory(self._live()), seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Add sequence dst to the cells of sequence src in [p0, p1) (a unified cache shares the cells)."""
        C.llama_memory_seq_cp(C.llama_get_memory(self._live()), src, dst, p0, p1)

    def pos_max(self, seq_id: int = 0) -> int:
        return int(C.llama_memory_seq_pos_max(C.llama_get_memory(self._live()), seq_id))

    def clear(self) -> None:
        C.llama_memory_clear(C.llama_get_memory(self._live()), True)

    # -- running graphs ----------------------------------------------------------------------------
    def _run(self, graph, *args) -> int:
        """Run one of llama.cpp's graph calls on this context (through `runner` where one is set), timed
        into t_native up to llama_synchronize (the backend may still be copying outputs: that is llama.cpp's
        time too). Returns its rc."""
        if self.runner is not None:
            return self.runner(self._call, graph, *args)
        return self._call(graph, *args)

    def _call(self, graph, *args) -> int:
        if self._capture is not None:
            self._capture.reset()
        t = time.perf_counter()
        rc = graph(self._live(), *args)
        C.llama_synchronize(self.ptr)
        self.t_native += time.perf_counter() - t
        self._decoded = self._decoded or rc == 0
        if self._capture is not None and rc == 0:
            self._capture.check()
        return rc

    def ran(self, seconds: float, decoded: bool) -> None:
        """Graphs run on this context from C (chain.c's draft steps) took `seconds` up to llama_synchronize, timed into
        t_native; where one succeeded (`decoded`) its outputs are there to read."""
        self.t_native += seconds
        self._decoded = self._decoded or decoded

    def decode(self, batch: "Batch") -> None:
        rc = self._run(C.llama_decode, batch.struct)
        if rc != 0:
            raise DecodeError(decode_failure(rc))

    def process(self, kind: int, batch: "BatchExt") -> None:
        rc = self._run(C.llama_process, kind, batch._live())
        if rc != 0:
            what = "ENCODE" if kind == LLAMA_PROCESS_TYPE_ENCODE else "DECODE"
            raise Eagle3Error(f"llama_process({what}) failed (rc={rc}): the draft context may be full (raise -c)")

    def encode(self, batch: "Batch") -> None:
        """llama_encode: for an EAGLE-3 head, its encoder (fc) on a batch of feature rows."""
        rc = self._run(C.llama_encode, batch.struct)
        if rc != 0:
            raise Eagle3Error(f"llama_encode failed (rc={rc})")

    # -- choosing tokens inside the graph ----------------------------------------------------------
    @property
    def owned(self) -> bool:
        """Made here (not borrowed from llama_cpp.Llama)."""
        return self._owned

    @property
    def greedy_sampling(self) -> bool:
        """Whether the graph chooses (set_graph_choice): the logits are then not handed back."""
        return self._choice is not None

    @property
    def graph_choice(self) -> GraphChoice | None:
        """What the graph chooses (set_graph_choice), None where it hands back the logits."""
        return self._choice

    def set_greedy_sampling(self, enabled: bool) -> bool:
        """Let the graph take each output row's argmax (sampled_token) instead of handing the logits back:
        set_graph_choice(1) or (0). On a GPU it saves the device-to-host copy of every verify row; on a CPU ggml's
        argmax costs more than numpy's over the copy (decode.greedy_in_graph decides)."""
        return self.set_graph_choice(1 if enabled else 0)

    def set_graph_choice(self, k: int, probs: bool = False) -> bool:
        """Let the graph choose each output row's tokens of sequence 0 (choice.py, llama.cpp's backend sampling):
        k = 1 its argmax (sampled_token), k > 1 its k likeliest (sampled_top), and with `probs` their probabilities
        under a softmax over the row; 0: hand the logits back again. While the graph chooses, no logits are copied
        out (logits() raises), but those of rows it chose nothing for (chosen_token None; logits_ith reads them). Only
        on a context made here: a borrowed one's owner reads the logits itself. Returns whether the graph chooses:
        False where the backend cannot, or choice.c cannot be built here (choice.available: no C compiler); the logits
        are then handed back."""
        probs = probs and k > 0
        if (k, probs) == ((self._choice.k, self._choice.probs) if self._choice is not None else (0, False)):
            return k > 0
        if not self._owned:
            raise Eagle3Error("choosing tokens in the graph needs a context eagle3-gguf made, not a borrowed one")
        if self._choice is not None:
            C.llama_set_sampler(self._live(), 0, None)
            self._choice.close()
            self._choice = None
        if k and choice_available():
            choice = GraphChoice(k, probs)
            # LLAMA_API bool llama_set_sampler(struct llama_context * ctx, llama_seq_id seq_id, struct llama_sampler * smpl);
            if not C.llama_set_sampler(self._live(), 0, choice.ptr):
                choice.close()
                return False
            self._choice = choice
        return self._choice is not None

    def sampled_token(self, i: int) -> int:
        """The graph's choice (argmax) at batch row i of the last decode (set_graph_choice(1))."""
        tok = C.llama_get_sampled_token_ith(self._live(), i)
        if tok < 0:
            raise Eagle3Error(f"no sampled token for batch row {i}: set_greedy_sampling(True) before the decode")
        return tok

    def chosen_token(self, i: int) -> int | None:
        """sampled_token, or None where the graph chose nothing at row i, whose logits are then handed back
        (logits_ith). llama.cpp runs sequence 0's choice on the rows whose sequences it lists with 0 first (a set: the
        order is its own) and copies out the logits of every ubatch with a row of a sequence that has no choice, as a
        draft tree's rows off its chain are."""
        tok = C.llama_get_sampled_token_ith(self._live(), i)
        return tok if tok >= 0 else None

    def _chose(self, i: int) -> bool:
        """Whether the graph chose at row i of the last decode (a token, or k candidates)."""
        if self._choice.k == 1:
            return self.chosen_token(i) is not None
        return C.llama_get_sampled_candidates_count_ith(self._live(), i) > 0

    def sampled_top(self, i: int) -> tuple[list[int], list[float]]:
        """The graph's k likeliest tokens at batch row i of the last decode, in no order, and their probabilities
        (set_graph_choice(k, probs=True))."""
        c = self._choice
        if c is None or not c.probs:
            raise Eagle3Error("no probabilities chosen in the graph: set_graph_choice(k, probs=True) before the decode")
        ctx = self._live()
        # (a row the graph chose nothing for reads as the whole vocab's ids: its counts tell)
        if C.llama_get_sampled_probs_count_ith(ctx, i) != c.k or \
                (c.k > 1 and C.llama_get_sampled_candidates_count_ith(ctx, i) != c.k):
            raise Eagle3Error(f"no tokens chosen in the graph for batch row {i}")
        ids = [C.llama_get_sampled_token_ith(ctx, i)] if c.k == 1 else C.llama_get_sampled_candidates_ith(ctx, i)[:c.k]
        return ids, C.llama_get_sampled_probs_ith(ctx, i)[:c.k]

    def logits(self, n_rows: int) -> np.ndarray:
        """The output rows of the last decode, in batch order.  # [n_rows, n_vocab] (view)"""
        if self._choice is not None:
            raise Eagle3Error(NO_LOGITS)
        addr = llama_get_logits_addr(self._live())
        if not addr:
            raise Eagle3Error("no logits: the last batch requested none")
        return self._view(addr, (n_rows, self.model.n_vocab))

    def logits_ith(self, i: int) -> np.ndarray:
        """Output row i of the last decode.  # [n_vocab] (view)"""
        if self._choice is not None and self._chose(i):
            raise Eagle3Error(NO_LOGITS)  # where the graph chose, llama.cpp may have copied no logits
        addr = llama_get_logits_ith_addr(self._live(), i)
        if not addr:
            raise Eagle3Error(f"no logits for batch row {i}")
        return self._view(addr, (self.model.n_vocab,))  # [n_vocab] (view)

    def _view(self, addr: int, shape: tuple[int, ...]) -> np.ndarray:
        """A float32 numpy view of llama.cpp's buffer at address `addr`. Making one costs microseconds and
        the buffers rarely move, so views are kept by address and shape: valid whenever llama.cpp hands
        out that address again, as it does now."""
        key = (addr, shape)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 64:
                self._views.clear()
            ptr = ctypes.cast(addr, ctypes.POINTER(ctypes.c_float))
            view = self._views[key] = np.ctypeslib.as_array(ptr, shape=shape)
        return view

    # -- hidden-state extraction (staging API) ----------------------------------------------------
    def set_layer_inp(self, lid: int, enabled: bool = True) -> None:
        """Ask for the input hidden state of layer `lid` (0..n_layer-1) on every decoded token."""
        if not 0 <= lid < self.model.n_layer:
            raise Eagle3Error(f"layer id {lid} out of range for a {self.model.n_layer}-layer model")
        if self._capture is not None:
            if lid not in self._capture.layers:
                raise Eagle3Error(f"layer {lid}'s input is not among the captured ones {self._capture.layers}")
        else:
            require_ext()
            llama_set_embeddings_layer_inp(self._live(), lid, enabled)
        (self._layer_inp.add if enabled else self._layer_inp.discard)(lid)
        self._decoded = False

    def extracts_layer_inp(self, lid: int) -> bool:
        """Whether decodes extract layer `lid`'s input (set_layer_inp)."""
        return lid in self._layer_inp

    def layer_inp(self, lid: int, n_tokens: int) -> np.ndarray:
        """Layer `lid`'s input rows of the last decode.  # [n_tokens, n_embd] (view)"""
        return self._view(self._layer_inp_addr(lid), (n_tokens, self.model.n_embd))

    def _layer_inp_addr(self, lid: int) -> int:
        if lid not in self._layer_inp or not self._decoded:
            raise Eagle3Error(f"layer {lid} input was not extracted: call set_layer_inp({lid}) and decode first")
        if self._capture is not None:
            return self._capture.address(lid)
        addr = llama_get_embeddings_layer_inp(self._live(), lid)
        if not addr:
            raise Eagle3Error(f"llama.cpp returned no input rows for layer {lid}")
        return addr

    def copy_row(self, row: int, layers: list[int], dst: int) -> None:
        """Row `row` of the last decode's extracted hidden states, one block of n_embd float32 per layer id
        (an id < n_layer: that layer's input; n_layer: the pre-norm output), side by side into the buffer
        at address `dst`: what layer_inp() and nextn() give, without numpy views, for the one row a plain
        cycle sets aside (it runs cache-cold after the target's graph: 26 us through the views, measured)."""
        n_layer, size = self.model.n_layer, self.model.n_embd * 4
        for lid in layers:
            addr = self._layer_inp_addr(lid) if lid < n_layer else self._nextn_addr()
            ctypes.memmove(dst, addr + row * size, size)
            dst += size

    def set_nextn(self, enabled: bool = True, masked: bool = True) -> None:
        """Ask for the pre-norm hidden state (EAGLE-3: g from the encoder, h from the decoder)."""
        require_ext()
        llama_set_embeddings_nextn(self._live(), enabled, masked)
        self._nextn = enabled
        self._decoded = False

    def nextn(self, n_rows: int) -> np.ndarray:
        """All pre-norm rows of the last graph.  # [n_rows, n_embd] (view)"""
        return self._view(self._nextn_addr(), (n_rows, self.model.n_embd))

    def _nextn_addr(self) -> int:
        if not self._nextn or not self._decoded:
            raise Eagle3Error("pre-norm hidden states were not requested: call set_nextn() and run a graph first")
        addr = llama_get_embeddings_nextn(self._live())
        if not addr:
            raise Eagle3Error("llama.cpp returned no pre-norm hidden states")
        return addr

    def nextn_ith(self, i: int) -> np.ndarray:
        """The pre-norm row of batch row i.  # [n_embd] (view)"""
        if not self._nextn or not self._decoded:
            raise Eagle3Error("pre-norm hidden states were not requested: call set_nextn() and run a graph first")
        addr = llama_get_embeddings_nextn_ith(self._live(), i)
        if not addr:
            raise Eagle3Error(f"no pre-norm hidden state for batch row {i}")
        return self._view(addr, (self.model.n_embd,))
