"""The training loop of one node, top to bottom.

    eval(step 0)
    for step in 1..S:
        sample      this node's share of the step's prompts, G completions each (or G/n: horizontal)
        exchange    every node's rollouts, tokens + sampler log-probs only
        score       rewards from this node's own verifier
        advantages  per group (= per prompt), before any filtering
        update      receiver log-probs, F-TIS (or another) loss, one optimizer step
        eval, log, checkpoint

Resume, Ctrl-C and lost peers are handled here and in ftis.exchange.store (docs/RELIABILITY.md).
Deviations from the paper are listed in docs/design.md.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ftis.config import RunConfig
from ftis.exchange.base import Exchange, ExchangeAborted
from ftis.rollout.types import RolloutBatch
from ftis.tasks import build_task
from ftis.train import phases
from ftis.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
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
    interrupted: bool = False  # stopped early by Ctrl-C / SIGTERM, after writing a checkpoint
    last_step: int = 0  # the last completed step (the step of the final checkpoint)


class SimulatedCrash(BaseException):
    """`nodes[i].crash_at_step` in a single-node run: escapes like a kill (tests only)."""


class StopFlag:
    """Ctrl-C (SIGINT) or SIGTERM asks the loop to stop: it finishes the step it is in (or drops
    it while waiting for peers), writes a checkpoint of the last completed step and returns. A
    second Ctrl-C interrupts at once. Installed only in the main thread."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self) -> bool:
        return self.requested

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def handler(signum, frame):
            if self.requested and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.requested = True
            log.warning("stop requested: checkpointing after the current step")

        for sig in previous:
            signal.signal(sig, handler)
        try:
            yield
        finally:
            for sig, h in previous.items():
                signal.signal(sig, h)


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
    resume: bool = False,
    stop: StopFlag | None = None,
    crash: Callable[[int], None] | None = None,
) -> NodeResult:
    """Train node `rank` of `cfg` to the end (or until `stop`), writing rows and checkpoints
    under `run_dir`.

    resume: continue from the node's newest checkpoint (weights, optimizer, RNGs, counters); the
        caller has already dropped the node's metric rows after that step.
    crash: called with the step number when `crash_at_step` is reached (default: raise
        SimulatedCrash); worker processes pass one that exits hard.
    """
    t_start = time.perf_counter()
    stop = stop or StopFlag()
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
    node_dir = run_dir / "nodes" / node.name
    tc = cfg.train
    vocab_size = int(node.model.get_input_embeddings().num_embeddings)
    torch.manual_seed(tc.seed * 7919 + rank)
    counters = {"generated_tokens_total": 0.0, "skipped_updates_total": 0.0}
    start = 0
    ckpt = latest_checkpoint(node_dir) if resume else None
    if ckpt is not None:
        state = load_checkpoint(node, ckpt)
        start = int(state["step"])
        counters.update(state.get("counters", {}))
        log.info("node %s: resumed from %s (step %d)", node.name, ckpt, start)
    exchange = exchange_factory(node)
    logger = MetricLogger(run_dir, node.name, tensorboard=cfg.log.tensorboard)
    timer = PhaseTimer()

    def run_eval(step: int) -> dict[str, float]:
        with timer("eval"):
            return evaluate(node, task, cfg.eval, tc, seed=tc.seed + 104729 * step)

    def checkpoint(step: int) -> None:
        save_checkpoint(
            node,
            node_dir,
            step,
            keep=cfg.checkpoint.keep,
            counters=counters,
        )

    last_eval: dict[str, float] = {}
    first_eval: dict[str, float] = {}
    if start == 0:
        first_eval = last_eval = run_eval(0)
        logger.log(0, {**first_eval, **timer.pop(), "time/setup": setup_seconds})
        if progress:
            progress("step", step=0, total=tc.steps, metrics=first_eval)

    done = start  # the last completed step: its row is logged and its update applied
    saved = start if ckpt is not None else -1
    try:
        with stop.installed():
            for step in range(start + 1, tc.steps + 1):
                if stop():
                    break
                if node_cfg.crash_at_step == step:
                    (crash or _raise_crash)(step)
                try:
                    metrics = _train_step(
                        cfg,
                        node,
                        task,
                        exchange,
                        timer,
                        step=step,
                        rank=rank,
                        vocab_size=vocab_size,
                        counters=counters,
                    )
                except ExchangeAborted as e:
                    log.warning("node %s: step %d dropped: %s", node.name, step, e)
                    break
                metrics["train/elapsed_seconds"] = time.perf_counter() - t_start
                if step == tc.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                    last_eval = run_eval(step)
                    metrics.update(last_eval)
                    first_eval = first_eval or last_eval
                metrics.update(timer.pop())
                logger.log(step, metrics)
                done = step
                if step == tc.steps or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                    checkpoint(step)
                    saved = step
                if progress:
                    progress("step", step=step, total=tc.steps, metrics=metrics)
            if saved != done:  # stopped early (or steps == 0): keep what was done
                checkpoint(done)
    finally:
        logger.close()
    exchange.close()
    return NodeResult(
        name=node.name,
        first_eval=first_eval,
        last_eval=last_eval,
        wall_seconds=time.perf_counter() - t_start,
        steps=tc.steps,
        interrupted=done < tc.steps,
        last_step=done,
    )


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _raise_crash(step: int) -> None:
    raise SimulatedCrash(f"crash_at_step={step}")


def _train_step(
    cfg: RunConfig,
    node: Node,
    task,
    exchange: Exchange,
    timer: PhaseTimer,
    *,
    step: int,
    rank: int,
    vocab_size: int,
    counters: dict[str, float],
) -> dict[str, float]:
    """sample -> exchange -> validate -> score -> advantages -> update, for one step."""
    tc, loss_cfg, node_cfg = cfg.train, node.cfg.loss, node.cfg
    train_split = task.split("train")
    t_step = time.perf_counter()
    with timer("sample"):
        indices = phases.step_prompts(tc.seed, step, tc.prompts_per_step, len(train_split))
        mine = phases.assign_prompts(
            indices, rank=rank, world_size=exchange.world_size, scheme=cfg.sharing.scheme
        )
        slots = phases.sample_slots(
            rank=rank,
            world_size=exchange.world_size,
            scheme=cfg.sharing.scheme,
            group_size=tc.group_size,
        )
        own = phases.generate(
            node, task, [train_split[i] for i in mine], slots=slots, cfg=tc, step=step
        )
    with timer("exchange"):
        outgoing = own
        if node_cfg.adversary is not None:  # testing/research: a dishonest peer
            adv_gen = torch.Generator().manual_seed(tc.seed * 1_000_003 + 7919 * step + rank)
            outgoing = phases.adversarial(
                own, node_cfg.adversary, vocab_size=vocab_size, generator=adv_gen
            )
        received = exchange.all_gather(outgoing)
        received[rank] = own  # a node trains on its own honest samples
    with timer("validate"):
        rejected = 0
        for peer, b in enumerate(received):
            if peer == rank or b is None:
                continue
            quota = phases.peer_prompt_quota(
                indices,
                peer=peer,
                world_size=exchange.world_size,
                scheme=cfg.sharing.scheme,
                group_size=tc.group_size,
            )
            why = phases.check_peer_batch(b, quota, train_size=len(train_split))
            if why is not None:
                log.warning(
                    "node %s step %d: rejected rank %d's batch: %s", node.name, step, peer, why
                )
                received[peer] = None
                rejected += 1
    batch = RolloutBatch.concat([b for b in received if b is not None], node.tokenizer.pad_token_id)
    with timer("score"):
        rewards, bad_rewards = phases.finite_rewards(phases.score(task, node.tokenizer, batch))
    if bad_rewards:
        log.warning(
            "node %s step %d: the verifier returned %d non-finite rewards; counted as 0",
            node.name,
            step,
            bad_rewards,
        )
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
            counters["skipped_updates_total"] += 1
    metrics["train/skipped_updates_total"] = counters["skipped_updates_total"]
    metrics["reward/non_finite"] = float(bad_rewards)
    metrics.update(_reward_metrics(batch, rewards, rank))
    metrics.update(_exchange_metrics(exchange, own, batch, rejected=rejected))
    counters["generated_tokens_total"] += own.num_tokens
    metrics["train/generated_tokens"] = float(own.num_tokens)
    metrics["train/generated_tokens_total"] = counters["generated_tokens_total"]
    metrics["train/step_seconds"] = time.perf_counter() - t_step
    metrics["memory/peak_rss_mb"] = peak_rss_mb()
    return metrics


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
    exchange: Exchange, own: RolloutBatch, batch: RolloutBatch, *, rejected: int = 0
) -> dict[str, float]:
    """Wire cost and validation of this step; `rejected` adds the trainer's own rejections
    (prompt checks) to the decoder's."""
    if exchange.world_size == 1:
        return {}
    s = exchange.last_stats
    out = {
        "exchange/bytes_sent": float(s.bytes_sent),
        "exchange/bytes_received": float(s.bytes_received),
        "exchange/seconds": s.seconds,
        "exchange/rejected": float(s.rejected + rejected),
        "exchange/sequences_received": float(batch.num_sequences - own.num_sequences),
        # encode_seconds, comm_seconds (includes waiting for slower peers), decode_seconds;
        # the store transport adds peers (payloads received) and lost_peers (so far)
        **{f"exchange/{k}": float(v) for k, v in s.extra.items()},
    }
    if own.num_tokens:
        out["exchange/bytes_per_token"] = s.bytes_sent / own.num_tokens
    return out
