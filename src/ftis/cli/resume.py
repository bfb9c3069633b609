"""What a stopped run can continue from, and how to tell the user."""

from __future__ import annotations

from pathlib import Path


def _resume_hint(cfg, run_dir: Path) -> str:
    """How to continue a run that stopped on a fault: --resume when a node (or a federated
    run's server) has a checkpoint, else start again (warm starts are cached)."""
    from ftis.train.checkpoint import CheckpointError, checkpoint_step

    for name in [n.name for n in cfg.nodes] + ["server"]:
        try:
            if checkpoint_step(run_dir / "nodes" / name) is not None:
                return f"Continue with: ftis run --resume {run_dir}"
        except CheckpointError:
            continue
    return (
        f"No checkpoint had been written yet (checkpoint.every: {cfg.checkpoint.every}; 0 "
        f"saves only at the end), so start again: ftis run CONFIG --out {run_dir} --overwrite "
        "(finished warm starts are cached)"
    )


def _stopped_message(cfg, run_dir: Path) -> str:
    """What a stopped run can resume: every node with a checkpoint continues from it; a node
    stopped before its first one (during its warm start, say) starts again from step 0. A run
    with no checkpoint at all cannot be resumed, but finished warm starts are cached."""
    from ftis.train.checkpoint import CheckpointError, checkpoint_step

    steps: dict[str, int | None] = {}
    for n in cfg.nodes:
        try:
            steps[n.name] = checkpoint_step(run_dir / "nodes" / n.name)
        except CheckpointError:
            steps[n.name] = None
    if all(s is None for s in steps.values()):
        return (
            f"interrupted before any node wrote a checkpoint (during setup or the warm start): "
            f"there is nothing to resume in {run_dir}. Start the run again with --overwrite; "
            "warm starts that finished are cached and are not redone"
        )
    missing = [n for n, s in steps.items() if s is None]
    have = ", ".join(f"{n} at step {s}" for n, s in steps.items() if s is not None)
    tail = (
        f"; {', '.join(missing)} stopped before a checkpoint and will start from step 0"
        if missing
        else ""
    )
    return (
        f"interrupted; the nodes wrote checkpoints ({have}){tail}. Continue with: "
        f"ftis run --resume {run_dir}"
    )


def _resumable_config(run_dir: Path, overrides: list[str]):
    """The config of a run directory that has something to resume from."""
    from ftis.config import load_config
    from ftis.train.checkpoint import CheckpointError, checkpoint_step

    if not (run_dir / "config.yaml").is_file():
        raise CheckpointError(
            f"{run_dir} is not a run directory (no config.yaml); give a directory written by "
            "ftis run"
        )
    cfg = load_config(run_dir / "config.yaml", overrides)
    steps = {n.name: checkpoint_step(run_dir / "nodes" / n.name) for n in cfg.nodes}
    if all(s is None for s in steps.values()):
        raise CheckpointError(
            f"{run_dir} has no checkpoints (nodes/<name>/latest) to resume from: the run "
            "stopped before its first one. Start it again with --overwrite, or set "
            "checkpoint.every to save more often"
        )
    return cfg
