"""The gossip step of decentralized DPO: average with the neighbours (docs/dpo.md, "Gossip").

    theta_i <- W_ii theta_i + sum_{j in N(i)} W_ij theta_j,   W_ij = 1 / (1 + max(deg_i, deg_j))

over the node's trainable parameters, flattened in a fixed order. Each message carries the
sender's round and its *current* degree (live neighbours taking part in the round), so agent i
computes W_ij from deg_i and the deg_j that j announced, and j computes W_ji from the same two
numbers: the weights stay symmetric however the agents learn of a loss. When an agent is lost,
its neighbours' degrees drop, so every weight is Metropolis-Hastings over the remaining graph
(`ftis.core.mixing.drop_agents`); the weight a rejected or failed message would have had stays
with the receiver, so each row still sums to 1.

A received message is rejected (counted in `gossip/rejected`) when its header does not fit
(round, size, a degree outside 1..world-1) or any number is not finite; the sender's weight then
stays with the receiver for the round.

Consensus error `(1/n) sum_i ||theta_i - theta_bar||^2`, before and after mixing, needs every
agent's parameters, which gossip never gathers. By default each agent shares a count sketch of
its parameters (`ftis.core.mixing.sketch`, `sketch_size` numbers, the same sketch on every
agent) through the run's store transport, and every agent computes the error of the sketches:
an unbiased estimate within about sqrt(2/k) relative error (k = 2048: about 3%), at k numbers
per agent per round. `consensus: exact` shares the whole parameters instead (N*P numbers; small
models), `off` skips it. This is logging traffic, separate from the neighbour-only gossip.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from ftis.core.graphs import adjacency, build_graph, neighbours
from ftis.core.mixing import (
    consensus_error,
    metropolis_hastings,
    mix,
    pairwise_weight,
    second_eigenvalue,
    sketch,
    sketch_plan,
)
from ftis.exchange.transport import ExchangeAborted

log = logging.getLogger(__name__)

HEADER = 3  # round, size, degree
_SKETCH_MAGIC = 0x53  # first byte of a consensus payload


def encode(round_: int, degree: int, theta: torch.Tensor) -> torch.Tensor:
    """(HEADER + P,) float32: round, P, degree, then the parameters."""
    head = torch.tensor([float(round_), float(theta.numel()), float(degree)], dtype=torch.float32)
    return torch.cat([head, theta.detach().float().cpu()])


def decode(
    msg: torch.Tensor, *, round_: int, size: int, world_size: int
) -> tuple[int, torch.Tensor] | str:
    """(degree, parameters) of a received message, or why it is rejected."""
    if msg.shape != (HEADER + size,):
        return f"{msg.numel()} numbers, expected {HEADER + size}"
    head = msg[:HEADER].tolist()
    if head[0] != float(round_):
        return f"round {head[0]!r}, expected {round_}"
    if head[1] != float(size):
        return f"size {head[1]!r}, expected {size}"
    degree = head[2]
    if not (math.isfinite(degree) and degree == int(degree) and 1 <= degree <= world_size - 1):
        return f"degree {degree!r} is not an integer in 1..{world_size - 1}"
    theta = msg[HEADER:]
    if not bool(torch.isfinite(theta).all()):
        return f"{int((~torch.isfinite(theta)).sum())} non-finite parameters"
    return int(degree), theta


def flat_parameters(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """(P,) float32 copy of the parameters, in order."""
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in params])


@torch.no_grad()
def load_flat(params: list[torch.nn.Parameter], theta: torch.Tensor) -> None:
    """Write (P,) `theta` back into the parameters (in their own dtype and device)."""
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(theta[offset : offset + n].view_as(p).to(p.dtype))
        offset += n


def live_graph_rho(adj: torch.Tensor, gone: set[int]) -> float:
    """rho of the Metropolis-Hastings matrix of the graph among the agents not in `gone`."""
    keep = [i for i in range(adj.shape[0]) if i not in gone]
    if len(keep) < 2:
        return 0.0
    sub = adj[keep][:, keep]
    return second_eigenvalue(metropolis_hastings(sub))


class Gossip:
    """One agent's gossip: its neighbours on the graph, the channel to them, the round.

    Args:
        ctx: the node's context (rank, config, the shell's transport for consensus logging).
        params: the trainable parameters that are averaged (all of them for full training, the
            adapters for LoRA), in a fixed order.
        channel: a `NeighbourChannel` (or anything with its interface), None for one agent.
    """

    def __init__(self, ctx: Any, params: list[torch.nn.Parameter], channel: Any) -> None:
        a = ctx.cfg.algorithm
        self.ctx = ctx
        self.rank = ctx.rank
        self.n = len(ctx.cfg.nodes)
        self.adj = adjacency(
            build_graph(
                a.topology,
                self.n,
                degree=a.degree,
                seed=a.graph_seed,
                edges=a.edge_indices(ctx.cfg),
            ),
            self.n,
        )
        self.neighbours = neighbours(self.adj, self.rank)
        self.params = params
        self.size = sum(p.numel() for p in params)
        self.channel = channel
        self.consensus = a.consensus
        self.sketch_size = a.sketch_size
        self.plan = (
            sketch_plan(self.size, a.sketch_size, seed=a.graph_seed)
            if a.consensus == "sketch"
            else None
        )
        self.rho = second_eigenvalue(metropolis_hastings(self.adj))
        self.counters = {"rejected_total": 0.0}

    def describe(self) -> dict[str, float]:
        """The graph's figures (logged at step 0 and every round): rho and the spectral gap of
        the full graph, and this agent's degree in it."""
        return {
            "gossip/rho_full": self.rho,
            "gossip/spectral_gap_full": 1.0 - self.rho**2,
            "gossip/degree_full": float(len(self.neighbours)),
        }

    def round(self, step: int) -> dict[str, float]:
        """Exchange with the live neighbours, mix, measure. Returns the round's gossip/*
        metrics."""
        t0 = time.perf_counter()
        theta = flat_parameters(self.params)
        gone: set[int] = set()  # agents not in this round: lost, or not started (a resume)
        if self.channel is not None:
            everyone = [j for j in range(self.n) if j != self.rank]
            self.channel.check_left(everyone, step)  # all of them: rho of the live graph
            gone = {j for j in everyone if not self.channel.takes_part(j, step)}
        peers = [j for j in self.neighbours if j not in gone]
        degree = len(peers)
        got = self.channel.exchange(step, encode(step, degree, theta), peers) if peers else {}
        others, weights, rejected = [], [], 0
        for j in peers:
            if j not in got:  # lost during the exchange: its share stays with this agent
                continue
            decoded = decode(got[j], round_=step, size=self.size, world_size=self.n)
            if isinstance(decoded, str):
                rejected += 1
                log.warning(
                    "rank %d round %d: rejected neighbour %d's parameters: %s",
                    self.rank,
                    step,
                    j,
                    decoded,
                )
                continue
            d_j, theta_j = decoded
            others.append(theta_j)
            weights.append(pairwise_weight(degree, d_j))
        mixed = mix(theta, others, weights) if others else theta
        if others:
            load_flat(self.params, mixed)
        self.counters["rejected_total"] += rejected
        lost = self.channel.lost if self.channel is not None else {}
        rho = live_graph_rho(self.adj, gone | set(lost))  # with losses found while exchanging
        out = {
            "gossip/neighbours": float(degree),
            "gossip/mixed": float(len(others)),
            "gossip/self_weight": 1.0 - sum(weights),
            "gossip/rejected": float(rejected),
            "gossip/rejected_total": self.counters["rejected_total"],
            "gossip/lost_total": float(len(lost)),
            "gossip/rho": rho,
            "gossip/spectral_gap": 1.0 - rho**2,
            "gossip/seconds": time.perf_counter() - t0,
            **self.describe(),
        }
        out.update(self._consensus(step, theta, mixed))
        return out

    def _consensus(self, step: int, before: torch.Tensor, after: torch.Tensor) -> dict[str, float]:
        """gossip/consensus_error_before and _after over the agents that answered (see module
        doc). Never raises after the parameters changed: a failed exchange only skips it."""
        if self.consensus == "off":
            return {}
        if self.plan is not None:
            mine = torch.stack(
                [
                    sketch(before, self.plan, self.sketch_size),
                    sketch(after, self.plan, self.sketch_size),
                ]
            )
        else:
            mine = torch.stack([before.double(), after.double()])
        payload = bytes([_SKETCH_MAGIC]) + mine.numpy().tobytes()
        try:
            got = self.ctx.transport.exchange(step, payload, max_bytes=len(payload))
        except ExchangeAborted as e:  # stop requested or the store is gone: skip the figure
            log.warning("rank %d round %d: consensus error not measured: %s", self.rank, step, e)
            return {}
        rows = [mine]
        for data in got.values():
            if data is None or len(data) != len(payload) or data[0] != _SKETCH_MAGIC:
                continue
            other = torch.frombuffer(bytearray(data[1:]), dtype=torch.float64).view(mine.shape)
            if bool(torch.isfinite(other).all()):
                rows.append(other)
        stacked = torch.stack(rows)  # (agents, 2, k)
        return {
            "gossip/consensus_error_before": float(consensus_error(stacked[:, 0])),
            "gossip/consensus_error_after": float(consensus_error(stacked[:, 1])),
            "gossip/consensus_agents": float(len(rows)),
        }
