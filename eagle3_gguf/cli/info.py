"""`eagle3-gguf info FILE.gguf`: what a head or a target is, and whether they can pair."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import typer

from ..errors import Eagle3Error
from ..report import describe_gguf
from .common import fail, setup_logging


def register(app: typer.Typer) -> None:
    @app.command("info")
    def info(
        path: Path = typer.Argument(..., help="A GGUF file: an EAGLE-3 head or a target model."),
        tensors: bool = typer.Option(False, "--tensors", help="Also list every tensor (name, shape, type, size)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts (always with the tensors)."),
        verbose: bool = typer.Option(False, "-v", "--verbose", help="Show debug output."),
    ) -> None:
        """Summarise a GGUF: for a target its layers, hidden size, heads, vocab, tensor types, context,
        chat template and whether the pinned llama.cpp can extract its hidden states; for a head its target
        layers, hidden size, draft vocab and flags. --tensors lists the tensors."""
        setup_logging(verbose)
        try:
            report = describe_gguf(path)
        except Eagle3Error as e:
            fail(str(e))
            return
        if as_json:
            typer.echo(json.dumps(asdict(report), indent=2, default=str))
        else:
            typer.echo(report.text(tensors=tensors))
