"""Named, timed phases: `with timer("sample"): ...` adds to `time/sample` of the step's row."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        """The `time/<phase>` seconds since the last pop, and reset."""
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        self.seconds.clear()
        return out
