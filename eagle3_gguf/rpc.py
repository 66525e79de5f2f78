"""llama.cpp's RPC backend: the target's layers on `rpc-server` hosts, the head on this machine.

llama.cpp splits a model across hosts by registering one RPC device per server (`--rpc host:port,...`
in its tools: `ggml_backend_rpc_add_server` + `ggml_backend_register`) and placing layers on them. The
RPC backend is either built into llama-cpp-python (`CMAKE_ARGS="-DGGML_RPC=ON"`) or loaded here as a
ggml backend module built from the same pinned tree (`python scripts/build_upstream.py` builds
`libggml-rpc.so`; `ggml_backend_load` registers it in llama-cpp-python's ggml). Servers are registered
once per process and stay (ggml has no way to remove a device). Each is first reached here with a
time-out, because ggml's own connect aborts the process on failure; a server that dies mid-run still
aborts inside ggml (see `on_abort`).
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from llama_cpp import llama_cpp as C

from .errors import Eagle3Error
from .native import sibling_library

RPC_BACKEND_ENV = "EAGLE3_GGUF_RPC_BACKEND"  # path of a libggml-rpc module, when llama-cpp-python has none built in
CONNECT_TIMEOUT_S = 5.0
GGML_BACKEND_DEVICE_TYPE_GPU = 1  # enum ggml_backend_dev_type: CPU, GPU, IGPU, ACCEL
GGML_BACKEND_DEVICE_TYPE_IGPU = 2
_RPC_REG_NAME = b"RPC"
# ggml-rpc.cpp at the pin: RPC_CMD_HELLO (always 14), RPC_PROTO_{MAJOR,MINOR}_VERSION, transport.h's caps size
RPC_CMD_HELLO = 14
RPC_PROTO_MAJOR, RPC_PROTO_MINOR = 7, 0
RPC_CONN_CAPS_SIZE = 24


def _ggml() -> ctypes.CDLL:
    """libggml beside libllama (the backend registry llama.cpp reads)."""
    lib = sibling_library("ggml")
    if lib is None:
        raise Eagle3Error(f"{Path(C._lib._name).parent}: no libggml beside libllama, so --rpc cannot reach "
                          "llama.cpp's backend registry")
    return lib


@dataclass
class _Ggml:
    """The registry functions, bound once."""

    lib: ctypes.CDLL

    def __post_init__(self) -> None:
        lib, vp, cp = self.lib, ctypes.c_void_p, ctypes.c_char_p
        # GGML_API ggml_backend_reg_t ggml_backend_reg_by_name(const char * name);
        lib.ggml_backend_reg_by_name.argtypes, lib.ggml_backend_reg_by_name.restype = [cp], vp
        # GGML_API ggml_backend_reg_t ggml_backend_load(const char * path);
        lib.ggml_backend_load.argtypes, lib.ggml_backend_load.restype = [cp], vp
        # GGML_API void ggml_backend_register(ggml_backend_reg_t reg);
        lib.ggml_backend_register.argtypes, lib.ggml_backend_register.restype = [vp], None
        # GGML_API size_t ggml_backend_dev_count(void);
        lib.ggml_backend_dev_count.argtypes, lib.ggml_backend_dev_count.restype = [], ctypes.c_size_t
        # GGML_API ggml_backend_dev_t ggml_backend_dev_get(size_t index);
        lib.ggml_backend_dev_get.argtypes, lib.ggml_backend_dev_get.restype = [ctypes.c_size_t], vp
        # base: GGML_API void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);
        lib.ggml_backend_reg_get_proc_address.argtypes = [vp, cp]
        lib.ggml_backend_reg_get_proc_address.restype = vp
        # base: GGML_API size_t ggml_backend_reg_dev_count(ggml_backend_reg_t reg);
        lib.ggml_backend_reg_dev_count.argtypes, lib.ggml_backend_reg_dev_count.restype = [vp], ctypes.c_size_t
        # base: GGML_API ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index);
        lib.ggml_backend_reg_dev_get.argtypes, lib.ggml_backend_reg_dev_get.restype = [vp, ctypes.c_size_t], vp
        # base: GGML_API enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
        lib.ggml_backend_dev_type.argtypes, lib.ggml_backend_dev_type.restype = [vp], ctypes.c_int
        # base: GGML_API ggml_backend_reg_t ggml_backend_dev_backend_reg(ggml_backend_dev_t device);
        lib.ggml_backend_dev_backend_reg.argtypes, lib.ggml_backend_dev_backend_reg.restype = [vp], vp
        # base: GGML_API const char * ggml_backend_reg_name(ggml_backend_reg_t reg);
        lib.ggml_backend_reg_name.argtypes, lib.ggml_backend_reg_name.restype = [vp], cp


_AddServer = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)  # ggml_backend_reg_t (*)(const char * endpoint)
_lib: _Ggml | None = None
_servers: dict[str, list[int]] = {}  # endpoint -> its registered devices, for this process


def _registry() -> _Ggml:
    global _lib
    if _lib is None:
        _lib = _Ggml(_ggml())
    return _lib


def parse_servers(text: str) -> tuple[str, ...]:
    """`host:port,host:port` as llama.cpp's --rpc takes it: IPv4 addresses or host names (its RPC client
    splits at the first ':' and connects over IPv4 only), each with a port."""
    if not isinstance(text, str):
        raise Eagle3Error(f"--rpc (rpc_servers) is one string, 'host:port,host:port', not a {type(text).__name__}")
    out = []
    for item in (s.strip() for s in text.split(",")):
        host, sep, port = item.partition(":")
        if not sep or not host or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536:
            why = " (llama.cpp's RPC client takes IPv4 addresses and host names only)" if ":" in port else ""
            raise Eagle3Error(f"--rpc: '{item}' is not host:port{why} (e.g. --rpc 192.168.1.2:50052,192.168.1.3:50052)")
        out.append(item)
    if len(set(out)) != len(out):
        raise Eagle3Error(f"--rpc: a server is named twice in '{text}'")
    return tuple(out)


HEAD_SPLIT = "head"  # --tensor-split head: head_split's layers per server


def parse_tensor_split(text: str) -> tuple[float, ...] | str:
    """--tensor-split as llama.cpp takes it (proportions per device, e.g. 3,1) or 'head' (head_split)."""
    if text.strip() == HEAD_SPLIT:
        return HEAD_SPLIT
    try:
        parts = tuple(float(x) for x in text.split(","))
    except ValueError:
        parts = ()
    if not parts or not all(0.0 <= x < math.inf for x in parts) or not any(parts):
        raise Eagle3Error(f"--tensor-split: '{text}' is neither '{HEAD_SPLIT}' nor non-negative proportions per "
                          "device, not all 0 (e.g. --tensor-split 3,1)")
    return parts


def head_split(n_layer: int, head_layers: list[int], n_servers: int) -> tuple[int, ...]:
    """Layers per server (llama.cpp's order: layer 0 first, the output layer last) such that every layer input the
    head reads is made on a server of its own and none on the last: llama.cpp reads each extracted tensor with a
    round trip of its own after the graph, in turn per server, so only reads from the servers before the last
    overlap the last one's work (bench/NOTES.md: rpc-cpu). Balanced (the most layers on one server is least).
    Needs a server more than the head reads layers made on them."""
    n = n_layer + 1  # the repeating layers and the output layer, as tensor_split spreads them
    made = [0] * (n + 1)  # prefix counts of the layers whose output the head reads (a layer input: its layer - 1)
    for lid in {lid - 1 for lid in head_layers if lid > 0}:
        made[lid + 1] += 1
    for i in range(n):
        made[i + 1] += made[i]
    need = made[n] + 1
    if n_servers < need or n_servers > n:
        raise Eagle3Error(f"--tensor-split {HEAD_SPLIT}: the head reads {made[n]} of the target's layers, so it needs "
                          f"{need} to {n} rpc-servers (got {n_servers}): add servers or give proportions")
    worst = [[math.inf] * (n + 1) for _ in range(n_servers + 1)]  # [servers used][layers covered] -> max load
    cut = [[0] * (n + 1) for _ in range(n_servers + 1)]
    worst[0][0] = 0
    for k in range(1, n_servers + 1):
        allowed = 0 if k == n_servers else 1  # head layers made on this server
        for b in range(k, n + 1):
            for a in range(k - 1, b):
                load = max(worst[k - 1][a], b - a)
                if made[b] - made[a] <= allowed and load < worst[k][b]:
                    worst[k][b], cut[k][b] = load, a
    # always found: a cut after each layer the head reads (none past layer n_layer - 1), the output layer alone last
    assert worst[n_servers][n] < math.inf
    counts, b = [], n
    for k in range(n_servers, 0, -1):
        counts.append(b - cut[k][b])
        b = cut[k][b]
    return tuple(reversed(counts))


def _rpc_reg(module: str | Path | None) -> int:
    lib = _registry()
    reg = lib.lib.ggml_backend_reg_by_name(_RPC_REG_NAME)
    if reg:
        return reg
    module = module or os.environ.get(RPC_BACKEND_ENV)
    if not module:
        raise Eagle3Error("--rpc needs llama.cpp's RPC backend, which this llama-cpp-python was built without: "
                          "rebuild it with CMAKE_ARGS=\"-DGGML_RPC=ON\", or build the module with "
                          f"'python scripts/build_upstream.py' and name it with --rpc-backend or {RPC_BACKEND_ENV}")
    if not Path(module).is_file():
        raise Eagle3Error(f"{module}: no such RPC backend module (build it: python scripts/build_upstream.py)")
    reg = lib.lib.ggml_backend_load(str(module).encode())  # registers it too
    if not reg:
        raise Eagle3Error(f"{module}: ggml could not load it as a backend (it must be built from the pinned llama.cpp "
                          "with -DGGML_BACKEND_DL=ON -DGGML_RPC=ON)")
    return reg


def _hello(endpoint: str, timeout: float) -> None:
    """RPC's HELLO exchange with the server, bounded by `timeout` (ggml's own blocks, or aborts)."""
    host, _, port = endpoint.partition(":")
    fix = "start rpc-server there (rpc-server -H HOST -p PORT) or fix --rpc"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # as ggml's client connects
            sock.settimeout(timeout)
            sock.connect((host, int(port)))
            sock.sendall(struct.pack("<BQ", RPC_CMD_HELLO, RPC_CONN_CAPS_SIZE) + bytes(RPC_CONN_CAPS_SIZE))
            reply = b""
            while len(reply) < 8 + 4 + RPC_CONN_CAPS_SIZE:
                chunk = sock.recv(64)
                if not chunk:
                    raise Eagle3Error(f"RPC server {endpoint}: closed the connection at HELLO (is it an rpc-server "
                                      "of another llama.cpp version, or serving another client?)")
                reply += chunk
    except (socket.timeout, TimeoutError):
        raise Eagle3Error(f"RPC server {endpoint}: no answer within {timeout:g} s; {fix}") from None
    except OSError as e:  # refused, unreachable, or a name that does not resolve (socket.gaierror)
        raise Eagle3Error(f"RPC server {endpoint}: {e.strerror or e}; {fix}") from None
    major, minor = reply[8], reply[9]
    if major != RPC_PROTO_MAJOR or minor > RPC_PROTO_MINOR:
        raise Eagle3Error(f"RPC server {endpoint} speaks RPC protocol {major}.{minor}, the pinned llama.cpp "
                          f"{RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR}: run the rpc-server built from the same pin "
                          "(python scripts/build_upstream.py)")


def connect(servers: tuple[str, ...], module: str | Path | None = None,
            timeout: float = CONNECT_TIMEOUT_S) -> list[int]:
    """The RPC devices of `servers` (ggml_backend_dev_t), registered in llama.cpp's registry, in order."""
    reg = _rpc_reg(module)
    lib = _registry()
    add_server = lib.lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
    if not add_server:
        raise Eagle3Error("the RPC backend has no ggml_backend_rpc_add_server: it is not the pinned llama.cpp's")
    devices: list[int] = []
    for endpoint in servers:
        if endpoint not in _servers:
            _hello(endpoint, timeout)
            server_reg = _AddServer(add_server)(endpoint.encode())
            if not server_reg:  # ggml_backend_rpc_add_server: the server reported no devices
                raise Eagle3Error(f"RPC server {endpoint}: it offers no devices; check its backends (rpc-server -d)")
            lib.lib.ggml_backend_register(server_reg)
            _servers[endpoint] = [lib.lib.ggml_backend_reg_dev_get(server_reg, i)
                                  for i in range(lib.lib.ggml_backend_reg_dev_count(server_reg))]
        devices += _servers[endpoint]
    return devices


def in_use() -> bool:
    """Whether this process registered RPC servers (llama.cpp then offers them to every model it loads)."""
    return bool(_servers)


def local_devices() -> list[int]:
    """The GPUs on this machine a model not sent over RPC may use, as llama.cpp's default chooses them: the
    discrete ones, else the integrated ones (none on a CPU-only build)."""
    lib = _registry().lib
    found: dict[int, list[int]] = {GGML_BACKEND_DEVICE_TYPE_GPU: [], GGML_BACKEND_DEVICE_TYPE_IGPU: []}
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        kind = lib.ggml_backend_dev_type(dev)
        if kind in found and lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev)) != _RPC_REG_NAME:
            found[kind].append(dev)
    return found[GGML_BACKEND_DEVICE_TYPE_GPU] or found[GGML_BACKEND_DEVICE_TYPE_IGPU]


class Watchdog:
    """Calls on_stall(seconds) once, from a daemon thread, when, armed by a `tick`, no tick followed for more than
    `limit` seconds; `pause` disarms it until the next tick. An rpc-server that stops answering without closing
    its connection leaves llama.cpp waiting forever, and nothing on the waiting thread can end the wait."""

    def __init__(self, limit: float, on_stall: Callable[[float], None]):
        self.limit, self.on_stall = limit, on_stall
        self.last: float | None = None  # None: not armed
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="eagle3-rpc-watch", daemon=True).start()

    def tick(self, *_args) -> None:
        self.last = time.monotonic()

    def pause(self) -> None:
        self.last = None

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.limit / 4)):
            last = self.last
            if last is not None and time.monotonic() - last > self.limit:
                self.on_stall(time.monotonic() - last)
                return


_AbortCallback = ctypes.CFUNCTYPE(None, ctypes.c_char_p)  # void (*)(const char * error_message)
_on_abort_keep: list = []  # the installed callback, kept alive


def on_abort(handler: Callable[[str], None]) -> None:
    """Call `handler(message)` where ggml is about to abort the process (a server gone mid-run): the CLI
    prints its one line there and exits. ggml aborts after the handler returns."""
    lib = sibling_library("ggml-base")
    if lib is None:
        return
    # GGML_API ggml_abort_callback_t ggml_set_abort_callback(ggml_abort_callback_t callback);
    lib.ggml_set_abort_callback.argtypes, lib.ggml_set_abort_callback.restype = [_AbortCallback], ctypes.c_void_p
    cb = _AbortCallback(lambda msg: handler((msg or b"").decode(errors="replace").strip()))
    _on_abort_keep[:] = [cb]
    lib.ggml_set_abort_callback(cb)
