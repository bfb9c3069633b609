"""Batched group sampling with a KV cache that records each token's log-prob as it samples.

The log-prob recorded for a token is the one of the distribution it was drawn from (logits divided
by the temperature, then truncated by top-k / top-p and renormalised when those are on), in fp32:
exactly what the F-TIS loss needs as `sampler_logprobs`, with no second scoring pass (docs/math.md
§7). The receiver scores the tempered, untruncated distribution: pass the sampling temperature to
the functions of ftis.models.logprobs (what the importance weights then mean under truncation:
docs/math.md §7.1).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ftis.models.logprobs import _cache_kwarg, position_ids_from_mask
from ftis.models.precision import compute_context
from ftis.rollout.cache import preallocated_cache
from ftis.rollout.decode import decode_step, prefill_step


@dataclass
class Samples:
    """Output of :func:`sample`. N = len(prompts) * num_samples, each prompt's samples contiguous.

    prompt_ids/prompt_mask: (N, P) left-padded prompts; completion_ids: (N, T) right-padded with
    pad_id; lengths: (N,) real completion tokens including a final EOS; logprobs: (N, T) fp32 log-prob
    of each sampled token under the sampling distribution, 0 at padding; finished: (N,) bool, True
    where the sequence ended with EOS rather than hitting max_new_tokens.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    lengths: torch.Tensor
    logprobs: torch.Tensor
    finished: torch.Tensor


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), both (len(seqs), max_len), padded on the left."""
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("every prompt needs at least one token")
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


def right_pad(seqs, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, lengths): the sequences padded on the right into one (len(seqs), max_len) tensor
    (width 1 when every sequence is empty, or there are none)."""
    width = max([len(s) for s in seqs] + [1])
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return ids, torch.tensor([len(s) for s in seqs], dtype=torch.long)


def truncate_logits(logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(N, V) `logits` with every token outside the sampling support set to -inf: the `top_k`
    largest (0 = all; ties at the k-th value broken by index), then, of the distribution
    renormalised over those, the smallest set of most probable tokens whose probability reaches
    `top_p` (1 = all; the most probable token is always kept). Pass tempered logits
    (logits / T): the nucleus is taken on the distribution that is sampled."""
    if top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"top_k must be >= 0 and top_p in (0, 1], got {top_k!r}, {top_p!r}")
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        keep = torch.zeros_like(keep).scatter_(-1, logits.topk(top_k, dim=-1).indices, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p < 1:
        probs, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True, stable=True)
        before = probs.cumsum(-1) - probs  # mass of the more probable tokens
        keep_sorted = before < top_p
        keep_sorted[..., 0] = True
        keep = keep & torch.zeros_like(keep).scatter_(-1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    num_samples: int,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> Samples:
    """Sample `num_samples` completions for each prompt (temperature 0 = greedy).

    Randomness comes from `noise` when given: (N, max_new_tokens) uniforms in [0, 1), one per
    row and position, and token t of row i is the inverse-CDF draw at noise[i, t]. The samples
    then depend only on the model, the prompt and that row's noise, not on which other rows
    share the batch, so splitting prompts among identical nodes changes nothing. Without
    `noise`, the uniforms are drawn (on the CPU) from `generator`.

    With temperature T > 0 the recorded log-probs are ``log softmax(logits / T)`` of the sampled
    tokens; score them with ``completion_logprobs(..., temperature=T)`` (or the shared-prompt
    variant) so that a node's own samples have ratio 1. With temperature 0 the recorded
    log-probs are the model's own (temperature 1) log-probs of the greedy tokens.

    top_k > 0 / top_p < 1 (with T > 0) draw from the tempered distribution truncated by
    `truncate_logits` and renormalised, and record that distribution's log-probs, so a node's
    own samples no longer have ratio 1 against the untruncated receiver (docs/math.md §7.1).
    With top_k = 0 and top_p = 1 (the defaults) the draws are exactly those without them.

    compute_dtype: run the model's forward passes under autocast in this dtype (bf16: mixed
    precision, `ftis.models.precision`), each weight cast once for the whole rollout. The
    sampling itself stays in f32 on the (upcast) logits, so the recorded log-probs are exactly
    the f32 log-probs of the distribution each token was drawn from. None: as the weights are.
    """
    if num_samples < 1 or max_new_tokens < 1:
        raise ValueError("num_samples and max_new_tokens must be >= 1")
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature!r}")
    if top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(
            f"top_k must be >= 0 (0 = off) and top_p in (0, 1] (1 = off), got {top_k!r}, {top_p!r}"
        )
    if noise is not None and noise.shape != (len(prompts) * num_samples, max_new_tokens):
        raise ValueError(
            f"noise must have shape ({len(prompts) * num_samples}, {max_new_tokens}), "
            f"got {tuple(noise.shape)}"
        )
    if noise is None and temperature > 0:
        # Drawn on the CPU from `generator`, so a CPU generator also drives a GPU model. torch.rand
        # gives the same bits under every CPU kernel (default, AVX2, AVX-512; float32 randn does
        # not), so the draws travel: a token differs across machines only where the logits' last
        # bits differ across a cdf step (tests/test_basemodels.py checks a step-0 evaluation).
        noise = torch.rand((len(prompts) * num_samples, max_new_tokens), generator=generator)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        with compute_context(device, compute_dtype):
            return _sample_loop(
                model,
                prompts,
                num_samples=num_samples,
                max_new_tokens=max_new_tokens,
                eos_id=eos_id,
                pad_id=pad_id,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                noise=noise,
                device=device,
            )
    finally:
        model.train(was_training)


def greedy_samples(
    model: torch.nn.Module,
    prompts: list[list[int]],
    tokenizer: Any,
    *,
    max_new_tokens: int,
    batch_size: int,
    compute_dtype: torch.dtype | None = None,
) -> Iterator[Samples]:
    """One greedy (temperature 0) completion of every prompt, `batch_size` prompts at a time
    (`compute_dtype` as for :func:`sample`)."""
    for start in range(0, len(prompts), batch_size):
        yield sample(
            model,
            prompts[start : start + batch_size],
            num_samples=1,
            max_new_tokens=max_new_tokens,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            temperature=0.0,
            compute_dtype=compute_dtype,
        )


def _sample_loop(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    num_samples: int,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float,
    top_k: int,
    top_p: float,
    noise: torch.Tensor | None,
    device: torch.device,
) -> Samples:
    """The rollout of `sample` (arguments checked there, model in eval mode)."""
    truncated = top_k > 0 or top_p < 1
    repeated = [p for p in prompts for _ in range(num_samples)]
    prompt_ids, prompt_mask = left_pad(repeated, pad_id)
    n = prompt_ids.shape[0]
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)

    width = prompt_ids.shape[1]
    # KV buffers and the attention mask are allocated once for the whole rollout and
    # filled in place (rollout/cache.py); the model sees views of the filled part.
    cache = preallocated_cache(width + max_new_tokens)
    cache_kw = {_cache_kwarg(model): cache}
    full_attn = torch.ones((n, width + max_new_tokens), dtype=prompt_mask.dtype, device=device)
    full_attn[:, :width] = prompt_mask
    positions = position_ids_from_mask(prompt_mask)
    # Each prompt runs through the model once; its KV cache and last logits are then
    # gathered to its num_samples rows (the prompt's G completions share them).
    unique_ids, unique_mask = left_pad(prompts, pad_id)
    unique_ids, unique_mask = unique_ids.to(device), unique_mask.to(device)
    prefill = prefill_step(model)  # the model's body, then its head on (N, d): decode.py
    if prefill is not None:
        logits = prefill(unique_ids, unique_mask, position_ids_from_mask(unique_mask), cache)
    else:
        out = model(
            input_ids=unique_ids,
            attention_mask=unique_mask,
            position_ids=position_ids_from_mask(unique_mask),
            **cache_kw,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :]
    if num_samples > 1:
        row_of = torch.arange(len(prompts), device=device).repeat_interleave(num_samples)
        cache.batch_select_indices(row_of)
        logits = logits[row_of]
    next_pos = positions[:, -1:] + 1
    # One token per row per step: the model's layers called directly, bit-identical to forward
    # (rollout/decode.py); None for architectures it does not serve.
    step = decode_step(model, full_attn)

    tokens = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    lengths = torch.zeros(n, dtype=torch.long, device=device)
    steps = 0
    for t in range(max_new_tokens):
        logits = logits.float()
        if temperature > 0:
            scaled = logits / temperature if temperature != 1.0 else logits  # x / 1 == x
            if truncated:
                scaled = truncate_logits(scaled, top_k=top_k, top_p=top_p)
            logp = torch.log_softmax(scaled, dim=-1)
            cdf = logp.exp().cumsum(-1)
            u = noise[:, t : t + 1].to(cdf.device) * cdf[:, -1:]
            # right=True: the first token whose cdf exceeds u, so a draw of exactly 0 (or one
            # on a cdf step) never picks a token of probability 0.
            tok = torch.searchsorted(cdf, u, right=True).squeeze(-1)
            tok = tok.clamp_(max=cdf.shape[-1] - 1)
        else:
            logp = torch.log_softmax(logits, dim=-1)
            tok = logp.argmax(-1)
        tok_lp = logp.gather(-1, tok[:, None]).squeeze(-1)
        active = ~done
        tokens[:, t] = torch.where(active, tok, pad_id)
        logprobs[:, t] = torch.where(active, tok_lp, 0.0)
        lengths += active.long()
        done |= tok == eos_id
        steps = t + 1
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        if step is not None:
            logits = step(tokens[:, t : t + 1], width + t + 1, next_pos, cache)
        else:
            out = model(
                input_ids=tokens[:, t : t + 1],
                attention_mask=full_attn[:, : width + t + 1],
                position_ids=next_pos,
                **cache_kw,
                use_cache=True,
            )
            logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    return Samples(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=tokens[:, :steps],
        lengths=lengths,
        logprobs=logprobs[:, :steps],
        finished=done,
    )


def decode_completions(tokenizer, completion_ids: torch.Tensor, lengths: torch.Tensor) -> list[str]:
    """Text of each completion's real tokens (special tokens such as EOS removed): what a
    verifier reads. completion_ids (N, T) right-padded, lengths (N,)."""
    ids = [row[:n].tolist() for row, n in zip(completion_ids, lengths.tolist())]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)
