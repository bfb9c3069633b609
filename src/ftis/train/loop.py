"""The node shell: what every algorithm shares, top to bottom.

    build       the node's model, tokenizer and optimizer (warm start cached)
    resume      weights, optimizer, RNGs and the algorithm's state from the newest checkpoint
    eval        at step 0 (before training)
    for step in first..S:
        step        the algorithm's own work (`cfg.algorithm.kind`, ftis.algos)
        eval, log, checkpoint, progress

Each evaluation also writes its per-problem outcomes and a few sample completions
(evals.jsonl, samples.jsonl) for every algorithm that evaluates with ftis.train.evaluate.

The shell never learns which algorithm it runs (docs/design.md, "One shell, many algorithms").
Resume, Ctrl-C and lost peers are handled here and in ftis.exchange (docs/RELIABILITY.md).
"""

from __future__ import annotations

import contextlib
import logging
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ftis.config import RunConfig
from ftis.exchange.transport import ExchangeAborted, LocalTransport, Transport, TransportLost
from ftis.plugins import get_algorithm
from ftis.tasks import build_task
from ftis.train.checkpoint import load_latest_checkpoint, save_checkpoint
from ftis.train.context import NodeContext
from ftis.train.evaluate import collect_outcomes, greedy_cache
from ftis.train.metrics import EvalLogger, MetricLogger
from ftis.train.node import Node, build_node
from ftis.train.seeds import node_seed
from ftis.train.timing import PhaseTimer

log = logging.getLogger(__name__)


@dataclass
class NodeResult:
    name: str
    first_eval: dict[str, float]
    last_eval: dict[str, float]
    wall_seconds: float
    steps: int
    interrupted: bool = False  # stopped early by Ctrl-C / SIGTERM, after writing a checkpoint
    last_step: int = 0  # the last completed step (the step of the final checkpoint)


class NoTrainingSignal(RuntimeError):
    """A node had no usable group for `train.max_steps_without_signal` consecutive steps (it
    stopped after a checkpoint rather than drift); the message says why and what to change."""


class SimulatedCrash(BaseException):
    """`testing.crash_at_step` in a single-node run: escapes like a kill (tests only)."""


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
# metrics) after each step. The CLI turns these into a progress bar.
ProgressFn = Callable[..., None]


def train_node(
    cfg: RunConfig,
    *,
    rank: int,
    run_dir: Path,
    transport: Transport | None = None,
    progress: ProgressFn | None = None,
    resume: bool = False,
    stop: StopFlag | None = None,
    crash: Callable[[int], None] | None = None,
    peer_tokenizers: list[str] | None = None,
) -> NodeResult:
    """Run node `rank` of `cfg` to the end (or until `stop`), writing rows and checkpoints
    under `run_dir`.

    transport: how this node reaches its peers; None = a world of one (training alone).
    resume: continue from the node's newest valid checkpoint (weights, optimizer, RNGs, the
        algorithm's state); the caller has already dropped the node's metric rows after that
        step.
    crash: called with the step number when `testing.crash_at_step` is reached (default: raise
        SimulatedCrash); worker processes pass one that exits hard.
    peer_tokenizers: every rank's tokenizer fingerprint from the group-forming handshake
        (`NodeContext.peer_tokenizers`); None: none ran.

    Raises TransportLost (after checkpointing) when the transport itself is gone.
    """
    t_start = time.perf_counter()
    stop = stop or StopFlag()
    transport = transport or LocalTransport()
    node_cfg = cfg.nodes[rank]
    task = build_task(cfg.task, reward=node_cfg.reward)
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
    torch.manual_seed(node_seed(tc.seed, rank))
    found = load_latest_checkpoint(node, node_dir) if resume else None
    start, state = (0, {}) if found is None else (int(found[1]["step"]), found[1])
    if found is not None:
        log.info("node %s: resumed from %s (step %d)", node.name, found[0], start)
    # A transport without a fixed membership (a swarm) may have moved on while this node was
    # away: it joins at the group's current step (optional `join_step(done) -> step`).
    join_step = getattr(transport, "join_step", None)
    if join_step is not None:
        start = max(start, int(join_step(start)))
    # The shell's own running totals: bytes the transport moved, for every algorithm alike.
    totals = {"bytes_sent_total": 0.0, "bytes_received_total": 0.0}
    totals.update({k: v for k, v in state.get("counters", {}).items() if k in totals})
    timer = PhaseTimer()
    algo = get_algorithm(cfg.algorithm.kind).build(
        NodeContext(
            cfg=cfg,
            rank=rank,
            node=node,
            task=task,
            transport=transport,
            timer=timer,
            first_step=start + 1,
            run_dir=run_dir,
            peer_tokenizers=peer_tokenizers,
        )
    )
    if found is not None:
        # Checkpoints of version 1 kept the F-TIS counters where the shell's totals are now.
        v1 = state.get("version") == 1
        algo.load_state_dict({"counters": state.get("counters", {})} if v1 else state["algorithm"])
    transport.ready()
    logger = MetricLogger.for_run(cfg, run_dir, node.name)
    eval_logger = EvalLogger(run_dir, node.name)

    def run_eval(step: int, *, cached: bool = False) -> dict[str, float]:
        with timer("eval"), collect_outcomes() as outcomes, greedy_cache(cached):
            metrics = algo.evaluate(step)
        eval_logger.log(step, outcomes)
        return metrics

    def checkpoint(step: int) -> None:
        save_checkpoint(
            node,
            node_dir,
            step,
            keep=cfg.checkpoint.keep,
            counters=totals,
            algorithm_state=algo.state_dict(),
        )

    last_eval: dict[str, float] = {}
    first_eval: dict[str, float] = {}
    if start == 0 or found is None:  # before training (at the join step for a late joiner)
        # the weights the run starts from: a sweep's other runs often start from them too
        first_eval = last_eval = run_eval(start, cached=True)
        logger.log(
            start,
            {**first_eval, **timer.pop(), "time/setup": setup_seconds, **_reward_stats(task)},
        )
        if progress:
            progress("step", step=start, total=tc.steps, metrics=first_eval)

    crash_at = cfg.testing.crash_at_step.get(node.name)
    done = start  # the last completed step: its row is logged and its update applied
    saved = start if found is not None else -1
    lost: TransportLost | None = None
    starved: NoTrainingSignal | None = None
    pushed = 0.0  # seconds the vLLM engine spent taking weights, up to the last row
    try:
        with stop.installed():
            for step in range(start + 1, tc.steps + 1):
                if stop():
                    break
                if crash_at == step:
                    (crash or _raise_crash)(step)
                sent = transport.stats.copy()
                t_step = time.perf_counter()
                try:
                    metrics = algo.step(step)
                except TransportLost as e:
                    log.error("node %s: step %d dropped: %s", node.name, step, e)
                    lost = e
                    break
                except ExchangeAborted as e:
                    log.warning("node %s: step %d dropped: %s", node.name, step, e)
                    break
                metrics["train/step_seconds"] = time.perf_counter() - t_step
                metrics.update(_engine_metrics(node, pushed))
                pushed = metrics.get("engine/push_s_total", 0.0)
                metrics.update(_transport_metrics(transport, sent, totals))
                metrics["memory/peak_rss_mb"] = peak_rss_mb()
                metrics["train/elapsed_seconds"] = time.perf_counter() - t_start
                if step == tc.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                    last_eval = run_eval(step)
                    metrics.update(last_eval)
                    first_eval = first_eval or last_eval
                metrics.update(timer.pop())
                metrics.update(_reward_stats(task))
                logger.log(step, metrics)
                if start == 0 and step == min(ZERO_REWARD_STEPS, tc.steps):
                    _warn_if_zero_rewards(task, node.name, step)
                done = step
                if step == tc.steps or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                    checkpoint(step)
                    saved = step
                if progress:
                    progress("step", step=step, total=tc.steps, metrics=metrics)
                starved = _starved(cfg, node.name, step, metrics)
                if starved is not None:
                    log.error("%s", starved)
                    break
            if saved != done:  # stopped early (or steps == 0): keep what was done
                checkpoint(done)
    finally:
        logger.close()
        eval_logger.close()
    transport.close()
    if lost is not None:
        raise lost
    if starved is not None:
        raise starved
    return NodeResult(
        name=node.name,
        first_eval=first_eval,
        last_eval=last_eval,
        wall_seconds=time.perf_counter() - t_start,
        steps=tc.steps,
        interrupted=done < tc.steps,
        last_step=done,
    )


ZERO_REWARD_STEPS = 5  # the first steps whose rewards, all 0, earn a warning


def _reward_stats(task) -> dict[str, float]:
    """The reward's counters since the last row (`ftis.rewards.runtime.Reward.pop_stats`)."""
    pop = getattr(task, "pop_reward_stats", None)
    return pop() if callable(pop) else {}


def _warn_if_zero_rewards(task, name: str, step: int) -> None:
    reward = getattr(task, "reward_fn", None)
    if reward is None or reward.total_scored == 0 or reward.total_nonzero:
        return
    log.warning("node %s: %s", name, zero_reward_message(reward.total_scored, step, reward.names))


def zero_reward_message(scored: int, step: int, names: list[str]) -> str:
    """Why every reward of the first steps may be 0: the likely causes, for the log and the
    summary."""
    return (
        f"every one of the {scored} completions scored in steps 0-{step} earned reward 0 "
        f"(reward: {', '.join(names)}). Likely causes: the completions miss the format the "
        "reward wants (look at samples.jsonl); the reward's markers (<think>, <answer>, ####) "
        "are special tokens the model never emits or the prompt never asks for; a reward that "
        "raises (see reward/errors/* in metrics.jsonl and the warnings above); a model too weak "
        "for the task (a warm start, docs/tasks.md)"
    )


def _starved(
    cfg: RunConfig, name: str, step: int, metrics: dict[str, float]
) -> NoTrainingSignal | None:
    """The error that stops a node whose algorithm reports `train/no_signal_streak` (consecutive
    steps without a usable group) at `train.max_steps_without_signal`; None otherwise."""
    limit = cfg.train.max_steps_without_signal
    streak = int(metrics.get("train/no_signal_streak", 0))
    if not limit or streak < limit:
        return None
    return NoTrainingSignal(
        f"node {name}: no usable group for {streak} consecutive steps (steps "
        f"{step - streak + 1}-{step}: every group had a single completion or equal rewards, so "
        f"no optimizer step was taken); stopped after a checkpoint of step {step} rather than "
        "go on without a training signal. Check that the peers are alive (horizontal sharing "
        "needs every peer's share of a group) and the task's difficulty, or set "
        "train.max_steps_without_signal (0 = never stop)"
    )


def _engine_metrics(node: Node, pushed_before: float) -> dict[str, float]:
    """train.rollout_engine vllm: the engine's start-up seconds, and the seconds this step and
    the run so far spent pushing the trainer's weights into it (nothing without an engine)."""
    engine = node.engine
    if engine is None:
        return {}
    return {
        "engine/start_s": engine.start_seconds,
        "engine/push_s": engine.push_seconds - pushed_before,
        "engine/push_s_total": engine.push_seconds,
    }


def _transport_metrics(transport: Transport, before, totals: dict[str, float]) -> dict[str, float]:
    """Bytes the transport moved during the step, and since the run began, under the same
    names for every algorithm (nothing when training alone)."""
    if transport.world_size == 1:
        return {}
    now = transport.stats
    sent = float(now.bytes_sent - before.bytes_sent)
    received = float(now.bytes_received - before.bytes_received)
    totals["bytes_sent_total"] += sent
    totals["bytes_received_total"] += received
    return {
        "exchange/bytes_sent": sent,
        "exchange/bytes_received": received,
        "exchange/bytes_sent_total": totals["bytes_sent_total"],
        "exchange/bytes_received_total": totals["bytes_received_total"],
    }


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB.

    Read from VmHWM in /proc/self/status where there is one (Linux): it belongs to this
    process's own address space. getrusage's ru_maxrss is not: Linux carries the address space
    a process had before exec into the figure, and a forked child starts with a copy of its
    parent's, so every node process started by a launcher with a larger footprint reported at
    least the launcher's resident size. ru_maxrss is the fallback elsewhere
    (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def _raise_crash(step: int) -> None:
    raise SimulatedCrash(f"crash_at_step={step}")
