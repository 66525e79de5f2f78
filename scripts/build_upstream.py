#!/usr/bin/env python3
"""Build upstream's reference tools from vendor/llama.cpp into a cache folder keyed by the pin.

Tools: llama-speculative-simple, llama-completion, llama-bench, llama-quantize (for differential tests
and benchmarks), and llama.cpp's RPC parts: `ggml-rpc-server` (serves a CPU backend over TCP) and
`libggml-rpc.so`, the RPC client as a ggml backend module that eagle3_gguf.rpc loads into
llama-cpp-python's ggml (built with GGML_BACKEND_DL and no CPU backend of its own, ~10 s). At the pin, `llama-completion` is the classic one-shot CLI; `llama-cli` became the
chat front end of llama-server and needs its web UI build, so it is not built here. Prints the bin folder. Reused when already built. Extra CMake flags come from
CMAKE_ARGS, e.g. CMAKE_ARGS="-DGGML_CUDA=on" (macOS builds Metal by default); amx_guard.cmake is
always included (it keeps ggml off AMX kernels that would crash here). The build folder is named by a
hash of the configure flags, so a build made with other flags is never reused.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pin import VENDOR_DIR, read_pin  # noqa: E402

TOOLS = ["llama-speculative-simple", "llama-completion", "llama-bench", "llama-quantize"]
AMX_GUARD = Path(__file__).resolve().parent / "amx_guard.cmake"


def configure_flags() -> list[str]:
    return ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=ON",
            "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
            f"-DCMAKE_PROJECT_INCLUDE={AMX_GUARD}", *shlex.split(os.environ.get("CMAKE_ARGS", ""))]


# The RPC parts: the server with a native CPU backend, the client module without one (ggml refuses
# GGML_NATIVE with GGML_BACKEND_DL, and the client computes nothing)
RPC_SERVER = "ggml-rpc-server"
RPC_SERVER_FLAGS = ["-DGGML_RPC=ON"]
RPC_MODULE_FLAGS = ["-DGGML_RPC=ON", "-DBUILD_SHARED_LIBS=ON", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU=OFF",
                    "-DGGML_NATIVE=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]


def build_dir(extra: list[str] = (), name: str = "build") -> Path:
    flags = [f for f in configure_flags() + list(extra) if not f.startswith("-DCMAKE_PROJECT_INCLUDE=")]  # the clone's path
    digest = hashlib.sha256("\n".join(flags + [AMX_GUARD.read_text()]).encode()).hexdigest()[:10]
    return read_pin().cache_dir / f"{name}-{digest}"


def rpc_server_bin() -> Path:
    return build_dir(RPC_SERVER_FLAGS, "rpc-server") / "bin" / RPC_SERVER


def rpc_module() -> Path:
    return build_dir(RPC_MODULE_FLAGS, "rpc-module") / "bin" / "libggml-rpc.so"


def bin_dir() -> Path:
    return build_dir() / "bin"


def requantized(target: Path, qtype: str = "Q4_0") -> Path:
    """The target requantized with upstream llama-quantize, cached beside the build (made on first use)."""
    out = read_pin().cache_dir / f"{target.stem}.{qtype}.gguf"
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        subprocess.run([str(bin_dir() / "llama-quantize"), "--allow-requantize", str(target), str(tmp), qtype],
                       check=True, capture_output=True)
        tmp.replace(out)
    return out


def _build(build: Path, extra: list[str], targets: list[str], wanted: list[Path]) -> None:
    if all(p.exists() for p in wanted):
        return
    jobs = str(os.cpu_count() or 2)
    configure = ["cmake", "-S", str(VENDOR_DIR), "-B", str(build), *configure_flags(), *extra]
    subprocess.run(configure, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--config", "Release", "-j", jobs, "--target", *targets],
                   check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    if not (VENDOR_DIR / "CMakeLists.txt").exists():
        subprocess.run([sys.executable, str(Path(__file__).parent / "fetch_llama_cpp.py")], check=True)
    out = build_dir() / "bin"
    _build(build_dir(), [], TOOLS, [out / t for t in TOOLS])
    _build(build_dir(RPC_SERVER_FLAGS, "rpc-server"), RPC_SERVER_FLAGS, [RPC_SERVER], [rpc_server_bin()])
    _build(build_dir(RPC_MODULE_FLAGS, "rpc-module"), RPC_MODULE_FLAGS, ["ggml-rpc"], [rpc_module()])
    print(f"upstream's tools: {out}")
    print(f"RPC server (run one on each host): {rpc_server_bin()}")
    print(f"RPC client module (--rpc-backend): {rpc_module()}")


if __name__ == "__main__":
    main()
