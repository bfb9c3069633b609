"""A dishonest peer, for tests and research (`testing.adversary`, docs/RELIABILITY.md)."""

from __future__ import annotations

import torch

from ftis.rollout.types import RolloutBatch

ADVERSARIES = ("zero-logprobs", "random-tokens", "duplicate")


def adversarial(
    batch: RolloutBatch, kind: str, *, vocab_size: int, generator: torch.Generator
) -> RolloutBatch:
    """A well-formed but dishonest version of `batch` (testing and research only).

    zero-logprobs: every real token claims log-prob 0 (probability 1).
    random-tokens: every real token is a uniform random id in [0, vocab_size); log-probs as sent.
    duplicate: every row is a copy of the first sample's tokens and log-probs (prompt indices
        kept, so the rows still pass the prompt check and answer the wrong prompts).
    """
    if kind not in ADVERSARIES:
        raise ValueError(f"unknown adversary {kind!r}; choose one of: {', '.join(ADVERSARIES)}")
    if batch.num_sequences == 0:
        return batch
    mask = batch.mask
    ids, lp, lengths = batch.completion_ids.clone(), batch.sampler_logprobs.clone(), batch.lengths
    if kind == "zero-logprobs":
        lp = torch.where(mask, torch.zeros_like(lp), lp)
    elif kind == "random-tokens":
        noise = torch.randint(0, vocab_size, ids.shape, generator=generator)
        ids = torch.where(mask, noise, ids)
    else:
        n = batch.num_sequences
        ids, lp = ids[:1].expand(n, -1).clone(), lp[:1].expand(n, -1).clone()
        lengths = lengths[:1].expand(n).clone()
    return batch.with_completions(ids, lengths, lp)
