"""Payload codecs (batches <-> bytes) and the rollout exchange that composes a codec with a
transport.

`RolloutCodec` turns a `RolloutBatch` into the versioned wire format (`ftis.exchange.wire`) and
validates and decodes a peer's bytes; it never touches the network. `RolloutExchange` gives an
algorithm `all_gather(batch) -> [batch or None per rank]` over any `Transport`: encode this
node's batch, trade bytes, decode every peer's payload, and account for the step in
`ExchangeStats`. Other payloads (parameter deltas, seeds + rewards) get their own codecs over
the same transports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ftis.exchange.transport import Transport
from ftis.exchange.wire import (
    DEFAULT_LOGPROB_FORMAT,
    MAX_VOCAB,
    PayloadError,
    decode_rollouts,
    describe_logprob_format,
    encode_rollouts,
    max_payload_size,
)
from ftis.rollout.types import RolloutBatch

log = logging.getLogger(__name__)


@dataclass
class ExchangeStats:
    """What the last `all_gather` cost: payload bytes sent and received, seconds spent, payloads
    rejected, and the transport's and codec's own figures in `extra`."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    rejected: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class RolloutCodec:
    """Rollout batches <-> bytes, with every check a receiver needs.

    Args:
        vocab_size: the shared tokenizer's vocabulary size (ids are validated against it).
        max_tokens: the longest completion a peer may send (the run's max_new_tokens).
        pad_id: this node's pad token id, used to pad decoded peer batches.
        logprob_format: wire format of the log-probs ("f32" exact, "qK", "compact"); see
            `ftis.exchange.wire.encode_rollouts`. Peers may differ: each payload says its own.
        max_sequences: the most sequences accepted from one peer.
        compress: zlib the payload sections when that shrinks them.
        bridged_peers: ranks on another tokenizer (docs/math.md §16): their payloads must carry
            the text section, and their ids are checked against the vocabulary the payload
            declares (they are the sender's ids, which this node never uses), not this node's.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        max_tokens: int,
        pad_id: int = 0,
        logprob_format: str = DEFAULT_LOGPROB_FORMAT,
        max_sequences: int = 8192,
        compress: bool = False,
        bridged_peers: frozenset[int] = frozenset(),
    ) -> None:
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self.pad_id = pad_id
        self.logprob_format = logprob_format
        self.max_sequences = max_sequences
        self.compress = compress
        self.bridged_peers = frozenset(bridged_peers)
        self.max_payload = max_payload_size(
            max_sequences=max_sequences,
            max_tokens=max_tokens,
            # a bridged peer's ids are its own: bound them by the widest id the format allows
            vocab_size=MAX_VOCAB if self.bridged_peers else vocab_size,
            text=bool(self.bridged_peers),
        )

    def describe(self) -> str:
        return describe_logprob_format(self.logprob_format, self.vocab_size)

    def encode(self, batch: RolloutBatch) -> bytes:
        """The payload for `batch`; raises ValueError when it cannot be encoded (e.g. NaN)."""
        return encode_rollouts(
            batch,
            logprob_format=self.logprob_format,
            vocab_size=self.vocab_size,
            compress=self.compress,
        )

    def decode(self, data: bytes, *, peer: int) -> RolloutBatch:
        """`peer`'s batch; PayloadError on anything malformed, oversized or not from `peer`."""
        if len(data) > self.max_payload:
            raise PayloadError(f"{len(data)} bytes exceeds the limit of {self.max_payload}")
        bridged = peer in self.bridged_peers
        batch = decode_rollouts(
            data,
            vocab_size=MAX_VOCAB if bridged else self.vocab_size,
            max_tokens=self.max_tokens,
            max_sequences=self.max_sequences,
            expected_generator=peer,
            pad_id=self.pad_id,
        )
        if bridged and batch.text is None:
            raise PayloadError(
                f"rank {peer} is on another tokenizer but its payload carries no text section"
            )
        return batch


def to_device(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    """`batch` with every tensor on `device` (the batch itself when `device` is the CPU)."""
    if device.type == "cpu":
        return batch
    return RolloutBatch(
        prompt_index=batch.prompt_index.to(device),
        generator=batch.generator.to(device),
        completion_ids=batch.completion_ids.to(device),
        lengths=batch.lengths.to(device),
        sampler_logprobs=batch.sampler_logprobs.to(device),
        text=batch.text,  # read on the CPU by the bridge (ftis.algos.ftis.bridge)
        bridged=None if batch.bridged is None else batch.bridged.to(device),
        bridge_sampler_logprob=None
        if batch.bridge_sampler_logprob is None
        else batch.bridge_sampler_logprob.to(device),
        bridge_sampler_length=None
        if batch.bridge_sampler_length is None
        else batch.bridge_sampler_length.to(device),
    )


class RolloutExchange:
    """Every node's rollout batch of a round, over any transport.

    `all_gather(batch)` returns a list indexed by rank: this node's own batch at its rank, each
    peer's decoded batch, or None for a peer that is lost, did not take part, or whose payload
    failed validation (counted in `last_stats.rejected` and logged). Rounds are numbered from
    `first_round` and advance by one per call.

    `corrupt_for_test`, when set, rewrites this node's payload after encoding (tests use it to
    make one rank send a corrupted payload).
    """

    def __init__(self, transport: Transport, codec: RolloutCodec, *, first_round: int = 1) -> None:
        self.transport = transport
        self.codec = codec
        self.round = first_round
        self.last_stats = ExchangeStats()
        self.corrupt_for_test: Callable[[bytes], bytes] | None = None

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    def all_gather(self, batch: RolloutBatch) -> list[RolloutBatch | None]:
        t0 = time.perf_counter()
        try:
            payload = self.codec.encode(batch)
        except ValueError as e:
            # Still send something (peers wait for it, or hang in a collective); they reject b"".
            log.error(
                "rank %d: own batch cannot be encoded, peers will reject it: %s", self.rank, e
            )
            payload = b""
        if self.corrupt_for_test is not None:
            payload = self.corrupt_for_test(payload)
        t1 = time.perf_counter()
        before = self.transport.stats.copy()
        raw = self.transport.exchange(self.round, payload, max_bytes=self.codec.max_payload)
        after = self.transport.stats
        t2 = time.perf_counter()
        out: list[RolloutBatch | None] = [None] * self.world_size
        out[self.rank] = batch
        rejected = 0
        device = batch.completion_ids.device
        for peer, data in sorted(raw.items()):
            try:
                if data is None:
                    raise PayloadError(f"over the limit of {self.codec.max_payload} bytes")
                out[peer] = to_device(self.codec.decode(data, peer=peer), device)
            except PayloadError as e:
                log.warning(
                    "rank %d: rejected rank %d's payload of round %d: %s",
                    self.rank,
                    peer,
                    self.round,
                    e,
                )
                rejected += 1
        t3 = time.perf_counter()
        self.round += 1
        self.last_stats = ExchangeStats(
            bytes_sent=after.bytes_sent - before.bytes_sent,
            bytes_received=after.bytes_received - before.bytes_received,
            seconds=t3 - t0,
            rejected=rejected,
            extra={
                "encode_seconds": t1 - t0,
                "comm_seconds": t2 - t1,
                "decode_seconds": t3 - t2,
                "peers": float(len(raw)),
                "lost_peers": float(len(after.lost)),
                # cumulative: peers skipped for a round, records that failed authentication
                "missed_payloads": float(after.missed),
                "forged_records": float(after.forged),
                "heartbeat_errors": float(after.heartbeat_errors),
                "stale_heartbeats": float(after.stale_heartbeats),
            },
        )
        return out
