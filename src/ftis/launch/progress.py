"""The columns of every progress bar the launchers and the study runner draw: a description,
the bar, done of total, time elapsed, and a free `info` field each task fills."""

from __future__ import annotations

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)


def progress_columns() -> list[ProgressColumn]:
    """Fresh column objects (rich keeps per-column state, so each Progress gets its own)."""
    return [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
    ]
