"""ftis: collaborative post-training of different LLMs with F-TIS.

Python entry point: ``ftis.run(config, out=None, overrides=())`` (see ftis.api.run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__version__ = "0.1.0"


def run(config: Any = None, out: str | Path | None = None, overrides: Any = (), **kw: Any) -> Path:
    """Train from a YAML path, a dict or a RunConfig, as `ftis run` does; returns the run
    directory. See ftis.api.run for every option (resume, overwrite)."""
    from ftis.api import run as _run

    return _run(config, out, overrides, **kw)
