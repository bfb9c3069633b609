"""top-k / top-p sampling (train.top_k, train.top_p; docs/math.md §7.1): the truncation by hand,
the recorded log-probs are the renormalised truncated distribution's, every drawn token lies in
the support, and with the options off the draws are bit-identical to the sampler before them."""

from __future__ import annotations

import math

import pytest
import torch

from ftis.models.loading import ModelConfig, build_model
from ftis.models.tokenizer import char_tokenizer
from ftis.rollout.sampler import sample, truncate_logits
from tests import _sampler_before_top_p as before

TOK = char_tokenizer()
PROMPTS = [TOK.encode(s, add_special_tokens=False) for s in ["12+34=", "5+6=", "100+7="]]
KW = dict(eos_id=TOK.eos_token_id, pad_id=TOK.pad_token_id)


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(preset="llama-xs", init_seed=3))


def _kept(logits, **kw) -> list[int]:
    return torch.isfinite(truncate_logits(logits, **kw)[0]).nonzero().flatten().tolist()


def test_truncation_by_hand():
    # probabilities 0.5, 0.3, 0.15, 0.05 in a shuffled vocabulary order
    p = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    logits = p.log()
    assert _kept(logits) == [0, 1, 2, 3]
    # top_p: tokens whose more probable tokens hold < top_p: 0 (0.5), 0.5 (0.3), 0.8 (0.15)
    assert _kept(logits, top_p=0.8) == [1, 3]  # 0.8 < 0.8 is false: the 0.15 token goes
    assert _kept(logits, top_p=0.81) == [0, 1, 3]
    assert _kept(logits, top_p=0.01) == [1]  # the most probable token always stays
    assert _kept(logits, top_k=2) == [1, 3]
    assert _kept(logits, top_k=4) == [0, 1, 2, 3]
    # top_k first, then top_p on the renormalised top 3: 0.5/0.95 = 0.526 < 0.6, 0.842 is not
    assert _kept(logits, top_k=3, top_p=0.6) == [1, 3]
    with pytest.raises(ValueError, match="top_p"):
        truncate_logits(logits, top_p=0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_defaults_draw_bit_identical_to_the_sampler_before_top_p(model, temperature):
    for seed in (0, 1):
        new = sample(
            model,
            PROMPTS,
            num_samples=4,
            max_new_tokens=6,
            temperature=temperature,
            generator=torch.Generator().manual_seed(seed),
            **KW,
        )
        old = before.sample(
            model,
            PROMPTS,
            num_samples=4,
            max_new_tokens=6,
            temperature=temperature,
            generator=torch.Generator().manual_seed(seed),
            **KW,
        )
        assert torch.equal(new.completion_ids, old.completion_ids)
        assert torch.equal(new.logprobs, old.logprobs)
        assert torch.equal(new.lengths, old.lengths)


@pytest.mark.parametrize("opts", [{"top_p": 0.5}, {"top_k": 3}, {"top_k": 5, "top_p": 0.7}])
def test_draws_lie_in_the_support_and_record_its_renormalised_logprobs(model, opts):
    """Re-derive each step's support from a full forward pass of prompt + completion so far,
    with the truncation rule written out here (sort, cumulative mass), independent of
    `truncate_logits`."""
    temperature = 0.8
    s = sample(
        model,
        PROMPTS,
        num_samples=3,
        max_new_tokens=5,
        temperature=temperature,
        generator=torch.Generator().manual_seed(7),
        **opts,
        **KW,
    )
    raised = 0
    for i in range(s.completion_ids.shape[0]):
        prompt = s.prompt_ids[i][s.prompt_mask[i].bool()].tolist()
        for t in range(int(s.lengths[i])):
            ids = torch.tensor([prompt + s.completion_ids[i, :t].tolist()])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, -1].double() / temperature
            probs = torch.softmax(logits, -1)
            order = probs.argsort(descending=True).tolist()
            support = order[: opts.get("top_k") or len(order)]
            mass = float(probs[support].sum())
            if "top_p" in opts:
                kept, acc = [], 0.0
                for tok in support:
                    if kept and acc >= opts["top_p"]:
                        break
                    kept.append(tok)
                    acc += float(probs[tok]) / mass
                support = kept
            tok = int(s.completion_ids[i, t])
            assert tok in support, (i, t)
            expected = math.log(float(probs[tok]) / float(probs[support].sum()))
            assert float(s.logprobs[i, t]) == pytest.approx(expected, abs=1e-4)
            untruncated = math.log(float(probs[tok]))
            raised += float(s.logprobs[i, t]) > untruncated + 1e-3
    assert raised > 0  # the truncation did raise the recorded log-probs above the receiver's


def test_top_k_one_is_greedy_with_logprob_zero(model):
    s = sample(
        model,
        PROMPTS,
        num_samples=2,
        max_new_tokens=5,
        temperature=1.0,
        top_k=1,
        generator=torch.Generator().manual_seed(0),
        **KW,
    )
    g = sample(model, PROMPTS, num_samples=2, max_new_tokens=5, temperature=0.0, **KW)
    assert torch.equal(s.completion_ids, g.completion_ids)
    assert torch.equal(s.logprobs, torch.zeros_like(s.logprobs))


def test_the_config_refuses_out_of_range_values():
    from ftis.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="top_p"):
        load_config(None, ["train.top_p=0"])
    with pytest.raises(ConfigError, match="top_k"):
        load_config(None, ["train.top_k=-1"])
    cfg = load_config(None, ["train.top_p=0.9", "train.top_k=20"])
    assert (cfg.train.top_p, cfg.train.top_k) == (0.9, 20)
