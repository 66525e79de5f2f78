"""The package's few lines of C (capture.c, choice.c, chain.c, logfilter.c), each built once per source version and
machine with the system C compiler into the cache (EAGLE3_GGUF_CACHE or ~/.cache/eagle3-gguf). They call ggml through
function pointers the caller puts in their structs, so they link against nothing and need no build step at install."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
from pathlib import Path

from .errors import Eagle3Error

_built: dict[str, ctypes.CDLL] = {}


def library(source: Path, why: str, struct: type[ctypes.Structure],
            more: tuple[tuple[str, type[ctypes.Structure]], ...] = ()) -> ctypes.CDLL:
    """`source` compiled and loaded (once per process); CC names the compiler (words split as a shell would:
    "ccache gcc"). `why` says in errors what the library is for, e.g. "capturing this target's hidden states".
    `struct` is the ctypes twin of the C struct its callers fill: the source's `size_t eagle3_<stem>_size(void)`
    must give its size (a source changed without its twin is refused, not run); each of `more`, (name, twin), the
    source's `eagle3_<stem>_<name>_size`."""
    if source.name in _built:
        return _built[source.name]
    text = source.read_bytes()
    base = Path(os.environ.get("EAGLE3_GGUF_CACHE", Path.home() / ".cache" / "eagle3-gguf"))
    lib = base / f"{source.stem}-{platform.machine()}-{hashlib.sha256(text).hexdigest()[:12]}.so"
    try:
        if not lib.is_file():
            _compile(source, lib, why)
        loaded = ctypes.CDLL(str(lib))
    except OSError as e:
        raise Eagle3Error(f"{lib}: {e.strerror or e} ({why} needs it built or loaded there; EAGLE3_GGUF_CACHE names "
                          "another folder)") from None
    for suffix, twin in (("", struct), *((f"_{name}", twin) for name, twin in more)):
        size = getattr(loaded, f"eagle3_{source.stem}{suffix}_size")
        size.restype = ctypes.c_size_t
        if size() != ctypes.sizeof(twin):
            raise Eagle3Error(f"{lib}: its {twin.__name__} is {size()} bytes, ctypes' {ctypes.sizeof(twin)}: "
                              "delete it to rebuild")
    _built[source.name] = loaded
    return loaded


def _compile(source: Path, lib: Path, why: str) -> None:
    cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")]
    if cc[0] is None:
        raise Eagle3Error(f"{why} needs a C compiler once (cc, gcc or clang; CC= names another), to build the few "
                          f"lines in eagle3_gguf/{source.name}")
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")  # each process its own, renamed into place: races are harmless
    try:
        # no fused multiply-adds: chain.c's judge computes in the order and roundings of its Python twin
        res = subprocess.run([*cc, "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(tmp), str(source)],
                             capture_output=True, text=True)
    except OSError as e:
        raise Eagle3Error(f"{cc[0]}: {e.strerror or e} ({why} needs a C compiler once: set CC or install cc)") from None
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        reason = (res.stderr.strip().splitlines() or ["no message"])[-1]
        raise Eagle3Error(f"{cc[0]} could not build eagle3_gguf/{source.name} ({reason})")
    tmp.replace(lib)
