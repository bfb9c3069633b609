"""bf16 mixed precision (model.compute_dtype, ftis.models.precision): the sampler runs the model
in bf16 yet records the exact f32 log-prob of the distribution each token was drawn from (what
the exchange carries), the update keeps f32 weights and moves them, and dtypes a machine cannot
run are refused with a message naming the field and the fix."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from ftis.config import TrainConfig
from ftis.exchange import decode_rollouts, encode_rollouts
from ftis.models.loading import ModelConfig, ModelLoadError, build_model
from ftis.models.logprobs import completion_logprobs
from ftis.models.tokenizer import char_tokenizer
from ftis.rollout.sampler import left_pad, sample
from ftis.tasks import ArithmeticTaskConfig, build_task
from ftis.train import sampling
from ftis.train import update as update_mod
from tests.conftest import tiny_node

TOK = char_tokenizer()
PROMPTS = [TOK.encode(s, add_special_tokens=False) for s in ["12+34=", "5+6=", "100+7="]]
TASK = build_task(ArithmeticTaskConfig(ops={"+": 1.0}))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_sampling_records_the_exact_f32_logprobs_of_its_draws(temperature):
    model = build_model(ModelConfig(preset="llama-xs", init_seed=2))
    seen: list[torch.Tensor] = []
    # the LM head sees the logits of the prompt pass ((N, V): its last positions only) and of
    # every decode step ((N, 1, V))
    model.lm_head.register_forward_hook(
        lambda m, i, out: seen.append((out[:, -1, :] if out.dim() == 3 else out).detach())
    )
    G, T = 2, 6
    noise = torch.rand((len(PROMPTS) * G, T), generator=torch.Generator().manual_seed(0))
    s = sample(
        model,
        PROMPTS,
        num_samples=G,
        max_new_tokens=T,
        eos_id=-1,
        pad_id=TOK.pad_token_id,
        temperature=temperature,
        noise=noise,
        compute_dtype=torch.bfloat16,
    )
    assert all(x.dtype == torch.bfloat16 for x in seen)  # the model did run in bf16
    assert s.logprobs.dtype == torch.float32
    row_of = torch.arange(len(PROMPTS)).repeat_interleave(G)
    for t in range(T):
        logits = seen[t] if t else seen[0][row_of]  # the prompt pass runs each prompt once
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        # the token is the inverse-CDF draw of this step's noise on that f32 distribution ...
        cdf = logp.exp().cumsum(-1)
        drawn = torch.searchsorted(cdf, noise[:, t : t + 1] * cdf[:, -1:], right=True)
        assert torch.equal(s.completion_ids[:, t], drawn.squeeze(-1).clamp(max=cdf.shape[-1] - 1))
        # ... and the recorded log-prob is that distribution's, bit for bit
        assert torch.equal(s.logprobs[:, t], logp.gather(-1, s.completion_ids[:, t : t + 1])[:, 0])
    # the wire's f32 format carries them unchanged
    node_batch = sampling_batch(s)
    back = decode_rollouts(encode_rollouts(node_batch), vocab_size=len(TOK), max_tokens=T)
    assert torch.equal(back.sampler_logprobs, node_batch.sampler_logprobs)


def sampling_batch(s):
    from ftis.rollout.types import RolloutBatch

    n = s.completion_ids.shape[0]
    return RolloutBatch(
        prompt_index=torch.arange(n) // 2,
        generator=torch.zeros(n, dtype=torch.long),
        completion_ids=s.completion_ids,
        lengths=s.lengths,
        sampler_logprobs=s.logprobs,
    )


def test_bf16_scoring_is_close_to_f32_and_not_equal():
    """bf16 matmuls (8-bit mantissa) move a log-prob by about 1e-2 nats on this model; 0.1 nats
    is ~10x that and still far below a token's log-prob (~ -4.6 over V = 102). Not equal: the
    bf16 path really ran."""
    model = build_model(ModelConfig(preset="llama-xs", init_seed=3))
    ids, mask = left_pad(PROMPTS, TOK.pad_token_id)
    comp = torch.randint(3, len(TOK), (len(PROMPTS), 5), generator=torch.Generator().manual_seed(1))
    kw = dict(
        prompt_ids=ids, prompt_mask=mask, completion_ids=comp, completion_mask=torch.ones_like(comp)
    )
    f32 = completion_logprobs(model, **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = completion_logprobs(model, **kw)
    assert bf16.dtype == torch.float32
    diff = (bf16 - f32).abs().max().item()
    assert 0 < diff < 0.1, diff


def test_bf16_update_keeps_f32_weights_and_moves_them():
    node = tiny_node("grpo", lr=1e-3)
    node.cfg = node.cfg.model_copy(
        update={"model": node.cfg.model.model_copy(update={"compute_dtype": "bfloat16"})}
    )
    problems = [TASK.split("train")[i] for i in range(3)]
    batch = sampling.generate(
        node, TASK, problems, slots=(0, 4), cfg=TrainConfig(max_new_tokens=5, group_size=4), step=1
    )
    before = [p.detach().clone() for p in node.model.parameters()]
    adv = torch.linspace(-1, 1, batch.num_sequences)
    metrics = update_mod.update(node, TASK, batch, adv, loss_cfg=node.cfg.loss, micro_batch_size=4)
    assert torch.isfinite(torch.tensor(metrics["grad_norm"])) and metrics["grad_norm"] > 0
    params = list(node.model.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    moved = [bool((p.detach() != b).any()) for p, b in zip(params, before)]
    assert all(moved)  # f32 master weights: a 1e-3 step moves every tensor


def test_dtypes_this_machine_cannot_run_are_refused():
    with pytest.raises(ValidationError, match="model.dtype float16 is not supported on the CPU"):
        ModelConfig(preset="llama-xs", dtype="float16", device="cpu")
    with pytest.raises(ValidationError, match="compute_dtype"):
        ModelConfig(preset="llama-xs", compute_dtype="float16")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="model.dtype float16 is not supported"):
            build_model(ModelConfig(preset="llama-xs", dtype="float16"))


def _bf16_node(mode: str):
    node = tiny_node("grpo", lr=1e-3)
    model_cfg = node.cfg.model.model_copy(
        update={"compute_dtype": "bfloat16", "compute_mode": mode}
    )
    node.cfg = node.cfg.model_copy(update={"model": model_cfg})
    return node


def test_cast_weights_gradients_are_the_f32_gradients_to_bf16_precision_on_the_masters():
    """model.compute_mode cast_weights: the forward and backward run on bf16 copies, yet the
    gradients land, in f32, on the model's own (f32) parameters, summed over micro-batches;
    the copies are gone afterwards. Within bf16 precision of the f32 gradient (cosine > 0.99),
    not equal to it (the bf16 path really ran)."""
    from ftis.models.precision import CastWeights

    model = build_model(ModelConfig(preset="llama-xs", init_seed=3))
    originals = [(n, p) for n, p in model.named_parameters()]
    ids, mask = left_pad(PROMPTS, TOK.pad_token_id)
    comp = torch.randint(3, len(TOK), (len(PROMPTS), 5), generator=torch.Generator().manual_seed(1))

    def loss_of(rows):
        lp = completion_logprobs(
            model,
            prompt_ids=ids[rows],
            prompt_mask=mask[rows],
            completion_ids=comp[rows],
            completion_mask=torch.ones_like(comp[rows]),
        )
        return -lp.sum()

    loss_of(slice(None)).backward()
    f32 = {n: p.grad.clone() for n, p in originals}
    model.zero_grad(set_to_none=True)
    with CastWeights(model, torch.bfloat16) as cast:
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        for rows in (slice(0, 2), slice(2, 3)):  # two micro-batches, summed in f32
            loss_of(rows).backward()
            cast.accumulate()
    assert [(n, p) for n, p in model.named_parameters()] == originals  # the masters are back
    for n, p in originals:
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, n
        g, ref = p.grad.flatten(), f32[n].flatten()
        if ref.norm() < 1e-6:
            continue
        cos = float(torch.nn.functional.cosine_similarity(g, ref, dim=0))
        assert cos > 0.99, (n, cos)
    assert any(not torch.equal(p.grad, f32[n]) for n, p in originals)


def test_cast_weights_update_steps_the_f32_masters():
    node = _bf16_node("cast_weights")
    problems = [TASK.split("train")[i] for i in range(3)]
    batch = sampling.generate(
        node, TASK, problems, slots=(0, 4), cfg=TrainConfig(max_new_tokens=5, group_size=4), step=1
    )
    params = list(node.model.parameters())
    before = [p.detach().clone() for p in params]
    adv = torch.linspace(-1, 1, batch.num_sequences)
    metrics = update_mod.update(node, TASK, batch, adv, loss_cfg=node.cfg.loss, micro_batch_size=4)
    assert metrics["grad_norm"] > 0
    assert list(node.model.parameters()) == params  # the same f32 parameters, the optimizer's
    assert all(p.dtype == torch.float32 for p in params)
    assert all(bool((p.detach() != b).any()) for p, b in zip(params, before))


def test_cast_weights_needs_a_bf16_compute_dtype():
    with pytest.raises(ValidationError, match="model.compute_mode cast_weights"):
        ModelConfig(preset="llama-xs", compute_mode="cast_weights")
