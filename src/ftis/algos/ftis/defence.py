"""The receiver's screens of peers' samples (`defence`, docs/RELIABILITY.md "Poisoned rollouts";
the math in ftis.core.defence, docs/math.md §15).

Per step, in this order:

    length      drop a peer's sequence longer than defence.max_completion_tokens
    score       the receiver's own log-probs of the whole batch (one pass, no gradient)
    flag        implausible (defence.plausibility's test) or, for a same-model peer, reported
                log-probs that differ from the receiver's (defence.same_model's test)
    drop        the flagged sequences of each screen that is on

The plausibility screen and the same-model check also judge the receiver's *own* samples (an
honest sample at temperature 1 can hold a token of probability below e^-10; its recorded
log-probs differ from a second pass by numerical noise). Otherwise a node would keep its own
such sample while its same-model peers dropped it, their weights would drift apart, and the
same-model check would then flag honest peers: in the first measured run (4 nodes, 20 steps,
own samples exempt) the honest nodes' trust in one another fell below 0.5 by step 17. Scoring
the whole batch in one pass (not the peers' rows alone) gives every honest node the same
numbers. Own samples never count against any trust; the length and share bounds apply to
peers only. For the same reason trust scales a peer's advantages only once it falls below
defence.downweight_below (0.8): a node never scales its own samples, so down-weighting an
honest peer for one odd sample would again split same-model peers' weights.
    trust       each peer's running distrust from the fraction of its sequences that were
                flagged or over the length bound; trust = 1 - distrust scales its advantages
                once below defence.downweight_below, below defence.quarantine_below all its
                sequences are dropped
    share       at most defence.max_peer_share of the batch from one peer

Dropped sequences leave the batch before the advantages (they do not shape a group's baseline).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ftis.config import DefenceConfig, RunConfig
from ftis.core.defence import (
    implausible,
    max_abs_logprob_gap,
    mean_abs_logratio,
    rare_tokens,
    share_cap,
    update_distrust,
)
from ftis.rollout.types import RolloutBatch
from ftis.train import scoring

log = logging.getLogger(__name__)

SCREENS = ("length", "plausibility", "same_model", "quarantine", "share")
# "own": the receiver's own sequences the plausibility screen dropped (as a fraction of its own)


def same_model_ranks(cfg: RunConfig, rank: int) -> set[int]:
    """The ranks whose node config equals `rank`'s in everything but the name: the same model,
    warm start, optimizer and loss, hence the same weights while both train on the same
    batches."""

    def key(i: int) -> dict[str, Any]:
        return cfg.nodes[i].model_dump(exclude={"name"})

    mine = key(rank)
    return {i for i in range(len(cfg.nodes)) if i != rank and key(i) == mine}


def same_model_caveat(cfg: RunConfig, rank: int) -> str | None:
    """Why the same-model test misfires for `rank`, or None: a loss that weighs a node's own
    samples and its peers' differently (HACPO's clamped peer weight, policy shaping of peers'
    tokens) moves same-config peers' weights apart even on the same batches, and the test then
    flags honest peers. It drops what it flags under defence.same_model, and trust counts its
    flags whether or not same_model is on."""
    loss = cfg.nodes[rank].loss
    d = cfg.defence
    if not (d.same_model or d.trust) or not same_model_ranks(cfg, rank):
        return None
    if loss.method != "hacpo" and loss.shaping_gamma is None:
        return None
    name = "hacpo" if loss.method == "hacpo" else f"{loss.method} with policy shaping"
    on = " and ".join(k for k in ("same_model", "trust") if getattr(d, k))
    return (
        f"defence.{on} with loss {name}: this loss weighs a node's own samples and its peers' "
        "differently, so same-config peers' weights drift apart even on the same batches and "
        "the same-model test flags honest peers (dropped by same_model, distrusted and "
        "quarantined by trust; measured for HACPO in docs/results/poisoning.md); use the "
        "plausibility screen alone with this loss"
    )


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
        dropped = dict.fromkeys((*SCREENS, "own"), 0)
        evidence = torch.zeros(n, dtype=torch.bool)  # what counts against a peer's trust
        metrics: dict[str, float] = {}
        if cfg.max_completion_tokens is not None:
            long = ~own & (batch.lengths > cfg.max_completion_tokens)
            dropped["length"] = int(long.sum())
            keep &= ~long
            evidence |= long
        if cfg.screens and n:
            # Every row is scored, the receiver's own too, in one pass over the whole batch:
            # honest same-model peers receive the same batch, so they compute the same numbers
            # and make the same decisions (see the module docstring).
            lp = scoring.model_logprobs(
                node, task, batch, temperature=temperature, micro_batch_size=micro_batch_size
            )
            glp, mask = batch.sampler_logprobs.float().cpu(), batch.mask.cpu()
            odd = (
                implausible(
                    logprobs=lp,
                    sampler_logprobs=glp,
                    mask=mask,
                    max_logratio=cfg.max_logratio,
                    min_token_logprob=cfg.min_token_logprob,
                    max_rare_tokens=cfg.max_rare_tokens,
                )
                & keep
            )
            # the receiver's own rows are checked as a same-model peer's would be (see above)
            twin = own | torch.tensor(
                [int(g) in self.same_model for g in batch.generator.tolist()], dtype=torch.bool
            )
            gap = max_abs_logprob_gap(logprobs=lp, sampler_logprobs=glp, mask=mask)
            forged = twin & (gap > cfg.same_model_tolerance) & keep
            peers = ~own & keep
            if bool(peers.any()):
                ratio = mean_abs_logratio(logprobs=lp, sampler_logprobs=glp, mask=mask)
                rare = rare_tokens(logprobs=lp, mask=mask, floor=cfg.min_token_logprob)
                metrics["defence/logratio_mean"] = float(ratio[peers].mean())
                metrics["defence/rare_token_seqs"] = float((rare[peers] > 0).float().mean())
            if bool((twin & ~own).any()):
                metrics["defence/same_model_gap_max"] = float(gap[twin & ~own].max())
            if bool(own.any()):  # numerical noise only: the sampler's pass against this one
                metrics["defence/own_gap_max"] = float(gap[own].max())
            evidence |= ~own & (odd | forged)
            if cfg.plausibility:
                dropped["plausibility"] = int((odd & ~own).sum())
                dropped["own"] = int((odd & own).sum())
                keep &= ~odd
            if cfg.same_model:
                dropped["same_model"] = int((forged & keep & ~own).sum())
                dropped["own"] += int((forged & keep & own).sum())
                keep &= ~forged
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
                elif t < cfg.downweight_below:
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
        total_own = int(own.sum())
        metrics["defence/own_dropped"] = dropped["own"] / total_own if total_own else 0.0
        metrics["defence/peer_sequences"] = float(total_peer)
        metrics["defence/flagged"] = float(evidence.sum()) / total_peer if total_peer else 0.0
        if any(dropped.values()):
            log.info(
                "rank %d: defences dropped %s of %d peer sequences", self.rank, dropped, total_peer
            )
        return keep, scale, metrics
