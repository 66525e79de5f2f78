"""`eagle3-gguf`: wires the command modules together and turns errors into one line + exit 2."""

from __future__ import annotations

import inspect
import os
import signal
import sys

import typer

try:  # typer 0.2x carries its own click; older typers use click's
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError

from ..errors import Eagle3Error
from . import bench, convert, generate, info, serve, train
from .common import EXIT_INTERRUPTED, EXIT_TERMINATED, TERMINATION

app = typer.Typer(
    name="eagle3-gguf",
    help="EAGLE-3 speculative decoding on llama.cpp: convert draft heads to GGUF, decode faster, losslessly.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


for _command in (info, convert, generate, bench, train, serve):
    _command.register(app)
for _info in app.registered_commands:  # the commands table keeps a docstring's line breaks: its first paragraph, as one
    _info.short_help = _info.short_help or " ".join(inspect.getdoc(_info.callback).split("\n\n")[0].split())


def main() -> None:
    termination = TERMINATION
    termination.install()
    try:
        try:
            code = app(prog_name="eagle3-gguf", standalone_mode=False)  # usage errors come here, not to a boxed screen
            sys.stdout.flush()  # a full disk fails here, not silently at the interpreter's exit
            sys.exit(code if isinstance(code, int) else 0)  # a command's typer.Exit(code), or 0
        except NoArgsIsHelpError:  # `eagle3-gguf` alone: typer has shown the help; click's exit code
            sys.exit(2)
        except UsageError as e:  # an unknown flag, a bad value, a missing argument
            where = e.ctx.command_path if e.ctx is not None else "eagle3-gguf"
            typer.echo(f"error: {' '.join(e.format_message().split())} (see {where} --help)", err=True)
            sys.exit(2)
        except ClickException as e:
            typer.echo(f"error: {' '.join(e.format_message().split())}", err=True)
            sys.exit(e.exit_code)
        except typer.Abort:  # end of input at a prompt
            typer.echo("Aborted!", err=True)
            sys.exit(1)
        except Eagle3Error as e:  # commands normally catch these themselves; this is the last net
            typer.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:  # outside a command (typer turns one inside into exit 130)
            sys.exit(EXIT_INTERRUPTED)
        except OSError as e:  # commands say their own files' errors: this is the output (a full disk, `| head`)
            sys.exit(output_failed(e))
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            raise  # sys.exit("message"): Python prints it
        code = termination.exit_code(e.code or 0)
        if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
            typer.echo("terminated" if termination.signum == signal.SIGTERM else "interrupted", err=True)
        sys.exit(code)


def output_failed(e: OSError) -> int:
    """The exit code where writing failed: a reader that stopped reading (`| head -1`) ends the run quietly with 1,
    as click ends one whose pipe closes mid-command; anything else is one line and 2."""
    try:
        sys.stdout.flush()
    except OSError:
        pass  # what is left in the buffer cannot be written: it goes
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())  # the interpreter's last flush would fail again
        os.close(null)
    except (OSError, ValueError):
        pass  # stdout is no file (captured): nothing flushes it at exit
    if isinstance(e, BrokenPipeError):
        return 1
    if e.filename is not None:  # a file a command did not say its own error for
        typer.echo(f"error: {e.filename}: {e.strerror or e}", err=True)
    else:
        typer.echo(f"error: the output could not be written ({e.strerror or e})", err=True)
    return 2


if __name__ == "__main__":
    main()
