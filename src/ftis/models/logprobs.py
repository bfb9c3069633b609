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


# Rows of (tokens, vocab) logits that `chunked_token_logprobs` holds at once: 2**23 elements
# (32 MiB in f32; 170 rows of SmolLM2's 49,152-token vocabulary).
CHUNK_ELEMENTS = 2**23

# transformers' causal-LM forwards that are `lm_head(self.model(...).last_hidden_state)` with
# nothing after the head: for these the head can be taken out and run in chunks. A subclass that
# overrides forward (to change the logits, say) keeps its own forward.
_PLAIN_HEAD_FORWARDS = frozenset(
    f"{arch}ForCausalLM.forward" for arch in ("Llama", "Qwen2", "Qwen3", "Mistral")
)


def _matmul_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer would run its matmul in here: autocast's, if it is on."""
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log softmax((hidden @ weight.T) / temperature)[targets] row chunk by row chunk.

    Forward keeps only each row's log-sum-exp; backward recomputes each chunk's logits, so no
    (rows, vocab) tensor outlives its chunk in either pass. The matmuls run in the dtype a linear
    layer would use here (autocast's bf16 under `model.compute_dtype: bfloat16`, the weights'
    dtype otherwise); the softmax and everything after it in f32, as `gather_logprobs` does.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_rows, mm_dtype):
        m = hidden.shape[0]
        out = torch.empty(m, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(m, dtype=torch.float32, device=hidden.device)
        w = weight.to(mm_dtype)
        for s in range(0, m, chunk_rows):
            e = min(s + chunk_rows, m)
            logits = (hidden[s:e].to(mm_dtype) @ w.t()).float()
            if temperature != 1.0:
                logits.div_(temperature)  # a fresh tensor: in place, no second (rows, V) one
            lse[s:e] = torch.logsumexp(logits, dim=-1)
            out[s:e] = logits.gather(-1, targets[s:e, None]).squeeze(-1) - lse[s:e]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_rows, ctx.mm_dtype = temperature, chunk_rows, mm_dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        temperature, chunk_rows, mm_dtype = ctx.temperature, ctx.chunk_rows, ctx.mm_dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        # The weight's gradient: summed in place by each chunk's matmul (addmm_, which
        # accumulates in f32 inside) when the weight is in the matmul's dtype, as under
        # model.compute_mode cast_weights or in f32; else (bf16 matmuls on f32 weights, autocast)
        # summed in f32 and cast once.
        in_place = weight.dtype == mm_dtype
        grad_w = (
            torch.zeros(
                weight.shape,
                dtype=weight.dtype if in_place else torch.float32,
                device=weight.device,
            )
            if need_w
            else None
        )
        w = weight.to(mm_dtype)
        grad_out = grad_out.float()
        for s in range(0, hidden.shape[0], chunk_rows):
            e = min(s + chunk_rows, hidden.shape[0])
            h = hidden[s:e].to(mm_dtype)
            logits = (h @ w.t()).float()
            if temperature != 1.0:
                logits.div_(temperature)
            g = grad_out[s:e, None]
            # d/dz [z_t - logsumexp(z)] = onehot(t) - softmax(z), z = logits / temperature;
            # in place on the chunk's fresh logits, so no second (rows, V) tensor is made.
            grad_logits = logits.sub_(lse[s:e, None]).exp_().mul_(-g)
            grad_logits.scatter_add_(-1, targets[s:e, None], g)
            if temperature != 1.0:
                grad_logits.div_(temperature)
            grad_logits = grad_logits.to(mm_dtype)
            if need_h:
                grad_h[s:e] = (grad_logits @ w).to(hidden.dtype)
            if need_w:
                if in_place:
                    grad_w.addmm_(grad_logits.t(), h)
                else:
                    grad_w += (grad_logits.t() @ h).float()
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """`gather_logprobs(hidden @ weight.T, targets, temperature=...)` without a whole
    (.., V) logits tensor: the lm-head and the log-softmax run `chunk_rows` rows at a time, in
    forward and (by recomputation) in backward.

    hidden (N, T, H), weight (V, H) (an lm-head's, bias-free), targets (N, T) int64 -> (N, T)
    float32, differentiable in hidden and weight. Equal to the unchunked path within float
    rounding (tests/test_chunked_logprobs.py: 1e-5 in f32).
    """
    _check_temperature(temperature)
    n, t, h = hidden.shape
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // weight.shape[0])
    out = _ChunkedTokenLogprobs.apply(
        hidden.reshape(n * t, h),
        weight,
        targets.reshape(n * t),
        float(temperature),
        int(rows),
        _matmul_dtype(hidden),
    )
    return out.reshape(n, t)


def split_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.Tensor] | None:
    """(backbone, lm-head weight) of a causal LM whose logits are a plain bias-free linear map
    of the backbone's last hidden state (transformers' own forwards in `_PLAIN_HEAD_FORWARDS`,
    not overridden), else None: those go through the model's own forward."""
    base = base_model(model)
    config = getattr(base, "config", None)
    if getattr(type(base).forward, "__qualname__", "") not in _PLAIN_HEAD_FORWARDS:
        return None
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    backbone = getattr(base, "model", None)
    if type(head) is not torch.nn.Linear or head.bias is not None or backbone is None:
        return None
    if head._forward_hooks or head._forward_pre_hooks:  # a hook on the head must see it run
        return None
    return backbone, head.weight


def _run_and_score(
    model, split, targets, temperature, select, *, cache=None, keep_last=False, **inputs
):
    """Run `model` (or, with `split` from `split_head`, its backbone), take `select` of its
    (N, L, .) output, and score `targets` there: through the chunked head, or through the
    model's own logits (`keep_last`: only the last position's, `logits_to_keep=1`). `cache`: a
    KV cache, passed under the argument name the callee takes."""
    callee = model if split is None else split[0]
    if cache is not None:
        inputs[_cache_kwarg(callee)] = cache
    if split is not None:
        hidden = select(callee(**inputs).last_hidden_state)
        return chunked_token_logprobs(hidden, split[1], targets, temperature=temperature)
    if keep_last:
        inputs["logits_to_keep"] = 1
    return gather_logprobs(select(callee(**inputs).logits), targets, temperature=temperature)


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
    inputs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    # Logits at column j predict token j+1: columns P-1 .. P+T-2 predict the completion.
    return _run_and_score(
        model,
        split_head(model),
        completion_ids,
        temperature,
        lambda out: out[:, p - 1 : -1, :],
        **inputs,
    )


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
    prompt_pos = position_ids_from_mask(prompt_mask)
    prompt_in = dict(
        input_ids=prompt_ids,
        attention_mask=prompt_mask.long(),
        position_ids=prompt_pos,
        use_cache=True,
    )
    # The last prompt position predicts the first completion token. With a plain head, the
    # backbone runs and the head sees only the rows it needs, as a 2-D product (design.md:
    # `logits_to_keep=1`'s 3-D slice costs a copy of the head weight per prompt in bf16).
    split = split_head(model)
    first_lp = _run_and_score(
        model,
        split,
        completion_ids[:, :1],
        temperature,
        lambda out: out[:, -1:, :][prompt_of],
        cache=cache,
        keep_last=True,
        **prompt_in,
    )
    t = completion_ids.shape[1]
    if t == 1:
        return first_lp
    cache.batch_select_indices(prompt_of)
    attn = torch.cat([prompt_mask[prompt_of], completion_mask[:, : t - 1]], dim=1).long()
    pos = (
        prompt_pos[prompt_of, -1:] + 1 + torch.arange(t - 1, device=completion_ids.device)[None, :]
    )
    rest = dict(
        input_ids=completion_ids[:, : t - 1],
        attention_mask=attn,
        position_ids=pos,
        use_cache=True,
    )
    rest_lp = _run_and_score(
        model, split, completion_ids[:, 1:], temperature, lambda out: out, cache=cache, **rest
    )
    return torch.cat([first_lp, rest_lp], dim=1)
