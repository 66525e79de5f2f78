"""llama.cpp's log callback is process-wide: importing eagle3_gguf leaves llama-cpp-python's in place, so
`Llama(verbose=...)` behaves as before; only the CLI (setup_logging) routes the log through ours."""

from __future__ import annotations

import subprocess
import sys

CALLBACK = """
import ctypes, llama_cpp

def current():
    fn, data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(fn), ctypes.byref(data))
    return ctypes.cast(fn, ctypes.c_void_p).value

def address(fn):
    return ctypes.cast(fn, ctypes.c_void_p).value
"""


def python(code: str, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-c", CALLBACK + code, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r


def test_import_leaves_llama_cpp_python_log_callback_in_place():
    r = python("""
import llama_cpp._logger
theirs = address(llama_cpp._logger.llama_log_callback)
assert current() == theirs, "llama-cpp-python's callback is not the current one to begin with"
import eagle3_gguf, eagle3_gguf.native, eagle3_gguf.context, eagle3_gguf.batch, eagle3_gguf.llama, eagle3_gguf.pair
import eagle3_gguf.decode, eagle3_gguf.server
import eagle3_gguf.cli.main
print(current() == theirs)
from eagle3_gguf.cli.common import setup_logging
setup_logging(False)
from eagle3_gguf.native import _log_callback
print(current() == address(_log_callback))
""")
    assert r.stdout.split() == ["True", "True"]  # untouched by imports; ours once the CLI asks


def test_llama_verbose_behaves_as_before_after_import(tiny_target):
    code = """
import sys
import eagle3_gguf.llama
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, verbose=sys.argv[2] == "1")
llm.close()
"""
    loud = python(code, str(tiny_target), "1").stderr
    quiet = python(code, str(tiny_target), "0").stderr
    assert "llama_model_loader" in loud and "llama_context" in loud
    assert "llama_model_loader" not in quiet and "llama_context" not in quiet


def test_cli_shows_llama_cpp_log_only_with_v(tiny_target, tiny_head):
    cmd = [sys.executable, "-m", "eagle3_gguf.cli.main", "generate", "-m", str(tiny_target), "--draft", str(tiny_head),
           "-p", "Hello", "-n", "2", "-c", "256"]
    quiet = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    loud = subprocess.run([*cmd, "-v"], capture_output=True, text=True, timeout=120)
    assert quiet.returncode == loud.returncode == 0, quiet.stderr + loud.stderr
    assert "llama_model_loader" not in quiet.stderr and "llama_model_loader" in loud.stderr


def test_the_cli_says_what_a_first_run_measures_and_a_cached_one_does_not(tiny_target, tiny_head, tmp_path):
    """Where the cache holds no answer for the set-up, the exactness probe and the cost curve take seconds (a minute
    or more at 8B on a CPU) before any text: stderr says so first; a run that finds both cached says nothing of it."""
    import os

    cmd = [sys.executable, "-m", "eagle3_gguf.cli.main", "generate", "-m", str(tiny_target), "--draft", str(tiny_head),
           "-p", "Hello", "-n", "2", "-c", "256"]
    env = {**os.environ, "EAGLE3_GGUF_CACHE": str(tmp_path)}
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert first.returncode == again.returncode == 0, first.stderr + again.stderr
    said = [line for line in first.stderr.splitlines() if line.startswith("measuring ")]
    assert said == ["measuring which verify batch widths compute exactly as lone rows here (cached for later runs)",
                    "measuring what verify rows and draft steps cost here (cached for later runs)"]
    assert first.stderr.index(said[-1]) < first.stderr.index("ran on")  # before the run, not after
    assert "measuring" not in again.stderr
