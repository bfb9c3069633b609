"""One FedDPO client (a user with its own preferences): E local DPO steps from the model the
server sends, then its delta and number of training pairs (docs/dpo.md, "FedDPO"). No Flower
here: the ClientApp (`ftis.algos.federated.apps`) calls this, and so does the centralized
baseline's evaluation.

    built once   the model (the shared base model), the frozen reference (the starting
                 weights: a copy, or the LoRA model with its adapters off), the client's pairs
                 (`data`, as gossip-dpo: its own prompts and mistakes), its own task
    fit          load the sent parameters, a fresh optimizer (FedAvg with a local optimizer),
                 LocalDPO.train(E, first=(round-1)*E): the batches of the round are keyed by
                 (train.seed, client, round), so a round depends only on the parameters sent,
                 whichever worker runs it; reply delta = theta_k - sent, n_k = training pairs
    evaluate     held-out preference accuracy (its own pairs) and greedy eval/accuracy on its
                 own task (the run's task with its data.agents overrides)
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ftis.algos.dpo.config import FedDPOConfig
from ftis.algos.dpo.data import agent_task, tokenized_agent_pairs
from ftis.algos.dpo.local import LocalDPO, Reference
from ftis.algos.federated.params import (
    COUNT_KEY,
    load_params,
    params_delta,
    save_client_checkpoint,
)
from ftis.config import RunConfig
from ftis.train.evaluate import evaluate
from ftis.train.node import Node, build_node, build_optimizer
from ftis.train.seeds import eval_seed
from ftis.train.timing import PhaseTimer


def reference_for(model: torch.nn.Module) -> Reference:
    """The frozen reference of a model that has not trained yet: LoRA -> adapters off (the base
    is never trained), else a frozen copy."""
    if hasattr(model, "disable_adapter"):
        return Reference.adapters_off(model)
    return Reference.frozen_copy(model)


def dpo_learner(
    cfg: RunConfig, node: Node, reference: Reference, pairs: Any, **kw: Any
) -> LocalDPO:
    """LocalDPO on `node` with the run's DPO settings (`kw` overrides, e.g. batch_size)."""
    algo: FedDPOConfig = cfg.algorithm  # type: ignore[assignment]
    args: dict[str, Any] = {
        "pad_id": node.tokenizer.pad_token_id,
        "beta": algo.beta,
        "batch_size": algo.batch_size,
        "grad_clip": node.cfg.optim.grad_clip,
        "include_prompt": algo.include_prompt,
        "sft_weight": algo.sft_weight,
        "seed": cfg.train.seed,
        "salt": node.cfg.name,
        **kw,
    }
    return LocalDPO(node.model, node.optimizer, reference, pairs, **args)


def evaluate_client(
    cfg: RunConfig, node: Node, local: LocalDPO, heldout: Any, task: Any, round_: int
) -> dict[str, float]:
    """eval/* of `node`'s model for one client: preference figures on its held-out pairs,
    eval/accuracy on its task (or = preference accuracy with task_eval false), eval/size = its
    held-out pairs (the server's union weights)."""
    out = local.evaluate(heldout)
    if cfg.algorithm.task_eval:  # type: ignore[attr-defined]
        out.update(
            evaluate(node, task, cfg.eval, cfg.train, seed=eval_seed(cfg.train.seed, round_))
        )
    else:
        out["eval/accuracy"] = out["eval/preference_accuracy"]
    out["eval/size"] = float(len(heldout))
    return out


class DPOClient:
    """Client `rank` of `cfg` (node `cfg.nodes[rank]`), on the model in `base_dir` (the shared
    warm start, built once by the launcher) or the node's own model config when None."""

    def __init__(self, cfg: RunConfig, rank: int, *, base_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.algo: FedDPOConfig = cfg.algorithm  # type: ignore[assignment]
        node_cfg = cfg.nodes[rank]
        self.name = node_cfg.name
        if base_dir is not None:
            model = node_cfg.model.model_copy(update={"path": str(base_dir), "preset": None})
            node_cfg = node_cfg.model_copy(update={"model": model, "warm_start": None})
        self.node: Node = build_node(node_cfg, rank=rank, task_cfg=cfg.task)
        self.reference = reference_for(self.node.model)
        self.task = agent_task(cfg, rank)
        self.train_pairs, self.heldout = tokenized_agent_pairs(
            cfg, rank, self.node.tokenizer, reference=self.reference, task=self.task
        )
        self.local = dpo_learner(cfg, self.node, self.reference, self.train_pairs)
        key = hashlib.blake2b(
            f"fed-dpo-client:{cfg.train.seed}:{self.name}".encode(), digest_size=8
        )
        self.seed = int.from_bytes(key.digest(), "little") & ((1 << 62) - 1)
        self.timer = PhaseTimer()
        self._saved = False

    def fit(
        self, params: Mapping[str, torch.Tensor], round_: int, config: Mapping[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
        """E local DPO steps from `params`: (delta, reply metrics with the pair count, the
        state kept in the client's checkpoint)."""
        t0 = time.perf_counter()
        load_params(self.node.model, params)
        self.node.model.train()
        self.node.optimizer = build_optimizer(self.node.model, self.node.cfg.optim)
        self.local.optimizer = self.node.optimizer
        torch.manual_seed(self.seed + round_)  # dropout, if the model has any
        e = self.algo.local_steps
        with self.timer("local"):
            metrics: dict[str, Any] = self.local.train(e, first=(round_ - 1) * e)
        delta = params_delta(self.node.model, params)
        metrics.update(self.timer.pop())
        metrics["train/local_steps"] = float(e)
        metrics["train/local_seconds"] = time.perf_counter() - t0
        metrics[COUNT_KEY] = len(self.train_pairs)
        return delta, metrics, {}

    def evaluate(self, params: Mapping[str, torch.Tensor], round_: int) -> dict[str, float]:
        """eval/* of the model `params` for this client (`evaluate_client`)."""
        load_params(self.node.model, params)
        with self.timer("eval"):
            m = evaluate_client(self.cfg, self.node, self.local, self.heldout, self.task, round_)
        m.update(self.timer.pop())
        return m

    def save(self, run_dir: Path, round_: int, state: dict[str, Any] | None = None) -> None:
        """Checkpoint the client's local model (after its round) under nodes/<name>/: on the
        checkpoint.every cadence, the last round, and its first round in this process (the
        server's checkpoint is what a resume continues from; a DPO round is so short that
        saving every one would cost more than the round)."""
        every, last = self.cfg.checkpoint.every, self.cfg.train.steps
        due = round_ == last or bool(every and round_ % every == 0)
        if not due and self._saved:
            return
        self._saved = True
        save_client_checkpoint(self, run_dir, round_, state)
