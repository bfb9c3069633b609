"""Metric sinks. JSONL always (RUN_DIR/metrics.jsonl, one object per line, with `step` and
`node`); TensorBoard and Weights & Biases when asked for (log.tensorboard, log.wandb) and
installed (the `tracking` extra). Each evaluation's per-problem outcomes and
sample completions go to RUN_DIR/evals.jsonl and RUN_DIR/samples.jsonl (`EvalLogger`)."""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

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
                "pip install 'ftis[tracking]', or set log.tensorboard=false"
            ) from e
        self._w = SummaryWriter(str(logdir))

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        for k, v in row.items():
            if isinstance(v, int | float) and k != "step" and math.isfinite(v):
                self._w.add_scalar(k, v, step)

    def close(self) -> None:
        self._w.close()


# Set for the W&B client unless the user set them: no traffic leaves the machine by default
# (offline runs, synced later with `wandb sync RUN_DIR/wandb/offline-run-*` if wanted), no
# console noise, no crash reports.
WANDB_DEFAULTS = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false"}


class WandbSink:
    """One W&B run per node (named <run>/<node>, grouped by the run's name), its files under
    RUN_DIR/wandb. Offline unless the environment sets WANDB_MODE (WANDB_DEFAULTS); git and code
    capture and system-metrics sampling are off."""

    def __init__(
        self, run_dir: Path, node: str, *, run_name: str, config: dict[str, Any] | None = None
    ) -> None:
        for key, value in WANDB_DEFAULTS.items():
            os.environ.setdefault(key, value)
        try:
            import wandb
        except ImportError as e:  # wandb is an optional extra
            raise RuntimeError(
                "log.wandb is on but the wandb package is missing: "
                "pip install 'ftis[tracking]', or set log.wandb=false"
            ) from e
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(
            # explicit, not left to the environment: wandb's process-wide setup reads it once
            mode=os.environ["WANDB_MODE"],
            silent=True,
            console="off",
            disable_git=True,
            disable_code=True,
            save_code=False,
            x_disable_stats=True,
        )
        self._run = wandb.init(
            dir=str(run_dir),
            project=os.environ.get("WANDB_PROJECT", "ftis"),
            name=f"{run_name}/{node}",
            group=run_name,
            config=config or {},
            settings=settings,
            reinit="create_new",  # several nodes' runs in one process (FGRPO's simulation)
        )

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        data = {
            k: v
            for k, v in row.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"
            if math.isfinite(v)
        }
        self._run.log(data, step=step)

    def close(self) -> None:
        self._run.finish()


class MetricLogger:
    """Fans one row out to every sink; adds the node name."""

    def __init__(
        self,
        run_dir: Path,
        node: str,
        *,
        tensorboard: bool = False,
        wandb: bool = False,
        run_name: str = "ftis",
        config: dict[str, Any] | None = None,
    ) -> None:
        self.node = node
        self.sinks: list[Any] = [JsonlSink(run_dir / "metrics.jsonl")]
        if tensorboard:
            self.sinks.append(TensorBoardSink(run_dir / "tensorboard" / node))
        if wandb:
            self.sinks.append(WandbSink(run_dir, node, run_name=run_name, config=config))

    @classmethod
    def for_run(cls, cfg: Any, run_dir: Path, node: str) -> MetricLogger:
        """The logger of `node` in a run of RunConfig `cfg`: the sinks its `log` section asks
        for; W&B gets the resolved config."""
        return cls(
            run_dir,
            node,
            tensorboard=cfg.log.tensorboard,
            wandb=cfg.log.wandb,
            run_name=cfg.name,
            config=cfg.model_dump(mode="json") if cfg.log.wandb else None,
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, "node": self.node, **metrics}
        for s in self.sinks:
            s.write(row)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


# The row files of a run directory, each with `step` and `node` on every line: resume drops a
# node's rows after its checkpoint from all of them (`truncate_run_rows`).
ROW_FILES = ("metrics.jsonl", "evals.jsonl", "samples.jsonl")


def encode_outcomes(correct: Any) -> str:
    """Per-problem 0/1 outcomes as hex: problem i is bit 7 - i % 8 of byte i // 8 (the first
    problem is the high bit of the first byte), zero-padded to whole bytes. 1024 problems take
    256 characters."""
    bits = np.asarray(correct, dtype=np.uint8).ravel()
    if bits.size and bits.max() > 1:
        raise ValueError("outcomes must be 0 or 1")
    return np.packbits(bits).tobytes().hex()


def decode_outcomes(text: str, n: int) -> np.ndarray:
    """(n,) uint8 outcomes from `encode_outcomes`' hex; ValueError when the length or the padding
    does not fit n."""
    raw = np.frombuffer(bytes.fromhex(text), dtype=np.uint8)
    if len(raw) != (n + 7) // 8:
        raise ValueError(f"{len(text)} hex characters cannot hold {n} outcomes")
    bits = np.unpackbits(raw)
    if bits[n:].any():
        raise ValueError("outcome padding bits are not zero")
    return bits[:n]


class EvalLogger:
    """Writes what one evaluation saw, besides its metrics row: one evals.jsonl line per eval
    split (`step`, `node`, `split`, `n`, `correct`: the greedy per-problem outcomes, hex of
    `encode_outcomes`) and one samples.jsonl line per sample completion (`step`, `node`,
    `split`, `prompt`: the text the model was given, `question`: the problem as plain text,
    `completion`, `reward`). `outcomes` are ftis.train.evaluate's
    SplitOutcome records. The files are opened at the first evaluation that has outcomes, so
    an algorithm that evaluates otherwise (e.g. preference accuracy only) leaves none."""

    def __init__(self, run_dir: Path, node: str) -> None:
        self.node = node
        self.run_dir = run_dir
        self.evals: JsonlSink | None = None
        self.samples: JsonlSink | None = None

    def log(self, step: int, outcomes: list[Any]) -> None:
        if outcomes and self.evals is None:
            self.evals = JsonlSink(self.run_dir / "evals.jsonl")
            self.samples = JsonlSink(self.run_dir / "samples.jsonl")
        for o in outcomes:
            assert self.evals is not None and self.samples is not None
            self.evals.write(
                {
                    "step": step,
                    "node": self.node,
                    "split": o.split,
                    "n": len(o.correct),
                    "correct": encode_outcomes(o.correct),
                }
            )
            questions = list(getattr(o, "questions", None) or [])
            for k, (prompt, completion, reward) in enumerate(o.samples):
                row = {"step": step, "node": self.node, "split": o.split, "prompt": prompt}
                if k < len(questions):
                    row["question"] = questions[k]
                self.samples.write({**row, "completion": completion, "reward": reward})

    def close(self) -> None:
        for sink in (self.evals, self.samples):
            if sink is not None:
                sink.close()


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


def truncate_run_rows(run_dir: Path, node: str, *, after_step: int | None) -> int:
    """`truncate_rows` on every row file of the run directory (ROW_FILES); rows dropped in all."""
    return sum(truncate_rows(run_dir / name, node, after_step=after_step) for name in ROW_FILES)
