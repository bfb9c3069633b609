"""Fuzzing the decoder: whatever bytes arrive, `decode_rollouts` returns a batch that satisfies
every invariant or raises PayloadError, never another exception, never hangs, never allocates
from an unchecked header value.

Payload counts (each test asserts its own; together well over 10,000):
random bytes 2 x 1500, truncations ~60 x 2 x payload length, bit flips 300 x 2 x 12,
field mutations 1200, zlib sections 400, huge declared sizes 40 (under tracemalloc).
"""

from __future__ import annotations

import struct
import tracemalloc
import zlib
from datetime import timedelta

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftis.exchange import PayloadError, decode_rollouts, encode_rollouts
from ftis.exchange.wire import MAGIC, _seal, _varint
from ftis.rollout.types import RolloutBatch

VOCAB = 300  # 9-bit ids: a width that is not byte aligned
MAX_TOKENS = 12
MAX_SEQUENCES = 24
PAD = 7
GEN = 2

FUZZ = settings(
    deadline=timedelta(seconds=2),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def decode_or_reject(data: bytes) -> RolloutBatch | None:
    """Decode; on success check every invariant a receiver relies on."""
    try:
        out = decode_rollouts(
            data,
            vocab_size=VOCAB,
            max_tokens=MAX_TOKENS,
            max_sequences=MAX_SEQUENCES,
            expected_generator=GEN,
            pad_id=PAD,
        )
    except PayloadError as e:
        assert str(e)
        return None
    n = out.num_sequences
    assert n <= MAX_SEQUENCES
    for t in (out.prompt_index, out.generator, out.lengths, out.completion_ids):
        assert t.dtype == torch.int64
    assert out.sampler_logprobs.dtype == torch.float32
    assert out.completion_ids.shape == out.sampler_logprobs.shape
    assert out.completion_ids.shape[1] <= MAX_TOKENS
    if n:
        assert out.completion_ids.shape[1] == int(out.lengths.max())
        assert ((out.lengths >= 1) & (out.lengths <= MAX_TOKENS)).all()
        assert (out.generator == GEN).all()
        assert (out.prompt_index >= 0).all()
    m = out.mask
    assert ((out.completion_ids[m] >= 0) & (out.completion_ids[m] < VOCAB)).all()
    assert (out.completion_ids[~m] == PAD).all()
    lp = out.sampler_logprobs
    assert torch.isfinite(lp).all() and (lp <= 0).all() and (lp[~m] == 0).all()
    return out


@st.composite
def batches(draw) -> RolloutBatch:
    n = draw(st.integers(0, 10))
    lengths = draw(st.lists(st.integers(1, MAX_TOKENS), min_size=n, max_size=n))
    t = max(lengths, default=0)
    seed = draw(st.integers(0, 2**32 - 1))
    g = torch.Generator().manual_seed(seed)
    ln = torch.tensor(lengths, dtype=torch.int64)
    mask = torch.arange(t)[None, :] < ln[:, None]
    ids = torch.where(mask, torch.randint(0, VOCAB, (n, t), generator=g), PAD)
    lp = torch.where(mask, -torch.rand((n, t), generator=g) * 5, 0.0)
    groups = draw(st.integers(1, 4))
    return RolloutBatch(
        prompt_index=torch.randint(0, 1000, (n,), generator=g).sort().values // groups,
        generator=torch.full((n,), GEN, dtype=torch.int64),
        completion_ids=ids,
        lengths=ln,
        sampler_logprobs=lp,
    )


FORMATS = st.sampled_from(["f32", "q8", "q13", "q16", "q24", "compact"])


@st.composite
def payloads(draw) -> bytes:
    return encode_rollouts(
        draw(batches()),
        logprob_format=draw(FORMATS),
        vocab_size=VOCAB,
        compress=draw(st.booleans()),
    )


def test_valid_payloads_decode() -> None:
    @settings(FUZZ, max_examples=150)
    @given(payloads())
    def run(data: bytes) -> None:
        assert decode_or_reject(data) is not None

    run()


def test_random_bytes() -> None:
    count = 0

    @settings(FUZZ, max_examples=1500)
    @given(st.binary(max_size=300))
    def run(junk: bytes) -> None:
        nonlocal count
        # raw junk dies at the magic/checksum; junk behind a valid magic and a valid checksum
        # reaches the field parsers
        assert decode_or_reject(junk) is None
        decode_or_reject(_seal(MAGIC + b"\x01" + junk))
        count += 2

    run()
    assert count >= 3000


def test_truncations() -> None:
    count = 0

    @settings(FUZZ, max_examples=60)
    @given(payloads())
    def run(data: bytes) -> None:
        nonlocal count
        body = data[:-4]
        for cut in range(len(data)):
            assert decode_or_reject(data[:cut]) is None
            count += 1
        for cut in range(len(body)):  # truncated but re-sealed: passes the checksum
            decode_or_reject(_seal(body[:cut]))
            count += 1

    run()
    assert count >= 3000


def test_bit_flips() -> None:
    count = 0

    @settings(FUZZ, max_examples=300)
    @given(payloads(), st.lists(st.integers(0, 2**31), min_size=12, max_size=12))
    def run(data: bytes, positions: list[int]) -> None:
        nonlocal count
        body = bytearray(data[:-4])
        for p in positions:
            flipped = bytearray(data)
            flipped[p % len(data)] ^= 1 << (p % 8)
            assert decode_or_reject(bytes(flipped)) is None  # the checksum catches every flip
            b = bytearray(body)
            b[p % len(body)] ^= 1 << (p % 8)
            decode_or_reject(_seal(bytes(b)))  # flipped then re-sealed: the validators' turn
            count += 2

    run()
    assert count >= 7000


HUGE = st.sampled_from([0, 1, 2**7, 2**31, 2**32, 2**53, 2**62, 2**63 - 1, 2**63, 2**64 - 1])


@st.composite
def field_mutations(draw) -> bytes:
    """A valid payload with one header byte or varint replaced (then re-sealed)."""
    data = draw(payloads())
    body = data[:-4]
    kind = draw(st.sampled_from(["byte", "varint", "splice"]))
    pos = draw(st.integers(0, len(body) - 1))
    if kind == "byte":
        new = body[:pos] + bytes([draw(st.integers(0, 255))]) + body[pos + 1 :]
    elif kind == "varint":
        # overwrite whatever starts at pos with a (possibly huge) varint
        v = _varint(draw(st.one_of(HUGE, st.integers(0, 2**64 - 1))))
        new = body[:pos] + v + body[pos + draw(st.integers(0, 10)) :]
    else:
        new = body[:pos] + draw(st.binary(max_size=12)) + body[pos:]
    return _seal(new)


def test_field_mutations() -> None:
    count = 0

    @settings(FUZZ, max_examples=1200)
    @given(field_mutations())
    def run(data: bytes) -> None:
        nonlocal count
        decode_or_reject(data)
        count += 1

    run()
    assert count >= 1200


def _header(flags: int, lp: tuple[int, int], vocab: int, n: int, total: int) -> bytes:
    return MAGIC + bytes([1, flags, *lp]) + _varint(vocab) + _varint(n) + _varint(total)


def test_zlib_sections() -> None:
    count = 0

    @settings(FUZZ, max_examples=400)
    @given(
        st.one_of(
            st.binary(max_size=200).map(zlib.compress),  # valid zlib, junk inside
            st.binary(max_size=200),  # not zlib at all
            st.integers(1, 5_000_000).map(lambda k: zlib.compress(b"\x00" * k, 1)),  # bombs
        ),
        st.integers(0, MAX_SEQUENCES + 2),
        st.integers(0, 400),
        st.sampled_from([(0, 32), (1, 16), (1, 9)]),
    )
    def run(sections: bytes, n: int, total: int, lp: tuple[int, int]) -> None:
        nonlocal count
        decode_or_reject(_seal(_header(1, lp, VOCAB, n, total) + sections))
        count += 1

    run()
    assert count >= 400


def test_huge_declared_sizes_allocate_nothing() -> None:
    """Headers that declare enormous counts must be refused before any allocation."""
    cases = []
    for n in (MAX_SEQUENCES, MAX_SEQUENCES + 1, 2**40, 2**63):
        for total in (n, n * MAX_TOKENS, 2**62):
            for flags in (0, 1):
                rest = zlib.compress(b"\x00" * 10_000) if flags else b"\x00" * 8
                cases.append(_seal(_header(flags, (0, 32), VOCAB, n, total) + rest))
    # sections that declare huge run counts and bit widths
    for col in (
        _varint(0) + _varint(2**40) + bytes([63, 32]),
        _varint(2**62) + _varint(MAX_SEQUENCES) + bytes([63, 32]),
    ):
        for n in (1, MAX_SEQUENCES):
            cases.append(
                _seal(_header(0, (0, 32), VOCAB, n, n) + b"\x00" + col + b"\x00" * (5 * n + 8))
            )
    tracemalloc.start()
    try:
        for data in cases:
            assert decode_or_reject(data) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(cases) >= 28
    assert peak < 4 * 2**20, f"decoder allocated {peak} bytes on a hostile header"


def test_every_prefix_of_a_valid_zlib_payload_is_rejected() -> None:
    g = torch.Generator().manual_seed(0)
    n, t = 8, MAX_TOKENS
    batch = RolloutBatch(
        prompt_index=torch.arange(n) // 4,
        generator=torch.full((n,), GEN),
        completion_ids=torch.randint(0, 20, (n, t), generator=g),
        lengths=torch.full((n,), t),
        sampler_logprobs=-torch.rand((n, t), generator=g).round(decimals=1),
    )
    data = encode_rollouts(batch, compress=True, vocab_size=VOCAB)
    assert data[5] == 1
    body = data[:-4]
    for cut in range(len(body)):
        assert decode_or_reject(_seal(body[:cut])) is None
    assert decode_or_reject(data) is not None
    # and a log-prob that is positive after decompression is still caught
    head = 8 + len(_varint(VOCAB)) + len(_varint(n)) + len(_varint(n * t))
    raw = bytearray(zlib.decompress(body[head:]))
    raw[-4:] = struct.pack("<f", 0.5)
    assert decode_or_reject(_seal(body[:head] + zlib.compress(bytes(raw)))) is None


@st.composite
def text_payloads(draw) -> bytes:
    """A valid payload with a text section (the bridged path): any Unicode text per sequence,
    each sequence's tokens all spelling it (character ends = its length)."""
    batch = draw(batches())
    n, t = batch.num_sequences, batch.completion_ids.shape[1]
    texts = [draw(st.text(max_size=6)) for _ in range(n)]
    from ftis.rollout.types import CompletionText

    ends = torch.tensor([[len(s)] * t for s in texts], dtype=torch.int64).reshape(n, t)
    batch.text = CompletionText(
        texts=texts,
        finished=torch.zeros(n, dtype=torch.bool),
        covered=batch.lengths.clone(),
        char_ends=ends,
    )
    return encode_rollouts(batch, vocab_size=VOCAB, compress=draw(st.booleans()))


def test_text_sections_survive_mutation() -> None:
    count = 0

    @settings(FUZZ, max_examples=200)
    @given(text_payloads(), st.lists(st.integers(0, 2**31), min_size=8, max_size=8))
    def run(data: bytes, positions: list[int]) -> None:
        nonlocal count
        out = decode_or_reject(data)
        assert out is not None and out.text is not None
        assert all(len(s.encode()) <= 8 * MAX_TOKENS for s in out.text.texts)
        body = data[:-4]
        for p in positions:
            b = bytearray(body)
            b[p % len(body)] ^= 1 << (p % 8)
            decode_or_reject(_seal(bytes(b)))
            decode_or_reject(_seal(body[: p % len(body)]))
            count += 2

    run()
    assert count >= 3000
