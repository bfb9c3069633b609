"""Start a run's nodes. One node runs in this process; several nodes run as one process each
(ftis.launch.multi, ftis.launch.worker)."""

from __future__ import annotations

import logging
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from ftis.config import RunConfig
from ftis.launch.multi import MultiResult
from ftis.launch.progress import progress_columns
from ftis.train.checkpoint import checkpoint_step
from ftis.train.loop import train_node
from ftis.train.metrics import truncate_run_rows

log = logging.getLogger(__name__)


class ProgressBar:
    """Turns the loop's progress events into a rich progress bar (warm start, then the
    algorithm's steps, labelled by `phase`: the algorithm's kind)."""

    def __init__(self, progress: Progress, node: str, phase: str = "RL") -> None:
        self.p = progress
        self.node = node
        self.phase = phase
        self.warm = None
        self.rl = None
        self.acc = "-"

    def __call__(self, event: str, **info) -> None:
        if event == "warm":
            if self.warm is None:
                self.warm = self.p.add_task(f"{self.node} warm start", total=info["total"], info="")
            self.p.update(self.warm, completed=info["step"], info=f"loss {info['loss']:.3f}")
            return
        if self.rl is None:
            self.rl = self.p.add_task(f"{self.node} {self.phase}", total=info["total"], info="")
        m = info["metrics"]
        if "eval/accuracy" in m:
            self.acc = f"{100 * m['eval/accuracy']:.1f}%"
        reward = m.get("reward/mean")
        reward_txt = f"reward {reward:.2f} " if reward is not None else ""
        self.p.update(
            self.rl, completed=info["step"], total=info["total"], info=f"{reward_txt}acc {self.acc}"
        )


def run_local(
    cfg: RunConfig, run_dir: Path, *, console: Console | None = None, resume: bool = False
) -> MultiResult:
    """Run every node of `cfg` on this machine: in this process when there is one node, else
    one process per rank (ftis.launch.multi, ftis.launch.worker). `resume` continues every node
    from its newest checkpoint. Ctrl-C stops the nodes after a checkpoint, then raises
    KeyboardInterrupt. A node lost while the others finished raises NodesLostError (a
    LaunchError) after they wrote everything. An algorithm registered with its own launcher
    (e.g. fgrpo, through Flower's simulation engine) is handed the run instead."""
    from ftis.plugins import get_algorithm
    from ftis.preflight import check_run

    check_run(cfg)  # model paths, optional packages: one clear error before any worker starts
    spec = get_algorithm(cfg.algorithm.kind)
    if spec.launcher is not None:
        return spec.launch(cfg, run_dir, console=console, resume=resume)
    if len(cfg.rank_names) != 1:
        from ftis.launch.multi import run_multi

        return run_multi(cfg, run_dir, console=console, resume=resume)
    name = cfg.nodes[0].name
    if resume:
        step = checkpoint_step(run_dir / "nodes" / name)
        truncate_run_rows(run_dir, name, after_step=step)
    columns = progress_columns()
    with Progress(*columns, console=console, disable=not cfg.log.progress) as p:
        bar = ProgressBar(p, name, cfg.algorithm.kind)
        res = train_node(
            cfg,
            rank=0,
            run_dir=run_dir,
            progress=bar,
            resume=resume,
        )
    if res.interrupted:
        raise KeyboardInterrupt  # after the checkpoint: callers see Ctrl-C as before
    return MultiResult(exit_codes={name: 0})
