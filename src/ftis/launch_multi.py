"""Launch a multi-node run on this machine: one process per node under torch's own launcher
(`python -m torch.distributed.run`, i.e. torchrun), gloo on CPU or NCCL when every node has a GPU.
The parent process only watches: it draws progress from the nodes' status files and reports
their errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ftis.config import RunConfig


class LaunchError(RuntimeError):
    """A node process failed; the message carries the nodes' own error messages."""


def torchrun_command(cfg: RunConfig, run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={len(cfg.nodes)}",
        "-m",
        "ftis.worker",
        str(run_dir / "config.yaml"),
        "--out",
        str(run_dir),
    ]


def run_multi(cfg: RunConfig, run_dir: Path, *, console: Console | None = None) -> None:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(cfg.nodes))))
    env["PYTHONUNBUFFERED"] = "1"
    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
    ]
    with (
        (logs / "nodes.log").open("w") as log_file,
        Progress(*columns, console=console, disable=not cfg.log.progress) as progress,
    ):
        proc = subprocess.Popen(
            torchrun_command(cfg, run_dir),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        bars: dict[tuple[str, str], int] = {}
        try:
            while proc.poll() is None:
                _update_bars(progress, bars, cfg, run_dir)
                time.sleep(0.5)
            _update_bars(progress, bars, cfg, run_dir)
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)
            raise
    if proc.returncode != 0:
        errors = [p.read_text().strip() for p in sorted(logs.glob("rank*.error"))]
        detail = "\n".join(dict.fromkeys(errors)) or f"see {logs / 'nodes.log'}"
        raise LaunchError(f"a node failed (exit code {proc.returncode}): {detail}")


def _update_bars(progress: Progress, bars: dict, cfg: RunConfig, run_dir: Path) -> None:
    for node in cfg.nodes:
        path = run_dir / ".status" / f"{node.name}.json"
        try:
            state = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        phase = "warm start" if state["event"] == "warm" else "RL"
        key = (node.name, phase)
        if key not in bars:
            bars[key] = progress.add_task(f"{node.name} {phase}", total=state["total"], info="")
        if phase == "warm start":
            info = f"loss {state['loss']:.3f}"
        else:
            parts = []
            if "reward/mean" in state:
                parts.append(f"reward {state['reward/mean']:.2f}")
            if "eval/accuracy" in state:
                parts.append(f"acc {100 * state['eval/accuracy']:.1f}%")
            info = " ".join(parts)
        progress.update(bars[key], completed=state["step"], info=info)
