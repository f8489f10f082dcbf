"""The command line's shared pieces: the typer app every command registers on, the consoles,
and `user_errors`, which turns every failure into one line (never a traceback). The commands
live in `cli` (build, inspect, generate, serve) and in `bench` and `calibrate`, which register
themselves on `app`; `cli` imports them, so `metrale.cli:app` holds every command.
"""

from __future__ import annotations

import contextlib
import logging
import os

import typer
from rich.console import Console
from rich.text import Text

from metrale.runtime.errors import MetraleError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Ahead-of-time engine builder and serving runtime for speculative decoding.")
err = Console(stderr=True)
out = Console()


def say_error(message: str) -> None:
    """One line on stderr, the message printed literally (no markup, no highlighting)."""
    err.print(Text("error: ", style="bold red") + Text(message), highlight=False, soft_wrap=True)


def say_warning(message: str) -> None:
    err.print(Text("warning: ", style="bold yellow") + Text(message), highlight=False, soft_wrap=True)


@contextlib.contextmanager
def user_errors():
    """MetraleError -> its message, exit 2; an OS error (a file, a folder, a port) -> its
    message naming the path, exit 1; Ctrl-C -> exit 130; anything else is a bug, reported in one
    line (exit 1; METRALE_DEBUG=1 re-raises it). Never a traceback."""
    try:
        yield
    except MetraleError as exc:
        say_error(str(exc))
        raise typer.Exit(2) from None
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        say_error(f"{where}{exc.strerror or exc}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP turned into it by a build
        import signal

        name = str(exc) if str(exc) in ("SIGTERM", "SIGHUP") else "SIGINT"
        say_error(f"interrupted ({name})")
        raise typer.Exit(128 + signal.Signals[name].value) from None
    except Exception as exc:  # a bug: still one line, with the traceback in the log on request
        if os.environ.get("METRALE_DEBUG"):
            raise
        logging.getLogger("metrale").debug("internal error", exc_info=exc)
        say_error(f"internal error ({type(exc).__name__}: {exc}); this is a bug in metrale — "
                  "METRALE_DEBUG=1 shows the traceback")
        raise typer.Exit(1) from None
