"""Seeds and rewards as payloads: the codec of a collaborative population (RandOpt, CoRP).

Parties score the same seed list on their private data and trade only what they measured: a
vector of mean rewards (one per member, or per CoRP candidate), how many problems each value
averages over (the pooling weight), a digest of the weights the perturbations were applied to,
and, for CoRP's consolidation round, the candidate directions as (seed, sigma, weight) lists.
No tensor, no token, no problem ever crosses the wire.

The decoder treats every payload as hostile: the length is checked against the header before
anything is read, the header against what the receiver expects for the round (kind, round,
first member, number of values, base digest), and every value must be finite. Any failure
leaves as `PayloadError` (a ValueError), never another error, so one bad party is left out of
the pool for that round and counted.

Layout, little-endian (docs/wire-format.md has the rollout format; this one is simpler):

    magic "FTPP" | version u8 | kind u8 | reserved u16 (0)
    | round u64 | offset u32 | n_values u32 | problems u32 | base 16 bytes | n_dirs u32
    | values: n_values x f64
    | n_dirs x (n_triples u32 | n_triples x (seed u64, sigma f64, weight f64))
    | crc32 u32 of everything before it
"""

from __future__ import annotations

import functools
import inspect
import math
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ftis.exchange.wire import PayloadError

MAGIC = b"FTPP"  # FTis Population Payload
VERSION = 1
KIND_REWARDS = 1  # one mean reward per population member, members offset .. offset + n - 1
KIND_PROBE = 2  # CoRP: the base's and every candidate's probe reward, and the directions
KINDS = {KIND_REWARDS: "rewards", KIND_PROBE: "probe"}
DIGEST_BYTES = 16

_HEADER = struct.Struct("<4sBBHQIII16sI")
_TRIPLE = struct.Struct("<Qdd")
_COUNT = struct.Struct("<I")
_CRC = struct.Struct("<I")
MAX_PROBLEMS = 1 << 31


@dataclass(frozen=True)
class PopulationPayload:
    """What one party sends in one round.

    kind: KIND_REWARDS or KIND_PROBE. round: the step it belongs to. offset: index of the member
    the first value belongs to (0 for probe payloads). problems: how many problems each value
    averages over (> 0). base: digest of the weights the perturbations were applied to and of
    the weights rebuilt from a check direction; parties with other base weights, or whose noise
    differs, measure other models and are rejected. values: the mean rewards.
    directions: CoRP candidate directions, each a tuple of (seed, sigma, weight).
    """

    kind: int
    round: int
    offset: int
    problems: int
    base: bytes
    values: tuple[float, ...]
    directions: tuple[tuple[tuple[int, float, float], ...], ...] = ()


def payload_size(n_values: int, direction_lengths: Sequence[int] = ()) -> int:
    """Exact encoded size of a payload with `n_values` values and directions of these lengths."""
    return (
        _HEADER.size
        + 8 * n_values
        + sum(_COUNT.size + _TRIPLE.size * n for n in direction_lengths)
        + _CRC.size
    )


def _payload_errors(decode: Callable[..., PopulationPayload]) -> Callable[..., PopulationPayload]:
    """`decode` with any error other than a PayloadError (struct errors, anything unforeseen)
    turned into one: a malformed payload is still only a bad payload. A wrong call (a missing or
    misspelt argument) is the caller's bug, not the peer's: it raises TypeError as before."""
    signature = inspect.signature(decode)

    @functools.wraps(decode)
    def checked(*args: Any, **kwargs: Any) -> PopulationPayload:
        signature.bind(*args, **kwargs)  # TypeError here, outside the payload's try
        try:
            return decode(*args, **kwargs)
        except PayloadError:
            raise
        except Exception as e:
            raise PayloadError(f"malformed population payload: {e}") from None

    return checked


class PopulationCodec:
    """Population payloads <-> bytes, with every check a receiver needs."""

    def encode(self, p: PopulationPayload) -> bytes:
        """The payload's bytes; ValueError when it cannot be encoded (a non-finite value, a bad
        field): a party never sends what its peers would reject."""
        if p.kind not in KINDS:
            raise ValueError(f"unknown payload kind {p.kind}")
        if len(p.base) != DIGEST_BYTES:
            raise ValueError(f"base digest must be {DIGEST_BYTES} bytes, got {len(p.base)}")
        if not 0 < p.problems < MAX_PROBLEMS:
            raise ValueError(f"problems must lie in [1, {MAX_PROBLEMS}), got {p.problems}")
        if not all(math.isfinite(v) for v in p.values):
            raise ValueError("a value is NaN or infinite")
        parts = [
            _HEADER.pack(
                MAGIC,
                VERSION,
                p.kind,
                0,
                p.round,
                p.offset,
                len(p.values),
                p.problems,
                p.base,
                len(p.directions),
            ),
            struct.pack(f"<{len(p.values)}d", *p.values),
        ]
        for d in p.directions:
            parts.append(_COUNT.pack(len(d)))
            for seed, sigma, weight in d:
                _check_triple(seed, sigma, weight)
                parts.append(_TRIPLE.pack(int(seed), float(sigma), float(weight)))
        body = b"".join(parts)
        return body + _CRC.pack(zlib.crc32(body))

    @_payload_errors
    def decode(
        self,
        data: bytes,
        *,
        kind: int,
        round_: int,
        offset: int,
        n_values: int,
        base: bytes,
        n_directions: int = 0,
        max_triples: int = 0,
    ) -> PopulationPayload:
        """A peer's payload, checked against what this round must hold: `kind`, `round_`,
        `offset`, exactly `n_values` values, the receiver's `base` digest, exactly
        `n_directions` directions of at most `max_triples` triples each. PayloadError on
        anything else."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise PayloadError(f"payload is a {type(data).__name__}, not bytes")
        data = bytes(data)
        if len(data) < _HEADER.size + _CRC.size:
            raise PayloadError(f"{len(data)} bytes is shorter than a header")
        body, (crc,) = data[:-4], _CRC.unpack(data[-4:])
        if zlib.crc32(body) != crc:
            raise PayloadError("checksum mismatch (truncated or corrupted)")
        magic, version, got_kind, _, got_round, got_offset, nv, problems, got_base, nd = (
            _HEADER.unpack_from(body)
        )
        if magic != MAGIC:
            raise PayloadError(f"bad magic {magic!r}: not a population payload")
        if version != VERSION:
            raise PayloadError(f"format version {version}, this ftis reads {VERSION}")
        want = (kind, round_, offset, n_values, n_directions)
        got = (got_kind, got_round, got_offset, nv, nd)
        if got != want:
            raise PayloadError(
                f"expected (kind, round, offset, values, directions) = {want}, got {got}"
            )
        if got_base != base:
            raise PayloadError(
                "the sender perturbs other base weights or rebuilds other weights from the "
                f"same seeds (digest {got_base.hex()} != {base.hex()}): its rewards measure "
                "another model"
            )
        if not 0 < problems < MAX_PROBLEMS:
            raise PayloadError(f"problems = {problems}: a value must average over >= 1 problem")
        pos = _HEADER.size
        if len(body) < pos + 8 * nv:
            raise PayloadError("payload ends inside its values")
        values = struct.unpack_from(f"<{nv}d", body, pos)
        pos += 8 * nv
        bad = sum(1 for v in values if not math.isfinite(v))
        if bad:
            raise PayloadError(f"{bad} of {nv} values are NaN or infinite")
        directions = []
        for _ in range(nd):
            if len(body) < pos + _COUNT.size:
                raise PayloadError("payload ends inside its directions")
            (n,) = _COUNT.unpack_from(body, pos)
            pos += _COUNT.size
            if n > max_triples:
                raise PayloadError(f"a direction of {n} terms exceeds the limit of {max_triples}")
            if len(body) < pos + _TRIPLE.size * n:
                raise PayloadError("payload ends inside a direction")
            d = []
            for _ in range(n):
                seed, sigma, weight = _TRIPLE.unpack_from(body, pos)
                pos += _TRIPLE.size
                try:
                    _check_triple(seed, sigma, weight)
                except ValueError as e:
                    raise PayloadError(str(e)) from None
                d.append((seed, sigma, weight))
            directions.append(tuple(d))
        if pos != len(body):
            raise PayloadError(f"{len(body) - pos} trailing bytes")
        return PopulationPayload(
            kind=got_kind,
            round=got_round,
            offset=got_offset,
            problems=problems,
            base=got_base,
            values=tuple(values),
            directions=tuple(directions),
        )


def _check_triple(seed: int, sigma: float, weight: float) -> None:
    if not 0 <= int(seed) < 2**63:
        raise ValueError(f"seed {seed} outside [0, 2**63)")
    if not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma {sigma} must be finite and > 0")
    if not math.isfinite(weight):
        raise ValueError(f"weight {weight} is not finite")
