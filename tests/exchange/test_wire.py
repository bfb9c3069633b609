"""Wire format: round trips, size budgets, and one crafted bad payload per validation rule."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch

from ftis.exchange import (
    PayloadError,
    bytes_per_token,
    decode_rollouts,
    encode_rollouts,
    logprob_max_error,
    resolve_logprob_format,
)
from ftis.exchange.wire import (
    LOGPROB_CLAMP,
    MAGIC,
    _id_bits,
    _pack,
    _put_column,
    _seal,
    _varint,
    max_payload_size,
)
from ftis.rollout.types import RolloutBatch

QWEN_VOCAB = 151936  # 18-bit ids
CHAR_VOCAB = 102  # the embedded character tokenizer: 7-bit ids


def make_batch(
    n: int,
    mean_len: int,
    vocab: int,
    *,
    seed: int = 0,
    group: int = 8,
    generator: int = 1,
    fixed_len: bool = False,
    pad_id: int = 0,
) -> RolloutBatch:
    """A batch shaped like real rollouts: groups of `group` completions per prompt, Zipf-ish ids
    (or digit-like ids for a small vocab), log-probs mostly near 0 with a heavy tail, some exact
    0.0 (prob-1 tokens), right padding with pad_id and 0.0."""
    rng = np.random.default_rng(seed)
    if fixed_len:
        lengths = np.full(n, mean_len)
    else:
        lengths = rng.integers(max(1, mean_len - 3), mean_len + 4, n)
    t = int(lengths.max()) if n else 0
    if vocab > 1000:
        ids = (rng.zipf(1.3, (n, t)) - 1) % vocab
    else:
        ids = rng.integers(max(0, vocab - 15), vocab, (n, t))
    lp = np.where(
        rng.random((n, t)) < 0.7, -rng.exponential(0.02, (n, t)), -rng.exponential(1.5, (n, t))
    )
    lp[rng.random((n, t)) < 0.1] = 0.0
    mask = np.arange(t)[None, :] < lengths[:, None]
    prompts = np.repeat(rng.integers(0, 7000, n // group + 1), group)[:n]
    return RolloutBatch(
        prompt_index=torch.as_tensor(prompts, dtype=torch.int64),
        generator=torch.full((n,), generator, dtype=torch.int64),
        completion_ids=torch.as_tensor(np.where(mask, ids, pad_id), dtype=torch.int64),
        lengths=torch.as_tensor(lengths, dtype=torch.int64),
        sampler_logprobs=torch.as_tensor(np.where(mask, lp, 0.0), dtype=torch.float32),
    )


def assert_same_metadata(a: RolloutBatch, b: RolloutBatch) -> None:
    for name in ("prompt_index", "generator", "lengths", "completion_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == torch.int64, name
        assert torch.equal(x, y), name


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("vocab", [1, 2, CHAR_VOCAB, 256, 257, 65536, QWEN_VOCAB, 2**24 + 3])
def test_f32_round_trip_is_bit_exact(vocab: int) -> None:
    batch = make_batch(40, 6, vocab, seed=vocab % 97, group=4)
    batch.completion_ids[batch.mask] = batch.completion_ids[batch.mask] % vocab
    batch.completion_ids[0, 0] = vocab - 1  # the largest id fits its width
    batch.sampler_logprobs[0, 1] = -0.0
    batch.sampler_logprobs[1, 0] = -1e30  # f32 carries any finite value
    data = encode_rollouts(batch, vocab_size=vocab)
    out = decode_rollouts(data, vocab_size=vocab, max_tokens=16)
    assert_same_metadata(out, batch)
    assert out.sampler_logprobs.dtype == torch.float32
    # bit-exact, including the sign of -0.0
    assert torch.equal(
        out.sampler_logprobs.view(torch.int32), batch.sampler_logprobs.view(torch.int32)
    )


def test_a_larger_senders_vocab_is_fine_while_ids_fit_the_receivers() -> None:
    # one tokenizer, embeddings padded differently (Qwen2.5-7B 152064 vs -0.5B 151936)
    batch = make_batch(16, 5, 1000, seed=2)
    data = encode_rollouts(batch, vocab_size=152064)
    out = decode_rollouts(data, vocab_size=QWEN_VOCAB, max_tokens=8)
    assert_same_metadata(out, batch)


def test_decode_pads_with_the_receivers_pad_id() -> None:
    batch = make_batch(16, 5, CHAR_VOCAB, pad_id=101)
    out = decode_rollouts(encode_rollouts(batch), vocab_size=CHAR_VOCAB, max_tokens=8, pad_id=101)
    assert_same_metadata(out, batch)
    assert (out.completion_ids[~out.mask] == 101).all()
    assert (out.sampler_logprobs[~out.mask] == 0.0).all()


def test_width_is_the_longest_decoded_completion_not_the_senders_padding() -> None:
    batch = make_batch(8, 3, CHAR_VOCAB, fixed_len=True)
    wide = RolloutBatch(
        prompt_index=batch.prompt_index,
        generator=batch.generator,
        completion_ids=torch.nn.functional.pad(batch.completion_ids, (0, 9)),
        lengths=batch.lengths,
        sampler_logprobs=torch.nn.functional.pad(batch.sampler_logprobs, (0, 9)),
    )
    out = decode_rollouts(encode_rollouts(wide), vocab_size=CHAR_VOCAB, max_tokens=12)
    assert out.completion_ids.shape == (8, 3)
    assert encode_rollouts(wide) == encode_rollouts(batch)  # no padding on the wire


@pytest.mark.parametrize("fmt", ["q8", "q12", "q13", "q16", "q24", "compact"])
@pytest.mark.parametrize("vocab", [CHAR_VOCAB, QWEN_VOCAB])
def test_fixed_point_round_trip_within_stated_bound(fmt: str, vocab: int) -> None:
    batch = make_batch(64, 20, vocab, seed=3)
    k = int(resolve_logprob_format(fmt, vocab)[1:])
    step = 2.0 ** -(k - 5)
    # a sweep over the whole range the bound covers, [-(32 - step), 0]
    sweep = -torch.linspace(0, LOGPROB_CLAMP - step, batch.num_tokens, dtype=torch.float32)
    batch.sampler_logprobs[batch.mask] = sweep[torch.randperm(sweep.numel())]
    batch.sampler_logprobs[0, 0] = 0.0
    data = encode_rollouts(batch, logprob_format=fmt, vocab_size=vocab)
    out = decode_rollouts(data, vocab_size=vocab, max_tokens=32)
    assert_same_metadata(out, batch)  # ids are exact in every format
    bound = logprob_max_error(fmt, vocab)
    assert bound == 2.0 ** -(k - 4)
    err = (out.sampler_logprobs - batch.sampler_logprobs).abs().max().item()
    assert err <= bound * (1 + 1e-6)
    assert err >= bound * 0.5  # the sweep does reach the stated bound: it is not loose
    # prob-1 tokens stay exactly 0.0 (positive zero); padding stays 0.0
    assert out.sampler_logprobs[0, 0].item() == 0.0
    assert not torch.signbit(out.sampler_logprobs[0, 0])
    assert (out.sampler_logprobs[~out.mask] == 0.0).all()
    assert (out.sampler_logprobs <= 0).all()


def test_fixed_point_clamps_below_the_range() -> None:
    batch = make_batch(2, 2, CHAR_VOCAB, fixed_len=True)
    batch.sampler_logprobs[0] = torch.tensor([-40.0, -1e30])
    out = decode_rollouts(
        encode_rollouts(batch, logprob_format="q16"), vocab_size=102, max_tokens=2
    )
    assert out.sampler_logprobs[0].tolist() == [-(65535 / 2048)] * 2


def test_compact_resolution_and_bounds() -> None:
    assert resolve_logprob_format("compact", CHAR_VOCAB) == "q16"
    assert resolve_logprob_format("compact", 32768) == "q16"
    assert resolve_logprob_format("compact", 32769) == "q15"
    assert resolve_logprob_format("compact", QWEN_VOCAB) == "q13"
    assert resolve_logprob_format("compact", 2**32) == "q8"
    assert logprob_max_error("f32") == 0.0
    assert logprob_max_error("q16") == 2.0**-12
    assert logprob_max_error("compact", QWEN_VOCAB) == 2.0**-9


def test_positive_rounding_is_clamped_to_zero_by_the_encoder() -> None:
    batch = make_batch(2, 2, CHAR_VOCAB, fixed_len=True)
    batch.sampler_logprobs[0, 0] = 5e-5
    out = decode_rollouts(encode_rollouts(batch), vocab_size=CHAR_VOCAB, max_tokens=2)
    assert out.sampler_logprobs[0, 0].item() == 0.0


def test_empty_batch_round_trips() -> None:
    batch = make_batch(0, 1, CHAR_VOCAB)
    data = encode_rollouts(batch, vocab_size=CHAR_VOCAB)
    out = decode_rollouts(data, vocab_size=CHAR_VOCAB, max_tokens=8, expected_generator=3)
    assert out.completion_ids.shape == (0, 0)
    assert out.num_tokens == 0
    assert bytes_per_token(data, batch) == 0.0
    assert len(data) < 40


@pytest.mark.parametrize("fmt", ["f32", "q16", "compact"])
def test_zlib_round_trip(fmt: str) -> None:
    batch = make_batch(64, 50, QWEN_VOCAB, seed=5)
    raw = encode_rollouts(batch, logprob_format=fmt, vocab_size=QWEN_VOCAB)
    packed = encode_rollouts(batch, logprob_format=fmt, vocab_size=QWEN_VOCAB, compress=True)
    assert packed[5] == 1 and len(packed) < len(raw)  # the flag is set, and it helps here
    a = decode_rollouts(raw, vocab_size=QWEN_VOCAB, max_tokens=64)
    b = decode_rollouts(packed, vocab_size=QWEN_VOCAB, max_tokens=64)
    assert_same_metadata(a, b)
    assert torch.equal(a.sampler_logprobs, b.sampler_logprobs)


def test_zlib_is_skipped_when_it_does_not_shrink() -> None:
    batch = make_batch(4, 2, 2**32, fixed_len=True)
    batch.completion_ids[:] = torch.randint(0, 2**32 - 1, (4, 2))
    batch.sampler_logprobs[:] = -torch.rand(4, 2) * 10
    data = encode_rollouts(batch, compress=True, vocab_size=2**32)
    assert data[5] == 0
    assert data == encode_rollouts(batch, vocab_size=2**32)


def test_input_on_other_dtypes_and_bytearray() -> None:
    batch = make_batch(8, 4, CHAR_VOCAB)
    b32 = RolloutBatch(
        prompt_index=batch.prompt_index.int(),
        generator=batch.generator.int(),
        completion_ids=batch.completion_ids.int(),
        lengths=batch.lengths.int(),
        sampler_logprobs=batch.sampler_logprobs.double(),
    )
    data = encode_rollouts(b32)
    assert data == encode_rollouts(batch)
    out = decode_rollouts(memoryview(bytearray(data)), vocab_size=CHAR_VOCAB, max_tokens=8)
    assert_same_metadata(out, batch)


# ----------------------------------------------------------------------------- size budgets
# Sizes, not timings: deterministic for a seeded batch, so asserting them is safe.

REALISTIC = [
    pytest.param(128, 6, CHAR_VOCAB, False, id="arith-N128-L6-V102"),
    pytest.param(128, 4, CHAR_VOCAB, False, id="arith-N128-L4-V102"),
    pytest.param(128, 8, CHAR_VOCAB, False, id="arith-N128-L8-V102"),
    pytest.param(64, 200, QWEN_VOCAB, True, id="gsm8k-N64-L200-V151936"),
    pytest.param(64, 200, 32000, True, id="gsm8k-N64-L200-V32000"),
]


@pytest.mark.parametrize(("n", "mean_len", "vocab", "fixed"), REALISTIC)
def test_default_format_is_within_8_bytes_per_token(n, mean_len, vocab, fixed) -> None:
    batch = make_batch(n, mean_len, vocab, fixed_len=fixed)
    bpt = bytes_per_token(encode_rollouts(batch, vocab_size=vocab), batch)
    assert bpt <= 8.0
    # and the default is exact: ids in ceil(log2 V) bits + 4 bytes, sequences cost ~1/2 byte
    assert bpt <= (_id_bits(vocab) + 32) / 8 + 0.6


@pytest.mark.parametrize(("n", "mean_len", "vocab", "fixed"), REALISTIC)
def test_compact_format_is_within_4_bytes_per_token(n, mean_len, vocab, fixed) -> None:
    batch = make_batch(n, mean_len, vocab, fixed_len=fixed)
    data = encode_rollouts(batch, logprob_format="compact", vocab_size=vocab)
    assert bytes_per_token(data, batch) <= 4.0


def test_compact_qwen_short_sequences_is_within_4_bytes_per_token() -> None:
    batch = make_batch(128, 8, QWEN_VOCAB)
    data = encode_rollouts(batch, logprob_format="compact", vocab_size=QWEN_VOCAB)
    assert bytes_per_token(data, batch) <= 4.0


def test_max_payload_size_bounds_real_payloads() -> None:
    batch = make_batch(64, 200, QWEN_VOCAB, fixed_len=True)
    bound = max_payload_size(max_sequences=64, max_tokens=200, vocab_size=QWEN_VOCAB)
    assert len(encode_rollouts(batch, vocab_size=QWEN_VOCAB)) <= bound


# ----------------------------------------------------------------------------- encoder refusals


def _with(batch: RolloutBatch, **fields) -> RolloutBatch:
    return RolloutBatch(**{**batch.__dict__, **fields})


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: _with(b, lengths=b.lengths * 0), "lengths must lie in"),
        (lambda b: _with(b, lengths=b.lengths + 100), "lengths must lie in"),
        (lambda b: _with(b, prompt_index=b.prompt_index - 10_000), "prompt_index must be >= 0"),
        (lambda b: _with(b, generator=b.generator - 5), "generator must be >= 0"),
        (lambda b: _with(b, completion_ids=b.completion_ids - 1000), "token ids must be >= 0"),
        (lambda b: _with(b, sampler_logprobs=b.sampler_logprobs + 1), "must be finite and <= 0"),
        (lambda b: _with(b, sampler_logprobs=b.sampler_logprobs / 0), "must be finite and <= 0"),
    ],
)
def test_encoder_refuses_batches_no_receiver_would_accept(mutate, message) -> None:
    batch = make_batch(8, 4, CHAR_VOCAB)
    with pytest.raises(ValueError, match=message):
        encode_rollouts(mutate(batch))


def test_encoder_refuses_ids_outside_vocab_and_unknown_formats() -> None:
    batch = make_batch(8, 4, CHAR_VOCAB)
    with pytest.raises(ValueError, match=r"token id 101 >= vocab_size 50"):
        encode_rollouts(batch, vocab_size=50)
    for fmt in ("f16", "q7", "q25", "bf16", ""):
        with pytest.raises(ValueError, match="unknown logprob_format"):
            encode_rollouts(batch, logprob_format=fmt)


# ----------------------------------------------------------------------------- crafted payloads


def craft(
    *,
    magic: bytes = MAGIC,
    version: int = 1,
    flags: int = 0,
    lp_kind: int = 0,
    lp_bits: int = 32,
    vocab: int = CHAR_VOCAB,
    vocab_raw: bytes | None = None,
    n: int | None = None,
    total: int | None = None,
    lengths: tuple[int, ...] = (2, 1),
    len_bits: int | None = None,
    prompt: bytes | None = None,
    gen: bytes | None = None,
    ids: tuple[int, ...] = (5, 6, 7),
    id_bits: int | None = None,
    lps: bytes | None = None,
    sections: bytes | None = None,
    tail: bytes = b"",
    seal: bool = True,
) -> bytes:
    """A payload built field by field (docs/wire-format.md layout); every field overridable."""
    n = len(lengths) if n is None else n
    total = sum(lengths) if total is None else total
    if sections is None:
        lb = (max(lengths, default=1) - 1).bit_length() if len_bits is None else len_bits
        if lps is None:
            lps = struct.pack(f"<{len(ids)}f", *[-0.5] * len(ids))
        sections = b"".join(
            [
                bytes([lb]),
                _pack(np.array(lengths, dtype=np.uint64) - np.uint64(1), lb),
                _put_column(np.array([4] * len(lengths), dtype=np.int64))
                if prompt is None
                else prompt,
                _put_column(np.array([1] * len(lengths), dtype=np.int64)) if gen is None else gen,
                _pack(
                    np.array(ids, dtype=np.uint64), _id_bits(vocab) if id_bits is None else id_bits
                ),
                lps,
            ]
        )
    body = b"".join(
        [
            magic,
            bytes([version, flags, lp_kind, lp_bits]),
            _varint(vocab) if vocab_raw is None else vocab_raw,
            _varint(n),
            _varint(total),
            sections,
            tail,
        ]
    )
    return _seal(body) if seal else body


def decode(data: bytes, **kw) -> RolloutBatch:
    kw = {"vocab_size": CHAR_VOCAB, "max_tokens": 8, "max_sequences": 16, **kw}
    return decode_rollouts(data, **kw)


def test_crafted_baseline_is_valid() -> None:
    out = decode(craft(), expected_generator=1)
    assert out.lengths.tolist() == [2, 1]
    assert out.completion_ids.tolist() == [[5, 6], [7, 0]]
    assert out.prompt_index.tolist() == [4, 4]
    assert out.sampler_logprobs.tolist() == [[-0.5, -0.5], [-0.5, 0.0]]


def _col(base: int, runs: int, vbits: int, cbits: int, payload: bytes = b"") -> bytes:
    return _varint(base) + _varint(runs) + bytes([vbits, cbits]) + payload


BAD = [
    # (payload, decode kwargs, message regex)
    (b"", {}, r"truncated: 0 bytes"),
    (craft()[:14], {}, r"truncated: 14 bytes"),
    (craft(magic=b"FTRX"), {}, r"bad magic b'FTRX'"),
    (craft(version=4), {}, r"unsupported wire version 4 \(this build reads versions 1, 2, 3\)"),
    (craft(version=3), {}, r"the text flag \(0x02\) is set exactly in version 3 payloads"),
    (craft()[:-1] + bytes([craft()[-1] ^ 1]), {}, r"checksum mismatch"),
    (craft()[:-5], {}, r"checksum mismatch"),
    (craft(flags=0x80), {}, r"unknown flags 0x80"),
    (craft(lp_kind=2), {}, r"unknown log-prob format \(kind 2, bits 32\)"),
    (craft(lp_kind=0, lp_bits=16), {}, r"unknown log-prob format \(kind 0, bits 16\)"),
    (craft(lp_kind=1, lp_bits=25), {}, r"unknown log-prob format \(kind 1, bits 25\)"),
    (craft(vocab=0), {}, r"payload vocab_size 0 outside \[1, 4294967296\]"),
    (craft(vocab=2**32 + 1), {}, r"payload vocab_size 4294967297 outside \[1, 4294967296\]"),
    (
        craft(vocab=151936, ids=(5, 102, 7)),
        {},
        r"token id 102 at sequence 0, position 1 >= receiver's vocab_size 102",
    ),
    (craft(n=17), {}, r"sequence count N 17 outside \[0, 16\]"),
    (craft(n=2**62), {}, r"sequence count N 4611686018427387904 outside"),
    (craft(total=17), {}, r"total_tokens 17 outside \[2, 16\]"),
    (craft(total=1), {}, r"total_tokens 1 outside \[2, 16\]"),
    (craft(total=8), {}, r"truncated: 8 tokens need at least 39 bytes, only 27 left"),
    (
        craft(total=4, ids=(5, 6, 7, 8), lps=struct.pack("<4f", -1, -1, -1, -1)),
        {},
        r"lengths sum to 3, header says 4",
    ),
    (craft(lengths=(9, 1), ids=(1,) * 10), {}, r"length 9 at sequence 0 > max_tokens 8"),
    (craft(len_bits=33), {}, r"len_bits 33 outside \[0, 32\]"),
    (craft(prompt=_col(0, 3, 0, 0)), {}, r"prompt_index run count 3 outside \[1, 2\]"),
    (craft(prompt=_col(0, 0, 0, 0)), {}, r"prompt_index run count 0 outside \[1, 2\]"),
    (craft(prompt=_col(0, 1, 64, 0)), {}, r"prompt_index value_bits 64 outside \[0, 63\]"),
    (craft(prompt=_col(0, 1, 0, 33)), {}, r"prompt_index count_bits 33 outside \[0, 32\]"),
    (
        craft(prompt=_col(0, 1, 0, 8, b"\x05")),
        {},
        r"prompt_index runs cover 6 sequences, header says 2",
    ),
    (
        craft(prompt=_col(2**63, 1, 0, 1, b"\x80")),
        {},
        r"prompt_index base 9223372036854775808 outside",
    ),
    (
        craft(prompt=_col(2**63 - 1, 1, 8, 1, b"\x01\x80")),
        {},
        r"prompt_index value 9223372036854775808 overflows int64",
    ),
    (craft(gen=_col(1, 1, 0, 0)), {}, r"generator runs cover 1 sequences, header says 2"),
    (craft(), {"expected_generator": 0}, r"generator 1 at sequence 0 != expected generator 0"),
    (
        craft(ids=(5, 120, 7)),
        {},
        r"token id 120 at sequence 0, position 1 >= receiver's vocab_size 102",
    ),
    (
        craft(ids=(5, 6, 101), vocab=101),
        {},
        r"token id 101 at sequence 1, position 0 >= payload's vocab_size 101",
    ),
    (
        craft(lps=struct.pack("<3f", -1, float("nan"), -1)),
        {},
        r"log-prob nan at sequence 0, position 1 is not finite and <= 0",
    ),
    (
        craft(lps=struct.pack("<3f", -1, -1, float("-inf"))),
        {},
        r"log-prob -inf at sequence 1, position 0",
    ),
    (
        craft(lps=struct.pack("<3f", -1, float("inf"), -1)),
        {},
        r"log-prob inf at sequence 0, position 1",
    ),
    (
        craft(lps=struct.pack("<3f", 1e-7, -1, -1)),
        {},
        r"log-prob 1.0000000116860974e-07 at sequence 0, position 0",
    ),
    (craft(tail=b"\x00"), {}, r"1 trailing bytes after the log-probs"),
    (craft(lps=struct.pack("<3f", -1, -1, -1)[:-1]), {}, r"truncated: log-probs needs 12 bytes"),
    (
        craft(lp_kind=1, lp_bits=12, lps=b"\x00\x00\x00\x00\x01"),
        {},
        r"log-probs: nonzero padding bits",
    ),
    (craft(vocab_raw=b"\xe6\x00"), {}, r"vocab_size: non-canonical varint"),
    (craft(vocab_raw=b"\xff" * 10), {}, r"vocab_size: varint longer than 10 bytes"),
    (bytearray(craft()), {"max_sequences": 1}, r"sequence count N 2 outside \[0, 1\]"),
    ("not bytes", {}, r"payload must be bytes, got str"),
]


@pytest.mark.parametrize(("data", "kw", "message"), BAD, ids=[m for _, _, m in BAD])
def test_each_validation_rule_rejects_with_a_message(data, kw, message) -> None:
    with pytest.raises(PayloadError, match=message):
        decode(data, **kw)


def test_truncated_sections_are_reported_before_allocating() -> None:
    # a raw payload claiming N = 16 sequences of 8 tokens but carrying none of them
    data = craft(n=16, total=128, sections=b"")
    with pytest.raises(
        PayloadError, match=r"truncated: 128 tokens need at least 624 bytes, only 0 left"
    ):
        decode(data)


def _zlib_payload(sections: bytes, **kw) -> bytes:
    return craft(flags=1, sections=sections, **kw)


def test_zlib_bomb_is_bounded() -> None:
    bomb = zlib.compress(b"\x00" * 50_000_000, 9)  # 50 MB of zeros in ~50 kB
    with pytest.raises(PayloadError, match=r"inflate past \d+ bytes"):
        decode(_zlib_payload(bomb))


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (b"garbage!", r"malformed payload \(error: Error -3"),
        (zlib.compress(b"\x00\x01")[:-3], r"compressed sections are malformed, incomplete"),
        (zlib.compress(b"\x00") + b"tail", r"compressed sections are malformed, incomplete"),
        (zlib.compress(b""), r"truncated: len_bits needs 1 bytes"),
    ],
)
def test_zlib_failures(sections: bytes, message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        decode(_zlib_payload(sections))


def test_bad_arguments_are_value_errors() -> None:
    data = craft()
    for kw in ({"vocab_size": 0}, {"max_tokens": 0}, {"max_tokens": 1.5}, {"pad_id": None}):
        with pytest.raises(ValueError) as info:
            decode(data, **kw)
        assert not isinstance(info.value, PayloadError)


def test_payload_error_is_a_value_error() -> None:
    assert issubclass(PayloadError, ValueError)


# ----------------------------------------------------------------------------- exact f32 (v2)


def _f32_batch(values: list[float]) -> RolloutBatch:
    lp = torch.tensor([values], dtype=torch.float32)
    n = lp.shape[1]
    return RolloutBatch(
        prompt_index=torch.zeros(1, dtype=torch.long),
        generator=torch.zeros(1, dtype=torch.long),
        completion_ids=torch.arange(n)[None] % 7,
        lengths=torch.tensor([n]),
        sampler_logprobs=lp,
    )


def test_f32_is_bit_exact_on_every_kind_of_value() -> None:
    tiny = torch.finfo(torch.float32).tiny
    values = [0.0, -0.0, -tiny, -tiny / 8, -1e-45, -1e-30, -1e-7, -0.5, -1.0, -31.9, -32.0,
              -1e30, -float(torch.finfo(torch.float32).max)]  # fmt: skip
    batch = _f32_batch(values)
    data = encode_rollouts(batch, vocab_size=7)
    back = decode_rollouts(data, vocab_size=7, max_tokens=len(values))
    sent = batch.sampler_logprobs.view(torch.int32)
    assert torch.equal(back.sampler_logprobs.view(torch.int32), sent)  # bit for bit, -0.0 too


def test_f32_packs_below_four_bytes_of_log_prob_per_token() -> None:
    # A batch whose log-probs span [-8, -1/4): 6 exponents -> 3 class bits + 23 = 26 bits per
    # log-prob + 3 bits per id (vocab 7) = 29 bits, against 32 + 3 for plain f32.
    g = torch.Generator().manual_seed(0)
    n, t = 16, 64
    lp = -(torch.rand((n, t), generator=g) * 7.75 + 0.25)
    batch = RolloutBatch(
        prompt_index=torch.arange(n) // 8,
        generator=torch.zeros(n, dtype=torch.long),
        completion_ids=torch.randint(0, 7, (n, t), generator=g),
        lengths=torch.full((n,), t),
        sampler_logprobs=lp,
    )
    data = encode_rollouts(batch, vocab_size=7)
    assert data[7] == 3  # lp_bits: class bits
    assert len(data) / batch.num_tokens < (29 + 1) / 8
    back = decode_rollouts(data, vocab_size=7, max_tokens=t)
    assert torch.equal(back.sampler_logprobs, lp)


def test_version_1_f32_payloads_still_decode() -> None:
    lps = struct.pack("<3f", -0.5, -1.0, -0.25)
    data = craft(version=1, lp_kind=0, lp_bits=32, lps=lps)
    back = decode_rollouts(data, vocab_size=CHAR_VOCAB, max_tokens=8)
    assert back.sampler_logprobs[back.mask].tolist() == [-0.5, -1.0, -0.25]


def _packed_f32_payload(codes: list[int], class_bits: int, e_top: int) -> bytes:
    from ftis.exchange.wire import _pack

    width = class_bits + 23
    lps = bytes([e_top]) + _pack(np.array(codes, dtype=np.uint64), width)
    return craft(version=2, lp_kind=2, lp_bits=class_bits, lps=lps)


def test_packed_f32_rejects_malformed_codes() -> None:
    ok = _packed_f32_payload([2 << 23, 2 << 23, 2 << 23], 2, 126)
    assert decode_rollouts(ok, vocab_size=CHAR_VOCAB, max_tokens=8).sampler_logprobs[0, 0] == -0.5
    # class 0 (+0.0) with a nonzero mantissa
    with pytest.raises(PayloadError, match=r"not a valid \(class, mantissa\) pair"):
        decode_rollouts(_packed_f32_payload([1, 0, 0], 2, 126), vocab_size=CHAR_VOCAB, max_tokens=8)
    # a class below exponent 1 (e_top 1, class 3 -> exponent 0)
    with pytest.raises(PayloadError, match=r"not a valid \(class, mantissa\) pair"):
        decode_rollouts(
            _packed_f32_payload([3 << 23, 0, 0], 2, 1), vocab_size=CHAR_VOCAB, max_tokens=8
        )
    # e_top 255 would make inf/NaN
    with pytest.raises(PayloadError, match=r"e_top 255 outside \[0, 254\]"):
        decode_rollouts(_packed_f32_payload([0, 0, 0], 2, 255), vocab_size=CHAR_VOCAB, max_tokens=8)
    # more class bits than any exponent needs, and kind 2 in a version 1 payload
    with pytest.raises(PayloadError, match=r"unknown log-prob format \(kind 2, bits 9\)"):
        decode_rollouts(_packed_f32_payload([0, 0, 0], 9, 126), vocab_size=CHAR_VOCAB, max_tokens=8)
    v1 = craft(version=1, lp_kind=2, lp_bits=2, lps=b"\x7e" + b"\x00" * 10)
    with pytest.raises(PayloadError, match=r"unknown log-prob format \(kind 2, bits 2\)"):
        decode_rollouts(v1, vocab_size=CHAR_VOCAB, max_tokens=8)
