"""What every command shares: one error line + exit 2, and the logging set-up (`-v`).

The command modules import these from here, never from main.py, so main.py (which imports the commands)
and the commands import no circle.
"""

from __future__ import annotations

import logging
import sys

import typer


def setup_logging(verbose: bool) -> None:
    """Quiet by default; -v shows our debug lines and llama.cpp's own log.

    Only the CLI routes llama.cpp's process-wide log callback through Python logging: importing
    eagle3_gguf leaves llama-cpp-python's callback in place."""
    from ..native import enable_llama_log, install_log_callback

    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(message)s",
                        stream=sys.stderr)
    install_log_callback()
    enable_llama_log(verbose)


def fail(message: str) -> None:
    """Print one error line on stderr and exit 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)
