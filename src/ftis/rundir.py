"""The run directory's safety rules (docs/RELIABILITY.md, "The run directory").

- ftis marks every run directory it creates with a `.ftis-run` file; replacing a directory
  (`--overwrite`) removes only one that holds that marker, so a mistyped `--out` or run name
  can never delete someone else's files.
- One run at a time per directory: a run holds an exclusive `fcntl` lock on `.ftis-lock` in its
  directory from before the first write to the end; a second run (a second `--resume`, or an
  `--overwrite` of a running directory) is refused with a message saying so. The kernel drops
  the lock when the process dies, however it dies, so a crashed run never leaves it stuck.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

MARKER = ".ftis-run"
LOCK = ".ftis-lock"


class RunDirError(RuntimeError):
    """The run directory cannot be used; the message says why and what to do."""


def is_ftis_run_dir(run_dir: Path) -> bool:
    """Whether `run_dir` holds ftis's marker (it was created by ftis)."""
    return (run_dir / MARKER).is_file()


def check_not_a_file(run_dir: Path) -> None:
    """A RunDirError when `run_dir` (or a parent of it) exists and is not a directory."""
    for p in (run_dir, *run_dir.parents):
        if p.exists() and not p.is_dir():
            raise RunDirError(
                f"cannot write the run directory {run_dir}: {p} is a file, not a directory; "
                "choose another --out"
            )


def mark(run_dir: Path) -> None:
    """Create `run_dir` (and its parents) if needed and write ftis's marker into it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MARKER).write_text("a run directory created by ftis; --overwrite may replace it\n")


def clear(run_dir: Path, *, keep: tuple[str, ...] = (MARKER, LOCK)) -> None:
    """Remove everything inside `run_dir` but `keep`. Refuses (RunDirError) a directory that
    ftis did not create: one without the marker, or a symlink."""
    if run_dir.is_symlink():
        raise RunDirError(
            f"{run_dir} is a symlink (to {os.readlink(run_dir)}): --overwrite does not replace "
            "a directory through a link, even one ftis created. Pass the directory itself as "
            "--out, or choose another --out"
        )
    if not is_ftis_run_dir(run_dir):
        raise RunDirError(
            f"{run_dir} was not created by ftis (it has no {MARKER} marker): --overwrite only "
            "replaces run directories that ftis wrote. Remove it yourself if you mean to, or "
            "choose another --out"
        )
    for child in run_dir.iterdir():
        if child.name in keep:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


@contextlib.contextmanager
def locked(run_dir: Path) -> Iterator[None]:
    """Hold the run directory's exclusive lock for the duration; RunDirError at once when
    another process holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            who = f" (process {holder})" if holder.isdigit() else ""
            raise RunDirError(
                f"{run_dir} is in use by another ftis run{who}: one run at a time per "
                "directory. Wait for it to finish or stop it, or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextlib.contextmanager
def claim(run_dir: Path, *, overwrite: bool = False, resume: bool = False) -> Iterator[None]:
    """Take `run_dir` for one run, holding its lock until the block ends.

    resume: the directory must exist; it is locked and left as it is.
    Otherwise (a new run): the directory must be absent or empty, or (overwrite) be one ftis
    created, whose contents are removed under the lock. It is created and marked."""
    check_not_a_file(run_dir)
    if run_dir.is_symlink() and not run_dir.exists():
        raise RunDirError(
            f"{run_dir} is a symlink to {os.readlink(run_dir)}, which does not exist: remove the "
            "link, or choose another --out"
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(
            f"cannot write the run directory {run_dir}: {e.strerror or e}; choose another --out"
        ) from None
    if resume:
        with locked(run_dir):
            yield
        return
    nonempty = run_dir.is_dir() and any(c.name not in (MARKER, LOCK) for c in run_dir.iterdir())
    if nonempty and not overwrite:
        raise RunDirError(
            f"run directory {run_dir} already exists and is not empty; pass --overwrite "
            f"to replace it, --out DIR to write elsewhere, or --resume {run_dir} to "
            "continue it"
        )
    if nonempty and not is_ftis_run_dir(run_dir):
        clear(run_dir)  # raises: not ftis's (checked before the lock file is created there)
    with locked(run_dir):
        if nonempty:
            clear(run_dir)
        mark(run_dir)
        yield
