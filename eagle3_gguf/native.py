"""ctypes binding: llama.cpp's EAGLE-3 staging API on the libllama that llama_cpp loaded.

llama-cpp-python binds the public C API (llama.h). EAGLE-3 also needs the staging functions of
`src/llama-ext.h`, which are declared without `extern "C"` and so are exported under their
Itanium-mangled names. They are resolved here on `llama_cpp.llama_cpp._lib`, the very library
llama-cpp-python uses, so a context made by `llama_cpp.Llama` and one made here are interchangeable.

Owner classes, one per C handle, free in `close()` (idempotent) and work as context managers: `_Owner`, their
base, and `Model` (llama_model) are here; `Context` (llama_context) is in context.py, `Batch` (llama_batch)
and `BatchExt` (llama_batch_ext) in batch.py.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import llama_cpp
from gguf import GGMLQuantizationType
from llama_cpp import llama_cpp as C

from . import keys
from .cbuild import library
from .errors import Eagle3Error, NativeError

_lib = C._lib
model_p = C.llama_model_p_ctypes

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
    """Raise one clear error if the loaded libllama lacks any EAGLE-3 staging symbol, context.py's included."""
    from . import context  # noqa: F401  (here, not at the top: context.py imports this module; bound on import)

    if _missing:
        raise NativeError(
            f"the loaded libllama lacks {', '.join(_missing)} (llama-cpp-python {llama_cpp.__version__}); "
            f"eagle3-gguf needs llama-cpp-python=={keys.LLAMA_CPP_PYTHON_VERSION}: "
            f"pip install 'llama-cpp-python=={keys.LLAMA_CPP_PYTHON_VERSION}'"
        )


def _address_twin(name: str, argtypes: list) -> Callable:
    """A second ctypes function object for a public llama.h getter (llama_cpp's own keeps its restype),
    returning the address as an int."""
    fn = _lib[name]  # indexing makes a new function object; attribute access would share llama_cpp's
    fn.argtypes = argtypes
    fn.restype = ctypes.c_void_p
    return fn


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

# enum ggml_log_level (ggml.h at the pin) { NONE = 0, DEBUG = 1, INFO = 2, WARN = 3, ERROR = 4, CONT = 5 }
_GGML_TO_LOGGING = {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_log_state = {"level": logging.INFO, "line": ""}


@C.llama_log_callback
def _log_callback(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    if level != 5:
        _log_state["level"] = _GGML_TO_LOGGING.get(level, logging.INFO)
    _log_state["line"] += text.decode("utf-8", errors="replace")
    if _log_state["line"].endswith("\n"):
        line, _log_state["line"] = _log_state["line"].rstrip("\n"), ""
        log.log(_log_state["level"], "%s", line)


class _LogFilter(ctypes.Structure):
    """logfilter.c's `struct logfilter`."""

    _fields_ = [("forward", C.llama_log_callback), ("debug", ctypes.c_int32), ("dropping", ctypes.c_int32)]


_LOG_FILTER_SOURCE = Path(__file__).with_name("logfilter.c")
_log_filter = _LogFilter(forward=_log_callback)  # the C callback's user_data, alive as long as the module


def install_log_callback() -> None:
    """Route llama.cpp's (and ggml's) log into the `eagle3_gguf.llama_cpp` logger. Its DEBUG lines reach Python only
    once enable_llama_log() asks for them: logfilter.c drops them before they cost a call into Python (a few a
    decode on CUDA). Where logfilter.c cannot be built (no C compiler) every line comes through Python."""
    try:
        fn = library(_LOG_FILTER_SOURCE, "filtering llama.cpp's log", _LogFilter).eagle3_logfilter
    except Eagle3Error:
        C.llama_log_set(_log_callback, ctypes.c_void_p(0))
        return
    C.llama_log_set(C.llama_log_callback(ctypes.cast(fn, ctypes.c_void_p).value),
                    ctypes.cast(ctypes.pointer(_log_filter), ctypes.c_void_p))


def enable_llama_log(enabled: bool = True) -> None:
    """Let llama.cpp's log through to the application's handlers (the CLI's `-v`), its DEBUG lines too."""
    log.propagate = enabled
    log.setLevel(logging.DEBUG if enabled else logging.CRITICAL)
    pass_llama_debug(enabled)


def pass_llama_debug(enabled: bool) -> bool:
    """Let llama.cpp's DEBUG lines reach the `eagle3_gguf.llama_cpp` logger (logfilter.c drops them otherwise), e.g.
    while a benchmark reads which buffers a load chose; returns the setting before."""
    before = bool(_log_filter.debug)
    _log_filter.debug = int(enabled)
    return before


def free_memory() -> int | None:
    """Bytes this machine can still give a process (MemAvailable and free swap, Linux), None where not known."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return sum(int(fields[k].split()[0]) * 1024 for k in ("MemAvailable", "SwapFree"))
    except (OSError, KeyError, ValueError, IndexError):
        return None


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
