"""Per-token log-probs in fp32, the quantity every loss consumes.

Layout used throughout ftis: prompts left-padded to width P, completions right-padded to width T,
so every completion starts at column P and one forward pass serves the whole batch.

Temperature (docs/math.md §7): every function takes ``temperature`` and scores the tempered
distribution ``softmax(logits / temperature)``, the one the sampler (ftis.rollout.sampler) draws
from and records, as TRL and verl do. A node that samples with temperature T must score with the
same T, or the ratio ``exp(logprobs - sampler_logprobs)`` on its own samples is not 1.
"""

from __future__ import annotations

import inspect

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: the first real token of each row gets position 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _check_temperature(temperature: float) -> None:
    if not (isinstance(temperature, (int, float)) and 0 < temperature < float("inf")):
        raise ValueError(
            f"temperature must be a finite number > 0, got {temperature!r}; greedy decoding "
            "(temperature 0) samples no distribution, so its tokens have no tempered log-prob "
            "(score them with temperature=1.0 for the model's own log-probs)"
        )


def gather_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature)[targets] in fp32 without materialising the full (.., V)
    log-softmax.

    logits (N, T, V) any float dtype, targets (N, T) int64 -> (N, T) float32. The division is
    done in fp32, after the upcast, exactly as the sampler does it.
    """
    _check_temperature(temperature)
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
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
    """Log-probs of each completion token under ``model`` at ``temperature``
    (``log softmax(logits / temperature)``; 1.0: the model's own log-probs).

    prompt_ids/prompt_mask (N, P) left-padded; completion_ids/completion_mask (N, T) right-padded.
    Inputs may live on any device; they are moved to the model's. Returns (N, T) float32 on the
    model's device, with gradient (if enabled); values at masked positions are finite but
    meaningless.
    """
    _check_temperature(temperature)
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    completion_ids, completion_mask = completion_ids.to(device), completion_mask.to(device)
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
    return gather_logprobs(logits, completion_ids, temperature=temperature)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (its LoRA layers stay injected and active);
    any other model as it is."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _cache_kwarg(model: torch.nn.Module) -> str:
    """transformers >= 5.2x names the KV-cache argument `cache`; older releases `past_key_values`."""
    base = base_model(model)
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def shared_prompt_completion_logprobs(
    model: torch.nn.Module,
    *,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    prompt_of: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """`completion_logprobs` for N completions that share U < N prompts, running each prompt
    through the model once.

    GRPO samples G completions per prompt, and scoring them one sequence at a time runs the
    prompt G times. Here the U unique prompts (prompt_ids/prompt_mask (U, P), left-padded) go
    through the model once, with gradient; their KV cache is then gathered to the N completion
    rows (`prompt_of` (N,) int64: row i continues prompt prompt_of[i]) and the completions
    (N, T) run on top of it. The math is the same as the unshared pass (the gradient reaches
    the prompt's activations from every completion that attends to it); only the repeated
    prompt work is gone. `temperature` as in `completion_logprobs`: pass the sampling
    temperature. Returns (N, T) float32.
    """
    from transformers import DynamicCache

    _check_temperature(temperature)
    device = next(model.parameters()).device
    prompt_ids, prompt_mask, prompt_of = (
        prompt_ids.to(device),
        prompt_mask.to(device),
        prompt_of.to(device),
    )
    completion_ids, completion_mask = completion_ids.to(device), completion_mask.to(device)
    cache = DynamicCache()
    cache_kw = {_cache_kwarg(model): cache}
    prompt_pos = position_ids_from_mask(prompt_mask)
    first = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask.long(),
        position_ids=prompt_pos,
        use_cache=True,
        logits_to_keep=1,
        **cache_kw,
    )
    # The last prompt position predicts the first completion token.
    logits = [first.logits[:, -1:, :][prompt_of]]
    t = completion_ids.shape[1]
    if t > 1:
        cache.batch_select_indices(prompt_of)
        attn = torch.cat([prompt_mask[prompt_of], completion_mask[:, : t - 1]], dim=1).long()
        pos = (
            prompt_pos[prompt_of, -1:]
            + 1
            + torch.arange(t - 1, device=completion_ids.device)[None, :]
        )
        rest = model(
            input_ids=completion_ids[:, : t - 1],
            attention_mask=attn,
            position_ids=pos,
            use_cache=True,
            **cache_kw,
        )
        logits.append(rest.logits)
    return gather_logprobs(torch.cat(logits, dim=1), completion_ids, temperature=temperature)
