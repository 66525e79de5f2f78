"""`eagle3-gguf convert SRC --target T`: an EAGLE-3 checkpoint → a GGUF head for llama.cpp."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ..errors import Eagle3Error
from .common import fail, setup_logging

_BAR_MIN_BYTES = 64 * 2**20  # show a progress bar only for heads bigger than this


def parse_layer_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise Eagle3Error(f"--layer-ids '{text}': expected 3 comma-separated integers, e.g. 2,15,27") from None
    if len(ids) != 3:
        raise Eagle3Error(f"--layer-ids '{text}': expected exactly 3 ids, e.g. 2,15,27")
    return ids


class _Progress:
    """A progress bar that appears only once the head turns out to be big."""

    def __init__(self) -> None:
        self.bar = None
        self.shown = 0

    def __call__(self, row, done: int, total: int) -> None:
        if self.bar is None and total >= _BAR_MIN_BYTES:
            self.bar = typer.progressbar(length=total, label="writing", file=sys.stderr)
            self.bar.__enter__()
        if self.bar is not None:
            self.bar.update(done - self.shown)
            self.shown = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def register(app: typer.Typer) -> None:
    @app.command("convert")
    def convert(
        src: Path = typer.Argument(..., help="Checkpoint: .safetensors, .bin, *.index.json, or a directory "
                                             "with config.json."),
        target: Path = typer.Option(..., "--target", "-t", help="The target: its .gguf (tokenizer copied in) "
                                                                 "or its HF config.json."),
        out: Path = typer.Option(None, "-o", "--out", help="Output .gguf (default: beside the checkpoint)."),
        layer_ids: str = typer.Option(None, "--layer-ids", help="Override the 3 target layer ids, input-of-layer "
                                                                "as the GGUF stores them, e.g. 2,15,27."),
        outtype: str = typer.Option(None, "--outtype", help="Type of the matrices: q8_0 (default), f16, bf16, "
                                                            "f32."),
        fc_type: str = typer.Option(None, "--fc-type", help="Type of fc: q4_0 (default), q8_0, f16, bf16, f32."),
        verbose: bool = typer.Option(False, "-v", "--verbose", help="Show debug output."),
    ) -> None:
        """Convert a SafeAILab / speculators / ModelOpt / SpecForge EAGLE-3 checkpoint into a GGUF head
        that llama.cpp loads as arch eagle3; prints the detected layout, layer ids and a tensor table."""
        from ..convert import convert_head
        from ..convert.convert import result_text

        setup_logging(verbose)
        progress = _Progress()
        try:
            ids = parse_layer_ids(layer_ids) if layer_ids is not None else None
            result = convert_head(src, out, target, layer_ids=ids, outtype=outtype, fc_type=fc_type,
                                  progress=progress)
        except Eagle3Error as e:
            progress.close()
            fail(str(e))
            return
        progress.close()
        typer.echo(result_text(result))
