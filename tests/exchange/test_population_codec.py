"""The seeds-and-rewards codec (ftis.exchange.population): round trips, and every malformed,
non-finite or mismatched payload leaves as PayloadError, never as another error."""

from __future__ import annotations

import random
import struct
import zlib

import pytest

from ftis.exchange.population import (
    KIND_PROBE,
    KIND_REWARDS,
    PopulationCodec,
    PopulationPayload,
    payload_size,
)
from ftis.exchange.wire import PayloadError

BASE = bytes(range(16))
CODEC = PopulationCodec()


def _rewards(**kw) -> PopulationPayload:
    fields = dict(
        kind=KIND_REWARDS, round=3, offset=8, problems=64, base=BASE, values=(0.5, 0.25, 1.0)
    )
    return PopulationPayload(**{**fields, **kw})


def _decode(data: bytes, **kw) -> PopulationPayload:
    expect = dict(kind=KIND_REWARDS, round_=3, offset=8, n_values=3, base=BASE)
    return CODEC.decode(data, **{**expect, **kw})


def _resealed(body: bytes) -> bytes:
    """`body` with a valid checksum: what a buggy or hostile peer could send."""
    return body + struct.pack("<I", zlib.crc32(body))


def test_reward_vectors_round_trip_exactly():
    p = _rewards(values=(0.1, 1 / 3, 0.0))
    data = CODEC.encode(p)
    assert len(data) == payload_size(3)
    assert _decode(data) == p


def test_probe_payloads_carry_the_candidate_directions():
    dirs = (((5, 0.01, 0.75), (2**40, 0.002, -0.25)), ((7, 0.005, 1.0),))
    p = PopulationPayload(
        kind=KIND_PROBE,
        round=9,
        offset=0,
        problems=32,
        base=BASE,
        values=(0.4, 0.5),
        directions=dirs,
    )
    data = CODEC.encode(p)
    assert len(data) == payload_size(2, [2, 1])
    got = CODEC.decode(
        data,
        kind=KIND_PROBE,
        round_=9,
        offset=0,
        n_values=2,
        base=BASE,
        n_directions=2,
        max_triples=2,
    )
    assert got == p
    with pytest.raises(PayloadError, match="exceeds the limit"):
        CODEC.decode(
            data,
            kind=KIND_PROBE,
            round_=9,
            offset=0,
            n_values=2,
            base=BASE,
            n_directions=2,
            max_triples=1,
        )


def test_a_sender_never_encodes_non_finite_values():
    with pytest.raises(ValueError, match="NaN"):
        CODEC.encode(_rewards(values=(0.5, float("nan"), 1.0)))


@pytest.mark.parametrize(
    ("expect", "match"),
    [
        ({"round_": 4}, "expected"),
        ({"offset": 0}, "expected"),
        ({"n_values": 4}, "expected"),
        ({"kind": KIND_PROBE}, "expected"),
        ({"base": bytes(16)}, "other base weights"),
    ],
)
def test_payloads_for_another_round_member_range_or_base_are_rejected(expect, match):
    with pytest.raises(PayloadError, match=match):
        _decode(CODEC.encode(_rewards()), **expect)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rewards_are_rejected_even_with_a_valid_checksum(bad):
    body = CODEC.encode(_rewards())[:-4]
    first_value = struct.calcsize("<4sBBHQIII16sI")
    body = body[:first_value] + struct.pack("<d", bad) + body[first_value + 8 :]
    with pytest.raises(PayloadError, match="NaN or infinite"):
        _decode(_resealed(body))


def test_truncated_corrupted_or_foreign_bytes_are_rejected():
    data = CODEC.encode(_rewards())
    with pytest.raises(PayloadError, match="checksum"):
        _decode(data[:-5] + data[-4:])
    flipped = bytearray(data)
    flipped[20] ^= 0x40
    with pytest.raises(PayloadError, match="checksum"):
        _decode(bytes(flipped))
    with pytest.raises(PayloadError, match="shorter"):
        _decode(b"FTPP")
    with pytest.raises(PayloadError, match="magic"):
        _decode(_resealed(b"XXXX" + data[4:-4]))
    with pytest.raises(PayloadError, match="trailing"):
        _decode(_resealed(data[:-4] + b"\0"))
    zero = bytearray(data[:-4])
    struct.pack_into("<I", zero, 24, 0)  # the problems field
    with pytest.raises(PayloadError, match="problems"):
        _decode(_resealed(bytes(zero)))


def test_random_mutations_only_ever_raise_payload_errors():
    rng = random.Random(0)
    data = CODEC.encode(_rewards())
    for _ in range(500):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        cut = bytes(b[: rng.randint(0, len(b))]) if rng.random() < 0.3 else bytes(b)
        for blob in (cut, _resealed(cut[:-4]) if len(cut) > 4 else cut):
            try:
                _decode(blob)
            except PayloadError:
                pass


def test_a_wrong_call_is_the_callers_error_not_a_bad_payload():
    """Only the payload's faults become PayloadError (counted as a peer's); a misspelt or
    missing argument raises TypeError at the call."""
    with pytest.raises(TypeError):
        PopulationCodec().decode(b"\x00" * 64, kind=0, round=1)  # round_, and more, missing
