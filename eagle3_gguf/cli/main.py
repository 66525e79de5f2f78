"""`eagle3-gguf`: wires the command modules together and turns errors into one line + exit 2."""

from __future__ import annotations

import logging
import sys

import typer

from ..errors import Eagle3Error

app = typer.Typer(
    name="eagle3-gguf",
    help="EAGLE-3 speculative decoding on llama.cpp: convert draft heads to GGUF, decode faster, losslessly.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    from . import info

    info.register(app)
    for name in ("convert", "generate", "train", "bench", "serve"):
        try:
            module = __import__(f"{__package__}.{name}", fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.{name}":
                raise
            continue
        module.register(app)


_register()


def setup_logging(verbose: bool) -> None:
    """Quiet by default; -v shows our debug lines and llama.cpp's own log."""
    from ..native import enable_llama_log

    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(message)s",
                        stream=sys.stderr)
    enable_llama_log(verbose)


def fail(message: str) -> None:
    """Print one error line on stderr and exit 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


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
