"""One peer of a swarm: F-TIS on its own samples and whatever its peers published in time.

    sample      G completions of every prompt of the round (the round's prompts come from
                (seed, round): every peer answers the same prompts, whoever is present), with
                the peer's own sampling noise (seeds.swarm_sample_seed)
    exchange    publish, collect until the live members have published or the deadline passed;
                every payload carries the sender's policy version and sampling settings
                (ftis.algos.swarm.meta)
    validate    a peer's batch may only answer this round's prompts, at most G per prompt;
                samples from a policy more than `max_staleness` steps behind this peer's, or
                drawn with top-k / top-p truncation, are dropped and counted; then at most
                `max_peers_used` peers' batches are kept (drawn at random); a peer on another
                tokenizer is re-tokenized (F-TIS's bridged path, docs/math.md §16); then at
                most `peer_groups` peer groups (SAPO's J) are kept, drawn at random
    learn       F-TIS's own score / advantages / update (ftis.algos.ftis.algorithm.learn):
                a group holds one peer's G completions of a prompt (`groups: generator`,
                the default), or every present peer's (`groups: prompt`)

Differences from `ftis`: no sharing scheme (nobody knows who will be there, so every peer
samples whole groups); membership is whatever arrived (a peer is waited for as a member once
a signed payload of it has arrived: `SwarmTransport`); rounds are the shell's steps, and a
late joiner starts at the swarm's current round (`SwarmTransport.join_step`).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

from ftis.algos.ftis import sharing
from ftis.algos.ftis.algorithm import FTISAlgorithm
from ftis.algos.swarm.meta import SampleMeta, SwarmCodec
from ftis.exchange.swarm import SwarmTransport
from ftis.rollout.types import RolloutBatch
from ftis.train.context import NodeContext
from ftis.train.sampling import generate
from ftis.train.seeds import adversary_seed, swarm_sample_seed

log = logging.getLogger(__name__)


class SwarmAlgorithm:
    """A swarm peer. State: F-TIS's counters and the swarm's running totals."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.inner = FTISAlgorithm(ctx)  # its codec, exchange, update and evaluation
        self.totals = {
            "stale_total": 0.0,
            "late_total": 0.0,
            "rejected_total": 0.0,
            "rejected_heartbeats_total": 0.0,
            "forged_total": 0.0,
            "dropped_silent_total": 0.0,
            "stale_samples_total": 0.0,
            "truncated_samples_total": 0.0,
        }
        # the last round this peer trained on (its policy version; 0: its starting weights)
        self.policy_step = 0
        self.codec = SwarmCodec.wrapping(self.inner.exchange.codec)
        self.inner.exchange.codec = self.codec
        self._barrier_reported = False
        self._join_reported = False
        # every peer samples whole groups of the same prompts: its own noise, not the run's
        tc = ctx.cfg.train
        self._sampling = tc.model_copy(update={"seed": swarm_sample_seed(tc.seed, ctx.rank)})

    def state_dict(self) -> dict[str, Any]:
        return {
            "ftis": self.inner.state_dict(),
            "swarm": dict(self.totals),
            "policy_step": self.policy_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state.get("ftis", {}))
        self.totals.update(state.get("swarm", {}))
        self.policy_step = int(state.get("policy_step", 0))

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
                cfg=self._sampling,
                step=step,
            )
        with inner.timer("exchange"):
            s = self._sampling
            self.codec.start(step, SampleMeta(self.policy_step, s.temperature, s.top_p, s.top_k))
            received = inner.exchange.all_gather(inner._outgoing(own, step))
            received[inner.rank] = own
        with inner.timer("validate"):
            rejected = self._validate(received, indices, step)
            judged = self._judge(received, step)
            self._subsample(received, step)
        bridged: dict[str, float] = {}
        if inner.bridged_peers:
            with inner.timer("bridge"):
                bridged = inner._bridge(received, step)
        groups_used = self._take_groups(received, step)
        if inner.hacpo is not None:
            # a peer not heard from in a capability window is forgotten (it left, or lags)
            inner.hacpo.forget(step)
        metrics, batch = inner.learn(received, own, step, groups=self.ctx.cfg.algorithm.groups)
        self.policy_step = step
        metrics.update(inner._exchange_metrics(own, batch, rejected))
        metrics.update(self._swarm_metrics(received, rejected))
        metrics.update(judged)
        metrics.update(bridged)
        metrics["swarm/peer_groups_used"] = float(groups_used)
        return metrics

    def _take_groups(self, received: list[RolloutBatch | None], step: int) -> int:
        """Keep at most `peer_groups` (SAPO's J) of the peers' groups, one group being one
        peer's completions of one prompt, drawn by (seed, step, peer): the same every time.
        Returns how many peer groups are left to train on."""
        j = self.ctx.cfg.algorithm.peer_groups
        rank = self.inner.rank
        keys = [
            (p, q)
            for p, b in enumerate(received)
            if b is not None and p != rank
            for q in sorted(set(b.prompt_index.tolist()))
        ]
        if j is None or len(keys) <= j:
            return len(keys)
        rng = random.Random(adversary_seed(self.ctx.cfg.train.seed, step, rank) + 2)
        chosen = rng.sample(keys, j)
        for p, b in enumerate(received):
            if b is None or p == rank:
                continue
            mine = [q for pp, q in chosen if pp == p]
            if not mine:
                received[p] = None
                continue
            keep = torch.isin(b.prompt_index, torch.tensor(mine, device=b.prompt_index.device))
            received[p] = b.select(keep)  # after bridging: no text is needed any more
        return j

    def _judge(self, received: list[RolloutBatch | None], step: int) -> dict[str, float]:
        """Drop (and count) the peers' samples this peer must not train on: from a policy more
        than `max_staleness` steps behind its own, or drawn with top-k / top-p truncation."""
        a = self.ctx.cfg.algorithm
        stale = truncated = 0
        ages = []
        for peer, meta in sorted(self.codec.received.items()):
            b = received[peer]
            if b is None or peer == self.inner.rank:
                continue
            age = max(0, self.policy_step - meta.policy_step)
            ages.append(float(age))
            why = None
            if a.max_staleness is not None and age > a.max_staleness:
                stale += b.num_sequences
                why = f"its policy is {age} steps behind (max_staleness {a.max_staleness})"
            elif meta.truncated and not a.accept_truncated:
                truncated += b.num_sequences
                why = (
                    f"drawn with top_k {meta.top_k} / top_p {meta.top_p:g} (truncated: "
                    "algorithm.accept_truncated is false)"
                )
            if why is not None:
                self._refuse(
                    received, step, peer, f"dropped peer {peer}'s {b.num_sequences} samples", why
                )
        self.totals["stale_samples_total"] += stale
        self.totals["truncated_samples_total"] += truncated
        return {
            "swarm/stale_samples": float(stale),
            "swarm/stale_samples_total": self.totals["stale_samples_total"],
            "swarm/truncated_samples": float(truncated),
            "swarm/truncated_samples_total": self.totals["truncated_samples_total"],
            "swarm/peer_policy_age": sum(ages) / len(ages) if ages else 0.0,
        }

    def _subsample(self, received: list[RolloutBatch | None], step: int) -> None:
        """Keep at most `max_peers_used` peers' batches (SAPO: a few external rollouts next to
        its own), drawn by (seed, step, peer): the same every time."""
        k = self.ctx.cfg.algorithm.max_peers_used
        rank = self.inner.rank
        peers = [p for p, b in enumerate(received) if b is not None and p != rank]
        if k is None or len(peers) <= k:
            return
        rng = random.Random(adversary_seed(self.ctx.cfg.train.seed, step, rank) + 1)
        for p in set(peers) - set(rng.sample(peers, k)):
            received[p] = None

    def _validate(self, received: list[RolloutBatch | None], indices: list[int], step: int) -> int:
        quota = dict.fromkeys(indices, self.ctx.cfg.train.group_size)
        rejected = 0
        for peer, b in enumerate(received):
            if peer == self.inner.rank or b is None:
                continue
            why = sharing.check_peer_batch(b, quota, train_size=len(self.inner.train_split))
            if why is not None:
                self._refuse(received, step, peer, f"rejected peer {peer}'s batch", why)
                rejected += 1
        return rejected

    def _refuse(
        self, received: list[RolloutBatch | None], step: int, peer: int, what: str, why: str
    ) -> None:
        """Leave peer `peer`'s batch of this round out of training, saying what and why."""
        log.warning("peer %s round %d: %s: %s", self.inner.node.name, step, what, why)
        received[peer] = None

    def _swarm_metrics(
        self, received: list[RolloutBatch | None], rejected: int
    ) -> dict[str, float]:
        transport = self.ctx.transport
        info = transport.last if isinstance(transport, SwarmTransport) else None
        decoded = self.inner.exchange.last_stats.rejected
        self.totals["rejected_total"] += decoded + rejected
        own = received[self.inner.rank]
        samples = sum(b.num_sequences for b in received if b is not None and b is not own)
        out = {
            "swarm/peers_used": float(sum(b is not None for b in received) - 1),
            "swarm/samples_received": float(samples),
            "swarm/rejected": float(decoded + rejected),
            "swarm/rejected_total": self.totals["rejected_total"],
        }
        if info is not None:
            self.totals["stale_total"] += info.stale
            self.totals["late_total"] += info.late
            self.totals["rejected_heartbeats_total"] += info.rejected
            self.totals["forged_total"] += info.forged
            self.totals["dropped_silent_total"] += info.dropped
            out.update(
                {
                    "swarm/members": float(info.members),
                    "swarm/peers_seen": float(info.arrived),
                    "swarm/stale": float(info.stale),
                    "swarm/late": float(info.late),
                    "swarm/timed_out": float(info.timed_out),
                    "swarm/stale_total": self.totals["stale_total"],
                    "swarm/late_total": self.totals["late_total"],
                    "swarm/rejected_heartbeats": float(info.rejected),
                    "swarm/rejected_heartbeats_total": self.totals["rejected_heartbeats_total"],
                    "swarm/candidates": float(info.candidates),
                    "swarm/forged": float(info.forged),
                    "swarm/forged_total": self.totals["forged_total"],
                    "swarm/dropped_silent": float(info.dropped),
                    "swarm/dropped_silent_total": self.totals["dropped_silent_total"],
                }
            )
            if info.published is not None:  # the simulator: peers that sent this round at all
                tc = self.ctx.cfg.train
                out["swarm/published"] = float(info.published)
                out["swarm/samples_published"] = float(
                    info.published * tc.prompts_per_step * tc.group_size
                )
            if transport.barrier_waited_s is not None and not self._barrier_reported:
                # this process's first round: how long the start barrier waited, for whom
                self._barrier_reported = True
                out["swarm/start_wait_s"] = transport.barrier_waited_s
                out["swarm/start_missing"] = float(len(transport.barrier_missing))
            if transport.join_waited_s is not None and not self._join_reported:
                # a peer started ahead of its join round: how long it waited for the swarm
                self._join_reported = True
                out["swarm/join_wait_s"] = transport.join_waited_s
        return out
