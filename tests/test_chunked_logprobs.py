"""The chunked lm-head log-probs (ftis.models.logprobs.chunked_token_logprobs): the same values
and gradients as the whole-logits path, and the model-level functions that use it."""

import pytest
import torch

from ftis.models import logprobs as lp_mod
from ftis.models.loading import LoraConfig, ModelConfig, attach_lora, build_model
from ftis.models.logprobs import (
    chunked_token_logprobs,
    completion_logprobs,
    gather_logprobs,
    shared_prompt_completion_logprobs,
    split_head,
)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [1, 3, None])
def test_chunked_equals_whole_logits_in_value_and_gradient(temperature, chunk_rows):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    weight = (torch.randn(40, 16, generator=g) * 0.5).requires_grad_(True)
    targets = torch.randint(0, 40, (3, 5), generator=g)
    upstream = torch.randn(3, 5, generator=g)

    ref = gather_logprobs(hidden @ weight.t(), targets, temperature=temperature)
    ref_gh, ref_gw = torch.autograd.grad((ref * upstream).sum(), [hidden, weight])
    got = chunked_token_logprobs(
        hidden, weight, targets, temperature=temperature, chunk_rows=chunk_rows
    )
    gh, gw = torch.autograd.grad((got * upstream).sum(), [hidden, weight])

    assert got.dtype == torch.float32 and got.shape == (3, 5)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(gh, ref_gh, atol=1e-5, rtol=0)
    torch.testing.assert_close(gw, ref_gw, atol=1e-5, rtol=0)


def test_chunked_gradcheck_in_float64():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3), generator=g)

    def f(h, w):
        # The function returns f32 by contract; gradcheck's finite differences need f64 inside,
        # so check the backward formula through the autograd Function directly.
        return lp_mod._ChunkedTokenLogprobs.apply(
            h.reshape(6, 4), w, targets.reshape(6), 0.8, 4, torch.float64
        )

    # Forward returns float32; compare the analytical gradient against finite differences with a
    # tolerance that f32 outputs allow.
    assert torch.autograd.gradcheck(f, (hidden, weight), eps=1e-3, atol=1e-3, rtol=1e-3)


def test_frozen_head_gets_no_gradient_and_hidden_still_does():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 4, 8, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, generator=g)  # requires_grad False: a LoRA node's head
    targets = torch.randint(0, 11, (2, 4), generator=g)
    got = chunked_token_logprobs(hidden, weight, targets, chunk_rows=3)
    got.sum().backward()
    assert hidden.grad is not None and weight.grad is None


def _batch():
    prompt_ids = torch.tensor([[0, 1, 5, 6], [1, 8, 9, 4]])
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    completion_ids = torch.tensor([[7, 3, 2, 0], [5, 6, 0, 0], [9, 9, 9, 9]])
    completion_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    prompt_of = torch.tensor([0, 1, 1])
    return prompt_ids, prompt_mask, prompt_of, completion_ids, completion_mask


def _scores(model, shared: bool, temperature: float):
    prompt_ids, prompt_mask, prompt_of, completion_ids, completion_mask = _batch()
    if shared:
        return shared_prompt_completion_logprobs(
            model,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            prompt_of=prompt_of,
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            temperature=temperature,
        )
    return completion_logprobs(
        model,
        prompt_ids=prompt_ids[prompt_of],
        prompt_mask=prompt_mask[prompt_of],
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        temperature=temperature,
    )


def _values_and_grads(model, shared, temperature):
    model.zero_grad(set_to_none=True)
    out = _scores(model, shared, temperature)
    mask = _batch()[4].bool()
    (out * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), mask, grads


@pytest.mark.parametrize("preset", ["llama-xs", "qwen2-s"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("lora", [False, True])
def test_models_score_the_same_through_the_chunked_head(monkeypatch, preset, shared, lora):
    model = build_model(ModelConfig(preset=preset, init_seed=3))
    if lora:
        model = attach_lora(model, LoraConfig(r=4, alpha=8))
    assert split_head(model) is not None
    got, mask, got_grads = _values_and_grads(model, shared, 0.7)
    monkeypatch.setattr(lp_mod, "split_head", lambda m: None)  # the model's own forward
    ref, _, ref_grads = _values_and_grads(model, shared, 0.7)

    torch.testing.assert_close(got[mask], ref[mask], atol=1e-5, rtol=0)
    assert got_grads.keys() == ref_grads.keys() and got_grads
    for name in ref_grads:
        torch.testing.assert_close(got_grads[name], ref_grads[name], atol=1e-5, rtol=1e-4)


def test_chunked_head_under_bf16_autocast_matches_the_autocast_forward(monkeypatch):
    """Under `model.compute_dtype: bfloat16` the chunked head runs its matmul in bf16, as the
    model's own (autocast) lm-head does: the two agree far more closely than either does with
    the f32 scores."""
    model = build_model(ModelConfig(preset="llama-s", init_seed=4))
    with torch.no_grad():
        f32 = _scores(model, True, 1.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = _scores(model, True, 1.0)
            monkeypatch.setattr(lp_mod, "split_head", lambda m: None)
            ref = _scores(model, True, 1.0)
    mask = _batch()[4].bool()
    gap_to_autocast = (got - ref)[mask].abs().max().item()
    gap_to_f32 = (got - f32)[mask].abs().max().item()
    assert gap_to_f32 > 0
    assert gap_to_autocast < 0.1 * gap_to_f32, (gap_to_autocast, gap_to_f32)


def test_heads_that_are_not_a_plain_linear_map_use_the_models_forward():
    model = build_model(ModelConfig(preset="llama-xs", init_seed=5))
    model.config.final_logit_softcapping = 30.0
    assert split_head(model) is None
    model.config.final_logit_softcapping = None
    assert split_head(model) is not None
    hook = model.get_output_embeddings().register_forward_hook(lambda mod, inp, out: out)
    assert split_head(model) is None  # a hook on the head must see it run
    hook.remove()
    assert split_head(model) is not None

    class Rescaled(type(model)):  # a forward that changes the logits must be the one that runs
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    model.__class__ = Rescaled
    assert split_head(model) is None
