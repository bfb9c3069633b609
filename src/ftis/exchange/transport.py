"""Transports move bytes between the ranks of a run; they know nothing of what the bytes mean.

A transport trades one payload per rank per round: `exchange(round, payload)` hands this rank's
bytes to every peer taking part and returns the peers' bytes by rank. A peer that is lost, has
left, or does not take part in the round is simply absent from the answer; a peer whose payload
is larger than `max_bytes` comes back as None (counted, never buffered). What the bytes are
(rollouts, parameter deltas, seeds and rewards) is a codec's business (`ftis.exchange.codec`):
codecs and transports compose, neither inherits the other.

Every transport counts the bytes it sends and receives (`TransportStats`); the node shell turns
them into the same `exchange/*` metrics for every algorithm.

Implementations: `LocalTransport` (a world of one) here, `StoreTransport` (a key-value store,
tolerant of lost peers; what `ftis run` uses) and `DistributedTransport` (torch.distributed
collectives) in their own modules.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Protocol

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
    """The exchange of a round was abandoned because this node was asked to stop while it
    waited; the caller drops the round and stops, its state is that of the previous round."""


class TransportLost(ExchangeAborted):
    """The transport itself is gone (e.g. the store's host died): the node checkpoints its last
    completed round and stops with this message, which says how to resume."""


@dataclass
class TransportStats:
    """Cumulative counts of one transport: payload bytes it sent and received, seconds spent
    trading them (including waiting for slower peers), payloads over the size limit, and the
    peers it has declared lost (rank -> why)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    oversized: int = 0
    lost: dict[int, str] = field(default_factory=dict)
    missed: int = 0  # a live peer's payload skipped for one round (overwritten, deleted, late)
    forged: int = 0  # records in the transport that failed authentication (ignored)
    heartbeat_errors: int = 0  # heartbeats the transport refused (retried)
    stale_heartbeats: int = 0  # authentic heartbeats older than one already seen (replays)

    def copy(self) -> TransportStats:
        return dataclasses.replace(self, lost=dict(self.lost))

    def received(self, data: bytes, max_bytes: int) -> bytes | None:
        """Count a payload received: `data`, or None (counted oversized) when it is longer than
        `max_bytes`."""
        self.bytes_received += len(data)
        if len(data) > max_bytes:
            self.oversized += 1
            return None
        return data


class Transport(Protocol):
    """What every transport offers. `rank` and `world_size` count every rank of the run,
    including ranks that are not training nodes (a federated server, an aggregator)."""

    rank: int
    world_size: int
    stats: TransportStats

    def exchange(self, round_: int, payload: bytes, *, max_bytes: int) -> dict[int, bytes | None]:
        """Send `payload` as this rank's payload of `round_` and return every participating
        peer's payload of that round by rank (None: over `max_bytes`). May raise ExchangeAborted
        (asked to stop while waiting) or TransportLost."""
        ...

    def ready(self) -> None:
        """This rank has finished its set-up (model built, warm start done) and will take part
        in rounds from now on; peers may start timing it out."""
        ...

    def close(self) -> None: ...


class LocalTransport:
    """A world of one: nothing to send, nobody to hear from."""

    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self.stats = TransportStats()

    def exchange(self, round_: int, payload: bytes, *, max_bytes: int) -> dict[int, bytes | None]:
        return {}

    def ready(self) -> None:
        pass

    def close(self) -> None:
        pass
