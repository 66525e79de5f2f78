"""`eagle3-gguf`: wires the command modules together and turns errors into one line + exit 2."""

from __future__ import annotations

import sys

import typer

from ..errors import Eagle3Error
from . import convert, generate, info, serve, train
from .common import fail, setup_logging  # noqa: F401  (re-exported: commands that still import them from here)

app = typer.Typer(
    name="eagle3-gguf",
    help="EAGLE-3 speculative decoding on llama.cpp: convert draft heads to GGUF, decode faster, losslessly.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


for _command in (info, convert, generate, train, serve):
    _command.register(app)


def main() -> None:
    try:
        app(standalone_mode=True)
    except Eagle3Error as e:  # commands normally catch these themselves; this is the last net
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
