"""One peer of a swarm: F-TIS on its own samples and whatever its peers published in time.

    sample      G completions of every prompt of the round (the round's prompts come from
                (seed, round): every peer answers the same prompts, whoever is present)
    exchange    publish, collect until the live members have published or the deadline passed
    validate    a peer's batch may only answer this round's prompts, at most G per prompt
    learn       F-TIS's own score / advantages / update (ftis.algos.ftis.algorithm.learn):
                a group holds every present peer's completions of its prompt

Differences from `ftis`: no sharing scheme (nobody knows who will be there, so every peer
samples whole groups); membership is whatever arrived; rounds are the shell's steps, and a
late joiner starts at the swarm's current round (`SwarmTransport.join_step`).
"""

from __future__ import annotations

import logging
from typing import Any

from ftis.algos.base import NodeContext
from ftis.algos.ftis import sharing
from ftis.algos.ftis.algorithm import FTISAlgorithm
from ftis.exchange.swarm import SwarmTransport
from ftis.rollout.types import RolloutBatch
from ftis.train.sampling import generate

log = logging.getLogger(__name__)


class SwarmAlgorithm:
    """A swarm peer. State: F-TIS's counters and the swarm's running totals."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.inner = FTISAlgorithm(ctx)  # its codec, exchange, update and evaluation
        self.totals = {"stale_total": 0.0, "late_total": 0.0, "rejected_total": 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {"ftis": self.inner.state_dict(), "swarm": dict(self.totals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state.get("ftis", {}))
        self.totals.update(state.get("swarm", {}))

    def evaluate(self, step: int) -> dict[str, float]:
        return self.inner.evaluate(step)

    def step(self, step: int) -> dict[str, float]:
        inner, tc = self.inner, self.ctx.cfg.train
        with inner.timer("sample"):
            indices = sharing.step_prompts(
                tc.seed, step, tc.prompts_per_step, len(inner.train_split)
            )
            own = generate(
                inner.node,
                inner.task,
                [inner.train_split[i] for i in indices],
                slots=(0, tc.group_size),
                cfg=tc,
                step=step,
            )
        with inner.timer("exchange"):
            received = inner.exchange.all_gather(inner._outgoing(own, step))
            received[inner.rank] = own
        with inner.timer("validate"):
            rejected = self._validate(received, indices, step)
        metrics, batch = inner.learn(received, own, step)
        metrics.update(inner._exchange_metrics(own, batch, rejected))
        metrics.update(self._swarm_metrics(received, rejected))
        return metrics

    def _validate(self, received: list[RolloutBatch | None], indices: list[int], step: int) -> int:
        quota = dict.fromkeys(indices, self.ctx.cfg.train.group_size)
        rejected = 0
        for peer, b in enumerate(received):
            if peer == self.inner.rank or b is None:
                continue
            why = sharing.check_peer_batch(b, quota, train_size=len(self.inner.train_split))
            if why is not None:
                log.warning(
                    "peer %s round %d: rejected peer %d's batch: %s",
                    self.inner.node.name,
                    step,
                    peer,
                    why,
                )
                received[peer] = None
                rejected += 1
        return rejected

    def _swarm_metrics(
        self, received: list[RolloutBatch | None], rejected: int
    ) -> dict[str, float]:
        transport = self.ctx.transport
        info = transport.last if isinstance(transport, SwarmTransport) else None
        decoded = self.inner.exchange.last_stats.rejected
        self.totals["rejected_total"] += decoded + rejected
        out = {
            "swarm/peers_used": float(sum(b is not None for b in received) - 1),
            "swarm/rejected_total": self.totals["rejected_total"],
        }
        if info is not None:
            self.totals["stale_total"] += info.stale
            self.totals["late_total"] += info.late
            out.update(
                {
                    "swarm/members": float(info.members),
                    "swarm/peers_seen": float(info.arrived),
                    "swarm/stale": float(info.stale),
                    "swarm/late": float(info.late),
                    "swarm/timed_out": float(info.timed_out),
                    "swarm/stale_total": self.totals["stale_total"],
                    "swarm/late_total": self.totals["late_total"],
                }
            )
        return out
