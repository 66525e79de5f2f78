"""ctypes binding: llama.cpp's EAGLE-3 staging API on the libllama that llama_cpp loaded.

llama-cpp-python binds the public C API (llama.h). EAGLE-3 also needs the staging functions of
`src/llama-ext.h`, which are declared without `extern "C"` and so are exported under their
Itanium-mangled names. They are resolved here on `llama_cpp.llama_cpp._lib`, the very library
llama-cpp-python uses, so a context made by `llama_cpp.Llama` and one made here are interchangeable.

Owner classes, one per C handle, free in `close()` (idempotent) and work as context managers:
`Model` (llama_model), `Context` (llama_context), `Batch` (llama_batch), `BatchExt` (llama_batch_ext).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import llama_cpp
from gguf import GGMLQuantizationType
from llama_cpp import llama_cpp as C

from . import keys
from .errors import Eagle3Error, NativeError

_lib = C._lib
ctx_p = C.llama_context_p_ctypes
model_p = C.llama_model_p_ctypes

LLAMA_PROCESS_TYPE_ENCODE = 0
LLAMA_PROCESS_TYPE_DECODE = 1

# ------------------------------------------------------------------------------------------------
# Staging API (src/llama-ext.h), resolved by mangled name
# ------------------------------------------------------------------------------------------------

_missing: list[str] = []


def _bind(name: str, argtypes: list, restype) -> Callable:
    for symbol in (keys.MANGLED_SYMBOLS[name], name):
        try:
            fn = getattr(_lib, symbol)
        except AttributeError:
            continue
        fn.argtypes = argtypes
        fn.restype = restype
        return fn
    _missing.append(name)

    def unavailable(*_args):
        require_ext()

    unavailable.__name__ = name
    return unavailable


def require_ext() -> None:
    """Raise one clear error if the loaded libllama lacks any EAGLE-3 staging symbol."""
    if _missing:
        raise NativeError(
            f"the loaded libllama lacks {', '.join(_missing)} (llama-cpp-python {llama_cpp.__version__}); "
            f"eagle3-gguf needs llama-cpp-python=={keys.LLAMA_CPP_PYTHON_VERSION}: "
            f"pip install 'llama-cpp-python=={keys.LLAMA_CPP_PYTHON_VERSION}'"
        )


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


def _address_twin(name: str, argtypes: list) -> Callable:
    """A second ctypes function object for a public llama.h getter (llama_cpp's own keeps its restype),
    returning the address as an int."""
    fn = _lib[name]  # indexing makes a new function object; attribute access would share llama_cpp's
    fn.argtypes = argtypes
    fn.restype = ctypes.c_void_p
    return fn


# LLAMA_API float * llama_get_logits(struct llama_context * ctx);
llama_get_logits_addr = _address_twin("llama_get_logits", [ctx_p])

# LLAMA_API float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
llama_get_logits_ith_addr = _address_twin("llama_get_logits_ith", [ctx_p, ctypes.c_int32])

# LLAMA_API const int32_t * llama_model_target_layer_ids(const struct llama_model * model);
llama_model_target_layer_ids = _bind(
    "llama_model_target_layer_ids", [model_p], ctypes.POINTER(ctypes.c_int32))

# LLAMA_API uint32_t llama_model_target_layer_ids_n(const struct llama_model * model);
llama_model_target_layer_ids_n = _bind(
    "llama_model_target_layer_ids_n", [model_p], ctypes.c_uint32)

# LLAMA_API int32_t llama_model_n_devices(const struct llama_model * model);
llama_model_n_devices = _bind("llama_model_n_devices", [model_p], ctypes.c_int32)

# LLAMA_API ggml_backend_dev_t llama_model_get_device(const struct llama_model * model, int i);
llama_model_get_device = _bind("llama_model_get_device", [model_p, ctypes.c_int], ctypes.c_void_p)


@functools.cache
def sibling_library(stem: str) -> ctypes.CDLL | None:
    """A ggml library beside libllama, as libllama loaded it: by its soname file first (a wheel holds
    libggml.so and libggml.so.0 as two copies, and only the one libllama loaded shares its state). One
    handle per library, so every binding of a function is made on the same object."""
    libdir = Path(_lib._name).parent
    for name in (f"lib{stem}.so.0", f"lib{stem}.0.dylib", f"lib{stem}.so", f"lib{stem}.dylib", f"{stem}.dll"):
        if (libdir / name).is_file():
            return ctypes.CDLL(str(libdir / name))
    return None


def _ggml_base() -> ctypes.CDLL | None:
    """ggml's base library beside libllama (the one libllama runs on: loading it again shares it)."""
    lib = sibling_library("ggml-base")
    if lib is not None:
        # GGML_API const char * ggml_backend_dev_name(ggml_backend_dev_t device);
        lib.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_name.restype = ctypes.c_char_p
        # GGML_API const char * ggml_backend_dev_description(ggml_backend_dev_t device);
        lib.ggml_backend_dev_description.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_description.restype = ctypes.c_char_p
    return lib


_GGML_BASE = _ggml_base()
if _GGML_BASE is not None:
    # GGML_API size_t ggml_quantize_chunk(enum ggml_type type, const float * src, void * dst, int64_t start,
    #                                     int64_t nrows, int64_t n_per_row, const float * imatrix);
    _GGML_BASE.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                               ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    _GGML_BASE.ggml_quantize_chunk.restype = ctypes.c_size_t
    # GGML_API bool ggml_quantize_requires_imatrix(enum ggml_type type);
    _GGML_BASE.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    _GGML_BASE.ggml_quantize_requires_imatrix.restype = ctypes.c_bool


GGML_MAX_OP_PARAMS, GGML_MAX_SRC = 64, 10  # ggml.h's, at the pin


class GgmlTensorHead(ctypes.Structure):
    """The leading fields of ggml.h's `struct ggml_tensor`, up to its sources (what an eval callback reads of a
    node: its type, shape, op and inputs)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int),
                ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)), ("flags", ctypes.c_int32),
                ("src", ctypes.c_void_p * GGML_MAX_SRC)]


if _GGML_BASE is not None:
    # GGML_API const char * ggml_get_name(const struct ggml_tensor * tensor);
    _GGML_BASE.ggml_get_name.argtypes = [ctypes.c_void_p]
    _GGML_BASE.ggml_get_name.restype = ctypes.c_char_p
    # GGML_API size_t ggml_nbytes(const struct ggml_tensor * tensor);
    _GGML_BASE.ggml_nbytes.argtypes = [ctypes.c_void_p]
    _GGML_BASE.ggml_nbytes.restype = ctypes.c_size_t
    # GGML_API void ggml_backend_tensor_get(const struct ggml_tensor * tensor, void * data, size_t offset, size_t size);
    _GGML_BASE.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    _GGML_BASE.ggml_backend_tensor_get.restype = None
    # GGML_API const char * ggml_op_name(enum ggml_op op);
    _GGML_BASE.ggml_op_name.argtypes = [ctypes.c_int]
    _GGML_BASE.ggml_op_name.restype = ctypes.c_char_p


@functools.cache
def op_name(op: int) -> str:
    """The name of a graph node's enum ggml_op value ("MUL_MAT"); only for values read off real nodes."""
    return _GGML_BASE.ggml_op_name(op).decode()


def node_head(t: int) -> GgmlTensorHead:
    """The leading fields of the graph node at address t."""
    return GgmlTensorHead.from_address(t)


def node_name(t: int) -> str:
    return _GGML_BASE.ggml_get_name(t).decode(errors="replace")


def node_bytes(t: int) -> bytes:
    """A computed node's data, copied from its backend (contiguous nodes)."""
    n = _GGML_BASE.ggml_nbytes(t)
    buf = ctypes.create_string_buffer(n)
    _GGML_BASE.ggml_backend_tensor_get(t, buf, 0, n)
    return buf.raw


def quantize_rows(rows: np.ndarray, ggml_type: int, row_bytes: int) -> np.ndarray | None:
    """Rows quantized as llama.cpp quantizes them (ggml_quantize_chunk, no importance matrix); None where
    ggml is not at hand or the type needs an importance matrix.  # [n, n_per_row] float32 -> [n, row_bytes]"""
    if _GGML_BASE is None or _GGML_BASE.ggml_quantize_requires_imatrix(ggml_type):
        return None
    src = np.ascontiguousarray(rows, dtype=np.float32)
    out = np.zeros((src.shape[0], row_bytes), np.uint8)
    _GGML_BASE.ggml_quantize_chunk(ggml_type, src.ctypes.data, out.ctypes.data, 0, src.shape[0], src.shape[1], None)
    return out


@dataclass(frozen=True)
class Placement:
    """Where a model runs: the GPU devices llama.cpp gave it, and how many of its layers (the output layer
    counted, as llama.cpp's "offloaded N/M layers" counts) are on them; none offloaded: the CPU."""

    devices: tuple[str, ...]  # "CUDA0 (NVIDIA H100 80GB HBM3)", ...
    offloaded: int
    n_layers: int

    @property
    def remote(self) -> bool:
        """Whether layers run on rpc-servers (llama.cpp names their devices RPC0, RPC1, ...)."""
        return bool(self.offloaded) and any(d.startswith("RPC") for d in self.devices)

    def __str__(self) -> str:
        if not self.offloaded:
            return "CPU"
        return f"{', '.join(self.devices)}: {self.offloaded}/{self.n_layers} layers offloaded"


# ------------------------------------------------------------------------------------------------
# llama.cpp's log → Python logging. The callback is process-wide and llama-cpp-python installs its own
# at import (Llama(verbose=...) steers it), so importing this module leaves it alone: only an
# application that asks (the CLI's setup_logging) calls install_log_callback().
# ------------------------------------------------------------------------------------------------

log = logging.getLogger("eagle3_gguf.llama_cpp")
log.addHandler(logging.NullHandler())
log.propagate = False  # silent by default; enable_llama_log() opts in

# enum ggml_log_level { NONE = 0, INFO = 1, WARN = 2, ERROR = 3, DEBUG = 4, CONT = 5 };
_GGML_TO_LOGGING = {0: logging.CRITICAL, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR,
                    4: logging.DEBUG}
_log_state = {"level": logging.INFO, "line": ""}


@C.llama_log_callback
def _log_callback(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    if level != 5:
        _log_state["level"] = _GGML_TO_LOGGING.get(level, logging.INFO)
    _log_state["line"] += text.decode("utf-8", errors="replace")
    if _log_state["line"].endswith("\n"):
        line, _log_state["line"] = _log_state["line"].rstrip("\n"), ""
        log.log(_log_state["level"], "%s", line)


def install_log_callback() -> None:
    """Route llama.cpp's (and ggml's) log into the `eagle3_gguf.llama_cpp` logger."""
    C.llama_log_set(_log_callback, ctypes.c_void_p(0))


def enable_llama_log(enabled: bool = True) -> None:
    """Let llama.cpp's log through to the application's handlers (the CLI's `-v`)."""
    log.propagate = enabled
    log.setLevel(logging.DEBUG if enabled else logging.CRITICAL)


def default_threads() -> int:
    """Threads for llama.cpp: every core on small machines, half of them (physical cores) on big ones."""
    n = os.cpu_count() or 1
    return n if n <= 4 else n // 2


# ------------------------------------------------------------------------------------------------
# KV cache types and batch invariance
# ------------------------------------------------------------------------------------------------

# llama.cpp's -ctk/-ctv names -> enum ggml_type (the gguf package's copy of the enum)
CACHE_TYPES = {name: int(GGMLQuantizationType[name.upper()])
               for name in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")}
_F16, _F32 = CACHE_TYPES["f16"], CACHE_TYPES["f32"]


def flash_attn_type(enabled: bool) -> int:
    """llama.cpp's flash_attn_type for on / off."""
    return C.LLAMA_FLASH_ATTN_TYPE_ENABLED if enabled else C.LLAMA_FLASH_ATTN_TYPE_DISABLED


@functools.cache
def backend_fingerprint() -> str:
    """A short digest of llama.cpp's backends and CPU features in this process (they change row costs)."""
    return hashlib.sha256(C.llama_print_system_info() or b"").hexdigest()[:12]


def _type_name(t: int) -> str:
    return next((n for n, v in CACHE_TYPES.items() if v == t), str(t))


def cache_type(name: str) -> int:
    """The ggml type for a KV cache type name, as llama.cpp's --cache-type-k/-v take it."""
    if name not in CACHE_TYPES:
        raise Eagle3Error(f"unknown KV cache type '{name}' (one of: {', '.join(CACHE_TYPES)})")
    return CACHE_TYPES[name]


def batch_invariant_cache(type_k: int, type_v: int) -> bool:
    """Whether ggml-cpu's flash attention computes a lone query row exactly as it computes one row of
    a verify batch, for these cache types. At the pin it does not when K and V are both f16 (an f32
    cache is cast to f16 first, llama-graph.cpp): a single row with 512+ KV cells then takes the
    split-KV path (`use_split_kv_path`, ggml-cpu/ops.cpp: KV chunks per thread and a reduction of the
    partial softmaxes) while batch rows are computed whole, so the logits differ in the last bits.
    Any other pairing (bf16 V, quantized caches, K type != V type) takes the whole-row path alike."""
    def seen(t: int) -> int:
        return _F16 if t == _F32 else t
    return not (seen(type_k) == seen(type_v) == _F16)


# ------------------------------------------------------------------------------------------------
# Owner classes
# ------------------------------------------------------------------------------------------------


class _Owner:
    """Frees its C handle once, in close(); usable as a context manager."""

    ptr = None

    def close(self) -> None:
        if self.ptr:
            self._free(self.ptr)
        self.ptr = None

    def _free(self, ptr) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass

    def _live(self):
        if not self.ptr:
            raise Eagle3Error(f"{type(self).__name__} is closed")
        return self.ptr


class Model(_Owner):
    """A llama_model loaded from a GGUF file."""

    def __init__(self, path: str | Path, *, n_gpu_layers: int = 0, use_mmap: bool = True, borrowed=None,
                 devices: list[int] | None = None, repack: bool = True, tensor_split: tuple[float, ...] = ()):
        """borrowed: a llama_model someone else owns (llama_cpp.Llama's) to wrap; close() won't free it.
        devices: the ggml devices its offloaded layers may use (llama_model_params.devices; [] = none),
        None for llama.cpp's default (every GPU, and every RPC server registered). repack: let llama.cpp
        repack weights for its CPU kernels (llama_model_params.use_extra_bufts, its default; --no-repack).
        tensor_split: the offloaded layers' proportions per device, as llama.cpp's --tensor-split (() = its own)."""
        self.path = Path(path)
        self.n_gpu_layers = n_gpu_layers
        self.repack = repack  # as asked: a borrowed model's is its owner's
        self._owned = borrowed is None
        ptr = borrowed
        if ptr is None:
            if not self.path.is_file():
                raise Eagle3Error(f"{self.path}: no such file")
            params = C.llama_model_default_params()
            params.n_gpu_layers = n_gpu_layers
            params.use_mmap = use_mmap
            params.use_extra_bufts = repack
            if devices is not None:
                listed = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)  # NULL-terminated
                params.devices = ctypes.addressof(listed)  # a void * field in llama-cpp-python's struct
            if len(tensor_split) > C.llama_max_devices():
                raise Eagle3Error(f"--tensor-split: {len(tensor_split)} proportions, but llama.cpp places layers on "
                                  f"{C.llama_max_devices()} devices at most")
            if tensor_split:  # llama.cpp reads one float per device it may use, up to llama_max_devices()
                split = (ctypes.c_float * C.llama_max_devices())(*tensor_split)
                params.tensor_split = ctypes.cast(split, ctypes.POINTER(ctypes.c_float))
            ptr = C.llama_model_load_from_file(str(self.path).encode(), params)
            if not ptr:
                raise Eagle3Error(f"{self.path}: llama.cpp could not load it (run with -v to see why)")
        self.ptr = ptr
        self.vocab = C.llama_model_get_vocab(ptr)

    def _free(self, ptr) -> None:
        if self._owned:
            C.llama_model_free(ptr)

    @functools.cached_property
    def n_embd(self) -> int:
        return C.llama_model_n_embd(self._live())

    @functools.cached_property
    def n_layer(self) -> int:
        return C.llama_model_n_layer(self._live())

    @functools.cached_property
    def n_vocab(self) -> int:
        return C.llama_vocab_n_tokens(self.vocab)

    @property
    def arch(self) -> str:
        return self.meta(keys.KEY_ARCHITECTURE) or ""

    @functools.cached_property
    def placement(self) -> Placement:
        """Where it runs (n_gpu_layers < 0: every layer offloaded, as llama.cpp reads it)."""
        ptr = self._live()
        devices = []
        for i in range(llama_model_n_devices(ptr)):
            dev = llama_model_get_device(ptr, i)
            if dev and _GGML_BASE is not None:
                name = _GGML_BASE.ggml_backend_dev_name(dev).decode(errors="replace")
                devices.append(f"{name} ({_GGML_BASE.ggml_backend_dev_description(dev).decode(errors='replace')})")
            elif dev:
                devices.append(f"device {i}")
        n_layers = self.n_layer + 1
        wanted = n_layers if self.n_gpu_layers < 0 else self.n_gpu_layers
        return Placement(tuple(devices), min(wanted, n_layers) if devices else 0, n_layers)

    def meta(self, key: str) -> str | None:
        """A metadata value as llama.cpp renders it, or None when absent."""
        buf = ctypes.create_string_buffer(4096)
        n = C.llama_model_meta_val_str(self._live(), key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", errors="replace")

    def target_layer_ids(self) -> list[int]:
        """An EAGLE-3 head's extract layers (input-of-layer ids); empty for other models."""
        require_ext()
        n = llama_model_target_layer_ids_n(self._live())
        ids = llama_model_target_layer_ids(self.ptr)
        return [int(ids[i]) for i in range(n)] if n and ids else []

    def chat_template(self) -> str | None:
        tmpl = C.llama_model_chat_template(self._live(), None)
        return tmpl.decode("utf-8") if tmpl else None


NO_LOGITS = "no logits: this context samples greedily in the graph (set_greedy_sampling)"


class Context(_Owner):
    """A llama_context; `ctx_other` pairs an EAGLE-3 head with its target."""

    def __init__(self, model: Model, *, n_ctx: int = 2048, n_batch: int = 512, n_ubatch: int | None = None,
                 n_threads: int | None = None, ctx_other: "Context | None" = None, n_seq_max: int = 1,
                 kv_unified: bool = True, type_k: int | None = None, type_v: int | None = None,
                 flash_attn: int | None = None, borrowed=None, capture=None):
        """kv_unified=False gives every sequence its own KV stream (n_ctx / n_seq_max cells): a row attends
        over its own sequence only, but llama.cpp then orders a batch's rows by sequence id in its ubatches
        (so layer-input rows come out in that order: keep batches sorted by sequence). type_k/type_v: the
        KV cache's ggml types (`cache_type`); llama.cpp's default is f16 for both. flash_attn: llama.cpp's
        flash_attn_type (default: auto). borrowed: a llama_context someone else owns (`llama_cpp.Llama._ctx.ctx`)
        to wrap, made with these settings; close() won't free it. capture: a capture.LayerCapture whose eval
        callback gives the layer inputs of a graph without llama.cpp's hook (set_layer_inp then reads it)."""
        self.model = model
        self.ctx_other = ctx_other  # keeps the target alive while the head borrows from it
        threads = n_threads or default_threads()
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
        # what the cost of a row depends on besides the files and threads (policy.CostKey)
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
        # how this context's graphs are called: runner(graph_call) in this thread by default; slots.Engine
        # passes its own, which runs every graph on one thread
        self.runner: Callable[..., int] | None = None
        self.t_native = 0.0  # seconds spent inside llama_decode / llama_process (for overhead figures)
        self._views: dict[tuple, np.ndarray] = {}
        self._layer_inp: set[int] = set()
        self._nextn = False
        self._decoded = False
        self._greedy: GreedySampler | None = None

    def _free(self, ptr) -> None:
        if self._owned:
            C.llama_free(ptr)
        if self._greedy is not None:  # after the context: it held the sampler
            self._greedy.close()
            self._greedy = None

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

    def decode(self, batch: "Batch") -> None:
        rc = self._run(C.llama_decode, batch.struct)
        if rc != 0:
            raise Eagle3Error(f"llama_decode failed (rc={rc}): the context may be full (raise -c)")

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

    # -- greedy sampling inside the graph ----------------------------------------------------------
    @property
    def owned(self) -> bool:
        """Made here (not borrowed from llama_cpp.Llama)."""
        return self._owned

    @property
    def greedy_sampling(self) -> bool:
        return self._greedy is not None

    def set_greedy_sampling(self, enabled: bool) -> bool:
        """Let the graph take each output row's argmax (llama.cpp's backend sampling, sequence 0) instead of
        handing the logits back: the rows' logits are then neither copied out nor read (logits() raises), and
        sampled_token(i) gives the choices. On a GPU it saves the device-to-host copy of every verify row; on a
        CPU ggml's argmax costs more than the copy and numpy's argmax (decode.greedy_in_graph decides). Only on a
        context made here: a borrowed one's owner reads the logits itself. Returns whether it is on: False
        where the backend cannot run the sampler (llama.cpp then keeps handing back logits)."""
        if enabled == self.greedy_sampling:
            return enabled
        if not self._owned:
            raise Eagle3Error("greedy sampling in the graph needs a context eagle3-gguf made, not a borrowed one")
        if enabled:
            smpl = GreedySampler()
            # LLAMA_API bool llama_set_sampler(struct llama_context * ctx, llama_seq_id seq_id, struct llama_sampler * smpl);
            if not C.llama_set_sampler(self._live(), 0, smpl.ptr):
                smpl.close()
                return False
            self._greedy = smpl
        else:
            C.llama_set_sampler(self._live(), 0, None)
            self._greedy.close()
            self._greedy = None
        return enabled

    def sampled_token(self, i: int) -> int:
        """The graph's choice (argmax) at batch row i of the last decode (set_greedy_sampling on)."""
        tok = C.llama_get_sampled_token_ith(self._live(), i)
        if tok < 0:
            raise Eagle3Error(f"no sampled token for batch row {i}: set_greedy_sampling(True) before the decode")
        return tok

    def logits(self, n_rows: int) -> np.ndarray:
        """The output rows of the last decode, in batch order.  # [n_rows, n_vocab] (view)"""
        if self._greedy is not None:
            raise Eagle3Error(NO_LOGITS)
        addr = llama_get_logits_addr(self._live())
        if not addr:
            raise Eagle3Error("no logits: the last batch requested none")
        return self._view(addr, (n_rows, self.model.n_vocab))

    def logits_ith(self, i: int) -> np.ndarray:
        if self._greedy is not None:
            raise Eagle3Error(NO_LOGITS)
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


class GreedySampler(_Owner):
    """A sampler chain holding llama.cpp's greedy sampler, for Context.set_greedy_sampling."""

    def __init__(self):
        # LLAMA_API struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
        ptr = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        if not ptr:
            raise Eagle3Error("llama_sampler_chain_init failed")
        self.ptr = ptr
        # LLAMA_API void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
        C.llama_sampler_chain_add(ptr, C.llama_sampler_init_greedy())  # the chain owns it

    def _free(self, ptr) -> None:
        C.llama_sampler_free(ptr)


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

    def set_embd(self, rows: np.ndarray, pos, tokens=None, seq_ids=None) -> int:
        """Embedding rows (with tokens: token + embedding entries) at positions `pos`, every row an output
        (the pinned eagle3 graphs have no output-row selection), of sequence 0 or of `seq_ids` (one a row).
        # rows: [n, n_embd]; pos, tokens, seq_ids: [n]"""
        n = rows.shape[0]
        self._fit(n)
        if rows.shape[1] != self.n_embd:
            raise Eagle3Error(f"embedding rows of width {rows.shape[1]} in a batch of width {self.n_embd}")
        self._embd[:n] = rows
        self._pos[:n] = pos
        self._logits[:n] = 1
        if tokens is not None:
            self._token[:n] = tokens
        if seq_ids is not None:
            self._seq[:n] = seq_ids
            self._n_seq[:n] = 1
        self._point("both" if tokens is not None else "embd", n, seq_ids=seq_ids is not None)
        return n

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
