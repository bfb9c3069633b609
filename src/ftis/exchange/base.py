"""The one narrow interface all communication goes through.

An `Exchange` hands this node's rollout batch to every peer and returns every node's batch.
Implementations: `LocalExchange` (one node, no peers; also the "alone" baseline) here, and the
torch.distributed transport. Nothing outside `ftis.exchange` calls a collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol

from ftis.rollout.types import RolloutBatch

_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def rank_from_env(error: type[Exception], joining: str) -> tuple[int, int]:
    """(rank, world_size) from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT). Raises `error`, saying it cannot join `joining`, when one is missing or RANK
    is out of range."""
    missing = [k for k in _ENV_VARS if k not in os.environ]
    if missing:
        raise error(
            f"cannot join {joining}: {', '.join(missing)} not set. Start the nodes with "
            "`ftis run` or torchrun, which set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not 0 <= rank < world_size:
        raise error(f"RANK={rank} must lie in [0, WORLD_SIZE={world_size})")
    return rank, world_size


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
