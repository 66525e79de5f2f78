"""The target split across two rpc-servers on 127.0.0.1 (llama.cpp's RPC backend), the head local.

Every run is a subprocess: RPC servers registered in a process stay registered there (ggml cannot
remove a device), and llama.cpp offers them to every model loaded after. The servers are the pinned
tree's `ggml-rpc-server` (scripts/build_upstream.py), stopped by the fixture and bounded by `timeout`. Flag errors need neither servers nor the RPC parts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from build_upstream import rpc_module, rpc_server_bin  # noqa: E402
from serving import free_port, kill_group, start_rpc_server  # noqa: E402

from eagle3_gguf.rpc import RPC_BACKEND_ENV  # noqa: E402

needs_rpc = pytest.mark.skipif(not (rpc_server_bin().exists() and rpc_module().exists()),
                               reason="RPC parts not built: python scripts/build_upstream.py")
ENV = {**os.environ, RPC_BACKEND_ENV: str(rpc_module())}
PROMPT = "The capital of France is Paris. The capital of Germany is"


def _start_server() -> tuple[subprocess.Popen, str]:
    return start_rpc_server(rpc_server_bin(), threads=1)


def running_servers(n: int):
    """n rpc-servers for a module's tests (its --rpc value), stopped after them."""
    started = [_start_server() for _ in range(n)]
    yield ",".join(endpoint for _, endpoint in started)
    for proc, _ in started:
        kill_group(proc)


@pytest.fixture(scope="module")
def servers():
    yield from running_servers(2)


def _generate(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle3_gguf.cli.main", "generate", "-p", PROMPT, "-t", "2",
                           "-c", "1024", *args], capture_output=True, text=True, timeout=timeout, env=ENV)


@needs_rpc
def test_split_across_two_servers_is_target_only(servers):
    flags = ["-n", "48", "--draft-policy", "fixed", "--draft-max", "4", "--baseline", "--json"]
    local, remote = _generate(*flags), _generate(*flags, "--rpc", servers)
    assert local.returncode == 0 and remote.returncode == 0, (local.stderr[-2000:], remote.stderr[-2000:])
    here, there = json.loads(local.stdout), json.loads(remote.stdout)
    assert there["stats"]["target_on"].startswith("RPC0 (127.0.0.1:") and ", RPC1 (127.0.0.1:" in there["stats"]["target_on"]
    assert there["stats"]["target_on"].endswith("31/31 layers offloaded") and there["stats"]["head_on"] == "CPU"
    assert here["stats"]["target_on"] == "CPU"
    texts = {here["text"], there["text"]}
    assert len(texts) == 1 and len(here["text"]) > 40, texts  # speculative, here and over RPC
    assert here["identical"] and there["identical"]  # and each run's target-only baseline
    assert there["stats"]["n_accepted"] > 0


@needs_rpc
def test_drop_in_over_rpc(servers):
    code = f"""
from eagle3_gguf.assets import smollm2_path, default_head_path
from eagle3_gguf.llama import Eagle3Llama
from llama_cpp import Llama
kw = dict(n_ctx=512, verbose=False, flash_attn=True, type_v=30)
plain = Llama(str(smollm2_path()), **kw)
want = plain({PROMPT!r}, max_tokens=32, temperature=0)["choices"][0]["text"]
plain.close()
llm = Eagle3Llama(str(smollm2_path()), default_head_path(), n_gpu_layers=-1, rpc_servers={servers!r},
                  draft_policy="fixed", draft_max=4, **kw)
got = llm({PROMPT!r}, max_tokens=32, temperature=0)["choices"][0]["text"]
print(got == want, llm.spec_stats.n_accepted, ",".join(llm._e3_pair.target_model.placement.devices),
      ",".join(llm._e3_pair.head_model.placement.devices), sep="|")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-2000:]
    same, accepted, target_on, head_on = res.stdout.strip().split("|")
    assert same == "True" and int(accepted) > 0, res.stdout
    assert target_on.startswith("RPC0 (127.0.0.1:") and ",RPC1 (127.0.0.1:" in target_on and head_on == "", res.stdout


@needs_rpc
def test_serve_over_rpc(servers, tmp_path):
    """serve --rpc: the target on the servers, the answer a local plain Llama's."""
    import http.client

    from serving import server_process

    code = f"""
from eagle3_gguf.assets import smollm2_path
from llama_cpp import Llama
plain = Llama(str(smollm2_path()), n_ctx=1024, verbose=False, flash_attn=True, type_v=30)
print(plain({PROMPT!r}, max_tokens=24, temperature=0)["choices"][0]["text"], end="")
"""
    want = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV)
    assert want.returncode == 0, want.stderr[-2000:]
    port = free_port()
    from eagle3_gguf.assets import default_head_path, smollm2_path

    cmd = [sys.executable, "-m", "eagle3_gguf.cli.main", "serve", "-m", str(smollm2_path()), "--draft",
           str(default_head_path()), "--port", str(port), "-c", "1024", "-t", "2", "--rpc", servers]
    with server_process(cmd, port, tmp_path / "serve.log", env=ENV):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        c.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                              "repeat_penalty": 1.0}),  # the server says 1.1
                  headers={"Content-Type": "application/json"})
        answer = json.loads(c.getresponse().read())
        c.close()
    assert answer["choices"][0]["text"] == want.stdout and len(want.stdout) > 20


def _one_error_line(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: ") and sum(ln.startswith("error: ") for ln in lines) == 1, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    return lines[-1]


@needs_rpc
def test_no_server_there():
    port = free_port()
    line = _one_error_line(_generate("-n", "8", "--rpc", f"127.0.0.1:{port}"))
    assert line == (f"error: RPC server 127.0.0.1:{port}: Connection refused; start rpc-server there "
                    "(rpc-server -H HOST -p PORT) or fix --rpc")


@needs_rpc
def test_server_that_never_answers_times_out():
    with socket.socket() as listener:  # accepts connections (the kernel's backlog) and never speaks
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
        start = time.monotonic()
        line = _one_error_line(_generate("-n", "8", "--rpc", endpoint, timeout=60))
    assert line == (f"error: RPC server {endpoint}: no answer within 5 s; start rpc-server there "
                    "(rpc-server -H HOST -p PORT) or fix --rpc")
    assert time.monotonic() - start < 30


@contextmanager
def _mid_run(*flags: str):
    """A long generate over a fresh rpc-server, once its first text is out: yields (server, run); both are
    killed whatever happens."""
    proc, endpoint = _start_server()
    run = None
    try:
        run = subprocess.Popen([sys.executable, "-m", "eagle3_gguf.cli.main", "generate", "-t", "2", "-n", "3000",
                                "-c", "4096", "-p", "Count from 1 to 2000, one number per line:", "--rpc", endpoint,
                                *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        assert run.stdout.read(40)  # it is generating over RPC
        yield proc, run
    finally:
        kill_group(proc)  # SIGKILL ends a stopped process too
        if run is not None:
            run.kill()
            run.wait()


def _ended(run: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    out, err = run.communicate(timeout=timeout)
    return subprocess.CompletedProcess(run.args, run.returncode, out, err)


@needs_rpc
def test_server_gone_mid_run():
    with _mid_run() as (server, run):
        kill_group(server)
        line = _one_error_line(_ended(run, 120))
    assert line.startswith("error: llama.cpp aborted (Remote RPC server crashed or returned malformed response); "
                           "with --rpc, most often an rpc-server gone mid-run"), line


@needs_rpc
def test_server_frozen_mid_run():
    """A server that stops answering without closing its connection: ggml would wait forever."""
    with _mid_run("--rpc-timeout", "3") as (server, run):
        os.killpg(server.pid, signal.SIGSTOP)
        start = time.monotonic()
        line = _one_error_line(_ended(run, 60))
        waited = time.monotonic() - start
    assert line == "error: no token for 3 s: the rpc-servers stopped answering (check their hosts)"
    assert 2 < waited < 10, waited


@needs_rpc
def test_serve_with_a_server_frozen_mid_request():
    """serve --rpc-timeout: an rpc-server that stops answering mid-request ends the server with one error line
    and exit 2 (llama.cpp would wait forever, and so would every client)."""
    import http.client

    from serving import wait_ready

    from eagle3_gguf.assets import default_head_path, smollm2_path

    server, endpoint = _start_server()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "eagle3_gguf.cli.main", "serve", "-m", str(smollm2_path()),
                             "--draft", str(default_head_path()), "--port", str(port), "-c", "4096", "-t", "2",
                             "--rpc", endpoint, "--rpc-timeout", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        wait_ready(proc, port)
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        c.request("POST", "/v1/completions", body=json.dumps({
            "prompt": "Count from 1 to 2000, one number per line:", "max_tokens": 3000, "temperature": 0,
            "stream": True}), headers={"Content-Type": "application/json"})
        assert c.getresponse().read(200)  # tokens stream over RPC
        os.killpg(server.pid, signal.SIGSTOP)
        start = time.monotonic()
        _, err = proc.communicate(timeout=60)
        waited = time.monotonic() - start
    finally:
        kill_group(server)  # SIGKILL ends a stopped process too
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert proc.returncode == 2 and last.startswith("error: a target step has run for "), err[-2000:]
    assert last.endswith(" s: the rpc-servers stopped answering (check their hosts)")
    assert 2 < waited < 12, waited


@pytest.mark.parametrize("args,message", [
    (["--rpc", "localhost"], "--rpc: 'localhost' is not host:port (e.g. --rpc 192.168.1.2:50052,192.168.1.3:50052)"),
    (["--rpc", "127.0.0.1:1,127.0.0.1:1"], "--rpc: a server is named twice in '127.0.0.1:1,127.0.0.1:1'"),
    (["--rpc-backend", "x.so"], "--rpc-backend needs --rpc"),
    (["--rpc", "127.0.0.1:1", "--rpc-timeout", "0"], "--rpc-timeout must be a positive number of seconds (got 0.0)"),
    (["--rpc", "127.0.0.1:1", "--rpc-timeout", "inf"], "--rpc-timeout must be a positive number of seconds (got inf)"),
    (["--rpc", "h:\u00b2"], "--rpc: 'h:\u00b2' is not host:port (e.g. --rpc 192.168.1.2:50052,192.168.1.3:50052)"),
    (["--rpc", "[::1]:50052"], "--rpc: '[::1]:50052' is not host:port (llama.cpp's RPC client takes IPv4 addresses "
                               "and host names only) (e.g. --rpc 192.168.1.2:50052,192.168.1.3:50052)"),
])
def test_bad_rpc_flags(args, message):
    assert _one_error_line(_generate("-n", "8", *args)) == f"error: {message}"


@pytest.mark.parametrize("value", ["0", "inf", "-1"])
def test_serve_bad_rpc_timeout(value):
    res = subprocess.run([sys.executable, "-m", "eagle3_gguf.cli.main", "serve", "-m", "t.gguf", "--draft", "h.gguf",
                          "--rpc", "127.0.0.1:1", "--rpc-timeout", value], capture_output=True, text=True, timeout=60,
                         env=ENV)
    assert _one_error_line(res) == f"error: --rpc-timeout must be a positive number of seconds (got {float(value)})"


def test_missing_rpc_backend_module():
    from llama_cpp import llama_cpp as C

    if C.llama_supports_rpc():
        pytest.skip("this llama-cpp-python has the RPC backend built in: --rpc-backend is not read")
    res = _generate("-n", "8", "--rpc", "127.0.0.1:1", "--rpc-backend", "/nonexistent/libggml-rpc.so")
    assert _one_error_line(res) == ("error: /nonexistent/libggml-rpc.so: no such RPC backend module (build it: "
                                    "python scripts/build_upstream.py)")


def test_without_the_rpc_backend():
    from llama_cpp import llama_cpp as C

    if C.llama_supports_rpc():
        pytest.skip("this llama-cpp-python has the RPC backend built in")
    env = {k: v for k, v in ENV.items() if k != RPC_BACKEND_ENV}
    res = subprocess.run([sys.executable, "-m", "eagle3_gguf.cli.main", "generate", "-n", "8", "--rpc", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert _one_error_line(res).startswith("error: --rpc needs llama.cpp's RPC backend, which this llama-cpp-python "
                                           "was built without: rebuild it with CMAKE_ARGS=\"-DGGML_RPC=ON\"")
