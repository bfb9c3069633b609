"""Studies: runs over seeds described in one YAML file, run sequentially with resume, summarised
into a results document (docs/RESULTS.md, docs/results/*.md). See studies/*.yaml and
docs/design.md ("Studies").

The engine (ftis.study.engine) is generic: a study file's `kind:` picks a registered study kind
(ftis.study.registry: "grid" and "arms" here, others registered by the systems), and its
document is written by the study renderer the system registered. Names are imported lazily, so
that ftis.algos can register into ftis.study.registry without importing the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RunSpec": "ftis.study.spec",
    "Study": "ftis.study.spec",
    "StudyError": "ftis.study.spec",
    "SweepOutcome": "ftis.study.runner",
    "plan": "ftis.study.engine",
    "run_status": "ftis.study.runner",
    "load_study": "ftis.study.engine",
    "run_study": "ftis.study.engine",
    "write_results": "ftis.study.engine",
    "register_study_kind": "ftis.study.registry",
    "register_study_renderer": "ftis.study.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ftis.study' has no attribute {name!r}")
