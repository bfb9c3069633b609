"""Metric sinks. JSONL always (RUN_DIR/metrics.jsonl, one object per line, with `step` and
`node`); TensorBoard when asked for and installed."""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _clean(v: Any) -> Any:
    # JSON has no NaN/inf: write null so every line stays valid JSON for other tools.
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class JsonlSink:
    """Appends one line per row with a single O_APPEND write, so several node processes can
    share one metrics.jsonl without interleaving their lines."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, row: dict[str, Any]) -> None:
        line = json.dumps({k: _clean(v) for k, v in row.items()}) + "\n"
        os.write(self._fd, line.encode("utf-8"))

    def close(self) -> None:
        os.close(self._fd)


class TensorBoardSink:
    def __init__(self, logdir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # tensorboard is an optional extra
            raise RuntimeError(
                "log.tensorboard is on but the tensorboard package is missing: "
                "pip install 'ftis[tensorboard]', or set log.tensorboard=false"
            ) from e
        self._w = SummaryWriter(str(logdir))

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        for k, v in row.items():
            if isinstance(v, int | float) and k != "step" and math.isfinite(v):
                self._w.add_scalar(k, v, step)

    def close(self) -> None:
        self._w.close()


class MetricLogger:
    """Fans one row out to every sink; adds the node name."""

    def __init__(self, run_dir: Path, node: str, *, tensorboard: bool = False) -> None:
        self.node = node
        self.sinks: list[Any] = [JsonlSink(run_dir / "metrics.jsonl")]
        if tensorboard:
            self.sinks.append(TensorBoardSink(run_dir / "tensorboard" / node))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, "node": self.node, **metrics}
        for s in self.sinks:
            s.write(row)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All rows of a metrics.jsonl; a torn last line (crash mid-write) is skipped."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("skipping a malformed line in %s", path)
    return rows


def truncate_rows(path: Path, node: str, *, after_step: int | None) -> int:
    """Drop `node`'s rows with step > after_step (all of them when after_step is None), so a
    resumed node neither loses nor repeats rows; returns how many were dropped.

    Under an exclusive lock, rewritten to a temporary file and renamed into place. Call it before
    any process opens the file for appending (the launcher and the workers do so before the
    group forms)."""
    if not path.exists():
        return 0
    lock = path.with_name(path.name + ".lock")
    with lock.open("w") as lf:
        fcntl.flock(lf, fcntl.LOCK_EX)
        kept, dropped = [], 0
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1  # a torn line from the crash
                continue
            if row.get("node") == node and (after_step is None or row.get("step", 0) > after_step):
                dropped += 1
                continue
            kept.append(line)
        if dropped:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
            os.replace(tmp, path)
    return dropped
