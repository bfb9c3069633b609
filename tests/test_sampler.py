import math

import pytest
import torch

from ftis.models.loading import ModelConfig, build_model
from ftis.models.logprobs import completion_logprobs, shared_prompt_completion_logprobs
from ftis.models.tokenizer import char_tokenizer
from ftis.rollout.sampler import left_pad, sample

TOK = char_tokenizer()
PROMPTS = [TOK.encode(s, add_special_tokens=False) for s in ["12+34=", "5+6=", "100+7=", "9="]]

# Log-probs recorded while sampling (fp32, KV cache, one token at a time) and recomputed by a
# scoring pass (fp32, one pass) are the same math in a different order: they differ by ~1e-6
# nats here (an fp32 ulp at |lp| ~ 5 is 5e-7). 1e-4 nats leaves ~100x headroom and means IS
# ratios exp(lp - glp) within 1e-4 of 1; it is far below a per-token log-prob (~ -4.6 for a
# near-uniform tiny model over V = 102) and below any error the loss could tolerate: a 1e-2
# shift fails it (test below), and scoring a T = 0.7 sample at T = 1 is off by ~0.5 nats.
LOGPROB_ATOL = 1e-4


def assert_logprobs_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=LOGPROB_ATOL, rtol=0)


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
    assert_logprobs_close(s.logprobs[mask], full[mask])
    assert (s.logprobs[~mask] == 0).all()
    assert (s.logprobs[mask] <= 0).all()
    # The same assertion catches a single token off by 1e-2 nats.
    perturbed = full.clone()
    perturbed[mask.nonzero()[len(mask.nonzero()) // 2].unbind()] += 1e-2
    with pytest.raises(AssertionError):
        assert_logprobs_close(s.logprobs[mask], perturbed[mask])


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_receiver_scores_own_samples_at_ratio_one(model, temperature):
    """The training update scores its own samples with shared_prompt_completion_logprobs; at the
    sampling temperature the own-sample ratio exp(lp - glp) is 1 (within LOGPROB_ATOL)."""
    s = sample(
        model,
        PROMPTS,
        num_samples=3,
        max_new_tokens=8,
        eos_id=TOK.eos_token_id,
        pad_id=TOK.pad_token_id,
        temperature=temperature,
        generator=torch.Generator().manual_seed(3),
    )
    mask = _mask(s)
    prompt_of = torch.arange(len(PROMPTS)).repeat_interleave(3)
    args = dict(
        prompt_ids=s.prompt_ids[::3],
        prompt_mask=s.prompt_mask[::3],
        prompt_of=prompt_of,
        completion_ids=s.completion_ids,
        completion_mask=mask.long(),
    )
    with torch.no_grad():
        scored = shared_prompt_completion_logprobs(model, temperature=temperature, **args)
        untempered = shared_prompt_completion_logprobs(model, **args)
    assert_logprobs_close(scored[mask], s.logprobs[mask])
    ratio = torch.exp(scored[mask] - s.logprobs[mask])
    assert (ratio - 1).abs().max() < 2 * LOGPROB_ATOL  # exp(1e-4) - 1 ~ 1e-4
    if temperature == 1.0:
        # Nothing changes at T = 1: the explicit argument is the old default, bit for bit.
        assert torch.equal(scored, untempered)
    else:
        # Scoring a tempered sample without the temperature (the old behaviour) is far off.
        assert (untempered[mask] - s.logprobs[mask]).abs().max() > 0.1
        with pytest.raises(AssertionError):
            assert_logprobs_close(untempered[mask], s.logprobs[mask])


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


def test_noise_driven_sampling_ignores_batch_mates(model):
    kw = dict(max_new_tokens=4, eos_id=TOK.eos_token_id, pad_id=TOK.pad_token_id)
    noise = torch.rand((len(PROMPTS) * 3, 4), generator=torch.Generator().manual_seed(0))
    together = sample(model, PROMPTS, num_samples=3, noise=noise, **kw)
    alone = sample(model, PROMPTS[1:2], num_samples=3, noise=noise[3:6], **kw)
    n = alone.completion_ids.shape[1]
    assert torch.equal(together.completion_ids[3:6, :n], alone.completion_ids)


# Inverse-CDF draws at the stratified points u_k = (k + 1/2) / n, k < n: token v is drawn for
# the u_k in its CDF interval, of length p_v, which holds n p_v +- 1 of them; fp32 rounding of
# the two interval ends (~1e-7) can move at most one more point. So every frequency is within
# 2 / n of its probability, deterministically. With n = 2000 that is 1e-3, 10x below the mean
# probability 1 / V ~ 0.01 of a near-uniform tiny model (min ~0.005), so a wrong distribution
# (the untempered one, or 3e-3 of mass moved between two tokens) fails it.
NUM_DRAWS = 2000
FREQ_ATOL = 2 / NUM_DRAWS


def assert_frequencies_match(freq: torch.Tensor, probs: torch.Tensor) -> None:
    torch.testing.assert_close(freq, probs, atol=FREQ_ATOL, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_inverse_cdf_draws_follow_the_tempered_distribution(model, temperature):
    prompt = PROMPTS[0]
    stratified = ((torch.arange(NUM_DRAWS) + 0.5) / NUM_DRAWS)[:, None]
    s = sample(
        model,
        [prompt],
        num_samples=NUM_DRAWS,
        max_new_tokens=1,
        eos_id=-1,
        pad_id=0,
        noise=stratified,
        temperature=temperature,
    )
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    probs = torch.softmax(logits / temperature, dim=-1)
    freq = torch.bincount(s.completion_ids[:, 0], minlength=probs.shape[0]).float() / NUM_DRAWS
    assert_frequencies_match(freq, probs)
    # The recorded log-prob of each draw is that of the tempered distribution.
    assert_logprobs_close(s.logprobs[:, 0], probs.log()[s.completion_ids[:, 0]])
    # The check has power: the tolerance is below the probabilities it compares, and a wrong
    # distribution fails it (the old check, |freq - p| < 0.05, accepted both).
    assert FREQ_ATOL < probs.min() and FREQ_ATOL < 1 / len(probs) / 5
    moved = probs.clone()
    top, bottom = int(probs.argmax()), int(probs.argmin())
    moved[top] -= 3e-3
    moved[bottom] += 3e-3
    with pytest.raises(AssertionError):
        assert_frequencies_match(freq, moved)
    if temperature != 1.0:
        with pytest.raises(AssertionError):
            assert_frequencies_match(freq, torch.softmax(logits, dim=-1))
    assert math.isclose(float(freq.sum()), 1.0)


@pytest.mark.parametrize(
    ("preset", "lora"), [("llama-xs", False), ("qwen2-s", False), ("llama-xs", True)]
)
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

    want, g_want = run(
        completion_logprobs, prompt_ids=prompt_ids[prompt_of], prompt_mask=prompt_mask[prompt_of]
    )
    got, g_got = run(
        shared_prompt_completion_logprobs,
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        prompt_of=prompt_of,
    )
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=0)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_zero_draw_never_picks_a_token_of_probability_zero():
    """u = 0 used to select token 0 whatever its probability (left-sided search of the cdf)."""
    from ftis.rollout.sampler import sample

    class Fixed(torch.nn.Module):
        """Logits that give token 0 (and 1) probability 0: only tokens 2.. can be drawn."""

        def __init__(self, vocab: int) -> None:
            super().__init__()
            self.vocab = vocab
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, input_ids, attention_mask=None, position_ids=None, **kw):
            logits = torch.zeros(*input_ids.shape, self.vocab)
            logits[..., :2] = float("-inf")
            return type("Out", (), {"logits": logits, "past_key_values": None})()

    out = sample(
        Fixed(8),
        [[3, 4]],
        num_samples=2,
        max_new_tokens=3,
        eos_id=7,
        pad_id=0,
        temperature=1.0,
        noise=torch.zeros(2, 3),
    )
    assert (out.completion_ids[:, :3] >= 2).all() and torch.isfinite(out.logprobs).all()


def test_preallocated_cache_samples_exactly_what_dynamic_cache_samples(monkeypatch):
    """The sampler's preallocated KV cache changes nothing: same tokens and bit-identical
    log-probs as with transformers' DynamicCache."""
    from transformers import DynamicCache

    import ftis.rollout.sampler as sampler_mod
    from ftis.models.loading import ModelConfig, build_model

    model = build_model(ModelConfig(preset="llama-xs"))
    prompts = [[1, 5, 6, 7], [1, 8], [1, 9, 9]]

    def run():
        return sampler_mod.sample(
            model, prompts, num_samples=3, max_new_tokens=6, eos_id=-1, pad_id=0,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip

    fast = run()
    monkeypatch.setattr(sampler_mod, "preallocated_cache", lambda capacity: DynamicCache())
    slow = run()
    assert torch.equal(fast.completion_ids, slow.completion_ids)
    assert torch.equal(fast.logprobs, slow.logprobs)


def _sample_both_ways(monkeypatch, model, prompts, **kw):
    """The sampler with its direct decode step (rollout/decode.py) and with the model's own
    forward for every step."""
    import ftis.rollout.sampler as sampler_mod

    def run():
        return sampler_mod.sample(
            model, prompts, num_samples=3, max_new_tokens=7, eos_id=-1, pad_id=0,
            generator=torch.Generator().manual_seed(3), **kw,
        )  # fmt: skip

    fast = run()
    with monkeypatch.context() as m:
        m.setattr(sampler_mod, "decode_step", lambda model, attention: None)
        slow = run()
    return fast, slow


@pytest.mark.parametrize(
    "preset, prompts, kw",
    [
        ("llama-xs", [[1, 5, 6, 7], [1, 8], [1, 9, 9]], {}),  # left padding: a boolean mask
        ("llama-xs", [[1, 5, 6], [1, 8, 4]], {}),  # no padding: no mask, SDPA's GQA path
        ("qwen2-s", [[1, 5, 6, 7], [1, 8]], {}),  # q/k/v biases
        ("llama-m", [[1, 5, 6, 7], [1, 8]], {"compute_dtype": torch.bfloat16}),
        ("qwen2-s", [[1, 5, 6, 7], [1, 8]], {"temperature": 0.0}),
    ],
)
def test_direct_decode_step_is_bit_identical_to_forward(monkeypatch, preset, prompts, kw):
    from ftis.rollout.decode import decode_step

    model = build_model(ModelConfig(preset=preset, init_seed=2))
    assert decode_step(model, torch.ones(2, 3, dtype=torch.long)) is not None
    fast, slow = _sample_both_ways(monkeypatch, model, prompts, **kw)
    assert torch.equal(fast.completion_ids, slow.completion_ids)
    assert torch.equal(fast.logprobs, slow.logprobs)


def test_direct_decode_step_serves_a_lora_model_bit_identically(monkeypatch):
    from ftis.models.config import LoraConfig
    from ftis.models.loading import attach_lora
    from ftis.rollout.decode import decode_step

    cfg = ModelConfig(preset="llama-xs", init_seed=2)
    model = attach_lora(build_model(cfg), LoraConfig(r=4))
    # A non-zero adapter, so that skipping it would change the logits.
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5, generator=torch.Generator().manual_seed(0))
    assert decode_step(model, torch.ones(2, 3, dtype=torch.long)) is not None
    fast, slow = _sample_both_ways(monkeypatch, model, [[1, 5, 6, 7], [1, 8]])
    assert torch.equal(fast.completion_ids, slow.completion_ids)
    assert torch.equal(fast.logprobs, slow.logprobs)
    with model.disable_adapter():
        plain, _ = _sample_both_ways(monkeypatch, model, [[1, 5, 6, 7], [1, 8]])
    assert not torch.equal(plain.logprobs, fast.logprobs)


def test_direct_decode_step_declines_other_models():
    from ftis.rollout.decode import decode_step

    model = build_model(ModelConfig(preset="llama-xs"))
    attention = torch.ones(2, 3, dtype=torch.long)
    model.config._attn_implementation = "eager"
    assert decode_step(model, attention) is None
    model.config._attn_implementation = "sdpa"
    model.config.model_type = "gemma"
    assert decode_step(model, attention) is None
    assert decode_step(torch.nn.Linear(2, 2), attention) is None


def test_a_model_whose_forward_is_overridden_samples_through_its_forward():
    """A subclass that changes the logits in its forward must not be bypassed."""
    from transformers import LlamaForCausalLM

    from ftis.rollout.decode import decode_step

    class OnlyTokenSeven(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = torch.full_like(out.logits, -1e4)
            out.logits[..., 7] = 0.0
            return out

    base = build_model(ModelConfig(preset="llama-xs"))
    model = OnlyTokenSeven(base.config)
    model.load_state_dict(base.state_dict())
    model.eval()
    assert decode_step(model, torch.ones(2, 3, dtype=torch.long)) is None
    s = sample(model, [[1, 5], [1, 8, 9]], num_samples=2, max_new_tokens=4, eos_id=-1, pad_id=0)
    assert (s.completion_ids == 7).all()
