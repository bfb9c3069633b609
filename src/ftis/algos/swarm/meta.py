"""What a swarm payload says about its samples (issue 35): the sender's policy version and its
sampling settings, in a small header before the rollout batch (docs/swarm.md, "Sample
metadata").

    magic "FTSM" | version u8 (1) | policy_step u32 | temperature f32 | top_p f32 | top_k u32
    | the rollout batch (ftis.exchange.wire)

`policy_step` is the last round the sender trained on (0: its starting weights), so a peer
that rejoined from an old checkpoint says how far behind its policy is, whatever round it
answers. A receiver rejects a payload (counted, like any malformed one) whose header is
missing, whose policy step is at or beyond the round it answers (a future step) or whose
sampling settings are out of range; it then judges the samples (`SwarmAlgorithm`): older than
`algorithm.max_staleness` steps, or drawn with top-k / top-p truncation (whose recorded
log-probs are those of the truncated distribution: a ratio against it cannot see the tokens the
sender could not draw), they are dropped and counted.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from ftis.exchange.codec import RolloutCodec
from ftis.exchange.wire import PayloadError
from ftis.rollout.types import RolloutBatch

MAGIC = b"FTSM"
VERSION = 1
_HEADER = struct.Struct("<4sBIffI")
HEADER_BYTES = _HEADER.size
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 24


@dataclass(frozen=True)
class SampleMeta:
    """The sender's policy version (last round trained, 0 = starting weights) and how it
    sampled."""

    policy_step: int
    temperature: float
    top_p: float = 1.0
    top_k: int = 0

    @property
    def truncated(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    def pack(self) -> bytes:
        return _HEADER.pack(
            MAGIC, VERSION, self.policy_step, self.temperature, self.top_p, self.top_k
        )


def unpack(data: bytes, *, round_: int) -> tuple[SampleMeta, bytes]:
    """The header of a payload answering `round_`, and the rollout bytes after it; PayloadError
    naming what is wrong otherwise."""
    if len(data) < HEADER_BYTES:
        raise PayloadError(f"no sample metadata: {len(data)} bytes, a header is {HEADER_BYTES}")
    magic, version, step, temperature, top_p, top_k = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise PayloadError("no sample metadata: not a swarm payload (magic)")
    if version != VERSION:
        raise PayloadError(f"sample metadata version {version}, this peer reads {VERSION}")
    if step >= round_:
        raise PayloadError(
            f"policy step {step} is not before round {round_}: a sample cannot come from a "
            "policy trained on its own round or later"
        )
    if not (math.isfinite(temperature) and 0 < temperature <= MAX_TEMPERATURE):
        raise PayloadError(f"temperature {temperature} is outside (0, {MAX_TEMPERATURE:g}]")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise PayloadError(f"top_p {top_p} is outside (0, 1]")
    if top_k > MAX_TOP_K:
        raise PayloadError(f"top_k {top_k} is over {MAX_TOP_K}")
    return SampleMeta(step, temperature, top_p, top_k), data[HEADER_BYTES:]


class SwarmCodec(RolloutCodec):
    """A rollout codec whose payloads carry `SampleMeta`: `outgoing` (set by the peer before
    each exchange) is written before every batch, `round` is the round being exchanged, and
    `received[peer]` holds each decoded payload's metadata (cleared with `start`)."""

    @classmethod
    def wrapping(cls, codec: RolloutCodec) -> SwarmCodec:
        out = cls.__new__(cls)
        out.__dict__.update(codec.__dict__)
        out.max_payload = codec.max_payload + HEADER_BYTES
        out.outgoing = SampleMeta(0, 1.0)
        out.round = 1
        out.received = {}
        return out

    def start(self, round_: int, meta: SampleMeta) -> None:
        self.round, self.outgoing, self.received = round_, meta, {}

    def encode(self, batch: RolloutBatch) -> bytes:
        return self.outgoing.pack() + super().encode(batch)

    def decode(self, data: bytes, *, peer: int) -> RolloutBatch:
        if len(data) > self.max_payload:
            raise PayloadError(f"{len(data)} bytes exceeds the limit of {self.max_payload}")
        meta, rest = unpack(data, round_=self.round)
        batch = super().decode(rest, peer=peer)
        self.received[peer] = meta
        return batch
