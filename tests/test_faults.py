"""Faults: a full disk or an interrupt at any point of a convert leaves no file; SIGTERM and SIGINT during
generate, serve and train end cleanly (exit 130 for SIGINT, 143 for SIGTERM, partial output and statistics
kept, no traceback, training resumable)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time

import gguf
import pytest
from typer.testing import CliRunner

from checkpoints import write_checkpoint
from eagle3_gguf.cli.main import app
from eagle3_gguf.gguf_file import read_gguf_metadata

runner = CliRunner()
CLI = [sys.executable, "-m", "eagle3_gguf.cli.main"]

# GGUFWriter's steps, in the order the converter calls them; "tensor:N" is the N-th tensor's data
STAGES = ["write_header_to_file", "write_kv_data_to_file", "write_ti_data_to_file", "tensor:0", "tensor:4",
          "tensor:last", "close"]


def fail_at(monkeypatch, stage: str, exc: BaseException, n_tensors: int) -> None:
    """Make GGUFWriter raise `exc` at `stage`, after doing the step's own writing (so a partial file exists)."""
    if stage.startswith("tensor:"):
        which = stage.split(":")[1]
        target = n_tensors - 1 if which == "last" else int(which)
        original = gguf.GGUFWriter.write_tensor_data
        calls = {"n": 0}

        def step(self, *a, **k):
            original(self, *a, **k)
            calls["n"] += 1
            if calls["n"] == target + 1:
                self.flush()
                raise exc

        monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", step)
        return
    original = getattr(gguf.GGUFWriter, stage)
    fired = {"done": False}

    def step(self, *a, **k):
        original(self, *a, **k)
        if not fired["done"]:  # the writer's own clean-up closes again: let that one through
            fired["done"] = True
            raise exc

    monkeypatch.setattr(gguf.GGUFWriter, stage, step)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("faults") / "ckpt", "speculators")


@pytest.fixture(scope="module")
def n_tensors(ckpt, tiny_target, tmp_path_factory) -> int:
    """How many tensors the converted head holds."""
    out = tmp_path_factory.mktemp("probe") / "probe.gguf"
    res = runner.invoke(app, ["convert", str(ckpt), "--target", str(tiny_target), "-o", str(out)])
    assert res.exit_code == 0, res.output
    return len(read_gguf_metadata(out).tensors)


@pytest.mark.parametrize("stage", STAGES)
def test_full_disk_during_convert_is_one_line_and_no_file(tmp_path, tiny_target, ckpt, n_tensors, monkeypatch, stage):
    n = n_tensors
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    fail_at(monkeypatch, stage, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), n)
    res = runner.invoke(app, ["convert", str(ckpt), "--target", str(tiny_target), "-o", str(out_dir / "head.gguf")])
    assert res.exit_code == 2, res.output
    assert res.stderr.splitlines() == [
        f"error: {out_dir / 'head.gguf'}: writing failed (No space left on device); nothing was written: "
        "free some disk space or choose another -o"]
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("stage", STAGES)
def test_convert_interrupted_at_any_point_leaves_no_file(tmp_path, tiny_target, ckpt, n_tensors, monkeypatch, stage):
    n = n_tensors
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    fail_at(monkeypatch, stage, KeyboardInterrupt(), n)
    res = runner.invoke(app, ["convert", str(ckpt), "--target", str(tiny_target), "-o", str(out_dir / "head.gguf")])
    assert res.exit_code == 130, res.output
    assert list(out_dir.iterdir()) == []


def test_unwritable_output_directory_is_one_line(tmp_path, tiny_target, ckpt, monkeypatch):
    import tempfile

    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)  # as a read-only directory does (root may write anywhere)
    res = runner.invoke(app, ["convert", str(ckpt), "--target", str(tiny_target), "-o", str(tmp_path / "h.gguf")])
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [
        f"error: {tmp_path / 'h.gguf'}: cannot create a file in {tmp_path} (Permission denied): choose another -o"]


# A convert that writes each tensor slowly, so that a signal lands mid-file.
SLOW_CONVERT = ("import sys, time, gguf; w = gguf.GGUFWriter.write_tensor_data\n"
                "def slow(self, *a, **k):\n    w(self, *a, **k); self.flush(); time.sleep(0.2)\n"
                "gguf.GGUFWriter.write_tensor_data = slow\n"
                "sys.argv = ['eagle3-gguf'] + sys.argv[1:]\n"
                "from eagle3_gguf.cli.main import main; main()")


@pytest.mark.parametrize("sig, code, word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_convert_killed_mid_file_leaves_no_file(tmp_path, tiny_target, ckpt, sig, code, word):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CONVERT, "convert", str(ckpt), "--target", str(tiny_target),
                             "-o", str(out_dir / "head.gguf")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    while not any(p.stat().st_size > 4096 for p in out_dir.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)  # wait for the temporary file to hold tensor data
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert err.splitlines() == [word], err
    assert list(out_dir.iterdir()) == []


# ------------------------------------------------------------------------------------------------
# generate, serve, train: a signal mid-run (subprocesses; the real model for long enough runs)
# ------------------------------------------------------------------------------------------------

def read_until(stream, n_bytes: int, timeout: float) -> bytes:
    """At least n_bytes of a pipe (or what came before the timeout)."""
    got = b""
    deadline = time.monotonic() + timeout
    while len(got) < n_bytes and time.monotonic() < deadline:
        chunk = os.read(stream.fileno(), 4096)
        if not chunk:
            break
        got += chunk
    return got


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_generate_signal_keeps_partial_output_and_statistics(smollm2_path, sig, code, word):
    proc = subprocess.Popen([*CLI, "generate", "-p", "Write a long story about a lighthouse keeper.", "--chat",
                             "-n", "2000", "-t", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = read_until(proc.stdout, 40, timeout=120)
    assert len(first) >= 40 and proc.poll() is None
    proc.send_signal(sig)
    rest, err = proc.communicate(timeout=60)
    err = err.decode()
    assert proc.returncode == code, err
    text = (first + rest).decode()
    assert text.strip() and len(text) < 2000 * 20  # partial output, flushed
    assert "Traceback" not in err
    assert "interrupted" in err and "tok/s" in err  # the statistics table, stop reason "interrupted"
    assert err.strip().splitlines()[-1] == word


@pytest.mark.slow
def test_serve_sigterm_finishes_the_running_request_then_exits(smollm2_path, tmp_path):
    """SIGTERM while a request runs: the request still gets its whole answer, new connections are refused,
    the server exits 143 without a traceback."""
    from test_serve import free_port, wait_ready

    port = free_port()
    log = tmp_path / "serve.log"
    from eagle3_gguf.assets import default_head_path

    with open(log, "w") as err:
        proc = subprocess.Popen([*CLI, "serve", "-m", str(smollm2_path), "--draft", str(default_head_path()),
                                 "--port", str(port), "-c", "1024", "-t", "2", "--draft-policy", "fixed"],
                                stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_ready(proc, port, timeout=300, log=log)
            import http.client

            answer: dict = {"events": []}
            running = threading.Event()  # its first token has streamed: the request is running, however busy the host

            def ask() -> None:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                c.request("POST", "/v1/completions", body=json.dumps(
                    {"prompt": "Once upon a time", "max_tokens": 60, "temperature": 0, "stream": True}),
                    headers={"Content-Type": "application/json"})
                r = c.getresponse()
                answer["status"] = r.status
                for line in r:
                    if line.startswith(b"data: "):
                        answer["events"].append(line[len(b"data: "):].strip())
                        running.set()

            t = threading.Thread(target=ask)
            t.start()
            assert running.wait(timeout=300), "the request never started"
            proc.send_signal(signal.SIGTERM)
            t.join(timeout=120)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    events = answer["events"]
    assert answer["status"] == 200 and events and events[-1] == b"[DONE]", answer
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length", events[-2]  # all 60 tokens
    assert proc.returncode == 143, text
    assert "Traceback" not in text, text
    assert text.strip().splitlines()[-1] == "terminated"


@pytest.mark.slow
def test_train_sigterm_then_resume(tmp_path, tiny_target):
    """SIGTERM mid-training: exit 143, no traceback; --resume continues from the last checkpoint and finishes.
    (With 3 prompts an epoch is one step, and every epoch ends with a checkpoint.)"""
    pytest.importorskip("torch")
    out = tmp_path / "run"
    args = ["train", "-m", str(tiny_target), "-o", str(out), "--prompts", "3", "--steps", "10", "--draft-vocab",
            "256", "--ffn", "64", "--max-new", "12", "--layer-ids", "1,3,4", "-t", "2"]
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (out / "train" / "ckpt.pt").is_file() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "terminated"
    assert not (out / "head.gguf").exists()
    r = subprocess.run([*CLI, *args, "--resume"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "training    10 steps" in r.stdout and (out / "head.gguf").is_file()
