"""Read a GGUF's metadata and tensor table in pure Python, before any C call can abort on it.

`read_gguf_metadata` parses the header, key/values and tensor table through mmap, keeping token
strings as raw bytes: ~50x faster than gguf.GGUFReader on a 49k-token vocab. `read_gguf` turns every
way a file can be wrong (missing, not a GGUF, truncated) into one `Eagle3Error` line. `TargetInfo` and
`HeadInfo` are what the pair check, `info`, the converter and the trainer need to know about the two kinds
of file, each read from the GGUF once (`from_gguf`) and passed along.
"""

from __future__ import annotations

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
                raise Eagle3Error(f"{path}: unsupported GGUF version {version}")
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
    except (struct.error, ValueError, OSError) as e:
        raise Eagle3Error(f"{path}: not a valid GGUF (truncated or corrupt metadata: {e})") from None
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
        tokens = self.metadata.get(keys.KEY_TOKENIZER_TOKENS)
        if tokens is not None:
            return len(tokens)
        return int(self.get(keys.KEY_VOCAB_SIZE, 0))


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
        raise Eagle3Error(f"{path}: truncated GGUF (tensor data needs {data_end} bytes, the file has {size}): "
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
# "int|ints" either (per-layer values), "bool", "floats" an array of floats, "strings" an array of strings.
_KEY_KINDS = {
    keys.KEY_CONTEXT_LENGTH: "int", keys.KEY_EMBEDDING_LENGTH: "int", keys.KEY_BLOCK_COUNT: "int",
    keys.KEY_FEED_FORWARD_LENGTH: "int|ints", keys.KEY_VOCAB_SIZE: "int", keys.KEY_HEAD_COUNT: "int|ints",
    keys.KEY_HEAD_COUNT_KV: "int|ints", keys.KEY_TARGET_LAYERS: "ints", keys.KEY_TARGET_HIDDEN_SIZE: "int",
    keys.KEY_NORM_BEFORE_RESIDUAL: "bool", keys.KEY_NORM_BEFORE_FC: "bool", keys.KEY_FC_NORM: "bool",
    keys.KEY_NORM_OUTPUT: "bool", keys.KEY_FC_NORM_WEIGHT: "floats", keys.KEY_TOKENIZER_TOKENS: "strings",
    keys.KEY_NAME: "string", keys.KEY_CHAT_TEMPLATE: "string",
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
            stored = kv.vtype.name + (f" of {kv.sub_type.name}" if kv.sub_type is not None else "")
            raise _corrupt(path, f"metadata {kv.key} holds {stored}, expected {kind.replace('|', ' or ')}")


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
                   tensor_types=frozenset(t.type for t in g.tensors))


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
        d2t = g.tensor(keys.T_D2T)
        return cls(
            g.path, [int(x) for x in layers], int(hidden), int(g.get(keys.KEY_EMBEDDING_LENGTH, 0)),
            int(g.get(keys.KEY_HEAD_COUNT, 0)), int(g.get(keys.KEY_HEAD_COUNT_KV, 0)),
            int(g.get(keys.KEY_FEED_FORWARD_LENGTH, 0)), g.n_vocab, d2t.shape[0] if d2t else None,
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
