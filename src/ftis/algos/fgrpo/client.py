"""One FGRPO client (a data owner): E local GRPO steps from the global model on its own task,
then its delta, performance signal and sample count (docs/fgrpo.md). No Flower here: the
ClientApp (`ftis.algos.fgrpo.apps`) calls this, and tests call it directly.

    load        the global trainable parameters (all weights, or LoRA adapters) into the model
    for e in 1..E:
        sample      P prompts of the client's train split, G completions each
        score       the client's verifier, times its reward scale
        advantages  per group
        update      the node's loss (any method), train.update_epochs x train.mini_batches steps
    before      (baseline pre-round) the same signal for the global model, before training:
                its held-out score, or the first local step's mean training reward
    performance mean scaled reward of greedy answers on the held-out local batch (or the last
                step's mean training reward)
    reply       delta = theta_k - theta, P_k, P_k before, n_k (sequences trained on), metrics

Every random draw is keyed by (client seed, local step number), and the optimizer starts fresh
every round (FedAvg with local Adam), so a round depends only on the global parameters it is
given, whichever worker process runs it: a resumed run repeats the uninterrupted one exactly.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ftis.algos.federated.params import (  # noqa: F401  (trainable_params: re-exported)
    COUNT_KEY,
    PERF_BEFORE_KEY,
    PERF_KEY,
    load_params,
    params_delta,
    save_client_checkpoint,
    trainable_params,
)
from ftis.algos.fgrpo.config import FGRPOConfig
from ftis.config import EvalConfig, NodeConfig, RunConfig, TrainConfig
from ftis.rollout.types import RolloutBatch
from ftis.tasks import build_task
from ftis.tasks.base import Problem, Task
from ftis.train import scoring
from ftis.train.evaluate import evaluate
from ftis.train.node import Node, build_node, build_optimizer
from ftis.train.sampling import generate
from ftis.train.seeds import eval_seed
from ftis.train.timing import PhaseTimer
from ftis.train.update import mean_step_metrics, train_on_round
from ftis.warmstart import starting_model

# Per-local-step figures that a round's row reports as totals rather than means.
SUMMED = ("train/optimizer_steps", "train/skipped_update", "train/generated_tokens")


# ---- the client's data ---------------------------------------------------------------------


def client_seed(seed: int, name: str) -> int:
    """The seed of client `name`'s prompt draws and sampling noise (distinct per client)."""
    key = hashlib.blake2b(f"fgrpo-client:{seed}:{name}".encode(), digest_size=8)
    return int.from_bytes(key.digest(), "little") & ((1 << 62) - 1)


class ScaledTask:
    """A task whose verifier reward is multiplied by `scale` (a client's reward scale); every
    split and prompt is the wrapped task's."""

    def __init__(self, task: Task, scale: float) -> None:
        self.task, self.scale = task, float(scale)
        self.name = task.name
        self.eval_splits = task.eval_splits

    def split(self, name: str) -> Sequence[Problem]:
        return self.task.split(name)

    def prompt_ids(self, problem: Problem, tokenizer) -> list[int]:
        return self.task.prompt_ids(problem, tokenizer)

    def reward(self, problem: Problem, completion: str) -> float:
        return self.scale * self.task.reward(problem, completion)


class HeldOutBatch:
    """The client's held-out local batch as a one-split task ("local"): the last `size` train
    problems, which local training never draws. Rewards are scaled like training rewards."""

    def __init__(self, task: ScaledTask, size: int) -> None:
        self.task = task
        train = task.split("train")
        self.problems = [train[i] for i in range(len(train) - size, len(train))]
        self.name = task.name
        self.eval_splits = ("local",)

    def split(self, name: str) -> Sequence[Problem]:
        return self.problems if name == "local" else self.task.split(name)

    def prompt_ids(self, problem: Problem, tokenizer) -> list[int]:
        return self.task.prompt_ids(problem, tokenizer)

    def reward(self, problem: Problem, completion: str) -> float:
        return self.task.reward(problem, completion)


@dataclass
class RoundResult:
    """What a client sends after a round: its delta, performance signal (after its local
    training, and before it when the baseline is pre-round; else None), sample count and the
    metrics of its row."""

    delta: dict[str, torch.Tensor]
    performance: float
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)
    performance_before: float | None = None


# ---- the client ----------------------------------------------------------------------------


class LocalClient:
    """Client `rank` of `cfg` (node `cfg.nodes[rank]`), on the model in `base_dir` (the shared
    warm start, built once by the launcher) or the node's own model config when None."""

    def __init__(self, cfg: RunConfig, rank: int, *, base_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.algo: FGRPOConfig = cfg.algorithm  # type: ignore[assignment]
        self.rank = rank
        node_cfg: NodeConfig = cfg.nodes[rank]
        self.name = node_cfg.name
        if base_dir is not None:  # the shared warm start, already made: build on it
            model = starting_model(node_cfg.model, None, cfg.task, base_dir=base_dir)
            node_cfg = node_cfg.model_copy(update={"model": model, "warm_start": None})
        self.node: Node = build_node(node_cfg, rank=rank, task_cfg=cfg.task)
        spec = self.algo.client_spec(self.name)
        self.task: Task = build_task(self.algo.client_task(cfg, self.name), reward=node_cfg.reward)
        self.scaled = ScaledTask(self.task, spec.reward_scale)
        self.seed = client_seed(cfg.train.seed, self.name)
        self.train_cfg: TrainConfig = cfg.train.model_copy(update={"seed": self.seed})
        self.prompts_per_step = spec.prompts_per_step or cfg.train.prompts_per_step
        size = len(self.task.split("train"))
        held = self.algo.performance_size
        if size - held < self.prompts_per_step:
            raise ValueError(
                f"client {self.name}: its train split has {size} problems, too few for a held-out "
                f"batch of algorithm.performance_size={held} plus {self.prompts_per_step} prompts "
                "per step; lower performance_size"
            )
        self.trainable_size = size - held  # local training draws from [0, size - held)
        self.held_out = HeldOutBatch(self.scaled, held)
        self.timer = PhaseTimer()

    # -- one round -----------------------------------------------------------------------

    def train_round(self, params: Mapping[str, torch.Tensor], round_: int) -> RoundResult:
        """E local GRPO steps from `params`; returns delta, performance, n and metrics."""
        t0 = time.perf_counter()
        load_params(self.node.model, params)
        self.node.model.train()
        # Fresh local optimizer every round (FedAvg with a local optimizer): the round depends
        # on the global parameters only.
        self.node.optimizer = build_optimizer(self.node.model, self.node.cfg.optim)
        before = None
        if self.algo.pre_round and self.algo.performance == "eval":
            with self.timer("performance"):  # the global model's score: the round's baseline
                before = self._performance(round_)
        torch.manual_seed(self.seed + round_)
        steps: list[dict[str, float]] = []
        num_examples = 0
        last_reward = 0.0
        E = self.algo.local_steps
        for e in range(1, E + 1):
            step = (round_ - 1) * E + e  # global local-step number: keys noise and prompts
            batch, _, m = self._local_step(step)
            num_examples += batch.num_sequences
            last_reward = m["reward/mean"]
            if e == 1 and self.algo.pre_round and self.algo.performance == "train":
                before = last_reward  # sampled from the global model, before any update
            steps.append(m)
        metrics = mean_step_metrics(steps)  # means over the local steps...
        for key in SUMMED:  # ...but counts add up over the round
            metrics[key] = float(sum(m.get(key, 0.0) for m in steps))
        with self.timer("performance"):
            performance = (
                self._performance(round_) if self.algo.performance == "eval" else last_reward
            )
        delta = params_delta(self.node.model, params)
        metrics.update(self.timer.pop())
        metrics["train/local_steps"] = float(E)
        metrics["train/num_examples"] = float(num_examples)
        metrics["train/local_seconds"] = time.perf_counter() - t0
        metrics["fgrpo/performance"] = performance
        if before is not None:
            metrics["fgrpo/performance_before"] = before
        return RoundResult(delta, performance, num_examples, metrics, before)

    def fit(
        self, params: Mapping[str, torch.Tensor], round_: int, config: Mapping[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
        """The ClientApp's train call: (delta, reply metrics with the performance signal and
        sample count, the state kept in the client's checkpoint)."""
        result = self.train_round(params, round_)
        metrics = {**result.metrics, PERF_KEY: result.performance, COUNT_KEY: result.num_examples}
        if result.performance_before is not None:
            metrics[PERF_BEFORE_KEY] = result.performance_before
        return result.delta, metrics, {"performance": result.performance}

    def _local_step(self, step: int) -> tuple[RolloutBatch, torch.Tensor, dict[str, float]]:
        tc = self.train_cfg
        with self.timer("sample"):
            rng = random.Random(f"fgrpo-prompts:{self.seed}:{step}")
            indices = rng.sample(range(self.trainable_size), self.prompts_per_step)
            train = self.task.split("train")
            batch = generate(
                self.node,
                self.task,
                [train[i] for i in indices],
                slots=(0, tc.group_size),
                cfg=tc,
                step=step,
            )
        with self.timer("score"):
            raw, bad = scoring.finite_rewards(scoring.score(self.task, self.node.tokenizer, batch))
            rewards = raw * self.scaled.scale
        with self.timer("advantages"):
            adv = scoring.advantages_for(batch, rewards, self.node.cfg.loss.advantage_scale)
        with self.timer("update"):
            m = self._update(batch, adv, step)
        m["reward/mean"] = float(rewards.mean()) if rewards.numel() else 0.0
        m["reward/own"] = float(raw.mean()) if raw.numel() else 0.0  # unscaled: 0/1 accuracy
        m["reward/non_finite"] = float(bad)
        m["train/completion_tokens"] = (
            float(batch.lengths.float().mean()) if batch.num_sequences else 0.0
        )
        m["train/generated_tokens"] = float(batch.num_tokens)
        return batch, rewards, m

    def _update(self, batch: RolloutBatch, adv: torch.Tensor, step: int) -> dict[str, float]:
        """The local step's optimizer steps (one on the batch, or update_epochs x mini_batches;
        a non-finite step is skipped and counted), as every GRPO-family algorithm does them."""
        out, skipped = train_on_round(
            self.node, self.task, batch, adv, train=self.train_cfg, step=step
        )
        out["train/skipped_update"] = float(skipped)
        return out

    def _performance(self, round_: int) -> float:
        """Mean scaled reward of greedy answers on the held-out local batch."""
        cfg = EvalConfig(
            size=len(self.held_out.problems), batch_size=self.cfg.eval.batch_size, pass_samples=0
        )
        m = evaluate(
            self.node, self.held_out, cfg, self.train_cfg, seed=eval_seed(self.seed, round_)
        )
        return float(m["eval/accuracy"])

    # -- evaluation and checkpoints ------------------------------------------------------

    def evaluate(self, params: Mapping[str, torch.Tensor], round_: int) -> dict[str, float]:
        """eval/* of the model `params` on the client's own task (unscaled: accuracy)."""
        load_params(self.node.model, params)
        with self.timer("eval"):
            m = evaluate(
                self.node,
                self.task,
                self.cfg.eval,
                self.cfg.train,
                seed=eval_seed(self.cfg.train.seed, round_),
            )
        m.update(self.timer.pop())
        m["eval/size"] = float(
            min(self.cfg.eval.size, len(self.task.split(self.task.eval_splits[0])))
        )
        return m

    def save(self, run_dir: Path, round_: int, state: dict[str, Any] | None = None) -> None:
        """Checkpoint the client's local model (after its round) under nodes/<name>/."""
        save_client_checkpoint(self, run_dir, round_, state)
