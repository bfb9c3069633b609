"""The one narrow interface all communication goes through.

An `Exchange` hands this node's rollout batch to every peer and returns every node's batch.
Implementations: `LocalExchange` (one node, no peers; also the "alone" baseline) here, and the
torch.distributed transport. Nothing outside `ftis.exchange` calls a collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ftis.rollout.types import RolloutBatch


class ExchangeAborted(RuntimeError):
    """The exchange of a step was abandoned (this node was asked to stop while waiting); the
    caller drops the step and stops, its state is that of the previous step."""


@dataclass
class ExchangeStats:
    """What the last `all_gather` cost: payload bytes sent and received, and seconds spent."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    rejected: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class Exchange(Protocol):
    rank: int
    world_size: int
    last_stats: ExchangeStats

    def all_gather(self, batch: RolloutBatch) -> list[RolloutBatch | None]:
        """Every node's batch, indexed by rank (this node's own at `rank`); None for a peer
        whose payload was rejected or that did not answer (a lost peer). May raise
        ExchangeAborted when the node is asked to stop while it waits."""
        ...

    def close(self) -> None: ...


class LocalExchange:
    """A world of one: the node trains on its own samples only."""

    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self.last_stats = ExchangeStats()

    def all_gather(self, batch: RolloutBatch) -> list[RolloutBatch | None]:
        self.last_stats = ExchangeStats()
        return [batch]

    def close(self) -> None:
        pass
