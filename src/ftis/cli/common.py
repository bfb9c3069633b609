"""What every verb shares: the stderr console, logging, the one-line error and its exit code,
and tables on stdout."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

console = Console(stderr=True)


def setup_logging(verbose: bool) -> None:
    handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
    logger = logging.getLogger("ftis")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    logger.propagate = False
    for noisy in ("transformers", "peft", "torch"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    # transformers' own tqdm bars ("Loading weights", "Writing model shards") would
    # interleave with ftis's progress display.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def fail(msg: str, code: int = 2) -> None:
    console.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True, highlight=False)
    ended(code)
    raise typer.Exit(code)


SUPERVISED_ENV = "FTIS_SUPERVISED_STATUS"  # set by `_supervise` for the run it watches


def ended(code: int) -> None:
    """Tell a supervising `ftis run` (`_supervise`) that ftis ended this run itself."""
    path = os.environ.get(SUPERVISED_ENV)
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(str(code))


def stdout() -> Console:
    """The console tables go to. Off a terminal (a pipe, a file, CI) rich would assume 80
    columns and wrap or truncate node names; there it is wide (unless COLUMNS says otherwise),
    so each row stays one line."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=WIDE_COLUMNS)


WIDE_COLUMNS = 400


def print_table(header: list[str], body: list[list[str]], title: str) -> None:
    table = Table(title=title)
    for h in header:
        table.add_column(h)
    for row in body:
        table.add_row(*row)
    stdout().print(table)
