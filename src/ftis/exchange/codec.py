"""What every transport does around its own communication: encode this node's batch, validate
and decode its peers' payloads, and account for the step in `ExchangeStats`.

A transport subclasses `PayloadExchange` and only moves bytes: its `all_gather` calls
`_encode_own`, trades the payload with its peers, hands what arrived to `_decode_peers` and
records `_stats`. Payloads are bytes checked by `ftis.exchange.wire`, never pickles.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ftis.exchange.base import ExchangeStats
from ftis.exchange.wire import (
    PayloadError,
    decode_rollouts,
    encode_rollouts,
    max_payload_size,
)
from ftis.rollout.types import RolloutBatch

log = logging.getLogger(__name__)


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
    )


@dataclass
class PeerBatches:
    """The peers' payloads of one step, decoded.

    batches: peer rank -> its batch, or None when its payload was rejected (in the order the
        payloads were given).
    rejected: how many payloads failed validation.
    bytes_received: the payload sizes the peers announced, summed (negative sizes count 0).
    """

    batches: dict[int, RolloutBatch | None]
    rejected: int
    bytes_received: int


class PayloadExchange:
    """The settings and payload handling the transports share (`DistributedExchange`,
    `StoreExchange`); see those for the meaning of the arguments.

    Attributes read at call time, so changing one after construction takes effect at the next
    step, as it always has. `corrupt_for_test`, when set, rewrites this node's payload after
    encoding (tests use it to make one rank send a corrupted payload).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        vocab_size: int,
        max_tokens: int,
        pad_id: int,
        logprob_format: str,
        max_sequences: int,
        compress: bool,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self.max_sequences = max_sequences
        self.pad_id = pad_id
        self.logprob_format = logprob_format
        self.compress = compress
        self.last_stats = ExchangeStats()
        self.corrupt_for_test: Callable[[bytes], bytes] | None = None
        self._max_payload = max_payload_size(
            max_sequences=max_sequences, max_tokens=max_tokens, vocab_size=vocab_size
        )

    def _encode_own(self, batch: RolloutBatch, *, logger: logging.Logger = log) -> bytes:
        """This node's payload for `batch`: b"" (logged on `logger`) when the batch cannot be
        encoded, so that the node still takes part in the step and its peers reject it."""
        try:
            payload = encode_rollouts(
                batch,
                logprob_format=self.logprob_format,
                vocab_size=self.vocab_size,
                compress=self.compress,
            )
        except ValueError as e:
            # Still send something (peers wait for it, or hang in a collective); they reject b"".
            logger.error(
                "rank %d: own batch cannot be encoded, peers will reject it: %s", self.rank, e
            )
            payload = b""
        if self.corrupt_for_test is not None:
            payload = self.corrupt_for_test(payload)
        return payload

    def _decode_peers(
        self,
        payloads: Mapping[int, tuple[int, bytes | None]],
        *,
        device: torch.device | None = None,
        step: int | None = None,
        logger: logging.Logger = log,
    ) -> PeerBatches:
        """Validate and decode every peer's payload.

        Args:
            payloads: peer rank -> (announced size, the bytes, or None when the transport did
                not buffer them because the size is negative or above the limit).
            device: where to move the decoded batches; None leaves them on the CPU.
            step: named in the rejection warnings when given.
            logger: where rejections are logged (the transport's logger).

        A payload that is over the limit or fails `decode_rollouts` is logged, counted and
        comes back as None; the others carry on.
        """
        where = "" if step is None else f" of step {step}"
        out = PeerBatches(batches={}, rejected=0, bytes_received=0)
        for peer, (size, data) in payloads.items():
            out.bytes_received += max(size, 0)
            try:
                if data is None or len(data) > self._max_payload:
                    raise PayloadError(f"{size} bytes exceeds the limit of {self._max_payload}")
                peer_batch = decode_rollouts(
                    data,
                    vocab_size=self.vocab_size,
                    max_tokens=self.max_tokens,
                    max_sequences=self.max_sequences,
                    expected_generator=peer,
                    pad_id=self.pad_id,
                )
            except PayloadError as e:
                logger.warning(
                    "rank %d: rejected rank %d's payload%s (%d bytes): %s",
                    self.rank,
                    peer,
                    where,
                    size,
                    e,
                )
                out.rejected += 1
                out.batches[peer] = None
                continue
            out.batches[peer] = peer_batch if device is None else to_device(peer_batch, device)
        return out

    @staticmethod
    def _stats(
        payload: bytes,
        peers: PeerBatches,
        marks: tuple[float, float, float, float],
        extra: Mapping[str, float] | None = None,
    ) -> ExchangeStats:
        """The step's `ExchangeStats`; `marks` are the perf_counter readings before encoding,
        after encoding, after the communication and after decoding; `extra` adds the
        transport's own figures to `ExchangeStats.extra`."""
        t0, t1, t2, t3 = marks
        return ExchangeStats(
            bytes_sent=len(payload),
            bytes_received=peers.bytes_received,
            seconds=t3 - t0,
            rejected=peers.rejected,
            extra={
                "encode_seconds": t1 - t0,
                "comm_seconds": t2 - t1,
                "decode_seconds": t3 - t2,
                **(extra or {}),
            },
        )
