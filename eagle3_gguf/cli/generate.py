"""`eagle3-gguf generate`: decode with a target and an EAGLE-3 head; text on stdout, statistics on stderr."""

from __future__ import annotations

import json
import secrets
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer

from ..errors import Eagle3Error
from .common import (RPC_TIMEOUT_HELP, cache_type_k_option, cache_type_v_option, check_context_flags, check_head_flag,
                     check_rpc_timeout, ctx_option, draft_option, drafting_from_flags, exit_now, fail,
                     gpu_layers_option, head_option, model_option, pair_config_from_flags, rpc_backend_option,
                     rpc_option, setup_logging, tensor_split_option, threads_option)


def register(app: typer.Typer) -> None:
    @app.command("generate")
    def generate(
        model: Optional[Path] = model_option(),
        draft: Optional[Path] = head_option(),
        prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="Prompt text."),
        file: Optional[Path] = typer.Option(None, "-f", "--file", help="Read the prompt from a file."),
        n_predict: int = typer.Option(128, "-n", "--n-predict", help="Tokens to generate."),
        n_ctx: int = ctx_option(),
        threads: Optional[int] = threads_option(),
        n_gpu_layers: str = gpu_layers_option("The target", "-ngl", "--n-gpu-layers", "--gpu-layers"),
        n_gpu_layers_draft: str = gpu_layers_option("The head", "-ngld", "--n-gpu-layers-draft", "--gpu-layers-draft"),
        rpc: Optional[str] = rpc_option(),
        rpc_backend: Optional[Path] = rpc_backend_option(),
        rpc_timeout: float = typer.Option(60.0, "--rpc-timeout", help=RPC_TIMEOUT_HELP),
        tensor_split: Optional[str] = tensor_split_option(),
        cache_type_k: str = cache_type_k_option(),
        cache_type_v: str = cache_type_v_option(),
        temp: float = typer.Option(0.0, "--temp", help="Temperature; 0 = greedy."),
        seed: int = typer.Option(0, "--seed", help="Sampling seed (with --temp > 0); -1: a random one, as "
                                 "llama.cpp's."),
        draft_max: int = draft_option("draft_max"),
        draft_p_min: float = draft_option("draft_p_min"),
        draft_policy: str = draft_option("draft_policy"),
        spec_sampling: str = draft_option("spec_sampling"),
        draft_temp_scale: Optional[float] = draft_option("draft_temp_scale", None),
        draft_lookup: str = draft_option("draft_lookup", "on"),
        draft_lookup_max: int = draft_option("draft_lookup_max"),
        draft_head: str = draft_option("draft_head", "on"),
        draft_topk: Optional[int] = draft_option("draft_topk", None),
        draft_nodes: Optional[int] = draft_option("draft_nodes", None),
        exact: str = draft_option("exact"),
        chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the target's chat template (from its GGUF)."),
        baseline: bool = typer.Option(False, "--baseline", help="Also run target-only decoding and report speedup and identity."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text + statistics) instead of streaming."),
        verbose: bool = typer.Option(False, "-v", "--verbose", help="Show llama.cpp's log."),
    ) -> None:
        """Decode with the target and the head paired: the head drafts, the target verifies in one batch.
        Every token is the target's own choice, and greedy text is target-only's on the verify widths the exactness
        probe finds exact here (--exact)."""
        setup_logging(verbose)
        try:
            _check_flags(prompt, file, n_predict, n_ctx, threads, temp, seed)
            check_head_flag(draft)
            drafting = drafting_from_flags(draft_max, draft_p_min, draft_policy, spec_sampling, draft_temp_scale,
                                           draft_lookup, draft_lookup_max, temp, draft_topk, draft_nodes, exact,
                                           draft_head)
            pair_config = pair_config_from_flags(n_ctx, threads, cache_type_k, cache_type_v, drafting.tree_sequences,
                                                 n_gpu_layers, n_gpu_layers_draft, rpc, rpc_backend, tensor_split)
            from ..decode import GenerateConfig

            config = GenerateConfig(n_predict=n_predict, **asdict(drafting))
            check_rpc_timeout(rpc_timeout)
            seed = secrets.randbits(32) if seed == -1 else seed
            _run(model, draft, prompt, file, pair_config, config, temp, seed, chat, baseline, as_json, rpc_timeout)
        except Eagle3Error as e:
            fail(str(e))


def _check_flags(prompt, file, n_predict, n_ctx, threads, temp, seed) -> None:
    if prompt is not None and file is not None:
        raise Eagle3Error("give the prompt with -p or -f, not both")
    if n_predict < 1:
        raise Eagle3Error(f"-n must be at least 1 (got {n_predict})")
    check_context_flags(n_ctx, threads)
    if not 0 <= temp < float("inf"):
        raise Eagle3Error(f"--temp must be 0 (greedy) or a finite number above it (got {temp})")
    if not -1 <= seed < 2**64:
        raise Eagle3Error(f"--seed must be between 0 and 2^64 - 1, or -1 for a random one (got {seed})")


INEXACT_NOTE = ("note: on this set-up no verify batch of 2 or more rows is computed bit for bit as a lone row "
                "(exactness probe: {found}): speculating anyway, as upstream llama.cpp does, so near-ties may part "
                "from target-only output (--exact strict keeps it identical)")


def _run(model, draft, prompt, file, pair_config, config, temp, seed, chat, baseline, as_json, rpc_timeout) -> None:
    from .. import rpc
    from ..assets import default_head_path, smollm2_path
    from ..bench import read_prompt_file
    from ..decode import PartialResult, Runner, Sampler
    from ..pair import load_pair
    from ..session import Eagle3Session
    from ..stats import Comparison
    from ..tokens import Detokenizer, chat_tokens, tokenize

    if file is not None:
        prompt = read_prompt_file(file)
    demo = prompt is None
    if demo:
        prompt, chat = DEMO_PROMPT, True
    target_path = model or smollm2_path()
    head_path = draft or default_head_path()
    with load_pair(target_path, head_path, pair_config) as pair:
        tokens = chat_tokens(pair.target_model, prompt) if chat else tokenize(pair.target_model, prompt)
        watchdog = rpc.Watchdog(rpc_timeout, lambda _s: exit_now(
            f"no token for {rpc_timeout:g} s: the rpc-servers stopped answering (check their hosts)")) \
            if pair_config.rpc_servers else None
        with Eagle3Session(pair.target, pair.head) as session, Runner(pair.target, session) as decoder:
            detok = Detokenizer(pair.target_model)
            decoder.check_prompt(tokens)  # before the measurements below, which take seconds on a new set-up
            if config.draft_max > 0:  # the exactness probe and the cost curve, before the text streams
                report = decoder.prepare(config, Sampler(temp, seed))
                if report.mode == "auto" and not report.kept:
                    typer.echo(INEXACT_NOTE.format(found=report.rows()[0][1]), err=True)

            def stream(new: list[int]) -> None:
                if watchdog is not None:
                    watchdog.tick()
                if not as_json:
                    _emit(detok.push(new))
            try:
                spec = decoder.generate(tokens, config, Sampler(temp, seed), speculative=config.draft_max > 0,
                                        on_tokens=stream)
            except PartialResult as p:
                if not as_json:
                    _emit(detok.flush() + "\n")
                typer.echo(p.result.stats.table(), err=True)
                raise typer.Exit(130)
            if not as_json:
                _emit(detok.flush() + "\n")
            if watchdog is not None:
                watchdog.pause()  # the baseline's prompt is processed untimed too
            base = decoder.generate(tokens, config, Sampler(temp, seed), speculative=False,
                                    on_tokens=watchdog and watchdog.tick) if baseline else None
        if watchdog is not None:
            watchdog.stop()
    # rejection sampling draws the target's distribution, not target-only's draws: no identity to check
    same_draws = not (temp > 0.0 and config.spec_sampling == "rejection" and config.draft_max > 0)
    if as_json:
        out = {"text": spec.text, "stats": spec.stats.to_dict()}
        if base is not None:
            cmp = Comparison(spec, base)
            out.update(baseline=base.stats.to_dict(), identical=cmp.identical if same_draws else None,
                       speedup=cmp.speedup)
        typer.echo(json.dumps(out, indent=2))
        return
    typer.echo("", err=True)
    typer.echo(spec.stats.table(), err=True)
    if base is not None:
        cmp = Comparison(spec, base)
        typer.echo(f"\ntarget only        {base.stats.tokens_per_second:.1f} tok/s ({base.stats.n_generated} tokens)",
                   err=True)
        typer.echo(f"speedup            {cmp.speedup:.2f}x" if cmp.speedup else "speedup            n/a (no token "
                   "after the first to time)", err=True)
        if same_draws:
            typer.echo(f"identical output   {'yes' if cmp.identical else 'NO'}", err=True)
        else:
            typer.echo("identical output   n/a (rejection sampling: the target's distribution, not its draws; "
                       "--spec-sampling match compares)", err=True)
    if demo and spec.stats.policy is not None and spec.stats.policy.cost_curve:
        typer.echo(f"\n{demo_line(spec.stats, Comparison(spec, base).speedup if base is not None else None)}", err=True)


# The prompt without -p or -f: a code edit, whose answer repeats the prompt, so that lookup drafts pay even where
# verify rows are dear (2 CPU cores); our own function, no benchmark's
DEMO_PROMPT = """Add type hints to every parameter and return value of this Python function, and return the whole function.

```python
def merge_intervals(intervals):
    intervals = sorted(intervals)
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
```
"""


def demo_line(st, speedup: float | None) -> str:
    """What the demo shows, from its own figures: which drafts carried it, and why chat text gains less here."""
    from ..benchreport import head_break_even, head_verdict

    curve, step = st.policy.cost_curve, st.policy.draft_step_cost
    c2 = curve[1] if len(curve) > 1 else curve[0]
    need = head_break_even(c2, step)
    speed = f", {speedup:.2f}x target-only" if speedup is not None else " (--baseline adds the speedup)"
    chat = ("expect about target-only's speed there on this machine (the adaptive policy then decodes plainly)"
            if need > 0.5 else "a head that good gains there too")
    verdict = head_verdict(need, " here")
    return (f"what you see: a code edit, whose answer repeats its prompt: {st.lookup_accepted} of the {st.n_generated} "
            f"tokens came from lookup drafts (copies of the text so far, no draft step), "
            f"{st.n_accepted - st.lookup_accepted} from the head's drafts{speed}. Chat text has little to copy, and a "
            f"head draft {verdict} (2 verify rows cost "
            f"{c2:.2f}x one row, a draft step {step:.2f}x): {chat}; where verify rows are nearly free (a GPU) far "
            "more pays. `eagle3-gguf bench` measures chat, code, edit and extraction text on this machine."
            + (BUSY_NOTE if speedup is not None and speedup < BUSY_BELOW else ""))


# the demo runs above target-only on an idle 2-core machine (README); far below, another job slowed one of the two runs
BUSY_BELOW = 0.9
BUSY_NOTE = (" Below 1x here, the machine was likely busy while one of the two runs ran (they are timed one after the "
             "other): run it again when it is idle, or `eagle3-gguf bench`, which interleaves them and says when "
             "target-only's own runs differ.")


def _emit(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
