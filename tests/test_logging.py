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
from eagle3_gguf import native
ours = {address(native._log_callback), address(native.library(native._LOG_FILTER_SOURCE, "", native._LogFilter).eagle3_logfilter)}
print(current() in ours)
""")
    assert r.stdout.split() == ["True", "True"]  # untouched by imports; ours once the CLI asks


LINES = """
import logging
from eagle3_gguf.native import enable_llama_log, install_log_callback, sibling_library

ggml = sibling_library("ggml-base")
seen = []

class Keep(logging.Handler):
    def emit(self, record):
        seen.append((record.levelname, record.getMessage()))

logger = logging.getLogger("eagle3_gguf.llama_cpp")
logger.addHandler(Keep())
logger.setLevel(logging.DEBUG)  # every line that reaches Python is kept, verbose or not

def say(level, *pieces):  # ggml_log_internal(level, "%s", piece): what GGML_LOG_DEBUG / GGML_LOG_CONT do
    for i, piece in enumerate(pieces):
        ggml.ggml_log_internal(level if i == 0 else 5, b"%s", piece.encode())

install_log_callback()
"""


def test_llama_cpps_debug_lines_reach_python_only_when_asked_for():
    """ggml-cuda logs a few DEBUG lines a decode ("CUDA Graph id N reused"): the CLI's callback drops them, and the
    CONT pieces that continue them, before Python, unless -v asks for llama.cpp's log; other lines always come, each
    at its own level (ggml.h: DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5)."""
    r = python(LINES + """
say(1, "CUDA Graph id 7 reused\\n")
say(2, "load_tensors: offloaded ", "33/33 layers\\n")
say(1, "a debug line ", "in two pieces\\n")
say(3, "a warning\\n")
say(4, "an error\\n")
print(seen)
seen.clear()
enable_llama_log(True)
say(1, "CUDA Graph id 7 reused\\n")
say(1, "a debug line ", "in two pieces\\n")
say(2, "an info line\\n")
enable_llama_log(False)
say(1, "dropped again\\n")
print(seen)
""")
    quiet, loud = (eval(line) for line in r.stdout.splitlines())
    assert quiet == [("INFO", "load_tensors: offloaded 33/33 layers"), ("WARNING", "a warning"), ("ERROR", "an error")]
    assert loud == [("DEBUG", "CUDA Graph id 7 reused"), ("DEBUG", "a debug line in two pieces"),
                    ("INFO", "an info line")]


def test_a_models_load_logs_its_debug_lines_only_when_asked_for(tiny_target):
    """llama.cpp's own lines, as a load emits them: its INFO lines (llama_model_loader) come either way, its DEBUG
    lines (the tokenizer's) only with enable_llama_log(True)."""
    r = python(LINES + """
import sys
def load():
    llama_cpp.llama_model_free(llama_cpp.llama_model_load_from_file(sys.argv[1].encode(),
                                                                     llama_cpp.llama_model_default_params()))
    levels = sorted({level for level, _ in seen})
    seen.clear()
    return levels
load()  # (the first load also logs the backends' registration)
print(load())
enable_llama_log(True)
print(load())
""", str(tiny_target))
    quiet, loud = (eval(line) for line in r.stdout.splitlines())
    assert "INFO" in quiet and "DEBUG" not in quiet
    assert "INFO" in loud and "DEBUG" in loud


def test_without_a_c_compiler_every_line_comes_through_python(tmp_path):
    """logfilter.c is built once with the system compiler; where there is none the CLI still logs, through Python."""
    import os

    env = {**os.environ, "CC": "/nonexistent/cc", "EAGLE3_GGUF_CACHE": str(tmp_path)}  # nothing built
    r = subprocess.run([sys.executable, "-c", CALLBACK + LINES + """
from eagle3_gguf.native import _log_callback
print(current() == address(_log_callback))
say(1, "a debug line\\n")
say(2, "an info line\\n")
print(seen)
"""], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    same, lines = r.stdout.splitlines()
    assert same == "True"
    assert eval(lines) == [("DEBUG", "a debug line"), ("INFO", "an info line")]


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
