"""`eagle3-gguf bench`: does speculation pay for this pair, on this machine, for this kind of text, and with which
settings? Contenders interleaved per prompt (eagle3_gguf/bench.py); the table and one line of advice on stdout,
progress on stderr."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer

from ..benchmarks import WORKLOADS
from ..errors import Eagle3Error
from .common import (EXIT_INTERRUPTED, cache_type_k_option, cache_type_v_option, check_context_flags, check_head_flag,
                     ctx_option, draft_option, fail, gpu_layers_option, head_option, model_option,
                     pair_config_from_flags, rpc_backend_option, rpc_option, setup_logging, tensor_split_option,
                     threads_option)

WORKLOADS_HELP = ("Comma-separated, of: chat (MT-bench's first turns), code (HumanEval: complete a function), edit "
                  "(a HumanEval function to edit and return whole: text that repeats the prompt), extract (copy one "
                  "docstring out of eight: 1-2k token prompts). Default: all four, or none with -f.")
WORKLOAD_LIMIT = 5  # prompts of each workload by default: with the default contenders, minutes on 2 CPU cores
CONTENDERS_HELP = ("Comma-separated, measured beside target-only (always run, first and last per prompt): default "
                   "(generate's defaults: adaptive, lookup drafts, trees where they pay), kN (fixed K=N at p_min 0.5, "
                   "e.g. k1,k2,k4), lookup (lookup drafts only, no draft step: --draft-head off), head (the head's "
                   "drafts only: --draft-lookup off), tree (a fixed EAGLE-2 tree: K=4, top-4, 8 nodes).")


def register(app: typer.Typer) -> None:
    @app.command("bench")
    def bench(
        model: Optional[Path] = model_option(),
        draft: Optional[Path] = head_option(),
        file: Optional[Path] = typer.Option(None, "-f", "--file", help="Your prompts, JSON Lines: a line is "
                                            "{\"text\": \"...\"} (an \"id\" optional) or a JSON string."),
        workloads: Optional[str] = typer.Option(None, "--workloads", help=WORKLOADS_HELP),
        limit: Optional[int] = typer.Option(None, "--limit", help="Prompts per workload, and of -f's file (0: all). "
                                            f"Default: {WORKLOAD_LIMIT} of each workload, all of the file."),
        contenders: Optional[str] = typer.Option(None, "--contenders", help=CONTENDERS_HELP
                                                 + " Default: default,k2,lookup,head."),
        n_predict: int = typer.Option(128, "-n", "--n-predict", help="Tokens to generate per prompt."),
        repeat: int = typer.Option(1, "--repeat", help="Rounds per prompt (a prompt's ratio is the median over them)."),
        time_limit: float = typer.Option(300.0, "--time-limit", help="Seconds from the start (loading included): "
                                         "start no prompt expected to end past them, keeping whole prompts (at "
                                         "least one). 0: none."),
        n_ctx: int = ctx_option(),
        threads: Optional[int] = threads_option(),
        cache_type_k: str = cache_type_k_option(),
        cache_type_v: str = cache_type_v_option(),
        n_gpu_layers: str = gpu_layers_option("The target", "-ngl", "--n-gpu-layers", "--gpu-layers"),
        n_gpu_layers_draft: str = gpu_layers_option("The head", "-ngld", "--n-gpu-layers-draft", "--gpu-layers-draft"),
        tensor_split: Optional[str] = tensor_split_option(),
        rpc: Optional[str] = rpc_option(),
        rpc_backend: Optional[Path] = rpc_backend_option(),
        exact: str = draft_option("exact"),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object (set-up, every run, the summary "
                                     "rows, the advice) instead of the table."),
        plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw speed by workload and contender, and "
                                            "acceptance by draft position, into this PNG (needs matplotlib)."),
        verbose: bool = typer.Option(False, "-v", "--verbose", help="Show llama.cpp's log."),
    ) -> None:
        """Measure target-only against speculative settings on your pair, machine and text: per-prompt speed
        ratios, tokens per forward, acceptance by position, identity with target-only, and which setting to use."""
        setup_logging(verbose)
        t0 = time.monotonic()
        try:
            from .. import bench as lib

            _check_flags(n_predict, limit, repeat, time_limit, n_ctx, threads, plot, exact)
            check_head_flag(draft, instead=lambda n: f"--contenders k{n}, measured beside target-only" if n else
                            "target-only, which bench always measures")
            named = _names(contenders, ",".join(lib.DEFAULT_CONTENDERS))
            if not named:
                raise Eagle3Error("--contenders names none: name one or more (e.g. default,k2), or leave it out for "
                                  "the defaults")
            chosen = lib.contenders_from(named, n_predict, exact)
            pair_config = pair_config_from_flags(n_ctx, threads, cache_type_k, cache_type_v, 1, n_gpu_layers,
                                                 n_gpu_layers_draft, rpc, rpc_backend, tensor_split)
            prompts = lib.load_jsonl(file, limit or None) if file is not None else []
            names = _names(workloads, "" if file is not None else ",".join(WORKLOADS))
            prompts += lib.load_workloads(names, (WORKLOAD_LIMIT if limit is None else limit) or None)
            if not prompts:
                raise Eagle3Error(f"no prompts to measure: name workloads ({', '.join(WORKLOADS)}) or give -f")
            code = _run(model, draft, pair_config, chosen, prompts, n_predict, repeat,
                        t0 + time_limit if time_limit else None, as_json, plot)
        except Eagle3Error as e:
            fail(str(e))
        if code:
            raise typer.Exit(code)


def _names(value: str | None, default: str) -> list[str]:
    return [x.strip() for x in (default if value is None else value).split(",") if x.strip()]


def _check_flags(n_predict: int, limit: int | None, repeat: int, time_limit: float, n_ctx: int, threads: int | None,
                 plot: Path | None, exact: str) -> None:
    from ..config import DraftConfig

    DraftConfig.from_flags(exact=exact)  # its own check, naming the flag
    if n_predict < 2:  # the first token comes with the prompt's processing, untimed
        raise Eagle3Error(f"-n must be at least 2: the speeds time the tokens after the first (got {n_predict})")
    if limit is not None and limit < 0:
        raise Eagle3Error(f"--limit cannot be negative (got {limit})")
    if repeat < 1:
        raise Eagle3Error(f"--repeat must be at least 1 (got {repeat})")
    if not time_limit >= 0:
        raise Eagle3Error(f"--time-limit must be seconds, 0 or more (got {time_limit})")
    check_context_flags(n_ctx, threads)
    if plot is not None:
        if plot.suffix.lower() != ".png":
            raise Eagle3Error(f"--plot writes a PNG: give a path ending in .png (got {plot})")
        if not plot.parent.is_dir():
            raise Eagle3Error(f"--plot: {plot.parent} is no folder")
        if plot.is_dir():
            raise Eagle3Error(f"--plot: {plot} is a folder: give a file's path")
        try:  # said before minutes of measuring, not after
            tempfile.TemporaryFile(dir=plot.parent).close()
        except OSError as e:
            raise Eagle3Error(f"--plot: cannot write into {plot.parent} ({e.strerror or e})") from None
        if importlib.util.find_spec("matplotlib") is None:  # said before minutes of measuring, not after
            raise Eagle3Error("--plot needs matplotlib: pip install matplotlib")


def _run(model, draft, pair_config, contenders, prompts, n_predict, repeat, deadline, as_json, plot) -> int:
    from ..assets import default_head_path, smollm2_path
    from ..bench import TARGET, Bench, whole_prompts
    from ..benchreport import Report, advice, plot as draw, summarize

    runs, stopped = [], ""
    with Bench(model or smollm2_path(), draft or default_head_path(), pair_config, contenders) as bench:
        bench.tokenize(prompts)
        progress = Progress(len(prompts) * bench.runs_per_prompt(repeat), bench.runs_per_prompt(repeat))
        setup = bench.prepare(n_predict)
        try:
            for run in bench.measure(prompts, repeat, n_predict, deadline):
                runs.append(run)
                progress.update(run)
            stopped = bench.stopped
        except KeyboardInterrupt:  # keep the prompts measured whole
            stopped = "interrupted"
        progress.done()
    runs = whole_prompts(runs, bench.runs_per_prompt(repeat))
    if not runs:
        typer.echo("bench: interrupted before a prompt was measured whole", err=True)
        return EXIT_INTERRUPTED
    names = [TARGET.name, *(c.name for c in contenders)]
    rows = summarize(runs, names)
    flags = {c.name: c.flags for c in contenders}
    report = Report(setup, runs, rows, advice(rows, setup, flags), stopped)
    typer.echo(report.to_json() if as_json else report.table().rstrip("\n"))
    if plot is not None:
        try:
            draw(report, plot)
        except OSError as e:
            raise Eagle3Error(f"--plot: could not write {plot}: {e.strerror or e}") from None
        typer.echo(f"bench: plot written to {plot}", err=True)
    return EXIT_INTERRUPTED if stopped == "interrupted" else 0


class Progress:
    """Progress on stderr: a bar rewritten in place on a terminal, a line per prompt otherwise."""

    def __init__(self, total: int, per_prompt: int):
        self.total, self.per_prompt = total, per_prompt
        self.n = 0
        self.t0 = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.speeds: dict[str, float] = {}  # this prompt's fastest run per contender, tok/s

    def update(self, run) -> None:
        self.n += 1
        self.speeds[run.contender] = max(self.speeds.get(run.contender, 0.0), run.tok_s)
        elapsed = time.monotonic() - self.t0
        if self.tty:
            filled = int(30 * self.n / self.total)
            sys.stderr.write(f"\r[{'#' * filled}{'-' * (30 - filled)}] {self.n}/{self.total} runs {elapsed:4.0f}s  "
                             f"{run.workload} {run.prompt_id} {run.contender}\033[K")
            sys.stderr.flush()
        elif self.n % self.per_prompt == 0:
            base = self.speeds.pop("target", 0.0) or 1.0
            ratios = " ".join(f"{c} {v / base:.2f}x" for c, v in self.speeds.items())
            typer.echo(f"bench: {self.n // self.per_prompt}/{self.total // self.per_prompt} prompts, {elapsed:.0f}s: "
                       f"{run.workload} {run.prompt_id}: target {base:.1f} tok/s; {ratios}", err=True)
        if self.n % self.per_prompt == 0:
            self.speeds = {}

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
