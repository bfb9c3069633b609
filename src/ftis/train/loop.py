"""The training loop of one node, top to bottom.

    eval(step 0)
    for step in 1..S:
        sample      this node's share of the step's prompts, G completions each (or G/n: horizontal)
        exchange    every node's rollouts, tokens + sampler log-probs only
        score       rewards from this node's own verifier
        advantages  per group (= per prompt), before any filtering
        update      receiver log-probs, F-TIS (or another) loss, one optimizer step
        eval, log, checkpoint

Deviations from the paper are listed in docs/design.md.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ftis.config import RunConfig
from ftis.exchange.base import Exchange
from ftis.rollout.types import RolloutBatch
from ftis.tasks import build_task
from ftis.train import phases
from ftis.train.checkpoint import save_checkpoint
from ftis.train.evaluate import evaluate
from ftis.train.metrics import MetricLogger
from ftis.train.node import Node, build_node

log = logging.getLogger(__name__)


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
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        self.seconds.clear()
        return out


@dataclass
class NodeResult:
    name: str
    first_eval: dict[str, float]
    last_eval: dict[str, float]
    wall_seconds: float
    steps: int


# progress(event, **info): "warm" (step, total, loss) during warm start, "step" (step, total,
# metrics) after each RL step. The CLI turns these into a progress bar.
ProgressFn = Callable[..., None]


def train_node(
    cfg: RunConfig,
    *,
    rank: int,
    exchange_factory: Callable[[Node], Exchange],
    run_dir: Path,
    progress: ProgressFn | None = None,
) -> NodeResult:
    t_start = time.perf_counter()
    node_cfg = cfg.nodes[rank]
    task = build_task(cfg.task)
    node = build_node(
        node_cfg,
        rank=rank,
        task_cfg=cfg.task,
        warm_progress=(lambda s, n, loss: progress("warm", step=s, total=n, loss=loss))
        if progress
        else None,
    )
    setup_seconds = time.perf_counter() - t_start  # model build + warm start (or cache load)
    exchange = exchange_factory(node)
    logger = MetricLogger(run_dir, node.name, tensorboard=cfg.log.tensorboard)
    node_dir = run_dir / "nodes" / node.name
    tc, loss_cfg = cfg.train, node_cfg.loss
    train_split = task.split("train")
    torch.manual_seed(tc.seed * 7919 + rank)
    sampler_gen = torch.Generator().manual_seed(tc.seed * 7919 + rank)
    timer = PhaseTimer()

    def run_eval(step: int) -> dict[str, float]:
        with timer("eval"):
            return evaluate(node, task, cfg.eval, tc, seed=tc.seed + 104729 * step)

    first_eval = run_eval(0)
    logger.log(0, {**first_eval, **timer.pop(), "time/setup": setup_seconds})
    last_eval = first_eval
    if progress:
        progress("step", step=0, total=tc.steps, metrics=first_eval)

    generated = 0  # completion tokens this node has sampled: the compute axis of equal-budget plots
    for step in range(1, tc.steps + 1):
        t_step = time.perf_counter()
        with timer("sample"):
            indices = phases.step_prompts(tc.seed, step, tc.prompts_per_step, len(train_split))
            mine, per_prompt = phases.assign_prompts(
                indices,
                rank=rank,
                world_size=exchange.world_size,
                scheme=cfg.sharing.scheme,
                group_size=tc.group_size,
            )
            own = phases.generate(
                node,
                task,
                [train_split[i] for i in mine],
                num_samples=per_prompt,
                cfg=tc,
                generator=sampler_gen,
            )
        with timer("exchange"):
            received = exchange.all_gather(own)
        batch = RolloutBatch.concat(
            [b for b in received if b is not None], node.tokenizer.pad_token_id
        )
        with timer("score"):
            rewards = phases.score(task, node.tokenizer, batch)
        with timer("advantages"):
            adv = phases.advantages_for(batch, rewards, loss_cfg.advantage_scale)
        metrics: dict[str, float] = {}
        with timer("update"):
            try:
                upd = phases.update(
                    node, task, batch, adv, loss_cfg=loss_cfg, micro_batch_size=tc.micro_batch_size
                )
                metrics.update({f"loss/{k}": v for k, v in upd.items()})
                metrics["train/skipped_update"] = 0
            except phases.NonFiniteError as e:
                log.warning("node %s step %d: update skipped: %s", node.name, step, e)
                metrics["train/skipped_update"] = 1
        metrics.update(_reward_metrics(batch, rewards, rank))
        metrics.update(_exchange_metrics(exchange, own, batch))
        generated += own.num_tokens
        metrics["train/generated_tokens"] = float(own.num_tokens)
        metrics["train/generated_tokens_total"] = float(generated)
        metrics["train/step_seconds"] = time.perf_counter() - t_step
        metrics["train/elapsed_seconds"] = time.perf_counter() - t_start
        metrics["memory/peak_rss_mb"] = peak_rss_mb()
        if step == tc.steps or (cfg.eval.every and step % cfg.eval.every == 0):
            last_eval = run_eval(step)
            metrics.update(last_eval)
        metrics.update(timer.pop())
        logger.log(step, metrics)
        if step == tc.steps or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
            save_checkpoint(
                node,
                node_dir,
                step,
                keep=cfg.checkpoint.keep,
                extra_rng={"sampler": sampler_gen.get_state()},
            )
        if progress:
            progress("step", step=step, total=tc.steps, metrics=metrics)

    if tc.steps == 0:
        save_checkpoint(node, node_dir, 0, keep=cfg.checkpoint.keep)
    logger.close()
    exchange.close()
    return NodeResult(
        name=node.name,
        first_eval=first_eval,
        last_eval=last_eval,
        wall_seconds=time.perf_counter() - t_start,
        steps=tc.steps,
    )


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reward_metrics(batch: RolloutBatch, rewards: torch.Tensor, rank: int) -> dict[str, float]:
    own = batch.generator == rank
    out = {"reward/mean": float(rewards.mean()) if rewards.numel() else 0.0}
    if own.any():
        out["reward/own"] = float(rewards[own].mean())
    if (~own).any():
        out["reward/peers"] = float(rewards[~own].mean())
    out["train/completion_tokens"] = (
        float(batch.lengths.float().mean()) if batch.num_sequences else 0.0
    )
    return out


def _exchange_metrics(
    exchange: Exchange, own: RolloutBatch, batch: RolloutBatch
) -> dict[str, float]:
    if exchange.world_size == 1:
        return {}
    s = exchange.last_stats
    out = {
        "exchange/bytes_sent": float(s.bytes_sent),
        "exchange/bytes_received": float(s.bytes_received),
        "exchange/seconds": s.seconds,
        "exchange/rejected": float(s.rejected),
        "exchange/sequences_received": float(batch.num_sequences - own.num_sequences),
        # encode_seconds, comm_seconds (includes waiting for slower peers), decode_seconds
        **{f"exchange/{k}": float(v) for k, v in s.extra.items()},
    }
    if own.num_tokens:
        out["exchange/bytes_per_token"] = s.bytes_sent / own.num_tokens
    return out
