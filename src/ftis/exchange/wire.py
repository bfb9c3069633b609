"""The wire format of a rollout batch: compact, versioned, binary, no pickle.

`encode_rollouts(batch) -> bytes` and `decode_rollouts(data, vocab_size=V, max_tokens=T) ->
RolloutBatch` are the public contract (docs/wire-format.md has the byte layout, the size figures
and the error bound of every log-prob format). Only real tokens travel: no padding, no masks, no
prompts; a receiver rebuilds the prompt from `prompt_index` and recomputes rewards itself.

The decoder treats every payload as hostile: every header value is bounded by the caller's limits
and by the payload's length before anything is allocated, every decoded value is checked, and any
failure, expected or not, leaves as `PayloadError` (a ValueError) with a message that says what
was wrong. Nothing else escapes `decode_rollouts`.

Layout (docs/wire-format.md section "Layout"), integers little-endian, `varint` = unsigned LEB128:

    magic "FTRB" | version u8 (2; version 1 payloads still decode) | flags u8 | lp_kind u8 | lp_bits u8
    | vocab_size varint | N varint | total_tokens varint
    | sections (raw, or one zlib stream when flags & FLAG_ZLIB)
    | crc32 u32 of everything before it

    sections = len_bits u8, (lengths - 1) packed at len_bits
             | prompt_index column | generator column     (run-length coded, see _put_column)
             | token ids packed at id_bits = bit_length(vocab_size - 1)
             | log-probs: exact f32 (kind 2: e_top u8, then (class, mantissa) codes packed at
               lp_bits + 23, see _f32_codes), fixed-point codes packed at lp_bits (kind 1), or
               plain f32 little-endian (kind 0, version 1 senders)

"packed at w" = each value as a w-bit unsigned field, most significant bit first, fields back to
back, the stream zero-padded to a whole byte.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ftis.rollout.types import CompletionText, RolloutBatch

__all__ = [
    "DEFAULT_LOGPROB_FORMAT",
    "FORMAT_VERSION",
    "LOGPROB_CLAMP",
    "LOGPROB_POSITIVE_TOLERANCE",
    "MAGIC",
    "MAX_VOCAB",
    "TEXT_BYTES_PER_TOKEN",
    "PayloadError",
    "bytes_per_token",
    "decode_rollouts",
    "describe_logprob_format",
    "encode_rollouts",
    "logprob_max_error",
    "max_payload_size",
    "resolve_logprob_format",
]

MAGIC = b"FTRB"  # FTis Rollout Batch
FORMAT_VERSION = 2
# Version 3 = version 2 plus the optional text section (FLAG_TEXT) for peers on another
# tokenizer; a payload without text is still written as version 2, byte for byte as before.
TEXT_FORMAT_VERSION = 3
# Version 1 is version 2 without log-prob kind 2 (its f32 is kind 0, 4 bytes per log-prob):
# payloads of older senders still decode.
READ_VERSIONS = (1, 2, 3)
FLAG_ZLIB = 0x01
FLAG_TEXT = 0x02
_KNOWN_FLAGS = FLAG_ZLIB | FLAG_TEXT
# The most UTF-8 bytes of text a sequence may carry, per token of max_tokens: a receiver's
# bound on what a peer's text can cost it (the embedded BPE's longest token is 3 bytes).
TEXT_BYTES_PER_TOKEN = 8
_LP_F32 = 0  # plain little-endian f32 (what version 1 senders wrote for "f32")
_LP_FIXED = 1
_LP_F32_PACKED = 2  # exact f32 as (exponent class, 23-bit mantissa), version >= 2
_MANTISSA_BITS = 23
_MAX_CLASS_BITS = 8
_Q_MIN_BITS, _Q_MAX_BITS = 8, 24
# Fixed-point codes cover -log p in [0, LOGPROB_CLAMP): code = round(-lp * 2**(K - 5)).
# exp(-32) ~ 1.3e-14: no sampler draws such a token in practice (docs/wire-format.md).
LOGPROB_CLAMP = 32.0
_Q_RANGE_BITS = 5  # LOGPROB_CLAMP == 2**_Q_RANGE_BITS
# A backend's log-softmax may round a prob-1 token's log-prob a hair above 0; the encoder clamps
# positives up to this much to 0.0 and refuses larger ones (a sampler bug). On the wire: <= 0.
LOGPROB_POSITIVE_TOLERANCE = 1e-4
DEFAULT_LOGPROB_FORMAT = "f32"
_MAX_VOCAB = 1 << 32
MAX_VOCAB = _MAX_VOCAB  # the widest vocabulary a payload may declare
_MAX_INDEX = (1 << 63) - 1
_HEADER_MIN = len(MAGIC) + 4 + 3 + 4  # fixed fields + three 1-byte varints + crc


class PayloadError(ValueError):
    """A received payload is malformed, inconsistent, or outside the receiver's limits."""


# ----------------------------------------------------------------------------- formats


@dataclass(frozen=True)
class _LpCodec:
    kind: int  # _LP_F32 | _LP_F32_PACKED | _LP_FIXED
    bits: int  # 32 for f32, K for qK

    @property
    def name(self) -> str:
        return f"q{self.bits}" if self.kind == _LP_FIXED else "f32"

    @property
    def step(self) -> float:
        return 2.0 ** -(self.bits - _Q_RANGE_BITS)


def _id_bits(vocab_size: int) -> int:
    return max(1, (vocab_size - 1).bit_length())


def resolve_logprob_format(logprob_format: str, vocab_size: int) -> str:
    """The concrete format ("f32" or "qK") that `logprob_format` names for this vocab size.

    "compact" is the most precise fixed-point code whose token (id + log-prob) fits in 31 bits,
    i.e. at most 4 bytes per token including per-sequence overhead on realistic batches:
    q16 for vocabularies up to 2**15, q13 for Qwen's 151936, never below q8.
    """
    if logprob_format == "compact":
        k = min(16, max(_Q_MIN_BITS, 31 - _id_bits(vocab_size)))
        return f"q{k}"
    return _codec(logprob_format).name


def check_logprob_format(name: str) -> str:
    """`name` when it is a log-prob format `encode_rollouts` accepts, else a ValueError that
    lists the formats."""
    if name != "compact":
        _codec(name)
    return name


def _codec(name: str) -> _LpCodec:
    if name == "f32":
        return _LpCodec(_LP_F32_PACKED, 32)
    if name.startswith("q") and name[1:].isdigit():
        k = int(name[1:])
        if _Q_MIN_BITS <= k <= _Q_MAX_BITS:
            return _LpCodec(_LP_FIXED, k)
    raise ValueError(
        f"unknown logprob_format {name!r}: use 'f32' (exact), 'q{_Q_MIN_BITS}'..'q{_Q_MAX_BITS}' "
        "(fixed-point) or 'compact'"
    )


def logprob_max_error(logprob_format: str, vocab_size: int = 2) -> float:
    """Largest |decoded - sent| log-prob error of a format: 0.0 for "f32" (bit-exact); for qK,
    step / 2 = 2**-(K - 4) for log-probs in [-(32 - step), 0] (step = 2**-(K - 5)); lower
    values are clamped to that most negative code, -(32 - step)."""
    c = _codec(resolve_logprob_format(logprob_format, vocab_size))
    return c.step / 2 if c.kind == _LP_FIXED else 0.0


def bytes_per_token(data: bytes, batch: RolloutBatch) -> float:
    """Wire cost per completion token, `len(data) / batch.num_tokens` (0.0 for a batch with no
    tokens, matching the empty-mask-gives-0 rule)."""
    n = batch.num_tokens
    return len(data) / n if n else 0.0


# ----------------------------------------------------------------------------- bit packing


def _pack(values: np.ndarray, width: int) -> bytes:
    """Unsigned `values` (each < 2**width) as `width`-bit fields, MSB first, zero-padded."""
    n = values.shape[0]
    if width == 0 or n == 0:
        return b""
    if width in (8, 16, 32, 64):
        return values.astype(f">u{width // 8}").tobytes()
    nb = (width + 7) // 8
    be = values.astype(">u8").view(np.uint8).reshape(n, 8)[:, 8 - nb :]
    bits = np.unpackbits(np.ascontiguousarray(be).reshape(-1)).reshape(n, 8 * nb)[
        :, 8 * nb - width :
    ]
    return np.packbits(bits.reshape(-1)).tobytes()


def _unpack(buf: bytes, n: int, width: int, what: str) -> np.ndarray:
    """Inverse of `_pack`: (n,) uint64. `buf` holds exactly ceil(n * width / 8) bytes."""
    if width == 0 or n == 0:
        return np.zeros(n, dtype=np.uint64)
    raw = np.frombuffer(buf, dtype=np.uint8)
    if width in (8, 16, 32, 64):
        return raw.view(f">u{width // 8}").astype(np.uint64)
    spare = len(buf) * 8 - n * width
    if spare and int(raw[-1]) & ((1 << spare) - 1):
        raise PayloadError(f"{what}: nonzero padding bits after the last field")
    nb = (width + 7) // 8  # whole bytes per value: temporaries stay ~8 * nb bytes per value
    bits = np.zeros((n, 8 * nb), dtype=np.uint8)
    bits[:, 8 * nb - width :] = np.unpackbits(raw)[: n * width].reshape(n, width)
    be = np.zeros((n, 8), dtype=np.uint8)
    be[:, 8 - nb :] = np.packbits(bits.reshape(-1)).reshape(n, nb)
    return be.reshape(-1).view(">u8").astype(np.uint64)


def _packed_size(n: int, width: int) -> int:
    return (n * width + 7) // 8


# ----------------------------------------------------------------------------- encode


def _varint(x: int) -> bytes:
    out = bytearray()
    while True:
        b = x & 0x7F
        x >>= 7
        if x:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _put_column(values: np.ndarray) -> bytes:
    """A non-negative int column as runs: base varint | R varint | value_bits u8 | count_bits u8
    | (run value - base) packed | (run length - 1) packed. A group's G completions share one
    prompt index and a node's batch has one generator, so both columns cost a few bytes."""
    n = values.shape[0]
    if n == 0:
        return _varint(0) + _varint(0) + bytes([0, 0])
    starts = np.concatenate([[0], np.flatnonzero(np.diff(values) != 0) + 1])
    run_values = values[starts]
    counts = np.diff(np.concatenate([starts, [n]]))
    base = int(run_values.min())
    offsets = (run_values - base).astype(np.uint64)
    vbits = int(offsets.max()).bit_length()
    cbits = int(counts.max() - 1).bit_length()
    return b"".join(
        [
            _varint(base),
            _varint(len(starts)),
            bytes([vbits, cbits]),
            _pack(offsets, vbits),
            _pack((counts - 1).astype(np.uint64), cbits),
        ]
    )


def _f32_codes(lp: np.ndarray) -> tuple[int, bytes]:
    """Exact f32 log-probs (all <= 0, finite) as (class_bits, section).

    A log-prob <= 0 is +0.0, -0.0, a negative subnormal, or a negative normal number; its sign
    bit carries nothing beyond that, and its 8 exponent bits take few values in one batch (the
    log-probs of sampled tokens span a few powers of two). Each value becomes a class c and its
    23 mantissa bits: c = 0 is +0.0 (mantissa 0), c = 1 is exponent field 0 with the sign set
    (-0.0 or a subnormal), c >= 2 is the normal exponent e_top - (c - 2), e_top being the
    batch's largest exponent. Section: e_top u8, then (c << 23 | mantissa) packed at
    class_bits + 23, class_bits = bit_length(max c). Bit-exact both ways (docs/wire-format.md).
    """
    u = lp.astype("<f4").view("<u4").astype(np.int64)
    exp = (u >> _MANTISSA_BITS) & 0xFF
    mant = u & ((1 << _MANTISSA_BITS) - 1)
    normal = exp > 0
    e_top = int(exp.max()) if u.size else 0
    cls = np.where(normal, e_top - exp + 2, np.where(u == 0, 0, 1))
    class_bits = int(cls.max()).bit_length() if u.size else 0
    codes = (cls << _MANTISSA_BITS) | mant
    return class_bits, bytes([e_top]) + _pack(codes.astype(np.uint64), class_bits + _MANTISSA_BITS)


def _f32_decode(r: _Reader, total: int, class_bits: int, lengths: np.ndarray) -> np.ndarray:
    """Inverse of `_f32_codes`, validating every code: (total,) float32, all finite and <= 0."""
    e_top = _check_range(r.u8("log-prob e_top"), 0, 254, "log-prob e_top")
    width = class_bits + _MANTISSA_BITS
    codes = _unpack(r.take(_packed_size(total, width), "log-probs"), total, width, "log-probs")
    codes = codes.astype(np.int64)
    cls = codes >> _MANTISSA_BITS
    mant = codes & ((1 << _MANTISSA_BITS) - 1)
    exp = e_top - cls + 2
    bad = ((cls == 0) & (mant != 0)) | ((cls >= 2) & (exp < 1))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise PayloadError(
            f"log-prob code {int(codes[i])} at {_locate(i, lengths)} is not a valid "
            f"(class, mantissa) pair for e_top {e_top}"
        )
    u = np.where(cls >= 2, (1 << 31) | (exp << _MANTISSA_BITS) | mant, (cls << 31) | mant)
    return u.astype("<u4").view("<f4").astype(np.float32)


def encode_rollouts(
    batch: RolloutBatch,
    *,
    logprob_format: str = DEFAULT_LOGPROB_FORMAT,
    vocab_size: int | None = None,
    compress: bool = False,
) -> bytes:
    """Encode a rollout batch for the wire.

    Args:
        batch: the sender's batch (any device; read on the CPU).
        logprob_format: "f32" (default: bit-exact, exponent-class + mantissa coded, measured
            4.5-4.6 B/token for the 102-symbol vocabulary, 5.8-6.0 for 151936: docs/wire-format.md,
            docs/BENCHMARKS.md), "qK" for K in 8..24 (fixed-point -log p, max abs error
            2**-(K-4) nats), or
            "compact" (the most precise qK fitting 4 B/token, see `resolve_logprob_format`).
        vocab_size: the shared tokenizer's vocabulary size, recorded in the header; every token id
            must be below it. Default: max id + 1 (the smallest bound that fits this batch).
        compress: zlib the sections; sent raw anyway when compression would not shrink them.

    Raises ValueError on a batch that no receiver would accept (lengths outside [1, T], negative
    indices, ids outside [0, vocab_size), non-finite or positive log-probs): fail at the source.
    """
    n = batch.num_sequences
    lengths = batch.lengths.detach().cpu().to(torch.int64).numpy()
    t = batch.completion_ids.shape[1]
    if n and (lengths.min() < 1 or lengths.max() > t):
        raise ValueError(f"lengths must lie in [1, T={t}], got [{lengths.min()}, {lengths.max()}]")
    mask = batch.mask.cpu()
    ids = batch.completion_ids.detach().cpu()[mask].to(torch.int64).numpy()
    lp = batch.sampler_logprobs.detach().cpu()[mask].to(torch.float32).numpy()
    prompt = batch.prompt_index.detach().cpu().to(torch.int64).numpy()
    gen = batch.generator.detach().cpu().to(torch.int64).numpy()
    for name, col in (("prompt_index", prompt), ("generator", gen)):
        if n and col.min() < 0:
            raise ValueError(f"{name} must be >= 0, got {col.min()}")
    if ids.size and ids.min() < 0:
        raise ValueError(f"token ids must be >= 0, got {ids.min()}")
    max_id = int(ids.max()) if ids.size else 0
    if vocab_size is None:
        vocab_size = max_id + 1
    if not 1 <= vocab_size <= _MAX_VOCAB:
        raise ValueError(f"vocab_size must lie in [1, 2**32], got {vocab_size}")
    if max_id >= vocab_size:
        raise ValueError(f"token id {max_id} >= vocab_size {vocab_size}")
    bad = ~(np.isfinite(lp) & (lp <= LOGPROB_POSITIVE_TOLERANCE))
    if bad.any():
        raise ValueError(
            f"sampler_logprobs must be finite and <= 0 on real tokens, got {lp[bad][0]!r}"
        )
    lp = np.where(lp > 0, np.float32(0.0), lp)  # (np.minimum would turn -0.0 into 0.0)
    codec = _codec(resolve_logprob_format(logprob_format, vocab_size))
    lp_bits = codec.bits
    if codec.kind == _LP_F32_PACKED:
        lp_bits, lp_bytes = _f32_codes(lp)
    else:
        scale = 2.0 ** (codec.bits - _Q_RANGE_BITS)
        codes = np.clip(np.rint(-lp.astype(np.float64) * scale), 0, (1 << codec.bits) - 1)
        lp_bytes = _pack(codes.astype(np.uint64), codec.bits)

    len_bits = int(lengths.max() - 1).bit_length() if n else 0
    parts = [
        bytes([len_bits]),
        _pack((lengths - 1).astype(np.uint64), len_bits),
        _put_column(prompt),
        _put_column(gen),
        _pack(ids.astype(np.uint64), _id_bits(vocab_size)),
        lp_bytes,
    ]
    flags = 0
    if batch.text is not None:
        parts.append(_text_section(batch, lengths, mask))
        flags |= FLAG_TEXT
    sections = b"".join(parts)
    if compress:
        packed = zlib.compress(sections, 6)
        if len(packed) < len(sections):
            sections, flags = packed, flags | FLAG_ZLIB
    version = TEXT_FORMAT_VERSION if flags & FLAG_TEXT else FORMAT_VERSION
    body = b"".join(
        [
            MAGIC,
            bytes([version, flags, codec.kind, lp_bits]),
            _varint(vocab_size),
            _varint(n),
            _varint(int(ids.size)),
            sections,
        ]
    )
    return _seal(body)


def _width(values: np.ndarray) -> int:
    return int(values.max()).bit_length() if values.size else 0


def _text_section(batch: RolloutBatch, lengths: np.ndarray, mask: torch.Tensor) -> bytes:
    """The text section (docs/wire-format.md "Text section"): finished bits, covered counts,
    text byte lengths, per-token character ends, then the UTF-8 text. Raises ValueError on text
    no receiver would accept."""
    text = batch.text
    assert text is not None
    n = lengths.shape[0]
    if len(text.texts) != n:
        raise ValueError(f"text has {len(text.texts)} strings for {n} sequences")
    blobs = [t.encode("utf-8") for t in text.texts]  # a lone surrogate raises here
    finished = text.finished.detach().cpu().to(torch.int64).numpy().astype(np.uint64)
    covered = text.covered.detach().cpu().to(torch.int64).numpy()
    ends = text.char_ends.detach().cpu()
    if ends.shape[1] < mask.shape[1]:
        ends = torch.nn.functional.pad(ends, (0, mask.shape[1] - ends.shape[1]))
    ends = ends[:, : mask.shape[1]][mask].to(torch.int64).numpy()
    if (covered < 0).any() or (ends < 0).any():
        raise ValueError("covered counts and character ends must be >= 0")
    sizes = np.array([len(b) for b in blobs], dtype=np.int64)
    cov_bits, size_bits, end_bits = _width(covered), _width(sizes), _width(ends)
    return b"".join(
        [
            _pack(finished, 1),
            bytes([cov_bits]),
            _pack(covered.astype(np.uint64), cov_bits),
            bytes([size_bits]),
            _pack(sizes.astype(np.uint64), size_bits),
            bytes([end_bits]),
            _pack(ends.astype(np.uint64), end_bits),
            *blobs,
        ]
    )


def _seal(body: bytes) -> bytes:
    """Append the CRC-32 trailer (tests use this to craft payloads that pass the checksum)."""
    return body + struct.pack("<I", zlib.crc32(body))


# ----------------------------------------------------------------------------- decode


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.left:
            raise PayloadError(
                f"truncated: {what} needs {n} bytes at offset {self.pos}, only {self.left} left"
            )
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def varint(self, what: str) -> int:
        x = 0
        for i in range(10):
            b = self.u8(what)
            x |= (b & 0x7F) << (7 * i)
            if not b & 0x80:
                if b == 0 and i:
                    raise PayloadError(f"{what}: non-canonical varint (trailing zero byte)")
                return x
        raise PayloadError(f"{what}: varint longer than 10 bytes")


def _check_range(value: int, lo: int, hi: int, what: str) -> int:
    if not lo <= value <= hi:
        raise PayloadError(f"{what} {value} outside [{lo}, {hi}]")
    return value


def _get_column(r: _Reader, n: int, what: str) -> np.ndarray:
    base = _check_range(r.varint(f"{what} base"), 0, _MAX_INDEX, f"{what} base")
    runs = _check_range(r.varint(f"{what} runs"), min(n, 1), n, f"{what} run count")
    vbits = _check_range(r.u8(f"{what} value_bits"), 0, 63, f"{what} value_bits")
    cbits = _check_range(r.u8(f"{what} count_bits"), 0, 32, f"{what} count_bits")
    offsets = _unpack(r.take(_packed_size(runs, vbits), what), runs, vbits, what)
    counts = _unpack(r.take(_packed_size(runs, cbits), what), runs, cbits, what) + np.uint64(1)
    if int(counts.sum()) != n:
        raise PayloadError(f"{what} runs cover {int(counts.sum())} sequences, header says {n}")
    if runs and base + int(offsets.max()) > _MAX_INDEX:
        raise PayloadError(f"{what} value {base + int(offsets.max())} overflows int64")
    return np.repeat(offsets.astype(np.int64) + base, counts.astype(np.int64))


def _sections_bound(
    n: int, total: int, id_bits: int, lp_bits: int, text_bytes: int | None = None
) -> int:
    """Largest possible size of the sections for these header values (bounds decompression);
    `text_bytes`: the most text bytes per sequence when the payload has a text section."""
    column = 10 + 10 + 2 + _packed_size(n, 63) + _packed_size(n, 32)
    # + 1 for the f32 section's e_top byte, + 1 of slack
    bound = 1 + _packed_size(n, 32) + 2 * column + _packed_size(total, id_bits + lp_bits) + 2
    if text_bytes is not None:
        bound += 3 + _packed_size(n, 1) + 2 * _packed_size(n, 64) + _packed_size(total, 64)
        bound += n * text_bytes
    return bound


def max_payload_size(
    *, max_sequences: int, max_tokens: int, vocab_size: int, text: bool = False
) -> int:
    """Upper bound on the size of any payload `decode_rollouts` accepts with these limits (a
    transport refuses to buffer more than this from one peer); `text`: payloads may carry the
    text section (at most TEXT_BYTES_PER_TOKEN * max_tokens bytes of text per sequence)."""
    total = max_sequences * max_tokens
    header = len(MAGIC) + 4 + 3 * 10 + 4
    return header + _sections_bound(
        max_sequences,
        total,
        _id_bits(vocab_size),
        32,
        TEXT_BYTES_PER_TOKEN * max_tokens if text else None,
    )


def _locate(flat_index: int, lengths: np.ndarray) -> str:
    """'sequence i, position t' of the flat_index-th real token."""
    ends = np.cumsum(lengths)
    seq = int(np.searchsorted(ends, flat_index, side="right"))
    return f"sequence {seq}, position {flat_index - int(ends[seq] - lengths[seq])}"


def _decode(
    data: bytes,
    vocab_size: int,
    max_tokens: int,
    max_sequences: int,
    expected_generator: int | None,
    pad_id: int,
) -> RolloutBatch:
    if len(data) < _HEADER_MIN:
        raise PayloadError(f"truncated: {len(data)} bytes is shorter than any valid payload")
    if data[: len(MAGIC)] != MAGIC:
        raise PayloadError(f"bad magic {bytes(data[: len(MAGIC)])!r}, expected {MAGIC!r}")
    version = data[len(MAGIC)]
    if version not in READ_VERSIONS:
        raise PayloadError(
            f"unsupported wire version {version} (this build reads versions "
            f"{', '.join(map(str, READ_VERSIONS))})"
        )
    body = data[:-4]
    (crc,) = struct.unpack("<I", data[-4:])
    if zlib.crc32(body) != crc:
        raise PayloadError("checksum mismatch: the payload was corrupted or truncated")

    r = _Reader(body)
    r.take(len(MAGIC) + 1, "magic and version")
    flags = r.u8("flags")
    if flags & ~_KNOWN_FLAGS:
        raise PayloadError(f"unknown flags 0x{flags:02x} (known: 0x{_KNOWN_FLAGS:02x})")
    if bool(flags & FLAG_TEXT) != (version == TEXT_FORMAT_VERSION):
        raise PayloadError(
            f"version {version} with flags 0x{flags:02x}: the text flag (0x{FLAG_TEXT:02x}) is "
            f"set exactly in version {TEXT_FORMAT_VERSION} payloads"
        )
    text_limit = TEXT_BYTES_PER_TOKEN * max_tokens if flags & FLAG_TEXT else None
    lp_kind, lp_bits = r.u8("lp_kind"), r.u8("lp_bits")
    if lp_kind == _LP_F32 and lp_bits == 32:
        codec = _LpCodec(_LP_F32, 32)
    elif lp_kind == _LP_F32_PACKED and version >= 2 and lp_bits <= _MAX_CLASS_BITS:
        # lp_bits = class bits; the bounds below count the mantissa and the e_top byte
        codec = _LpCodec(_LP_F32_PACKED, lp_bits + _MANTISSA_BITS)
    elif lp_kind == _LP_FIXED and _Q_MIN_BITS <= lp_bits <= _Q_MAX_BITS:
        codec = _LpCodec(_LP_FIXED, lp_bits)
    else:
        raise PayloadError(f"unknown log-prob format (kind {lp_kind}, bits {lp_bits})")
    # The sender's vocab_size sets the id width. It may exceed the receiver's (one tokenizer,
    # embeddings padded to different sizes, e.g. 151936 vs 152064): only the ids must fit both.
    declared_vocab = _check_range(r.varint("vocab_size"), 1, _MAX_VOCAB, "payload vocab_size")
    id_limit = min(declared_vocab, vocab_size)
    id_bits = _id_bits(declared_vocab)
    n = _check_range(r.varint("N"), 0, max_sequences, "sequence count N")
    total = _check_range(r.varint("total_tokens"), n, n * max_tokens, "total_tokens")

    if flags & FLAG_ZLIB:
        bound = _sections_bound(n, total, id_bits, codec.bits, text_limit)
        d = zlib.decompressobj()
        sections = d.decompress(r.take(r.left, "compressed sections"), bound + 1)
        if len(sections) > bound or d.unconsumed_tail or not d.eof or d.unused_data:
            raise PayloadError(
                "compressed sections are malformed, incomplete, or inflate past "
                f"{bound} bytes (the most these header values allow)"
            )
        r = _Reader(sections)
    elif _packed_size(total, id_bits) + _packed_size(total, codec.bits) > r.left:
        raise PayloadError(
            f"truncated: {total} tokens need at least "
            f"{_packed_size(total, id_bits) + _packed_size(total, codec.bits)} bytes, "
            f"only {r.left} left"
        )

    len_bits = _check_range(r.u8("len_bits"), 0, 32, "len_bits")
    lengths = _unpack(r.take(_packed_size(n, len_bits), "lengths"), n, len_bits, "lengths")
    lengths = lengths.astype(np.int64) + 1
    if n and lengths.max() > max_tokens:
        i = int(np.argmax(lengths))
        raise PayloadError(f"length {lengths[i]} at sequence {i} > max_tokens {max_tokens}")
    if int(lengths.sum()) != total:
        raise PayloadError(f"lengths sum to {int(lengths.sum())}, header says {total} tokens")
    prompt = _get_column(r, n, "prompt_index")
    gen = _get_column(r, n, "generator")
    if expected_generator is not None and n and (gen != expected_generator).any():
        i = int(np.flatnonzero(gen != expected_generator)[0])
        raise PayloadError(
            f"generator {gen[i]} at sequence {i} != expected generator {expected_generator}"
        )
    ids = _unpack(r.take(_packed_size(total, id_bits), "token ids"), total, id_bits, "token ids")
    if total and ids.max() >= id_limit:
        i = int(np.flatnonzero(ids >= id_limit)[0])
        which = "receiver's" if id_limit == vocab_size else "payload's"
        raise PayloadError(
            f"token id {ids[i]} at {_locate(i, lengths)} >= {which} vocab_size {id_limit}"
        )
    if codec.kind == _LP_F32_PACKED:
        lp = _f32_decode(r, total, codec.bits - _MANTISSA_BITS, lengths)
    elif codec.kind == _LP_F32:
        lp = np.frombuffer(r.take(4 * total, "log-probs"), dtype="<f4").astype(np.float32)
        bad = ~(np.isfinite(lp) & (lp <= 0))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise PayloadError(
                f"log-prob {float(lp[i])!r} at {_locate(i, lengths)} is not finite and <= 0"
            )
    else:
        codes = _unpack(
            r.take(_packed_size(total, codec.bits), "log-probs"), total, codec.bits, "log-probs"
        )
        # 0.0 - x, not -x: code 0 decodes to +0.0 (a prob-1 token stays exactly 0).
        lp = (0.0 - codes.astype(np.float64) * codec.step).astype(np.float32)
    text = None
    if text_limit is not None:
        text = _text_decode(r, lengths, total, text_limit)
    if r.left:
        raise PayloadError(f"{r.left} trailing bytes after the log-probs")

    width = int(lengths.max()) if n else 0
    lengths_t = torch.from_numpy(lengths)
    mask = torch.arange(width)[None, :] < lengths_t[:, None]
    completion_ids = torch.full((n, width), pad_id, dtype=torch.int64)
    completion_ids[mask] = torch.from_numpy(ids.astype(np.int64))
    sampler_logprobs = torch.zeros((n, width), dtype=torch.float32)
    sampler_logprobs[mask] = torch.from_numpy(lp)
    return RolloutBatch(
        prompt_index=torch.from_numpy(prompt),
        generator=torch.from_numpy(gen),
        completion_ids=completion_ids,
        lengths=lengths_t,
        sampler_logprobs=sampler_logprobs,
        text=text,
    )


def _text_decode(r: _Reader, lengths: np.ndarray, total: int, limit: int) -> CompletionText:
    """Read and validate the text section: every text within `limit` bytes and valid UTF-8, and
    the character ends, covered counts and finished bits consistent with it and the lengths."""
    n = lengths.shape[0]
    finished = _unpack(r.take(_packed_size(n, 1), "finished bits"), n, 1, "finished bits")
    cov_bits = _check_range(r.u8("covered_bits"), 0, 32, "covered_bits")
    covered = _unpack(r.take(_packed_size(n, cov_bits), "covered"), n, cov_bits, "covered")
    size_bits = _check_range(r.u8("text_size_bits"), 0, 32, "text_size_bits")
    sizes = _unpack(r.take(_packed_size(n, size_bits), "text sizes"), n, size_bits, "text sizes")
    end_bits = _check_range(r.u8("char_end_bits"), 0, 32, "char_end_bits")
    ends = _unpack(r.take(_packed_size(total, end_bits), "char ends"), total, end_bits, "ends")
    finished, covered = finished.astype(bool), covered.astype(np.int64)
    sizes, ends = sizes.astype(np.int64), ends.astype(np.int64)
    if n and sizes.max() > limit:
        i = int(np.argmax(sizes))
        raise PayloadError(
            f"text of sequence {i} is {int(sizes[i])} bytes, over the limit of {limit} "
            f"({TEXT_BYTES_PER_TOKEN} per token of max_tokens)"
        )
    if int(sizes.sum()) != r.left:
        raise PayloadError(f"text sizes sum to {int(sizes.sum())} bytes, {r.left} are left")
    texts: list[str] = []
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for i in range(n):
        blob = r.take(int(sizes[i]), f"text of sequence {i}")
        try:
            t = blob.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PayloadError(f"text of sequence {i} is not valid UTF-8 ({e.reason})") from None
        texts.append(t)
        length, cov, chars = int(lengths[i]), int(covered[i]), len(t)
        row = ends[starts[i] : starts[i + 1]]
        if finished[i] and cov != length - 1:
            raise PayloadError(
                f"sequence {i} is finished (last token EOS) but covers {cov} of {length} tokens"
            )
        if cov > length:
            raise PayloadError(f"sequence {i} covers {cov} tokens, more than its {length}")
        if (np.diff(row) < 0).any() or (length and row.max() > chars):
            raise PayloadError(
                f"character ends of sequence {i} must be non-decreasing and <= its {chars} "
                "characters"
            )
        spelled = int(row[cov - 1]) if cov else 0
        if spelled != chars or (row[cov:] != chars).any():
            raise PayloadError(
                f"sequence {i}: its first {cov} tokens must spell all {chars} characters and "
                "later tokens none"
            )
    width = int(lengths.max()) if n else 0
    char_ends = np.zeros((n, width), dtype=np.int64)
    char_ends[np.arange(width)[None, :] < lengths[:, None]] = ends
    return CompletionText(
        texts=texts,
        finished=torch.from_numpy(finished),
        covered=torch.from_numpy(covered),
        char_ends=torch.from_numpy(char_ends),
    )


def decode_rollouts(
    data: bytes,
    *,
    vocab_size: int,
    max_tokens: int,
    max_sequences: int = 8192,
    expected_generator: int | None = None,
    pad_id: int = 0,
) -> RolloutBatch:
    """Decode and validate a payload from `encode_rollouts`.

    Args:
        data: the payload (bytes, bytearray or memoryview).
        vocab_size: the receiver's vocabulary size. Every token id must be below it and below
            the vocab_size the payload declares (which may differ: see docs/wire-format.md).
        max_tokens: the longest completion accepted (T_max).
        max_sequences: the most sequences accepted. Decoded tensors are (N, max length), so
            memory stays below about 12 * max_sequences * max_tokens bytes.
        expected_generator: when given, every sequence's generator must equal it (the sending
            peer's rank).
        pad_id: the receiver's pad token id, used to right-pad `completion_ids`.

    Returns a CPU `RolloutBatch`: int64 indices, lengths and ids, float32 log-probs, 0.0 at
    padding, width = the longest decoded completion (0 when N = 0).

    Raises PayloadError (a ValueError) on anything malformed, and only that; ValueError for bad
    arguments.
    """
    for name, v in (("vocab_size", vocab_size), ("max_tokens", max_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if vocab_size > _MAX_VOCAB:
        raise ValueError(f"vocab_size must be <= 2**32, got {vocab_size}")
    if isinstance(max_sequences, bool) or not isinstance(max_sequences, int) or max_sequences < 0:
        raise ValueError(f"max_sequences must be a non-negative int, got {max_sequences!r}")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int):
        raise ValueError(f"pad_id must be an int, got {pad_id!r}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"payload must be bytes, got {type(data).__name__}")
    try:
        return _decode(
            bytes(data), vocab_size, max_tokens, max_sequences, expected_generator, pad_id
        )
    except PayloadError:
        raise
    except Exception as e:  # anything unexpected still leaves as PayloadError, never raw
        raise PayloadError(f"malformed payload ({type(e).__name__}: {e})") from e


def describe_logprob_format(logprob_format: str, vocab_size: int) -> str:
    """One line for logs: the concrete format and its log-prob error bound."""
    name = resolve_logprob_format(logprob_format, vocab_size)
    err = logprob_max_error(name)
    return f"{name} (exact)" if err == 0 else f"{name} (|error| <= {err:.3g} nats above -32)"
