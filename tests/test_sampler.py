import pytest
import torch

from ftis.models.loading import ModelConfig, build_model
from ftis.models.logprobs import completion_logprobs
from ftis.models.tokenizer import char_tokenizer
from ftis.rollout.sampler import left_pad, sample

TOK = char_tokenizer()
PROMPTS = [TOK.encode(s, add_special_tokens=False) for s in ["12+34=", "5+6=", "100+7=", "9="]]


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(preset="llama-s", init_seed=1))


def _mask(s):
    return torch.arange(s.completion_ids.shape[1])[None, :] < s.lengths[:, None]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_logprobs_equal_a_full_forward_pass(model, temperature):
    g = torch.Generator().manual_seed(0)
    s = sample(
        model,
        PROMPTS,
        num_samples=3,
        max_new_tokens=6,
        eos_id=TOK.eos_token_id,
        pad_id=TOK.pad_token_id,
        temperature=temperature,
        generator=g,
    )
    mask = _mask(s)
    with torch.no_grad():
        full = completion_logprobs(
            model,
            prompt_ids=s.prompt_ids,
            prompt_mask=s.prompt_mask,
            completion_ids=s.completion_ids,
            completion_mask=mask.long(),
            temperature=temperature,
        )
    # fp32 with a KV cache vs one pass: the same math in a different order; 1e-4 nats is far
    # below anything the loss can notice (IS weights move by 1e-4 relative).
    torch.testing.assert_close(s.logprobs[mask], full[mask], atol=1e-4, rtol=0)
    assert (s.logprobs[~mask] == 0).all()
    assert (s.logprobs[mask] <= 0).all()


def test_shapes_eos_and_padding(model):
    # Invariants of free sampling, which must hold whatever is sampled.
    g = torch.Generator().manual_seed(1)
    s = sample(
        model,
        PROMPTS,
        num_samples=5,
        max_new_tokens=7,
        eos_id=TOK.eos_token_id,
        pad_id=TOK.pad_token_id,
        generator=g,
    )
    n = len(PROMPTS) * 5
    assert s.completion_ids.shape[0] == n and s.completion_ids.shape[1] <= 7
    for row, length, fin in zip(s.completion_ids, s.lengths.tolist(), s.finished.tolist()):
        assert 1 <= length <= 7
        real = row[:length].tolist()
        assert TOK.eos_token_id not in real[:-1]  # nothing is sampled after EOS
        assert fin == (real[-1] == TOK.eos_token_id)
        assert (row[length:] == TOK.pad_token_id).all()


def test_eos_stops_a_sequence():
    model = build_model(ModelConfig(preset="llama-xs"))
    # A head whose bias makes EOS certain: every completion is just <eos>.
    head = torch.nn.Linear(model.config.hidden_size, len(TOK), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-30.0)
        head.bias[TOK.eos_token_id] = 30.0
    model.lm_head = head
    s = sample(
        model,
        PROMPTS,
        num_samples=2,
        max_new_tokens=5,
        eos_id=TOK.eos_token_id,
        pad_id=TOK.pad_token_id,
        generator=torch.Generator().manual_seed(0),
    )
    assert s.completion_ids.shape[1] == 1  # the loop stops once every row is done
    assert s.lengths.tolist() == [1] * 8 and s.finished.all()
    assert torch.allclose(s.logprobs[:, 0], torch.zeros(8), atol=1e-6)


def test_greedy_is_deterministic_and_independent_of_batch_padding(model):
    kw = dict(
        num_samples=1,
        max_new_tokens=5,
        eos_id=TOK.eos_token_id,
        pad_id=TOK.pad_token_id,
        temperature=0.0,
    )
    batched = sample(model, PROMPTS, **kw)
    for i, p in enumerate(PROMPTS):
        alone = sample(model, [p], **kw)
        n = int(alone.lengths[0])
        assert batched.lengths[i] == n
        assert torch.equal(batched.completion_ids[i, :n], alone.completion_ids[0, :n])
        torch.testing.assert_close(
            batched.logprobs[i, :n], alone.logprobs[0, :n], atol=1e-4, rtol=0
        )


def test_same_seed_same_samples(model):
    kw = dict(num_samples=4, max_new_tokens=6, eos_id=TOK.eos_token_id, pad_id=TOK.pad_token_id)
    a = sample(model, PROMPTS, generator=torch.Generator().manual_seed(7), **kw)
    b = sample(model, PROMPTS, generator=torch.Generator().manual_seed(7), **kw)
    assert torch.equal(a.completion_ids, b.completion_ids)


def test_left_pad_rejects_empty_prompts():
    ids, mask = left_pad([[5, 6], [7]], pad_id=0)
    assert ids.tolist() == [[5, 6], [0, 7]] and mask.tolist() == [[1, 1], [0, 1]]
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[5], []], pad_id=0)


def test_sampling_restores_train_mode(model):
    model.train()
    sample(model, PROMPTS[:1], num_samples=1, max_new_tokens=2, eos_id=2, pad_id=0)
    assert model.training


def test_noise_driven_sampling_matches_the_distribution_and_ignores_batch_mates(model):
    kw = dict(max_new_tokens=4, eos_id=TOK.eos_token_id, pad_id=TOK.pad_token_id)
    noise = torch.rand((len(PROMPTS) * 3, 4), generator=torch.Generator().manual_seed(0))
    together = sample(model, PROMPTS, num_samples=3, noise=noise, **kw)
    alone = sample(model, PROMPTS[1:2], num_samples=3, noise=noise[3:6], **kw)
    n = alone.completion_ids.shape[1]
    assert torch.equal(together.completion_ids[3:6, :n], alone.completion_ids)
    # Inverse-CDF draws follow the model's distribution: first-token frequencies over many rows
    # match its probabilities (2000 draws: 4 standard errors of a frequency is below 0.05).
    prompt = PROMPTS[0]
    many = torch.rand((2000, 1), generator=torch.Generator().manual_seed(1))
    s = sample(model, [prompt], num_samples=2000, max_new_tokens=1, eos_id=-1, pad_id=0, noise=many)
    with torch.no_grad():
        probs = model(input_ids=torch.tensor([prompt])).logits[0, -1].softmax(-1)
    freq = torch.bincount(s.completion_ids[:, 0], minlength=probs.shape[0]).float() / 2000
    assert (freq - probs).abs().max() < 0.05


@pytest.mark.parametrize(("preset", "lora"), [("llama-xs", False), ("qwen2-s", False), ("llama-xs", True)])
def test_shared_prompt_scoring_equals_scoring_each_sequence(preset, lora):
    """Running each prompt once and gathering its KV cache gives the unshared pass's log-probs
    and gradients (fp32; 1e-5 covers summation-order differences)."""
    from ftis.models.loading import LoraConfig, attach_lora
    from ftis.models.logprobs import shared_prompt_completion_logprobs

    torch.manual_seed(0)
    m = build_model(ModelConfig(preset=preset))
    if lora:
        m = attach_lora(m, LoraConfig(r=4))
    prompt_ids, prompt_mask = left_pad([[1, 5, 6, 7], [1, 8], [1, 9, 9, 9, 9, 5]], 0)
    prompt_of = torch.tensor([0, 0, 1, 2, 2, 2, 1])
    lengths = torch.tensor([5, 3, 1, 4, 5, 2, 5])
    mask = torch.arange(5)[None] < lengths[:, None]
    comp = torch.where(mask, torch.randint(4, 90, (7, 5)), 0)

    def run(fn, **kw):
        lp = fn(m, completion_ids=comp, completion_mask=mask.long(), **kw)
        (lp * mask).sum().backward()
        grads = [p.grad.clone() for p in m.parameters() if p.requires_grad]
        m.zero_grad()
        return lp.detach(), grads

    want, g_want = run(completion_logprobs, prompt_ids=prompt_ids[prompt_of],
                       prompt_mask=prompt_mask[prompt_of])
    got, g_got = run(shared_prompt_completion_logprobs, prompt_ids=prompt_ids,
                     prompt_mask=prompt_mask, prompt_of=prompt_of)
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=0)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
