"""`ftis eval`: score a node's checkpoint of a run, or any model directory (an export), on a
task's evaluation splits, with the run's own evaluation code (`ftis.train.evaluate.evaluate`):
greedy accuracy on each split (mean reward where the reward gives partial credit) and, when
asked, pass@k. For a run's checkpoint of step S the numbers are those the run logged at step S
(tests/test_offline_eval.py): the node is rebuilt as a resume rebuilds it, the checkpoint's
weights are loaded, and pass@k samples with the run's evaluation seed of that step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class EvalError(ValueError):
    """The evaluation cannot be made; the message says what to give instead."""


@dataclass
class EvalResult:
    source: str  # the run directory or model directory scored
    node: str
    step: int | None  # the checkpoint's step (None for a model directory)
    metrics: dict[str, float]  # eval/<split>/accuracy, eval/accuracy, eval/pass@k, ...
    problems: dict[str, int]  # problems scored per split

    def as_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "node": self.node,
            "step": self.step,
            "problems": self.problems,
            **self.metrics,
        }


class SplitsView:
    """A task whose evaluation splits are `splits` (the rest is the task's own)."""

    def __init__(self, task: Any, splits: list[str]) -> None:
        self._task = task
        self.eval_splits = splits

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)


def evaluate_source(
    source: Path,
    *,
    config: Path | None = None,
    node: str | None = None,
    step: int | None = None,
    split: str | None = None,
    pass_k: list[int] | None = None,
    size: int | None = None,
) -> EvalResult:
    """Score `source`: a run directory (its checkpoint of `step`, default the one a resume would
    load, of `node`, default its only node; `config` default its config.yaml) or a Hugging Face
    model directory (`config` names the task and the node settings: its `node`, default the
    first). `split` keeps one evaluation split; `pass_k` adds pass@k (samples = max k);
    `size` overrides eval.size."""
    from ftis.config import load_config
    from ftis.tasks import build_task
    from ftis.train.checkpoint import latest_checkpoint, load_checkpoint, read_meta
    from ftis.train.evaluate import collect_outcomes, evaluate
    from ftis.train.node import build_node
    from ftis.train.seeds import eval_seed

    source = Path(source)
    is_run = (source / "config.yaml").is_file() and (source / "nodes").is_dir()
    if not source.is_dir():
        raise EvalError(f"{source} is not a directory: give a run directory or a model directory")
    if not is_run and not (source / "config.json").is_file():
        raise EvalError(
            f"{source} is neither a run directory (config.yaml and nodes/) nor a model "
            "directory (config.json): give one of them"
        )
    if config is None:
        if not is_run:
            raise EvalError(f"{source} is a model directory: name the task with --config CONFIG")
        config = source / "config.yaml"
    cfg = load_config(config, [])
    names = [n.name for n in cfg.nodes]
    if node is None:
        if is_run and len(names) > 1:
            raise EvalError(
                f"{source} has {len(names)} nodes: choose one with --node ({', '.join(names)})"
            )
        node = names[0]
    if node not in names:
        raise EvalError(f"no node {node!r} in {config}; its nodes are: {', '.join(names)}")
    rank = names.index(node)
    node_cfg = cfg.nodes[rank]
    eval_cfg = cfg.eval
    if pass_k:
        if any(k < 1 for k in pass_k):
            raise EvalError(f"--pass-k {pass_k}: each k must be at least 1")
        eval_cfg = eval_cfg.model_copy(
            update={"pass_k": sorted(set(pass_k)), "pass_samples": max(pass_k)}
        )
    else:
        eval_cfg = eval_cfg.model_copy(update={"pass_samples": 0})
    if size is not None:
        eval_cfg = eval_cfg.model_copy(update={"size": size})
    if is_run:
        if step is None:
            ckpt = latest_checkpoint(source / "nodes" / node)
            if ckpt is None:
                raise EvalError(f"{source / 'nodes' / node} has no checkpoint to evaluate")
        else:
            ckpt = source / "nodes" / node / f"step-{step:06d}"
            if not ckpt.is_dir():
                have = sorted(p.name for p in (source / "nodes" / node).glob("step-*"))
                raise EvalError(
                    f"{source / 'nodes' / node} has no checkpoint of step {step}; it has: "
                    + (", ".join(have) or "none")
                )
        built = build_node(node_cfg, rank=rank, task_cfg=cfg.task)
        load_checkpoint(built, ckpt)
        step = int(read_meta(ckpt)["step"])
    else:
        from ftis.models.loading import ModelConfig

        model_cfg = ModelConfig(
            path=str(source), dtype=node_cfg.model.dtype, device=node_cfg.model.device
        )
        built = build_node(
            node_cfg.model_copy(update={"model": model_cfg, "warm_start": None}),
            rank=rank,
            task_cfg=cfg.task,
        )
    built.model.eval()
    task = build_task(cfg.task, reward=node_cfg.reward)
    if split is not None:
        if split not in task.eval_splits:
            raise EvalError(
                f"--split {split!r}: the task's evaluation splits are {', '.join(task.eval_splits)}"
            )
        task = SplitsView(task, [split])
    seed = eval_seed(cfg.train.seed, step or 0)
    with collect_outcomes() as outcomes:
        metrics = evaluate(built, task, eval_cfg, cfg.train, seed=seed)
    problems = {o.split: len(o.correct) for o in outcomes}
    return EvalResult(str(source), node, step, metrics, problems)


__all__ = ["EvalError", "EvalResult", "evaluate_source"]
