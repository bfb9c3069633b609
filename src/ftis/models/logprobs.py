"""Per-token log-probs in fp32, the quantity every loss consumes.

Layout used throughout ftis: prompts left-padded to width P, completions right-padded to width T,
so every completion starts at column P and one forward pass serves the whole batch.
"""

from __future__ import annotations

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: the first real token of each row gets position 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[targets] in fp32 without materialising the full (.., V) log-softmax.

    logits (N, T, V) any float dtype, targets (N, T) int64 -> (N, T) float32.
    """
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def completion_logprobs(
    model: torch.nn.Module,
    *,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs of each completion token under ``model``.

    prompt_ids/prompt_mask (N, P) left-padded; completion_ids/completion_mask (N, T) right-padded.
    Returns (N, T) float32 with gradient (if enabled); values at masked positions are finite but
    meaningless.
    """
    p = prompt_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    # Logits at column j predict token j+1: columns P-1 .. P+T-2 predict the completion.
    logits = out.logits[:, p - 1 : -1, :]
    if temperature != 1.0:
        logits = logits.float() / temperature
    return gather_logprobs(logits, completion_ids)
