"""Stream a GGUF to disk one tensor at a time, atomically.

The header, metadata and tensor table are written first from the planned shapes and types; then each
tensor is produced (loaded, transformed, encoded), written and dropped before the next is loaded, so
peak memory stays near the largest single tensor. Everything goes to a temporary file beside the
output, renamed over it only once complete: a failed or interrupted run leaves nothing behind.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf import GGUFWriter

from ..errors import Eagle3Error
from ..gguf_file import KeyValue
from .quantize import Encoded, n_bytes

# numpy dtype handed to GGUFWriter.add_tensor_info for each stored type (quantized: raw bytes)
_INFO_DTYPE = {GT.F32: np.float32, GT.F16: np.float16, GT.BF16: np.uint16, GT.I64: np.int64,
               GT.Q8_0: np.float32, GT.Q4_0: np.float32}


@dataclass
class PlannedTensor:
    name: str
    shape: tuple[int, ...]  # numpy order: rows first, the row length last
    ggml_type: GT
    produce: Callable[[], Encoded]  # called once, while streaming


@dataclass
class WrittenTensor:
    name: str
    shape: tuple[int, ...]  # numpy order
    ggml_type: GT
    n_bytes: int
    rel_error: float | None  # None for integer tensors


def write_gguf(out: Path, arch: str, kvs: list[KeyValue], tensors: list[PlannedTensor], *,
               on_tensor: Callable[[WrittenTensor], None] | None = None) -> list[WrittenTensor]:
    """Write `out` (via a temp file + os.replace); returns one row per tensor, in file order."""
    out = Path(out)
    if not out.parent.is_dir():
        raise Eagle3Error(f"{out}: output directory {out.parent} does not exist")
    if out.is_dir():
        raise Eagle3Error(f"{out}: is a directory; name an output file (-o head.gguf)")
    try:
        fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    except OSError as e:
        raise Eagle3Error(f"{out}: cannot create a file in {out.parent} ({e.strerror}): choose another -o") from None
    tmp = Path(tmp_name)
    os.close(fd)
    try:  # a new file's mode, as open() gives one: mkstemp's 0600 kept it private (some mounts refuse: then as it is)
        os.chmod(tmp, 0o666 & ~_umask())
    except OSError:
        pass
    try:
        return _write(out, tmp, arch, kvs, tensors, on_tensor)
    except OSError as e:  # a full disk (ENOSPC), a quota, an I/O error: the temp file is already gone
        tmp.unlink(missing_ok=True)
        raise Eagle3Error(f"{out}: writing failed ({e.strerror or e}); nothing was written: free some disk space "
                          "or choose another -o") from None


def _umask() -> int:
    """The process's umask: Linux says it in /proc, elsewhere reading it means setting it (and back)."""
    try:
        with open("/proc/self/status") as f:
            return int(next(line.split()[1] for line in f if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def _write(out: Path, tmp: Path, arch: str, kvs: list[KeyValue], tensors: list[PlannedTensor],
           on_tensor: Callable[[WrittenTensor], None] | None) -> list[WrittenTensor]:
    """Stream everything into `tmp`, then rename it to `out`; on any failure `tmp` is removed."""
    writer = GGUFWriter(tmp, arch)
    try:
        for kv in kvs:
            writer.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
        for t in tensors:
            writer.add_tensor_info(t.name, t.shape, np.dtype(_INFO_DTYPE[t.ggml_type]),
                                   n_bytes(t.shape, t.ggml_type), raw_dtype=t.ggml_type)
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rows = []
        for t in tensors:
            try:
                enc = t.produce()
            except OSError as e:  # reading the checkpoint, not writing the output
                raise Eagle3Error(f"{t.name}: reading the checkpoint failed ({e.strerror or e})") from None
            expected = n_bytes(t.shape, t.ggml_type)
            if enc.ggml_type != t.ggml_type or enc.data.nbytes != expected:  # a planning bug, not a user error
                raise RuntimeError(f"{t.name}: produced {enc.ggml_type.name} {enc.data.nbytes} bytes, "
                                   f"planned {t.ggml_type.name} {expected}")
            writer.write_tensor_data(np.ascontiguousarray(enc.data))
            row = WrittenTensor(t.name, t.shape, t.ggml_type, expected,
                                None if t.ggml_type == GT.I64 else enc.rel_error)
            del enc
            rows.append(row)
            if on_tensor is not None:
                on_tensor(row)
        writer.close()
        os.replace(tmp, out)
        return rows
    except BaseException:
        try:
            writer.close()
        except OSError:
            pass  # closing flushes, and may fail the same way; the first error is the one to report
        finally:
            tmp.unlink(missing_ok=True)
        raise
