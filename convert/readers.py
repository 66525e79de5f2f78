"""Open an EAGLE-3 checkpoint and read it one tensor at a time.

Accepted inputs: a `*.safetensors` file, a sharded set (`*.safetensors.index.json`), a
`pytorch_model.bin` (or its `.index.json`), or a directory holding one of those plus `config.json`.

Safetensors is parsed here directly (8-byte header length, JSON header, raw data), so that bf16 needs
no torch: its raw uint16 words are widened to float32 by a 16-bit shift. `.bin` files go through
`torch.load(weights_only=True)` only (no pickled code is ever run) and need torch installed.

Every defect a user can hand us (missing file, bad JSON, truncated data, unsupported dtype) becomes
one `Eagle3Error` line, raised when the checkpoint is opened, before any output exists.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import Eagle3Error

CONFIG_NAME = "config.json"

# safetensors dtype tag → (numpy dtype of the stored words, kind after loading)
_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened to float32 on load
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


@dataclass
class TensorMeta:
    name: str
    shape: tuple[int, ...]  # PyTorch order: rows first ([out_features, in_features] for a Linear)
    dtype: str  # safetensors tag: F32, F16, BF16, I64, BOOL, ...
    file: Path

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


@dataclass
class Checkpoint:
    """A checkpoint's tensor table and config; `load(name)` reads one tensor."""

    path: Path  # what the user named
    files: list[Path]
    config: dict[str, Any] | None
    config_path: Path | None
    tensors: dict[str, TensorMeta]
    _loaders: dict[Path, Callable[[TensorMeta], np.ndarray]] = field(default_factory=dict, repr=False)

    def load(self, name: str) -> np.ndarray:
        """One tensor: float32 for float dtypes, int64 for integers, bool for BOOL."""
        meta = self.tensors.get(name)
        if meta is None:
            raise Eagle3Error(f"{self.path}: checkpoint has no tensor '{name}'")
        return self._loaders[meta.file](meta)

    def has(self, name: str) -> bool:
        return name in self.tensors


def bf16_to_f32(words: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) → float32: bf16 is the top half of an f32."""
    wide = words.astype(np.uint32)
    wide <<= 16  # in place: one float32-sized buffer, no second temporary
    return wide.view(np.float32)


def read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise Eagle3Error(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise Eagle3Error(f"{path}: not UTF-8 text, so not a JSON file") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise Eagle3Error(f"{path}: invalid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


# ------------------------------------------------------------------------------------------------
# safetensors
# ------------------------------------------------------------------------------------------------


@dataclass
class _StEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


def _header_bytes(path: Path) -> tuple[int, bytes]:
    """A safetensors file's size and its JSON header's bytes."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise Eagle3Error(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n_header,) = struct.unpack("<Q", head)
        if n_header > size - 8:
            raise Eagle3Error(f"{path}: truncated or not a safetensors file "
                              f"(header claims {n_header} bytes, file has {size})")
        return size, f.read(n_header)


def _is_count(x: Any) -> bool:
    """A non-negative JSON integer (not a bool) that fits an int64."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63


def _parse_safetensors(path: Path) -> dict[str, _StEntry]:
    try:
        size, raw = _header_bytes(path)
    except OSError as e:
        raise Eagle3Error(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise Eagle3Error(f"{path}: corrupt safetensors header (not valid JSON)") from None
    if not isinstance(header, dict):
        raise Eagle3Error(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start = 8 + len(raw)
    entries: dict[str, _StEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise Eagle3Error(f"{path}: corrupt safetensors header entry for '{name}'") from None
        if not all(_is_count(x) for x in (*shape, begin, end)) or begin > end:
            raise Eagle3Error(f"{path}: corrupt safetensors header entry for '{name}' (shape {info['shape']!r}, "
                              f"data_offsets {info['data_offsets']!r})")
        if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
            raise Eagle3Error(f"{path}: tensor '{name}' has dtype {dtype}; only f32/f16/bf16 float checkpoints "
                              f"are supported (convert from the unquantized release)")
        n = 1
        for x in shape:  # Python ints: a corrupt shape cannot wrap around
            n *= x
        if end - begin != n * _ST_DTYPES[dtype].itemsize:
            raise Eagle3Error(f"{path}: corrupt safetensors header: '{name}' {list(shape)} {dtype} "
                              f"does not fit its {end - begin} bytes")
        if data_start + end > size:
            raise Eagle3Error(f"{path}: truncated safetensors file (tensor '{name}' needs bytes up to "
                              f"{data_start + end}, file has {size})")
        entries[name] = _StEntry(dtype, shape, data_start + begin, data_start + end)
    return entries


def _open_safetensors(path: Path, ckpt_tensors: dict[str, TensorMeta],
                      only: set[str] | None = None) -> Callable[[TensorMeta], np.ndarray]:
    entries = _parse_safetensors(path)
    for name, e in entries.items():
        if only is None or name in only:
            ckpt_tensors[name] = TensorMeta(name, e.shape, e.dtype, path)

    def load(meta: TensorMeta) -> np.ndarray:
        e = entries[meta.name]
        buf = bytearray(e.end - e.begin)
        with open(path, "rb") as f:
            f.seek(e.begin)
            if f.readinto(buf) != len(buf):
                raise Eagle3Error(f"{path}: truncated while reading '{meta.name}'")
        words = np.frombuffer(buf, dtype=_ST_DTYPES[e.dtype]).reshape(e.shape)
        return _widen(words, e.dtype)

    return load


def _widen(words: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return bf16_to_f32(words)
    if dtype in FLOAT_DTYPES:
        return words.astype(np.float32)
    if dtype == "BOOL":
        return words.astype(bool)
    return words.astype(np.int64)


# ------------------------------------------------------------------------------------------------
# pytorch_model.bin (torch.load with weights_only=True)
# ------------------------------------------------------------------------------------------------

_TORCH_TAGS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
               "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def _open_torch_bin(path: Path, ckpt_tensors: dict[str, TensorMeta],
                    only: set[str] | None = None) -> Callable[[TensorMeta], np.ndarray]:
    try:
        import torch
    except ImportError:
        raise Eagle3Error(f"{path}: reading a .bin checkpoint needs torch (pip install torch), "
                          f"or convert a .safetensors release") from None
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) format cannot be memory-mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            raise Eagle3Error(f"{path}: refusing to unpickle code; this file holds more than tensors "
                              f"(convert it to safetensors first)") from None
        raise Eagle3Error(f"{path}: not a readable PyTorch checkpoint (truncated or corrupt: {first})") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise Eagle3Error(f"{path}: PyTorch file holds a {type(state).__name__}, not a state dict of tensors")
    for name, t in state.items():
        if not isinstance(t, torch.Tensor) or (only is not None and name not in only):
            continue
        tag = _TORCH_TAGS.get(str(t.dtype).removeprefix("torch."))
        if tag is None:
            raise Eagle3Error(f"{path}: tensor '{name}' has dtype {t.dtype}; only f32/f16/bf16 float "
                              f"checkpoints are supported")
        ckpt_tensors[name] = TensorMeta(name, tuple(int(x) for x in t.shape), tag, path)

    def load(meta: TensorMeta) -> np.ndarray:
        t = state[meta.name].contiguous()
        if meta.dtype == "BF16":
            return bf16_to_f32(t.view(torch.int16).numpy().view(np.uint16))
        return _widen(t.numpy(), meta.dtype)

    return load


# ------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------


def _open_file(path: Path, tensors: dict[str, TensorMeta], only: set[str] | None = None):
    if path.suffix == ".safetensors":
        return _open_safetensors(path, tensors, only)
    if path.suffix in (".bin", ".pt", ".pth"):
        return _open_torch_bin(path, tensors, only)
    raise Eagle3Error(f"{path}: not a checkpoint file (expected .safetensors, .bin or an .index.json)")


def _find_in_dir(d: Path) -> list[Path]:
    """The checkpoint file(s) of a directory, most specific first."""
    for pattern in ("*.safetensors.index.json", "model.safetensors", "*.safetensors",
                    "pytorch_model.bin.index.json", "pytorch_model.bin", "*.bin"):
        hits = sorted(d.glob(pattern))
        if hits:
            return hits if pattern in ("*.safetensors", "*.bin") else hits[:1]
    raise Eagle3Error(f"{d}: no checkpoint found (expected model.safetensors, *.safetensors.index.json "
                      f"or pytorch_model.bin)")


def open_checkpoint(src: str | Path) -> Checkpoint:
    """Open a checkpoint file, sharded index or directory; parse every header up front."""
    src = Path(src)
    if not src.exists():
        raise Eagle3Error(f"{src}: no such file or directory")
    if src.is_dir():
        directory, entries = src, _find_in_dir(src)
    elif src.name == CONFIG_NAME:
        directory, entries = src.parent, _find_in_dir(src.parent)
    else:
        directory, entries = src.parent, [src]

    tensors: dict[str, TensorMeta] = {}
    loaders: dict[Path, Callable[[TensorMeta], np.ndarray]] = {}
    files: list[Path] = []
    for entry in entries:
        if entry.name.endswith(".index.json"):
            index = read_json(entry)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise Eagle3Error(f"{entry}: index has no 'weight_map'")
            by_file: dict[str, set[str]] = {}
            for name, fname in weight_map.items():
                by_file.setdefault(str(fname), set()).add(name)
            for fname, names in sorted(by_file.items()):
                shard = entry.parent / fname
                if not shard.is_file():
                    raise Eagle3Error(f"{entry}: shard '{fname}' is missing")
                loaders[shard] = _open_file(shard, tensors, names)
                files.append(shard)
                lost = names - tensors.keys()
                if lost:
                    raise Eagle3Error(f"{shard}: index lists '{sorted(lost)[0]}' but the shard lacks it")
        else:
            loaders[entry] = _open_file(entry, tensors)
            files.append(entry)

    config_path = directory / CONFIG_NAME
    config = read_json(config_path) if config_path.is_file() else None
    if config_path.is_file() and not isinstance(config, dict):  # null too: not "no config.json"
        raise Eagle3Error(f"{config_path}: expected a JSON object")
    return Checkpoint(src, files, config, config_path if config is not None else None, tensors, loaders)
