"""The bridged path end to end below the trainer: text section on the wire (validated, hostile
payloads rejected and counted), re-tokenization and the sender's totals (docs/math.md §16)."""

from __future__ import annotations

import pytest
import torch

from ftis.algos.ftis.bridge import attach_text, bridge_refusal, completion_text, retokenize
from ftis.core.bridge import sequence_logprob
from ftis.exchange import PayloadError, decode_rollouts, encode_rollouts
from ftis.exchange.codec import RolloutCodec, RolloutExchange
from ftis.exchange.transport import TransportStats
from ftis.exchange.wire import TEXT_BYTES_PER_TOKEN, _seal
from ftis.models.bpe import bpe_tokenizer
from ftis.models.tokenizer import char_tokenizer
from ftis.rollout.types import CompletionText, RolloutBatch

CHAR, BPE = char_tokenizer(), bpe_tokenizer()
MAX_TOKENS = 16


def batch_of(tok, rows: list[list[int]], *, generator: int = 1) -> RolloutBatch:
    """Completions `rows` (ids of `tok`) with log-probs -0.1 * (position + 1) * (row + 1)."""
    n, width = len(rows), max(len(r) for r in rows)
    ids = torch.full((n, width), tok.pad_token_id, dtype=torch.long)
    lp = torch.zeros((n, width))
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        lp[i, : len(r)] = -0.1 * torch.arange(1, len(r) + 1) * (i + 1)
    return RolloutBatch(
        prompt_index=torch.arange(n),
        generator=torch.full((n,), generator),
        completion_ids=ids,
        lengths=torch.tensor([len(r) for r in rows]),
        sampler_logprobs=lp,
    )


def enc(tok, s: str) -> list[int]:
    return tok.encode(s, add_special_tokens=False, split_special_tokens=True)


def through_wire(tok, batch: RolloutBatch, **kw) -> RolloutBatch:
    data = encode_rollouts(attach_text(batch, tok), vocab_size=len(tok), **kw)
    return decode_rollouts(data, vocab_size=2**32, max_tokens=MAX_TOKENS, expected_generator=1)


def test_text_round_trips_and_retokenizes_to_fewer_or_more_tokens():
    # char -> BPE: "198" + EOS is 4 char tokens, 2 BPE tokens ("19" "8") + EOS; "100" is 3 char
    # tokens, 2 BPE tokens ("10" "0")
    sent = batch_of(CHAR, [enc(CHAR, "198") + [CHAR.eos_token_id], enc(CHAR, "100")])
    got = through_wire(CHAR, sent, compress=True)
    assert got.text.texts == ["198", "100"] and got.text.finished.tolist() == [True, False]
    assert got.text.char_ends[0].tolist() == [1, 2, 3, 3]  # the EOS spells nothing
    assert got.text.char_ends[1, :3].tolist() == [1, 2, 3]
    out, rejected = retokenize(got, BPE, max_tokens=MAX_TOKENS)
    assert rejected == []
    assert enc(BPE, "198") == [BPE.convert_tokens_to_ids("19"), BPE.convert_tokens_to_ids("8")]
    assert out.completion_ids[0, :3].tolist() == enc(BPE, "198") + [BPE.eos_token_id]
    assert out.completion_ids[1, :2].tolist() == enc(BPE, "100")
    assert out.lengths.tolist() == [3, 2]  # 4 -> 3 and 3 -> 2 tokens
    assert out.bridged.tolist() == [True, True]
    # sender totals: row 0 = -0.1 - 0.2 - 0.3 - 0.4 (EOS included), row 1 = -0.2 - 0.4 - 0.6
    torch.testing.assert_close(out.bridge_sampler_logprob, torch.tensor([-1.0, -1.2]))
    assert out.bridge_sampler_length.tolist() == [4, 3]
    # BPE -> char: "198" is two BPE tokens and three characters
    back, _ = retokenize(through_wire(BPE, batch_of(BPE, [enc(BPE, "198")])), CHAR, max_tokens=8)
    assert back.lengths.tolist() == [3] and back.bridge_sampler_length.tolist() == [2]


def test_a_cut_inside_a_multibyte_character_leaves_the_partial_character_out():
    # "é€" is 5 byte-level tokens: é = 2, € = 3. Cut after 3 tokens: "é" + one byte of €.
    ids = enc(BPE, "é€")
    assert len(ids) == 5
    text = completion_text(BPE, batch_of(BPE, [ids[:3]]))
    assert text.texts == ["é"] and text.covered.tolist() == [2]
    assert text.char_ends.tolist() == [[0, 1, 1]]
    got = through_wire(BPE, batch_of(BPE, [ids[:3]]))
    out, rejected = retokenize(got, BPE, max_tokens=MAX_TOKENS)
    assert rejected == [] and out.completion_ids[0].tolist() == ids[:2]
    # the sender's total covers only the two tokens that spell "é": -0.1 - 0.2
    torch.testing.assert_close(out.bridge_sampler_logprob, torch.tensor([-0.3]))
    # the character tokenizer cannot spell "é": rejected, not guessed
    out, rejected = retokenize(got, CHAR, max_tokens=MAX_TOKENS)
    assert out.num_sequences == 0 and "cannot spell" in rejected[0]


def test_a_cut_mid_merge_is_just_text_the_receiver_tokenizes_its_own_way():
    # the char sender was cut after "19" of "198" (BPE would have spelled "19" "8"); BPE
    # tokenizes the text "19" itself, digit by digit, and the non-canonical BPE split "1","2","3"
    # comes back as the canonical "12" "3"
    out, _ = retokenize(through_wire(CHAR, batch_of(CHAR, [enc(CHAR, "19")])), BPE, max_tokens=8)
    assert out.completion_ids[0, : out.lengths[0]].tolist() == enc(BPE, "19")
    assert len(enc(BPE, "19")) == 2
    split = [enc(BPE, d)[0] for d in "123"]
    assert enc(BPE, "123") == [BPE.convert_tokens_to_ids("12"), BPE.convert_tokens_to_ids("3")]
    out, _ = retokenize(through_wire(BPE, batch_of(BPE, [split])), BPE, max_tokens=8)
    assert out.completion_ids[0, : out.lengths[0]].tolist() == enc(BPE, "123")
    assert out.bridge_sampler_length.tolist() == [3]


def test_special_tokens_spell_nothing_and_literal_tags_are_not_injected():
    # a BOS mid-completion is structural: zero width; the literal text "<eos>" (spelled by BPE
    # byte tokens) must not become the receiver's EOS
    rows = [[*enc(CHAR, "1"), CHAR.bos_token_id, *enc(CHAR, "2")], enc(BPE, "7<eos>8")]
    text = completion_text(CHAR, batch_of(CHAR, rows[:1]))
    assert text.texts == ["12"] and text.char_ends.tolist() == [[1, 1, 2]]
    out, rejected = retokenize(through_wire(BPE, batch_of(BPE, rows[1:])), CHAR, max_tokens=16)
    assert rejected == []
    ids = out.completion_ids[0, : out.lengths[0]].tolist()
    assert CHAR.eos_token_id not in ids and CHAR.decode(ids) == "7<eos>8"


def test_empty_completions():
    # only EOS: text "", finished -> the receiver's EOS alone; only a structural UNK: text "",
    # not finished -> no receiver token (the row contributes nothing to the loss)
    sent = batch_of(CHAR, [[CHAR.eos_token_id], [CHAR.unk_token_id]])
    out, rejected = retokenize(through_wire(CHAR, sent), BPE, max_tokens=4)
    assert rejected == [] and out.lengths.tolist() == [1, 0]
    assert out.completion_ids[0, 0] == BPE.eos_token_id
    torch.testing.assert_close(out.bridge_sampler_logprob, torch.tensor([-0.1, -0.2]))


def test_too_many_receiver_tokens_are_rejected():
    # "100" is 2 BPE tokens ("10" "0") but 3 characters: over a receiver limit of 2
    assert len(enc(BPE, "100")) == 2
    out, rejected = retokenize(
        through_wire(BPE, batch_of(BPE, [enc(BPE, "100")])), CHAR, max_tokens=2
    )
    assert out.num_sequences == 0 and "over the limit 2" in rejected[0]


def test_identical_tokenizer_gives_the_same_tokens_and_totals_as_the_exact_path():
    sent = batch_of(BPE, [enc(BPE, "123+45=168") + [BPE.eos_token_id], enc(BPE, "7-3=4")])
    out, _ = retokenize(through_wire(BPE, sent), BPE, max_tokens=MAX_TOKENS)
    assert torch.equal(out.completion_ids, sent.completion_ids)
    assert torch.equal(
        out.bridge_sampler_logprob, sequence_logprob(sent.sampler_logprobs, sent.mask)
    )
    assert torch.equal(out.bridge_sampler_length, sent.lengths)


def test_embedded_tokenizers_can_bridge():
    assert bridge_refusal(CHAR, "a") is None and bridge_refusal(BPE, "b") is None

    class Lossy:  # a tokenizer that lowercases: cannot decode the text it produced
        eos_token_id = 0

        def encode(self, s, **kw):
            return [ord(c) for c in s.lower()]

        def decode(self, ids, **kw):
            return "".join(map(chr, ids))

    assert "node q's tokenizer cannot decode" in bridge_refusal(Lossy(), "q")


# ------------------------------------------------------------------ hostile text sections


def _valid_payload(text: str = "ab") -> bytes:
    return encode_rollouts(attach_text(batch_of(CHAR, [enc(CHAR, text)]), CHAR), vocab_size=102)


def _patch_text(data: bytes, new: bytes) -> bytes:
    """Replace the trailing text bytes (just before the CRC) of an uncompressed payload."""
    body = data[:-4]
    return _seal(body[: -len(new)] + new)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (_patch_text(_valid_payload("ab"), b"\xff\xfe"), "not valid UTF-8"),
        (_patch_text(_valid_payload("abc"), b"a\xe2\x82"), "not valid UTF-8"),
    ],
)
def test_hostile_text_is_a_payload_error(data, match):
    with pytest.raises(PayloadError, match=match):
        decode_rollouts(data, vocab_size=102, max_tokens=MAX_TOKENS)


def _crafted(text: CompletionText, rows: list[list[int]]) -> bytes:
    return encode_rollouts(
        RolloutBatch(**{**batch_of(CHAR, rows).__dict__, "text": text}), vocab_size=102
    )


def test_inconsistent_text_sections_are_rejected():
    row = enc(CHAR, "12")

    def text(s="12", finished=False, covered=2, ends=(1, 2)):
        return CompletionText(
            [s], torch.tensor([finished]), torch.tensor([covered]), torch.tensor([list(ends)])
        )

    cases = {
        "non-decreasing": text(ends=(2, 1)),
        "must spell all 2": text(covered=1, ends=(1, 2)),
        "is finished": text(finished=True),
        "must spell all 3": text(s="123"),
    }
    for match, t in cases.items():
        with pytest.raises(PayloadError, match=match):
            decode_rollouts(_crafted(t, [row]), vocab_size=102, max_tokens=MAX_TOKENS)


def test_oversized_text_is_rejected():
    # 2 tokens claiming 8 * 4 + 1 characters of text, under max_tokens = 4
    row = enc(CHAR, "12")
    big = "x" * (TEXT_BYTES_PER_TOKEN * 4 + 1)
    t = CompletionText([big], torch.tensor([False]), torch.tensor([2]), torch.tensor([[1, 33]]))
    with pytest.raises(PayloadError, match="over the limit of 32"):
        decode_rollouts(_crafted(t, [row]), vocab_size=102, max_tokens=4)


class _Fixed:
    """A transport whose peer (rank 1) sends the given payload."""

    rank, world_size = 0, 2

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.stats = TransportStats()

    def exchange(self, round_, payload, *, max_bytes):
        return {1: self.payload}


def test_a_bridged_peer_without_text_or_with_bad_text_is_rejected_and_counted():
    codec = RolloutCodec(vocab_size=len(BPE), max_tokens=MAX_TOKENS, bridged_peers=frozenset({1}))
    own = batch_of(BPE, [enc(BPE, "1")], generator=0)
    plain = encode_rollouts(batch_of(CHAR, [enc(CHAR, "12")]), vocab_size=102)
    bad = _patch_text(_valid_payload("ab"), b"\xff\xfe")
    good = _valid_payload("ab")
    for payload, rejected in ((plain, 1), (bad, 1), (good, 0)):
        ex = RolloutExchange(_Fixed(payload), codec)
        out = ex.all_gather(own)
        assert ex.last_stats.rejected == rejected
        assert (out[1] is None) == bool(rejected)
    assert out[1].text.texts == ["ab"]
