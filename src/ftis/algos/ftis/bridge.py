"""The bridged path of the sample exchange: peers on different tokenizers (docs/math.md §16).

Sender: `attach_text` adds each completion's text, its finished bit and the character ends of
its tokens to the outgoing batch (the wire's text section). Receiver: `retokenize` turns a
bridged peer's decoded batch into this node's tokens, keeping the sender's total log-prob of
the string and its token count for the sequence-level weights of ftis.core.bridge.

Text rules (docs/math.md §16.5):
- structural tokens (pad, BOS, EOS, UNK, ...) spell nothing; a final EOS becomes the finished
  bit and the receiver appends its own EOS (both totals then include the stop event);
- every other special token travels as its literal text and is re-tokenized as plain text
  (`split_special_tokens`), so a peer cannot inject the receiver's control tokens;
- a completion cut inside a multi-byte character (max_new_tokens reached) loses the partial
  character, and the tokens that held it leave the sender's total;
- a text the receiver's tokenizer cannot spell (its tokens do not decode back to the text, e.g.
  characters outside its vocabulary) is rejected and counted, as is one that re-tokenizes to
  more than `max_tokens` tokens.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ftis.core.bridge import sequence_logprob
from ftis.rewards.decode import structural_ids
from ftis.rollout.sampler import right_pad
from ftis.rollout.types import CompletionText, RolloutBatch

log = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence
# Strings every bridgeable tokenizer must spell and decode back exactly (the embedded tasks'
# alphabet: digits, operators, letters, spaces, newlines).
PROBES = ("23+45=68", "12*3-405=-369\n", "Q: add 7 and 18. A: 25", "  0 ")


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def completion_text(tokenizer, batch: RolloutBatch) -> CompletionText:
    """The text section of `batch` for this node's tokenizer (docs/wire-format.md)."""
    drop = structural_ids(tokenizer)
    eos = tokenizer.eos_token_id
    n, width = batch.num_sequences, batch.completion_ids.shape[1]
    texts: list[str] = []
    finished = torch.zeros(n, dtype=torch.bool)
    covered = torch.zeros(n, dtype=torch.long)
    ends = torch.zeros((n, width), dtype=torch.long)
    for i, (row, length) in enumerate(zip(batch.completion_ids.cpu(), batch.lengths.tolist())):
        ids = row[:length].tolist()
        done = bool(ids) and ids[-1] == eos
        body = ids[:-1] if done else ids
        kept: list[int] = []
        prefixes: list[str] = []
        for t in body:
            if t not in drop:
                kept.append(t)
            prefixes.append(_decode(tokenizer, kept))
        full = prefixes[-1] if prefixes else ""
        text = full.rstrip(_REPLACEMENT)  # an incomplete trailing character is left out
        spelled = 0
        for t, prefix in enumerate(prefixes):
            spelled = max(spelled, min(_common_prefix(prefix, text), len(text)))
            ends[i, t] = spelled
        if done:
            ends[i, len(body)] = len(text)
        cov = len(body)
        if text != full and not done:  # cut mid-character: the partial tokens are not covered
            reach = (ends[i, : len(body)] == len(text)).nonzero()
            cov = int(reach[0]) + 1 if len(text) and reach.numel() else 0
        texts.append(text)
        finished[i], covered[i] = done, cov
    return CompletionText(texts=texts, finished=finished, covered=covered, char_ends=ends)


def attach_text(batch: RolloutBatch, tokenizer) -> RolloutBatch:
    """`batch` with its text section, for a payload that peers on other tokenizers read."""
    return dataclasses.replace(batch, text=completion_text(tokenizer, batch))


def retokenize(
    batch: RolloutBatch, tokenizer, *, max_tokens: int
) -> tuple[RolloutBatch, list[str]]:
    """A bridged peer's decoded batch in this node's tokens: (the batch of the sequences that
    could be bridged, with `bridged` set and the sender's totals; why each other one was
    rejected). `max_tokens`: the most tokens a re-tokenized completion may have."""
    text = batch.text
    if text is None:
        raise ValueError("a bridged peer's batch must carry its text section")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    drop = structural_ids(tokenizer)
    rows: list[list[int]] = []
    keep: list[int] = []
    spans = torch.zeros(batch.num_sequences, dtype=torch.long)
    rejected: list[str] = []
    for i, s in enumerate(text.texts):
        ids = [
            int(t) for t in tokenizer.encode(s, add_special_tokens=False, split_special_tokens=True)
        ]
        back = _decode(tokenizer, [t for t in ids if t not in drop])
        if back != s or any(t in drop for t in ids):
            rejected.append(f"sequence {i}: this tokenizer cannot spell its text {s[:40]!r}")
            continue
        if bool(text.finished[i]):
            ids.append(eos)
        if len(ids) > max_tokens:
            rejected.append(f"sequence {i}: {len(ids)} tokens here, over the limit {max_tokens}")
            continue
        rows.append(ids)
        keep.append(i)
        spans[i] = int(text.covered[i]) + int(bool(text.finished[i]))
    ids_t, lengths = right_pad(rows, pad)
    idx = torch.tensor(keep, dtype=torch.long)
    # The sender's total over exactly the tokens that spell the string (and its EOS): the same
    # function of the same per-token log-probs as the exact path's sequence total.
    sender_mask = torch.arange(batch.completion_ids.shape[1])[None, :] < spans[:, None]
    totals = sequence_logprob(batch.sampler_logprobs.cpu(), sender_mask)
    out = RolloutBatch(
        prompt_index=batch.prompt_index.cpu()[idx],
        generator=batch.generator.cpu()[idx],
        completion_ids=ids_t,
        lengths=lengths,
        sampler_logprobs=torch.zeros(ids_t.shape, dtype=torch.float32),
        bridged=torch.ones(len(rows), dtype=torch.bool),
        bridge_sampler_logprob=totals[idx].to(torch.float32),
        bridge_sampler_length=spans[idx],
    )
    return out, rejected


def bridge_refusal(tokenizer, name: str) -> str | None:
    """Why `tokenizer` (node `name`'s) cannot take part in the bridged path, or None: it must
    spell and decode back the probe strings exactly, and decode every prefix of their tokens
    to a prefix of the text (the character ends of the text section)."""
    for s in PROBES:
        ids = [int(t) for t in tokenizer.encode(s, add_special_tokens=False)]
        back = _decode(tokenizer, ids)
        if back != s:
            return (
                f"node {name}'s tokenizer cannot decode the text it produced: {s!r} -> {ids} -> "
                f"{back!r}"
            )
        for t in range(1, len(ids)):
            prefix = _decode(tokenizer, ids[:t]).rstrip(_REPLACEMENT)
            if not s.startswith(prefix):
                return (
                    f"node {name}'s tokenizer decodes a prefix of {s!r} to {prefix!r}, not a "
                    "prefix of the text, so its tokens have no character boundaries"
                )
    return None


def bridge_blocker(cfg, rank: int, tokenizer) -> str | None:
    """Why node `rank` of run config `cfg` cannot take the bridged path (a key of
    `ftis.exchange.group.BRIDGE_BLOCKERS`), or None: its algorithm must be the sample
    exchange ("ftis", or the swarm built on it), its loss method one with a bridged form, its tokenizer able to decode
    the text it produces (`bridge_refusal`)."""
    from ftis.core.bridge import BRIDGED_METHODS
    from ftis.core.losses import resolve_method

    node = cfg.nodes[rank]
    if cfg.algorithm.kind not in ("ftis", "swarm"):
        return "algorithm"
    if resolve_method(node.loss.method)[0] not in BRIDGED_METHODS:
        return "method"
    if bridge_refusal(tokenizer, node.name) is not None:
        return "decode"
    return None
