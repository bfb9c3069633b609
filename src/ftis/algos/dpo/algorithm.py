"""DPO and decentralized (gossip) DPO as node-shell algorithms (docs/dpo.md).

One round (a row's `step`) of `gossip-dpo` on agent i, top to bottom:

    local       E = local_steps DPO steps on i's own pairs (LocalDPO), its own optimizer
    gossip      send theta_i to the live neighbours, receive theirs (point-to-point only),
                theta_i <- sum_j W_ij theta_j with Metropolis-Hastings weights (Gossip)
    consensus   consensus error before and after mixing (a sketch through the run's store)

`dpo` is the local part alone. Evaluation (step 0 = before training, then on `eval.every`):
held-out preference accuracy and DPO figures on i's own held-out pairs, and the run's task
(greedy `eval/accuracy`). The reference is the starting weights, frozen: a copy made before the
first step, rebuilt from the node's config on resume (checked against a digest kept in the
checkpoint), or for LoRA the model with its adapters switched off.

Deviations from the authors' code (methods-wave2.md §2): prompt tokens are masked by default
(`include_prompt` restores theirs); the consensus error is estimated from sketches unless
`consensus: exact`; SGD and AdamW both come from the node's `optim`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ftis.algos.dpo.data import tokenized_agent_pairs
from ftis.algos.dpo.local import LocalDPO, Reference
from ftis.train.checkpoint import CheckpointError
from ftis.train.context import NodeContext
from ftis.train.evaluate import evaluate
from ftis.train.seeds import eval_seed

log = logging.getLogger(__name__)


def _starting_model(ctx: NodeContext) -> torch.nn.Module:
    """The node's model as the shell built it before any training: warm start (cached) or
    preset/path, without adapters."""
    from ftis.models.loading import ModelConfig, build_model
    from ftis.warmstart import warm_start

    node_cfg = ctx.cfg.nodes[ctx.rank]
    model_cfg = node_cfg.model
    if node_cfg.warm_start is not None:
        path = warm_start(model_cfg, node_cfg.warm_start, ctx.cfg.task)
        model_cfg = ModelConfig(path=str(path), dtype=model_cfg.dtype, device=model_cfg.device)
    return build_model(model_cfg)


class DPOAlgorithm:
    """One agent training alone with DPO on its own preference pairs (kind `dpo`)."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.algo = ctx.cfg.algorithm
        self.node = ctx.node
        self.timer = ctx.timer
        d = self.algo.data
        tok = ctx.node.tokenizer
        self.reference = self._reference()
        self.reference_digest = self.reference.digest()
        with self.timer("data"):
            self.train_pairs, self.heldout = tokenized_agent_pairs(
                ctx.cfg, ctx.rank, tok, reference=self.reference, task=ctx.task
            )
        self.local = LocalDPO(
            ctx.node.model,
            ctx.node.optimizer,
            self.reference,
            self.train_pairs,
            pad_id=tok.pad_token_id,
            beta=self.algo.beta,
            batch_size=self.algo.batch_size,
            grad_clip=ctx.node.cfg.optim.grad_clip,
            include_prompt=self.algo.include_prompt,
            sft_weight=self.algo.sft_weight,
            seed=ctx.cfg.train.seed,
            salt=ctx.node.name,
        )
        self.counters = {"local_steps_total": 0.0, "skipped_steps_total": 0.0}
        log.info(
            "node %s: %d training pairs, %d held out (%s)",
            ctx.node.name,
            len(self.train_pairs),
            len(self.heldout),
            d.source,
        )

    def _reference(self) -> Reference:
        model = self.node.model
        if hasattr(model, "disable_adapter"):  # LoRA: the base model is never trained
            return Reference.adapters_off(model)
        if self.ctx.first_step == 1:
            return Reference.frozen_copy(model)
        ref = Reference.frozen_copy(_starting_model(self.ctx))  # resume: rebuild, then check
        return ref

    # ------------------------------------------------------------------ the shell's protocol

    def step(self, step: int) -> dict[str, float]:
        e = self.algo.local_steps
        with self.timer("local"):
            metrics = self.local.train(e, first=(step - 1) * e)
        self.counters["local_steps_total"] += e - metrics["train/skipped_steps"]
        self.counters["skipped_steps_total"] += metrics["train/skipped_steps"]
        metrics["train/local_steps_total"] = self.counters["local_steps_total"]
        metrics["train/skipped_steps_total"] = self.counters["skipped_steps_total"]
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        out = self.local.evaluate(self.heldout)
        if self.algo.task_eval:
            tc = self.cfg.train
            out.update(
                evaluate(self.node, self.ctx.task, self.cfg.eval, tc, seed=eval_seed(tc.seed, step))
            )
        else:
            out["eval/accuracy"] = out["eval/preference_accuracy"]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"counters": dict(self.counters), "reference_digest": self.reference_digest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters.update(state.get("counters", {}))
        want = state.get("reference_digest")
        if want is not None and want != self.reference_digest:
            raise CheckpointError(
                f"node {self.node.name}: the reference model rebuilt on resume (digest "
                f"{self.reference_digest}) is not the one the run started from ({want}): the "
                "node's model, warm start or task config changed since; resume with the run's "
                "own config.yaml"
            )


def weights_digest(params) -> str:
    """A digest of tensors' values, dtypes and shapes, in order (the first 16 hex of sha256)."""
    import hashlib

    h = hashlib.sha256()
    for p in params:
        t = p.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class GossipDPOAlgorithm(DPOAlgorithm):
    """DecDPO (kind `gossip-dpo`): DPOAlgorithm's local steps, then one gossip step."""

    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        from ftis.algos.dpo.gossip import Gossip

        params = [p for p in ctx.node.model.parameters() if p.requires_grad]
        channel = None
        if len(ctx.cfg.nodes) > 1:
            from ftis.algos.dpo.gossip import HEADER
            from ftis.exchange.neighbours import NeighbourChannel

            channel = NeighbourChannel.join(
                first_step=ctx.first_step,
                size=HEADER + sum(p.numel() for p in params),
                timeout_s=ctx.cfg.exchange.timeout_s,
                backend=self.algo.backend,
                stats=ctx.transport.stats,
                # a fresh run's starting weights (on a resume they are the checkpoint's)
                start_digest=weights_digest(params) if ctx.first_step == 1 else "",
            )
        self.gossip = Gossip(ctx, params, channel)

    def step(self, step: int) -> dict[str, float]:
        metrics = super().step(step)
        with self.timer("gossip"):
            metrics.update(self.gossip.round(step))
        if step == self.cfg.train.steps and self.gossip.channel is not None:
            self.gossip.channel.close()  # every neighbour has finished its last exchange with us
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        out = super().evaluate(step)
        out.update(self.gossip.describe())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "gossip": dict(self.gossip.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.gossip.counters.update(state.get("gossip", {}))
