import math

import pytest
import torch
from transformers import AutoTokenizer

from ftis.models.loading import (
    LoraConfig,
    ModelConfig,
    ModelLoadError,
    attach_lora,
    build_model,
    count_parameters,
    load_tokenizer,
    tokenizer_fingerprint,
)
from ftis.models.logprobs import (
    completion_logprobs,
    gather_logprobs,
    shared_prompt_completion_logprobs,
)
from ftis.models.presets import PRESETS, preset_tokenizer
from ftis.models.tokenizer import char_tokenizer


def test_char_tokenizer_round_trips_through_save_pretrained(tmp_path):
    tok = char_tokenizer()
    text = "12+34=\n\nQuestion: what is 7*6?\tAnswer: 42"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character, newlines included
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.encode(text, add_special_tokens=False) == ids
    assert tokenizer_fingerprint(loaded) == tokenizer_fingerprint(tok)


def test_special_tokens_are_skipped_when_decoding():
    tok = char_tokenizer()
    ids = [
        tok.bos_token_id,
        *tok.encode("68", add_special_tokens=False),
        tok.eos_token_id,
        tok.pad_token_id,
    ]
    assert tok.decode(ids, skip_special_tokens=True) == "68"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_and_grow(name):
    model = build_model(ModelConfig(preset=name))
    out = model(input_ids=torch.tensor([[1, 5, 6]]))
    assert out.logits.shape == (1, 3, len(preset_tokenizer(name)))


def test_preset_sizes_are_ordered():
    sizes = [
        count_parameters(build_model(ModelConfig(preset=n)))[1]
        for n in ("llama-xs", "llama-s", "llama-m", "llama-l")
    ]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1] / 10


def test_preset_init_is_deterministic():
    a = build_model(ModelConfig(preset="llama-xs", init_seed=3))
    b = build_model(ModelConfig(preset="llama-xs", init_seed=3))
    c = build_model(ModelConfig(preset="llama-xs", init_seed=4))
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_load_by_path_gives_the_same_model(tmp_path):
    model = build_model(ModelConfig(preset="qwen2-s"))
    model.save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    cfg = ModelConfig(path=str(tmp_path))
    loaded, tok = build_model(cfg), load_tokenizer(cfg)
    ids = torch.tensor([tok.encode("1+2=", add_special_tokens=False)])
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert tok.padding_side == "left"


def test_lora_trains_only_adapters():
    model = attach_lora(build_model(ModelConfig(preset="llama-s")), LoraConfig(r=4, alpha=8))
    trainable, total = count_parameters(model)
    assert 0 < trainable < total / 5
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)


def test_model_config_needs_exactly_one_source():
    with pytest.raises(ValueError, match="exactly one of model.preset"):
        ModelConfig()
    with pytest.raises(ValueError, match="exactly one of model.preset"):
        ModelConfig(preset="llama-s", path="x")
    with pytest.raises(ValueError, match="unknown preset 'llama-huge'"):
        ModelConfig(preset="llama-huge")


def test_missing_model_path_is_a_clear_error(tmp_path):
    cfg = ModelConfig(path=str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="model.path="):
        load_tokenizer(cfg)
    with pytest.raises(ModelLoadError, match="model.path="):
        build_model(cfg)


def test_device_resolution_on_a_cpu_machine():
    from ftis.models.loading import model_device, resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        resolve_device("cuda")
    assert model_device(build_model(ModelConfig(preset="llama-xs"))) == torch.device("cpu")


def test_gather_logprobs_scores_the_tempered_distribution():
    # logits (0, ln 4): at T = 1 the probabilities are (1/5, 4/5); at T = 2 the logits become
    # (0, ln 2), probabilities (1/3, 2/3); at T = 0.5 (0, ln 16), probabilities (1/17, 16/17).
    logits = torch.tensor([[[0.0, math.log(4.0)], [0.0, math.log(4.0)]]])  # (N=1, T=2, V=2)
    targets = torch.tensor([[1, 0]])
    expected = {
        1.0: [[math.log(4 / 5), math.log(1 / 5)]],
        2.0: [[math.log(2 / 3), math.log(1 / 3)]],
        0.5: [[math.log(16 / 17), math.log(1 / 17)]],
    }
    for temperature, want in expected.items():
        got = gather_logprobs(logits, targets, temperature=temperature)
        # fp32 on O(1) numbers: a few ulps.
        torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=0)
    # The default is T = 1, bit for bit, and low-precision logits are upcast before dividing.
    assert torch.equal(
        gather_logprobs(logits, targets), gather_logprobs(logits, targets, temperature=1.0)
    )
    half = gather_logprobs(logits.bfloat16(), targets, temperature=2.0)
    assert half.dtype == torch.float32
    torch.testing.assert_close(
        half, gather_logprobs(logits.bfloat16().float(), targets, temperature=2.0)
    )


def test_logprob_functions_reject_a_temperature_that_is_not_positive():
    model = build_model(ModelConfig(preset="llama-xs"))
    ids, mask = torch.tensor([[1, 5]]), torch.ones(1, 2, dtype=torch.long)
    kw = dict(prompt_ids=ids, prompt_mask=mask, completion_ids=ids, completion_mask=mask)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            gather_logprobs(
                torch.zeros(1, 1, 3), torch.zeros(1, 1, dtype=torch.long), temperature=bad
            )
        with pytest.raises(ValueError, match="temperature"):
            completion_logprobs(model, temperature=bad, **kw)
        with pytest.raises(ValueError, match="temperature"):
            shared_prompt_completion_logprobs(
                model, prompt_of=torch.tensor([0]), temperature=bad, **kw
            )


def test_completion_logprobs_at_temperature_one_are_unchanged():
    model = build_model(ModelConfig(preset="llama-xs", init_seed=2))
    ids = torch.tensor([[1, 5, 6, 7], [1, 8, 9, 4]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logits = model(input_ids=torch.cat([ids, ids], dim=1)).logits[:, 3:-1].float()
        by_hand = torch.log_softmax(logits, dim=-1).gather(-1, ids[..., None]).squeeze(-1)
        by_hand_tempered = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, ids[..., None])
        kw = dict(prompt_ids=ids, prompt_mask=mask, completion_ids=ids, completion_mask=mask)
        default = completion_logprobs(model, **kw)
        one = completion_logprobs(model, temperature=1.0, **kw)
        tempered = completion_logprobs(model, temperature=0.7, **kw)
    assert torch.equal(default, one)
    # Same fp32 math as log_softmax, another order: 1e-5 nats covers it.
    torch.testing.assert_close(default, by_hand, atol=1e-5, rtol=0)
    torch.testing.assert_close(tempered, by_hand_tempered.squeeze(-1), atol=1e-5, rtol=0)
