"""The receiver's screens of peers' samples (`defence`, docs/RELIABILITY.md "Poisoned rollouts";
the math in ftis.core.defence, docs/math.md §15).

Per step, on the peers' sequences only (a node's own are never screened), in this order:

    length      drop a sequence longer than defence.max_completion_tokens
    score       the receiver's own log-probs of the rest (one forward pass, no gradient)
    flag        implausible (defence.plausibility's test) or, for a same-model peer, reported
                log-probs that differ from the receiver's (defence.same_model's test)
    drop        the flagged sequences of each screen that is on
    trust       each peer's running distrust from the fraction of its sequences that were
                flagged or over the length bound; trust = 1 - distrust scales its advantages,
                below defence.quarantine_below all its sequences are dropped
    share       at most defence.max_peer_share of the batch from one peer

Dropped sequences leave the batch before the advantages (they do not shape a group's baseline).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ftis.config import DefenceConfig, RunConfig
from ftis.core.defence import implausible, max_abs_logprob_gap, share_cap, update_distrust
from ftis.rollout.types import RolloutBatch
from ftis.train import scoring

log = logging.getLogger(__name__)

SCREENS = ("length", "plausibility", "same_model", "quarantine", "share")


def same_model_ranks(cfg: RunConfig, rank: int) -> set[int]:
    """The ranks whose node config equals `rank`'s in everything but the name: the same model,
    warm start, optimizer and loss, hence the same weights while both train on the same
    batches."""

    def key(i: int) -> dict[str, Any]:
        return cfg.nodes[i].model_dump(exclude={"name"})

    mine = key(rank)
    return {i for i in range(len(cfg.nodes)) if i != rank and key(i) == mine}


class Screen:
    """One receiver's screens and its per-peer distrust (checkpointed)."""

    def __init__(self, cfg: DefenceConfig, *, rank: int, same_model: set[int]) -> None:
        self.cfg = cfg
        self.rank = rank
        self.same_model = same_model
        self.distrust: dict[int, float] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"distrust": dict(self.distrust)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.distrust = {int(k): float(v) for k, v in state.get("distrust", {}).items()}

    def trust(self, peer: int) -> float:
        return 1.0 - self.distrust.get(peer, 0.0)

    def apply(
        self, batch: RolloutBatch, *, node, task, temperature: float, micro_batch_size: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """(keep (N,) bool, scale (N,) float for the advantages, metrics) for `batch`, whose
        rows with generator == this rank are the receiver's own."""
        cfg = self.cfg
        n = batch.num_sequences
        own = batch.generator == self.rank
        keep = torch.ones(n, dtype=torch.bool)
        scale = torch.ones(n, dtype=torch.float32)
        dropped = dict.fromkeys(SCREENS, 0)
        evidence = torch.zeros(n, dtype=torch.bool)  # what counts against a peer's trust
        if cfg.max_completion_tokens is not None:
            long = ~own & (batch.lengths > cfg.max_completion_tokens)
            dropped["length"] = int(long.sum())
            keep &= ~long
            evidence |= long
        peers = ~own & keep
        if cfg.screens and bool(peers.any()):
            rows = torch.nonzero(peers).flatten()
            sub = batch.select(rows)
            lp = scoring.model_logprobs(
                node, task, sub, temperature=temperature, micro_batch_size=micro_batch_size
            )
            glp, mask = sub.sampler_logprobs.float().cpu(), sub.mask.cpu()
            odd = implausible(
                logprobs=lp,
                sampler_logprobs=glp,
                mask=mask,
                max_logratio=cfg.max_logratio,
                min_token_logprob=cfg.min_token_logprob,
                max_rare_tokens=cfg.max_rare_tokens,
            )
            twin = torch.tensor([int(g) in self.same_model for g in sub.generator.tolist()])
            gap = max_abs_logprob_gap(logprobs=lp, sampler_logprobs=glp, mask=mask)
            forged = twin & (gap > cfg.same_model_tolerance)
            evidence[rows] |= odd | forged
            if cfg.plausibility:
                dropped["plausibility"] = int((odd & keep[rows]).sum())
                keep[rows[odd]] = False
            if cfg.same_model:
                dropped["same_model"] = int((forged & keep[rows]).sum())
                keep[rows[forged]] = False
        metrics: dict[str, float] = {}
        peer_ranks = sorted({int(g) for g in batch.generator[~own].tolist()})
        if cfg.trust:
            for p in peer_ranks:
                rows_p = batch.generator == p
                frac = torch.tensor([float(evidence[rows_p].float().mean())])
                prev = torch.tensor([self.distrust.get(p, 0.0)])
                self.distrust[p] = float(update_distrust(prev, frac, rate=cfg.trust_rate)[0])
                t = self.trust(p)
                if t < cfg.quarantine_below:
                    dropped["quarantine"] += int((rows_p & keep).sum())
                    keep &= ~rows_p
                else:
                    scale[rows_p] = t
        if cfg.max_peer_share < 1.0:
            capped = share_cap(
                batch.generator[keep], protected=own[keep], max_share=cfg.max_peer_share
            )
            kept_rows = torch.nonzero(keep).flatten()
            dropped["share"] = int((~capped).sum())
            keep[kept_rows[~capped]] = False
        total_peer = int((~own).sum())
        for name in SCREENS:
            metrics[f"defence/{name}_dropped"] = dropped[name] / total_peer if total_peer else 0.0
        metrics["defence/peer_sequences"] = float(total_peer)
        metrics["defence/flagged"] = float(evidence.sum()) / total_peer if total_peer else 0.0
        if any(dropped.values()):
            log.info(
                "rank %d: defences dropped %s of %d peer sequences", self.rank, dropped, total_peer
            )
        return keep, scale, metrics
