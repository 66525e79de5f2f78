"""Read a GGUF's metadata and tensor table in pure Python, before any C call can abort on it.

`read_gguf_metadata` parses the header, key/values and tensor table through mmap, keeping token
strings as raw bytes: ~50x faster than gguf.GGUFReader on a 49k-token vocab. `read_gguf` turns every
way a file can be wrong (missing, not a GGUF, truncated) into one `Eagle3Error` line. `TargetInfo` and
`HeadInfo` are what the pair check, `info`, the converter and the trainer need to know about the two kinds
of file, each read from the GGUF once (`from_gguf`) and passed along. `HeadGeometry` (`check_head`) is what the
pinned eagle3 graph assumes of a head's numbers and tensors, checked by `HeadInfo` and by the converter alike.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GT
from gguf import GGUFValueType as VT

from . import keys
from .errors import Eagle3Error

GGUF_MAGIC = b"GGUF"


@dataclass
class KeyValue:
    key: str
    value: Any
    vtype: VT
    sub_type: VT | None = None


def tensor_bytes(shape: list[int], t: GT) -> int:
    """Stored bytes of a tensor of GGUF shape `shape` (ne[0] = row length first) and type `t`."""
    block, size = GGML_QUANT_SIZES[t]
    n = 1
    for d in shape:  # Python ints: a corrupt shape cannot wrap around
        n *= int(d)
    return n // block * size


# ------------------------------------------------------------------------------------------------
# Fast metadata reader
# ------------------------------------------------------------------------------------------------

_SCALARS = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
            VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}


@dataclass
class TensorInfo:
    name: str
    shape: list[int]  # GGUF order: ne[0] (the row length) first
    ggml_type: GT
    offset: int  # absolute file offset of its data


@dataclass
class GGUFMetadata:
    path: Path
    kvs: list[KeyValue]  # in file order, typed as stored
    tensors: list[TensorInfo]

    def tensor(self, name: str) -> TensorInfo | None:
        return next((t for t in self.tensors if t.name == name), None)

    def tensor_data(self, name: str) -> np.ndarray:
        """A tensor's stored bytes, shaped [rows, row bytes] (reads only that range)."""
        t = self.tensor(name)
        if t is None:
            raise KeyError(name)
        return read_tensor_data(self.path, t)

    def get(self, key: str, default: Any = None) -> Any:
        return next((kv.value for kv in self.kvs if kv.key == key), default)

    def as_dict(self) -> dict[str, Any]:
        return {kv.key: kv.value for kv in self.kvs}


def read_tensor_data(path: Path, t: TensorInfo) -> np.ndarray:
    """The stored bytes of tensor `t` of the GGUF at `path`, shaped [rows, row bytes] (reads only that range)."""
    row = tensor_bytes([t.shape[0]], t.ggml_type)
    rows = int(np.prod(t.shape[1:], dtype=np.int64)) if len(t.shape) > 1 else 1
    with open(path, "rb") as f:
        f.seek(t.offset)
        raw = f.read(row * rows)
    return _rows_of(path, t, raw, rows, row)


def read_tensor_rows(path: Path, t: TensorInfo, rows: np.ndarray) -> np.ndarray:
    """The stored bytes of the given rows of tensor `t` (a row: its first dimension), read one by one.
    # rows: [n] -> [n, row bytes]"""
    row = tensor_bytes([t.shape[0]], t.ggml_type)
    raw = bytearray()
    with open(path, "rb") as f:
        for r in rows:
            f.seek(t.offset + int(r) * row)
            raw += f.read(row)
    return _rows_of(path, t, bytes(raw), len(rows), row)


def _rows_of(path: Path, t: TensorInfo, raw: bytes, rows: int, row: int) -> np.ndarray:
    if len(raw) != row * rows:
        raise Eagle3Error(f"{path}: truncated GGUF (tensor '{t.name}' runs past the end)")
    return np.frombuffer(raw, dtype=np.uint8).reshape(rows, row)


class _Cursor:
    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def raw_string(self) -> bytes:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("string runs past the end of the file")
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s

    def string(self) -> str | bytes:
        raw = self.raw_string()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw

    def value(self, vtype: VT, in_array: bool = False) -> tuple[Any, VT | None]:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype]), None
        if vtype == VT.STRING:
            return (self.raw_string() if in_array else self.string()), None
        if vtype == VT.ARRAY:
            sub, n = VT(self.unpack("<I")), self.unpack("<Q")
            if sub in _SCALARS:
                fmt = _SCALARS[sub]
                size = struct.calcsize(fmt) * n
                if self.pos + size > len(self.buf):
                    raise ValueError("array runs past the end of the file")
                values = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=n, offset=self.pos).tolist()
                self.pos += size
                return values, sub
            return [self.value(sub, in_array=True)[0] for _ in range(n)], sub
        raise ValueError(f"unknown value type {vtype}")


GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64
INT64_MAX = 2**63 - 1


def _corrupt(path: Path, detail: str) -> Eagle3Error:
    return Eagle3Error(f"{path}: corrupt GGUF ({detail}): download or convert it again")


def _check_table(path: Path, kvs: list[KeyValue], infos: list[tuple[str, list[int], GT, int]]) -> int:
    """The checks llama.cpp's gguf loader makes, so that every file it would refuse is refused here first,
    with one line: unique non-empty keys, a u32 power-of-2 alignment, unique tensor names shorter than
    GGML_MAX_NAME, at most 4 dims, none negative, no overflow, rows a whole number of blocks, offsets laid
    out one after the other. Returns the alignment."""
    seen: set[str] = set()
    for kv in kvs:
        if not kv.key:
            raise _corrupt(path, "a metadata key is empty")
        if kv.key in seen:
            raise _corrupt(path, f"duplicate metadata key '{kv.key}'")
        seen.add(kv.key)
    align_kv = next((kv for kv in kvs if kv.key == keys.KEY_ALIGNMENT), None)
    align = 32
    if align_kv is not None:
        if align_kv.vtype != VT.UINT32:
            raise _corrupt(path, f"{keys.KEY_ALIGNMENT} must be a UINT32, not {align_kv.vtype.name}")
        align = int(align_kv.value)
        if align <= 0 or align & (align - 1):
            raise _corrupt(path, f"{keys.KEY_ALIGNMENT} {align} is not a power of 2")
    names: set[str] = set()
    expected = 0
    for name, shape, t, off in infos:
        if len(name.encode("utf-8", "surrogateescape")) >= GGML_MAX_NAME:
            raise _corrupt(path, f"tensor name '{name[:80]}' is too long")
        if name in names:
            raise _corrupt(path, f"duplicate tensor '{name}'")
        names.add(name)
        if len(shape) > GGML_MAX_DIMS:
            raise _corrupt(path, f"tensor '{name}' has {len(shape)} dimensions (at most {GGML_MAX_DIMS})")
        if any(d > INT64_MAX for d in shape):
            raise _corrupt(path, f"tensor '{name}' has a negative dimension")
        n = 1
        for d in shape:
            n *= d
        if n > INT64_MAX:
            raise _corrupt(path, f"tensor '{name}' shape {shape} overflows")
        if t not in GGML_QUANT_SIZES:
            raise _corrupt(path, f"tensor '{name}' has ggml type {t.name}, which this reader does not know")
        block, size = GGML_QUANT_SIZES[t]
        if shape and shape[0] % block:
            raise _corrupt(path, f"tensor '{name}' rows of {shape[0]} are not a multiple of {t.name}'s block of {block}")
        if off != expected:
            raise _corrupt(path, f"tensor '{name}' data at offset {off}, expected {expected}")
        expected += -(-(n // block * size) // align) * align
    return align


def read_gguf_metadata(path: str | Path) -> GGUFMetadata:
    """Header + key/values of a GGUF (tensor data untouched); Eagle3Error if it is not a valid GGUF."""
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            cur = _Cursor(mm)
            if bytes(mm[:4]) != GGUF_MAGIC:
                raise Eagle3Error(f"{path}: not a GGUF file (expected magic 'GGUF', found {bytes(mm[:4])!r})")
            cur.pos = 4
            version, n_tensors, n_kv = cur.unpack("<I"), cur.unpack("<Q"), cur.unpack("<Q")
            if version not in (2, 3):
                swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
                raise Eagle3Error(f"{path}: a big-endian GGUF (version {swapped}): llama.cpp reads little-endian "
                                  "ones here (gguf-convert-endian converts it)" if swapped in (2, 3) else
                                  f"{path}: unsupported GGUF version {version}")
            kvs = []
            for _ in range(n_kv):
                key = cur.string()
                vtype = VT(cur.unpack("<I"))
                value, sub = cur.value(vtype)
                kvs.append(KeyValue(key if isinstance(key, str) else key.decode("utf-8", "replace"), value, vtype, sub))
            infos = []
            for _ in range(n_tensors):
                name = cur.raw_string().decode("utf-8", "replace")
                n_dims = cur.unpack("<I")
                shape = [cur.unpack("<Q") for _ in range(n_dims)]
                infos.append((name, shape, GT(cur.unpack("<I")), cur.unpack("<Q")))
            align = _check_table(path, kvs, infos)
            data_start = -(-cur.pos // align) * align
    except Eagle3Error:
        raise
    except struct.error:  # a read past the end of the header
        raise _corrupt(path, "its header ends early: the file is cut short") from None
    except ValueError as e:
        raise _corrupt(path, f"{e}") from None
    except OSError as e:
        raise Eagle3Error(f"{path}: cannot read ({e.strerror or e})") from None
    tensors = [TensorInfo(name, shape, t, data_start + off) for name, shape, t, off in infos]
    return GGUFMetadata(path, kvs, tensors)


@dataclass
class TensorEntry:
    name: str
    shape: list[int]  # GGUF order (ne[0] first: the row length)
    type: str  # ggml type name: F32, F16, Q4_0, I64, ...
    n_bytes: int


@dataclass
class GGUFFile:
    path: Path
    arch: str
    metadata: dict[str, Any]
    tensors: list[TensorEntry]
    file_size: int
    raw: "GGUFMetadata"  # typed key/values and tensor offsets, for copying and reading data

    def get(self, template: str, default: Any = None) -> Any:
        """A metadata value; `{arch}` in the key is filled with this file's architecture."""
        return self.metadata.get(keys.arch_key(template, self.arch), default)

    def tensor(self, name: str) -> TensorEntry | None:
        return next((t for t in self.tensors if t.name == name), None)

    @property
    def n_vocab(self) -> int:
        return metadata_vocab(self.metadata, self.arch)


def metadata_vocab(metadata: dict[str, Any], arch: str) -> int:
    """The vocabulary llama.cpp loads for a GGUF with this metadata: its tokenizer tokens (else {arch}.vocab_size)."""
    tokens = metadata.get(keys.KEY_TOKENIZER_TOKENS)
    if tokens is not None:
        return len(tokens)
    return int(metadata.get(keys.arch_key(keys.KEY_VOCAB_SIZE, arch), 0))


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF's header, metadata and tensor table; raise Eagle3Error on any defect."""
    path = Path(path)
    if not path.exists():
        raise Eagle3Error(f"{path}: no such file")
    if not path.is_file():
        raise Eagle3Error(f"{path}: not a file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise Eagle3Error(f"{path}: not a GGUF file (expected magic 'GGUF', found {magic!r})")
    meta = read_gguf_metadata(path)
    tensors, data_end = [], 0
    for t in meta.tensors:
        n = tensor_bytes(t.shape, t.ggml_type)
        tensors.append(TensorEntry(t.name, list(t.shape), t.ggml_type.name, n))
        data_end = max(data_end, t.offset + n)
    if data_end > size:
        raise Eagle3Error(f"{path}: truncated GGUF (its tensors end at byte {data_end}, the file has {size}): "
                          "download or convert it again")
    metadata = meta.as_dict()
    arch = metadata.get(keys.KEY_ARCHITECTURE)
    if not isinstance(arch, str):
        raise Eagle3Error(f"{path}: GGUF has no {keys.KEY_ARCHITECTURE}")
    _check_types(path, meta.kvs, arch)
    return GGUFFile(path, arch, metadata, tensors, size, meta)


_INTS = frozenset({VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64})
_FLOATS = frozenset({VT.FLOAT32, VT.FLOAT64})
# What the keys this package reads must hold: "int" a non-negative integer, "ints" an array of them,
# "int|ints" either (per-layer values), "bool", "floats" an array of floats, "strings" an array of strings, "eps" a
# finite float of at least 0 (llama.cpp's norms assert eps >= 0: a NaN or negative one is a GGML abort).
_KEY_KINDS = {
    keys.KEY_CONTEXT_LENGTH: "int", keys.KEY_EMBEDDING_LENGTH: "int", keys.KEY_BLOCK_COUNT: "int",
    keys.KEY_FEED_FORWARD_LENGTH: "int|ints", keys.KEY_VOCAB_SIZE: "int", keys.KEY_HEAD_COUNT: "int|ints",
    keys.KEY_HEAD_COUNT_KV: "int|ints", keys.KEY_TARGET_LAYERS: "ints", keys.KEY_TARGET_HIDDEN_SIZE: "int",
    keys.KEY_NORM_BEFORE_RESIDUAL: "bool", keys.KEY_NORM_BEFORE_FC: "bool", keys.KEY_FC_NORM: "bool",
    keys.KEY_NORM_OUTPUT: "bool", keys.KEY_FC_NORM_WEIGHT: "floats", keys.KEY_TOKENIZER_TOKENS: "strings",
    keys.KEY_NAME: "string", keys.KEY_CHAT_TEMPLATE: "string", keys.KEY_KEY_LENGTH: "int", keys.KEY_VALUE_LENGTH: "int",
    keys.KEY_ROPE_DIMENSION_COUNT: "int", keys.KEY_ROPE_SCALING_TYPE: "string", keys.KEY_RMS_EPS: "eps",
    keys.KEY_NORM_EPS: "eps", keys.KEY_SLIDING_WINDOW: "int",
}


def _kind_ok(kv: KeyValue, kind: str) -> bool:
    if kind == "int":
        return kv.vtype in _INTS and kv.value >= 0
    if kind == "ints":
        return kv.vtype == VT.ARRAY and kv.sub_type in _INTS
    if kind == "int|ints":
        return _kind_ok(kv, "int") or (_kind_ok(kv, "ints") and len(kv.value) > 0 and all(v >= 0 for v in kv.value))
    if kind == "bool":
        return kv.vtype == VT.BOOL
    if kind == "floats":
        return kv.vtype == VT.ARRAY and kv.sub_type in _FLOATS
    if kind == "strings":
        return kv.vtype == VT.ARRAY and kv.sub_type == VT.STRING
    if kind == "eps":
        return kv.vtype in _FLOATS and math.isfinite(kv.value) and kv.value >= 0
    return kv.vtype == VT.STRING and isinstance(kv.value, str)


def _check_types(path: Path, kvs: list[KeyValue], arch: str) -> None:
    """Every key this package reads holds the kind of value it must (a corrupt type byte is caught here,
    not as a TypeError further on)."""
    kinds = {keys.arch_key(k, arch): kind for k, kind in _KEY_KINDS.items()}
    for kv in kvs:
        kind = kinds.get(kv.key)
        if kind is not None and not _kind_ok(kv, kind):
            if kv.vtype == VT.STRING and kind == "string":
                raise _corrupt(path, f"metadata {kv.key} is not UTF-8 text")
            if kv.vtype in _FLOATS and kind == "eps":
                raise _corrupt(path, f"metadata {kv.key} is {kv.value}, where llama.cpp's norms need a finite "
                                     "epsilon of at least 0")
            stored = kv.vtype.name + (f" of {kv.sub_type.name}" if kv.sub_type is not None else "")
            expected = "a float" if kind == "eps" else kind.replace('|', ' or ')
            raise _corrupt(path, f"metadata {kv.key} holds {stored}, expected {expected}")


@dataclass
class TargetInfo:
    """A target model as pair, `info`, the converter and the trainer need it, read from its GGUF once
    (`from_gguf`). The converter also makes one from a HF config.json (kind "config.json"): that one has
    no llama hparams, token_embd or tokenizer."""

    path: Path
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int  # tokenizer tokens (else {arch}.vocab_size)
    hooked: bool  # the pinned llama.cpp can extract its layer inputs
    n_ctx_train: int = 0
    has_chat_template: bool = False
    kind: str = "gguf"  # or "config.json"
    # Llama hparams as stored (a head count or ffn width may be one per layer), None where the GGUF lacks
    # them; the trainer checks and converts them (train.export.read_target, train.model.HeadConfig.for_target)
    n_head: int | list[int] | None = None
    n_head_kv: int | list[int] | None = None  # n_head where the GGUF lacks it
    n_ff: int | list[int] | None = None
    rms_eps: float = 1e-5  # these two: llama's defaults where the GGUF lacks them
    rope_theta: float = 10000.0
    token_embd: TensorInfo | None = None  # [n_embd, n_vocab] (GGUF order), where its data lies in the file
    tokenizer: list[KeyValue] = field(default_factory=list, repr=False, compare=False)  # tokenizer.*, as stored
    tensor_types: frozenset[str] = frozenset()  # ggml type names of its tensors (GGUF files)
    sliding_window: int = 0  # cells its sliding-window layers attend (0: none)
    key_length: int = 0  # a head's K and V widths where the GGUF gives them (else n_embd / n_head)
    value_length: int = 0

    @property
    def repack_exact(self) -> bool:
        """Whether llama.cpp's repacked CPU kernels for its weights keep batch rows equal to lone rows: only
        the types measured so (keys.REPACK_EXACT_TYPES); Q4_K's are not (bench/NOTES.md, capture)."""
        return self.tensor_types <= keys.REPACK_EXACT_TYPES

    @property
    def captured(self) -> bool:
        """No hook, but eagle3_gguf.capture takes its layer inputs from the graph (an eval callback)."""
        return not self.hooked and self.arch in keys.CAPTURED_TARGET_ARCHS

    @property
    def extraction(self) -> str:
        """How its hidden states are read: "hook", "eval callback" or "none"."""
        return "hook" if self.hooked else "eval callback" if self.captured else "none"

    def require_extraction(self) -> None:
        """One Eagle3Error line where neither way reads its hidden states."""
        if self.extraction == "none":
            supported = ", ".join(sorted(keys.HOOKED_TARGET_ARCHS | keys.CAPTURED_TARGET_ARCHS))
            raise Eagle3Error(f"{self.path.name}: the pinned llama.cpp cannot extract hidden states from "
                              f"'{self.arch}' models (supported: {supported})")

    def require_hook(self) -> None:
        """One Eagle3Error line where its states are captured: llama-cpp-python's context (the drop-in's,
        serve's) takes no eval callback, so only a context eagle3-gguf makes can read them."""
        if self.captured:
            raise Eagle3Error(f"{self.path.name}: '{self.arch}' targets have no hidden-state hook; eagle3-gguf "
                              "captures them on a context of its own (eagle3-gguf generate), not on llama-cpp-python's")

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "TargetInfo":
        if g.arch == keys.ARCH_EAGLE3:
            raise Eagle3Error(f"{g.path}: this is an EAGLE-3 head, not a target model")
        n_layer = g.get(keys.KEY_BLOCK_COUNT)
        n_embd = g.get(keys.KEY_EMBEDDING_LENGTH)
        if n_layer is None or n_embd is None:
            raise Eagle3Error(f"{g.path}: GGUF lacks {g.arch}.block_count or {g.arch}.embedding_length")
        n_head = g.get(keys.KEY_HEAD_COUNT)
        return cls(g.path, g.arch, int(n_layer), int(n_embd), g.n_vocab, g.arch in keys.HOOKED_TARGET_ARCHS,
                   int(g.get(keys.KEY_CONTEXT_LENGTH, 0)), keys.KEY_CHAT_TEMPLATE in g.metadata,
                   n_head=n_head, n_head_kv=g.get(keys.KEY_HEAD_COUNT_KV, n_head),
                   n_ff=g.get(keys.KEY_FEED_FORWARD_LENGTH), rms_eps=g.get(keys.KEY_RMS_EPS, 1e-5),
                   rope_theta=g.get(keys.KEY_ROPE_FREQ_BASE, 10000.0),
                   token_embd=g.raw.tensor(keys.T_TOKEN_EMBD),
                   tokenizer=[kv for kv in g.raw.kvs if kv.key.startswith(keys.TOKENIZER_PREFIX)],
                   tensor_types=frozenset(t.type for t in g.tensors),
                   sliding_window=int(g.get(keys.KEY_SLIDING_WINDOW, 0)),
                   key_length=int(g.get(keys.KEY_KEY_LENGTH, 0)), value_length=int(g.get(keys.KEY_VALUE_LENGTH, 0)))


@dataclass
class HeadInfo:
    path: Path
    target_layers: list[int]
    target_hidden_size: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int  # the target vocabulary the head's tokenizer (and logits) span
    draft_vocab: int | None  # len(d2t), None when the head drafts over the full vocab
    norm_before_residual: bool
    norm_before_fc: bool
    own_token_embd: bool
    own_output: bool
    tensors: list[TensorEntry] = field(default_factory=list)
    fc_norm: list[int] | None = None  # EAGLE 3.1 per-feature norms: [n_feat, n_embd_tgt] (metadata), or None
    norm_output: bool = False  # EAGLE 3.1: output_norm(h) is fed back as g

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "HeadInfo":
        if g.arch != keys.ARCH_EAGLE3:
            raise Eagle3Error(f"{g.path}: architecture is '{g.arch}', not an EAGLE-3 head ('eagle3')")
        layers = g.get(keys.KEY_TARGET_LAYERS)
        if layers is None or len(layers) != 3:
            raise Eagle3Error(f"{g.path}: eagle3 GGUF needs exactly 3 {keys.arch_key(keys.KEY_TARGET_LAYERS, 'eagle3')}")
        hidden = g.get(keys.KEY_TARGET_HIDDEN_SIZE)
        if hidden is None:
            raise Eagle3Error(f"{g.path}: eagle3 GGUF lacks {keys.arch_key(keys.KEY_TARGET_HIDDEN_SIZE, 'eagle3')}")
        geo = check_head(g.path, g.metadata, g.tensors)
        d2t = g.tensor(keys.T_D2T)
        return cls(
            g.path, [int(x) for x in layers], int(hidden), geo.n_embd, geo.n_head, geo.n_head_kv, geo.n_ff, g.n_vocab,
            d2t.shape[0] if d2t else None,
            bool(g.get(keys.KEY_NORM_BEFORE_RESIDUAL, False)), bool(g.get(keys.KEY_NORM_BEFORE_FC, False)),
            g.tensor(keys.T_TOKEN_EMBD) is not None, g.tensor(keys.T_OUTPUT) is not None, g.tensors,
            fc_norm=_fc_norm_shape(g, len(layers), int(hidden)),
            norm_output=bool(g.metadata.get(keys.KEY_NORM_OUTPUT, False)),
        )


def _fc_norm_shape(g: GGUFFile, n_feat: int, n_embd_tgt: int) -> list[int] | None:
    """[n_feat, n_embd_tgt] when the head carries EAGLE 3.1 fc_norm weights (checked), else None."""
    if not g.metadata.get(keys.KEY_FC_NORM, False):
        return None
    weights = g.metadata.get(keys.KEY_FC_NORM_WEIGHT)
    if not isinstance(weights, list) or len(weights) != n_feat * n_embd_tgt:
        got = len(weights) if isinstance(weights, list) else "no"
        raise Eagle3Error(f"{g.path}: {keys.KEY_FC_NORM} is set but {keys.KEY_FC_NORM_WEIGHT} holds {got} values, "
                          f"expected {n_feat} x {n_embd_tgt}: convert the head again")
    return [n_feat, n_embd_tgt]


# ------------------------------------------------------------------------------------------------
# The geometry of an eagle3 head
# ------------------------------------------------------------------------------------------------

FIX_HEAD = "convert the head again"
# llama.cpp's LLAMA_ROPE_SCALING_TYPES: its loader aborts (GGML_ASSERT) on any other name
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
# ggml types the eagle3 graph's weights cannot be: its products and norms take floats and quantized blocks (an
# integer or F64 matrix crashed llama.cpp's CPU backend); d2t alone is I64
NOT_WEIGHT_TYPES = frozenset({"I8", "I16", "I32", "I64", "F64"})


@dataclass
class ExpectedShape:
    dims: list[int]  # GGUF order: ne[0] (the row length) first
    meaning: str  # what fixes them, e.g. "[2 x hidden 64, 4 heads x head_dim 16]"


@dataclass
class HeadGeometry:
    """The numbers the pinned eagle3 graph (src/models/eagle3.cpp) builds a head from, with the one description
    of what it assumes of them (`check`) and of every tensor (`shapes`, `check_tensors`). llama.cpp refuses some
    mismatches and aborts (GGML_ASSERT) on others, so each is refused here first, in one line: by the loader on
    a head GGUF's header (`check_head`), by the converter on a checkpoint's config and on the GGUF it is about
    to write."""

    n_layer: int  # block_count: the graph asserts exactly one decoder layer
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int  # attention.key_length, else n_embd // n_head (as llama.cpp derives it)
    head_dim_v: int  # attention.value_length, else as head_dim
    n_rot: int  # rope.dimension_count, else head_dim
    n_ff: int
    n_embd_tgt: int  # the target's hidden size: fc reads n_feat features of it
    n_feat: int  # 3 in a GGUF; a checkpoint may read fewer (the converter pads them)
    norm_before_fc: bool = False
    rope_scaling: str | None = None  # rope.scaling.type, as stored

    @classmethod
    def from_metadata(cls, where: Path, metadata: dict[str, Any], fix: str = FIX_HEAD) -> "HeadGeometry":
        """As llama.cpp's loader reads them (its defaults where a key is absent); the types are checked already
        (read_gguf's _check_types)."""
        a = lambda template: keys.arch_key(template, keys.ARCH_EAGLE3)  # noqa: E731

        def count(template: str, default: int = 0) -> int:
            value = metadata.get(a(template), default)
            if isinstance(value, list):  # one value per layer, as llama.cpp allows: a one-layer head has one
                if len(value) != 1:
                    raise Eagle3Error(f"{where}: {a(template)} holds {len(value)} values; a one-layer head has "
                                      f"one: {fix}")
                value = value[0]
            return int(value)

        n_embd, n_head = count(keys.KEY_EMBEDDING_LENGTH), count(keys.KEY_HEAD_COUNT)
        head_dim = count(keys.KEY_KEY_LENGTH, n_embd // n_head if n_head else 0)
        return cls(n_layer=count(keys.KEY_BLOCK_COUNT), n_embd=n_embd, n_head=n_head,
                   n_head_kv=count(keys.KEY_HEAD_COUNT_KV, n_head), head_dim=head_dim,
                   head_dim_v=count(keys.KEY_VALUE_LENGTH, n_embd // n_head if n_head else 0),
                   n_rot=count(keys.KEY_ROPE_DIMENSION_COUNT, head_dim), n_ff=count(keys.KEY_FEED_FORWARD_LENGTH),
                   n_embd_tgt=count(keys.KEY_TARGET_HIDDEN_SIZE),
                   n_feat=len(metadata.get(a(keys.KEY_TARGET_LAYERS), [])),
                   norm_before_fc=bool(metadata.get(a(keys.KEY_NORM_BEFORE_FC), False)),
                   rope_scaling=metadata.get(a(keys.KEY_ROPE_SCALING_TYPE)))

    def check(self, where: Path, fix: str = FIX_HEAD) -> None:
        """One Eagle3Error line for the first number the graph cannot run with."""
        if self.n_layer != 1:
            raise Eagle3Error(f"{where}: {self.n_layer} decoder layers; the pinned llama.cpp eagle3 graph runs "
                              f"exactly one: {fix}")
        for what, value in (("hidden size", self.n_embd), ("attention head count", self.n_head),
                            ("KV head count", self.n_head_kv), ("head size (head_dim)", self.head_dim),
                            ("feed-forward width", self.n_ff), ("target hidden size", self.n_embd_tgt)):
            if value < 1:
                raise Eagle3Error(f"{where}: {what} is {value}; the eagle3 graph needs at least 1: {fix}")
        if self.n_head % self.n_head_kv:
            raise Eagle3Error(f"{where}: {self.n_head} attention heads are not a multiple of {self.n_head_kv} KV "
                              f"heads, which llama.cpp's grouped-query attention needs (it aborts): {fix}")
        if self.head_dim_v != self.head_dim:
            raise Eagle3Error(f"{where}: value head size {self.head_dim_v} differs from key head size "
                              f"{self.head_dim}; the pinned eagle3 graph needs them equal: {fix}")
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            raise Eagle3Error(f"{where}: RoPE turns {self.n_rot} dimensions of each {self.head_dim}-wide head; "
                              f"llama.cpp needs an even number, at most the head size (it aborts): {fix}")
        if self.rope_scaling is not None and self.rope_scaling not in ROPE_SCALING_TYPES:
            raise Eagle3Error(f"{where}: RoPE scaling type {self.rope_scaling!r} is not one llama.cpp knows "
                              f"({', '.join(ROPE_SCALING_TYPES)}): {fix}")

    def shapes(self) -> dict[str, ExpectedShape]:
        """Every tensor these numbers fix (load_arch_tensors' shapes, by GGUF name); rope_freqs is optional."""
        e, hd = self.n_embd, self.head_dim
        hidden, ff = f"hidden {e}", f"feed-forward {self.n_ff}"
        q, kv = f"{self.n_head} heads x head_dim {hd}", f"{self.n_head_kv} KV heads x head_dim {hd}"
        feats = f"{self.n_feat} target layers x target hidden {self.n_embd_tgt}"
        shapes = {keys.T_FC: ExpectedShape([self.n_feat * self.n_embd_tgt, e], f"[{feats}, {hidden}]")}
        if self.norm_before_fc:
            shapes[keys.T_ENC_OUTPUT_NORM] = ExpectedShape([self.n_feat * self.n_embd_tgt], f"[{feats}]")
        for name in (keys.T_OUTPUT_NORM, keys.blk(keys.T_ATTN_NORM), keys.blk(keys.T_ATTN_NORM_2),
                     keys.blk(keys.T_FFN_NORM)):
            shapes[name] = ExpectedShape([e], f"[{hidden}]")
        shapes.update({
            keys.blk(keys.T_ATTN_Q): ExpectedShape([2 * e, self.n_head * hd], f"[2 x {hidden}, {q}]"),
            keys.blk(keys.T_ATTN_K): ExpectedShape([2 * e, self.n_head_kv * hd], f"[2 x {hidden}, {kv}]"),
            keys.blk(keys.T_ATTN_V): ExpectedShape([2 * e, self.n_head_kv * hd], f"[2 x {hidden}, {kv}]"),
            keys.blk(keys.T_ATTN_OUT): ExpectedShape([self.n_head * hd, e], f"[{q}, {hidden}]"),
            keys.blk(keys.T_FFN_GATE): ExpectedShape([e, self.n_ff], f"[{hidden}, {ff}]"),
            keys.blk(keys.T_FFN_UP): ExpectedShape([e, self.n_ff], f"[{hidden}, {ff}]"),
            keys.blk(keys.T_FFN_DOWN): ExpectedShape([self.n_ff, e], f"[{ff}, {hidden}]"),
            keys.T_ROPE_FREQS: ExpectedShape([self.n_rot // 2], f"[RoPE dimensions {self.n_rot} / 2]"),
        })
        return shapes

    def check_tensors(self, where: Path, tensors: list[TensorEntry], n_vocab: int, fix: str = FIX_HEAD) -> None:
        """The head's tensor table against these numbers and its vocabulary: each tensor the graph makes, of the
        shape it assumes and, where it asserts one, the type; none it has no place for."""
        table = {t.name: t for t in tensors}
        d2t = table.get(keys.T_D2T)
        if d2t is not None and (len(d2t.shape) != 1 or not d2t.shape[0] or d2t.type != "I64"):
            raise Eagle3Error(f"{where}: d2t is {d2t.type} {d2t.shape}; the eagle3 graph needs a non-empty 1-D I64 "
                              f"map: {fix}")
        rope = table.get(keys.T_ROPE_FREQS)
        if rope is not None and rope.type != "F32":
            raise Eagle3Error(f"{where}: {keys.T_ROPE_FREQS} is {rope.type}; the eagle3 graph needs F32: {fix}")
        vocab = f"draft vocab {d2t.shape[0]} (d2t)" if d2t is not None else f"vocab {n_vocab}"
        expected = {**self.shapes(),
                    keys.T_OUTPUT: ExpectedShape([self.n_embd, d2t.shape[0] if d2t is not None else n_vocab],
                                                 f"[hidden {self.n_embd}, {vocab}]"),
                    keys.T_TOKEN_EMBD: ExpectedShape([self.n_embd, n_vocab],
                                                     f"[hidden {self.n_embd}, vocab {n_vocab}]")}
        optional = {keys.T_OUTPUT, keys.T_TOKEN_EMBD, keys.T_ROPE_FREQS}
        stray = next((name for name in table if name not in expected and name != keys.T_D2T), None)
        if stray is not None:
            raise Eagle3Error(f"{where}: tensor '{stray}' has no place in the eagle3 graph (llama.cpp refuses a file "
                              f"holding it): {fix}")
        for name, shape in expected.items():
            t = table.get(name)
            if t is None and name not in optional:
                raise Eagle3Error(f"{where}: lacks tensor '{name}', which the eagle3 graph needs: {fix}")
            if t is not None and t.type in NOT_WEIGHT_TYPES:
                raise Eagle3Error(f"{where}: tensor '{name}' is {t.type}; the eagle3 graph's weights are floats or "
                                  f"quantized blocks: {fix}")
            if t is not None and _dims(t.shape) != _dims(shape.dims):
                raise Eagle3Error(f"{where}: tensor '{name}' is {t.shape}, expected {shape.dims} = {shape.meaning}: "
                                  f"{fix}")


def _dims(shape: list[int]) -> list[int]:
    """A shape as ggml holds it: trailing dimensions of 1 are the same tensor (llama.cpp's check_tensor_dims)."""
    return list(shape) + [1] * (GGML_MAX_DIMS - len(shape))


def check_head(where: Path, metadata: dict[str, Any], tensors: list[TensorEntry], fix: str = FIX_HEAD) -> HeadGeometry:
    """A head's metadata and tensor table (read from its GGUF, or what the converter is about to write), checked
    against everything the pinned eagle3 graph assumes; returns its geometry."""
    geo = HeadGeometry.from_metadata(where, metadata, fix)
    geo.check(where, fix)
    geo.check_tensors(where, tensors, metadata_vocab(metadata, keys.ARCH_EAGLE3), fix)
    return geo


def tokenizer_kvs(src: str | Path) -> list[KeyValue]:
    """The `tokenizer.*` keys of the GGUF at `src`, typed as stored."""
    meta = read_gguf_metadata(src)
    kvs = [kv for kv in meta.kvs if kv.key.startswith(keys.TOKENIZER_PREFIX)]
    if not any(kv.key == keys.KEY_TOKENIZER_TOKENS for kv in kvs):
        raise Eagle3Error(f"{src}: GGUF carries no tokenizer ({keys.KEY_TOKENIZER_TOKENS})")
    return kvs


def copy_tokenizer(src: str | Path, writer, skip: frozenset[str] = frozenset()) -> int:
    """Copy every `tokenizer.*` key of the GGUF at `src` but those in `skip` into a gguf.GGUFWriter; returns the
    vocab size.

    A head must carry its target's tokenizer: llama.cpp loads a vocab for every model, and the eagle3
    graph scatters draft logits into `vocab.n_tokens()` slots.
    """
    n_vocab = 0
    for kv in tokenizer_kvs(src):
        if kv.key in skip:
            continue
        writer.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
        if kv.key == keys.KEY_TOKENIZER_TOKENS:
            n_vocab = len(kv.value)
    return n_vocab
