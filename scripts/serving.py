"""Run `eagle3-gguf serve` as a child process: a free port, waiting until it answers, stopping it. Shared by
scripts/soak.py and the tests (tests/conftest.py puts scripts/ on the path)."""

from __future__ import annotations

import http.client
import socket
import subprocess
import time
from contextlib import closing


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, port: int, timeout: float = 120.0, headers: dict | None = None) -> None:
    """Until GET /v1/models (sent with `headers`: an API key) answers 200; RuntimeError if the server exits first
    (with its stderr where that is a pipe) or does not come up within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            detail = f": {proc.stderr.read()}" if proc.stderr is not None else ""
            raise RuntimeError(f"the server exited with {proc.returncode}{detail}")
        try:
            with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=2)) as c:
                c.request("GET", "/v1/models", headers=headers or {})
                if c.getresponse().status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("the server did not come up in time")


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)
