"""The sampler's decode step: one new token per row, without the model-level glue of `forward`.

Each call of transformers' Llama / Qwen2 `forward` rebuilds the attention mask from the 2-D
padding mask (`create_causal_mask`), wraps its outputs in dataclasses and checks its arguments:
a fixed cost per decode step, which shows on tiny models and short contexts (the sampler took
0.92x / 0.97x the time of the forward-per-step sampler at 16 / 64 tokens on `llama-m`,
docs/BENCHMARKS.md section b) and is lost in the noise at `llama-20m` (section g). Across a rollout the mask only grows by one attended position per step, so here it
is a view of one preallocated boolean tensor, and the step calls the model's own modules in
`forward`'s order: embedding, rotary embedding, every decoder layer, final norm, LM head. The
arithmetic is therefore that of `forward` op for op, and the logits are bit-identical
(tests/test_sampler.py checks tokens and log-probs with `torch.equal`, with and without padding,
in f32 and under bf16 autocast, with a LoRA adapter).

Only the architectures whose `forward` is exactly that sequence are served (transformers'
Llama and Qwen2 causal LMs, their `forward` not overridden, with full attention in every layer
and SDPA attention); for any other model :func:`decode_step` returns None and the sampler calls
the model itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from ftis.models.logprobs import base_model

ARCHITECTURES = ("llama", "qwen2")
# transformers' own forward methods, whose op sequence the decode step repeats.
CAUSAL_LM_FORWARDS = ("LlamaForCausalLM.forward", "Qwen2ForCausalLM.forward")
MODEL_FORWARDS = ("LlamaModel.forward", "Qwen2Model.forward")


def _supported(base: torch.nn.Module) -> bool:
    cfg = getattr(base, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in ARCHITECTURES:
        return False
    if getattr(cfg, "_attn_implementation", None) != "sdpa":
        return False
    # Qwen2 with sliding-window layers gives those layers a different mask.
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return False
    inner = getattr(base, "model", None)
    if not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm")):
        return False
    # A subclass that overrides forward (to change the logits, say) must get its own forward.
    for obj, own in ((base, CAUSAL_LM_FORWARDS), (inner, MODEL_FORWARDS)):
        if getattr(type(obj).forward, "__qualname__", "") not in own:
            return False
    if not hasattr(base, "lm_head") or len(inner.layers) != cfg.num_hidden_layers:
        return False
    return "cache" in inspect.signature(inner.layers[0].forward).parameters


def decode_step(
    model: torch.nn.Module, attention: torch.Tensor
) -> Callable[[torch.Tensor, int, torch.Tensor, object], torch.Tensor] | None:
    """A function ``step(ids, seen, position_ids, cache) -> logits`` for `model`, or None.

    ids: (N, 1) the last sampled tokens; seen: the number of positions after this step (prompt
    width + tokens so far), so that ``attention[:, :seen]`` is the 2-D padding mask `forward`
    would be given; position_ids: (N, 1); cache: the KV cache the prefill filled. Returns the
    (N, V) logits of the next token. `attention` is the rollout's whole (N, width + T) mask,
    allocated once; the step reads views of it."""
    base = base_model(model)
    if not _supported(base):
        return None
    inner, head = base.model, base.lm_head
    # forward passes no mask to SDPA when nothing is padded (then SDPA runs its GQA path); a
    # padded batch gets the boolean (N, 1, 1, seen) mask of the attended positions.
    padded = not bool(attention.all())
    mask = attention.bool()[:, None, None, :] if padded else None

    def step(ids: torch.Tensor, seen: int, position_ids: torch.Tensor, cache) -> torch.Tensor:
        m = mask[..., :seen].contiguous() if padded else None
        h = inner.embed_tokens(ids)
        pe = inner.rotary_emb(h, position_ids=position_ids)
        for layer in inner.layers:
            h = layer(
                h,
                attention_mask=m,
                position_embeddings=pe,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
        return head(inner.norm(h))[:, -1, :]

    return step


def prefill_step(
    model: torch.nn.Module,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, object], torch.Tensor] | None:
    """A function ``prefill(ids, mask, position_ids, cache) -> logits`` for `model`, or None
    (the architectures `decode_step` serves; the sampler then calls `forward` with
    ``logits_to_keep=1``).

    It runs the model's body (`LlamaModel` / `Qwen2Model`, filling `cache`) and applies the LM
    head to each row's last position as a 2-D (N, d) matrix. `forward` applies the head to the
    3-D slice ``h[:, -1:, :]``, which torch's CPU matmul runs in bf16 as a batched product with
    the (V, d) head weight expanded and copied once per row: for SmolLM2-135M's 49,152 x 576
    head, 8 prompts made that copy 3.5 s of a 17 s bf16 rollout (none in float32, where the
    slice folds into one matrix product). Returns the (N, V) logits of the first new token."""
    base = base_model(model)
    if not _supported(base):
        return None
    inner, head = base.model, base.lm_head
    cache_arg = "cache" if "cache" in inspect.signature(inner.forward).parameters else None
    if cache_arg is None:
        cache_arg = "past_key_values"

    def prefill(
        ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, cache
    ) -> torch.Tensor:
        h = inner(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            **{cache_arg: cache},
        ).last_hidden_state
        return head(h[:, -1, :].contiguous())

    return prefill
