"""Run `eagle3-gguf serve` as a child process: a free port, its log in a file, waiting until it answers, stopping
it; and the pinned tree's ggml-rpc-server on loopback. Shared by scripts/soak.py, scripts/bench_rpc.py and the tests
(tests/conftest.py puts scripts/ on the path)."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, port: int, timeout: float = 120.0, headers: dict | None = None,
               log: Path | None = None) -> None:
    """Until GET /v1/models (sent with `headers`: an API key) answers 200; RuntimeError if the server exits first
    or does not come up within `timeout` seconds, with the end of its stderr where it writes it to `log`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}{_tail(log)}")
        try:
            with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=2)) as c:
                c.request("GET", "/v1/models", headers=headers or {})
                if c.getresponse().status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"the server did not come up in {timeout:g} s{_tail(log)}")


def _tail(log: Path | None) -> str:
    return f": {log.read_text()[-4000:]}" if log is not None else ""


@contextmanager
def server_process(cmd: list[str], port: int, log: Path, timeout: float = 120.0, headers: dict | None = None,
                   env: dict | None = None) -> Iterator[subprocess.Popen]:
    """The server `cmd` (on `port`) as a child writing its stderr to `log`: a pipe nobody reads while it serves
    fills with its log lines (-v's, one per request) and stalls it. Yields it once it answers; stops it after."""
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            wait_ready(proc, port, timeout, headers, log)
            yield proc
        finally:
            stop(proc, timeout=20)


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def wait_listening(proc: subprocess.Popen, port: int, timeout: float = 30.0) -> None:
    """Until something accepts TCP connections on 127.0.0.1:port (an rpc-server takes the next client after
    this probe); RuntimeError if `proc` exits first or nothing listens within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


def start_rpc_server(binary: Path, threads: int, lifetime: float = 900.0) -> tuple[subprocess.Popen, str]:
    """ggml-rpc-server on a free loopback port, ended by `timeout` after `lifetime` seconds whatever happens, in a
    process group of its own (kill_group ends it and `timeout` both): (process, "127.0.0.1:PORT")."""
    port = free_port()
    proc = subprocess.Popen(["timeout", str(int(lifetime)), str(binary), "-H", "127.0.0.1", "-p", str(port),
                             "-t", str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_listening(proc, port)
    except RuntimeError:
        kill_group(proc)
        raise
    return proc, f"127.0.0.1:{port}"


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to a child started with start_new_session and everything in its group (a stopped one too)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
