"""The second embedded tokenizer: a byte-level BPE trained deterministically (issue 23)."""

from __future__ import annotations

import json

import torch
from tokenizers import Tokenizer

from ftis.models import bpe
from ftis.models.config import ModelConfig
from ftis.models.loading import build_model, load_tokenizer, tokenizer_fingerprint
from ftis.models.presets import PRESETS
from ftis.models.tokenizer import char_tokenizer

# The digest of the trained vocabulary and merges (bpe.bpe_digest). It must be the same on every
# machine and every run; a change of corpus, trainer settings or `tokenizers` release that moved
# a merge changes it (then the bpe presets' shipped bases would no longer match).
PINNED_DIGEST = "6342288e75780214"


def test_training_is_deterministic_and_pinned():
    a = json.loads(bpe._train_backend().to_str())["model"]
    b = json.loads(bpe._train_backend().to_str())["model"]
    assert a["merges"] == b["merges"] and a["vocab"] == b["vocab"]
    assert len(a["merges"]) == bpe.VOCAB_SIZE - 4 - 256
    assert bpe.bpe_digest() == PINNED_DIGEST


def test_is_a_real_fast_tokenizer_that_round_trips_through_save_pretrained(tmp_path):
    tok = bpe.bpe_tokenizer()
    assert len(tok) == bpe.VOCAB_SIZE
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(ModelConfig(path=str(tmp_path)))
    for text in ("23+45=68", "12*345-7=", "héllo €\n"):
        ids = tok.encode(text, add_special_tokens=False)
        assert loaded.encode(text, add_special_tokens=False) == ids
        assert loaded.decode(ids) == text  # byte-level: any UTF-8 text round-trips
    assert tokenizer_fingerprint(loaded) == tokenizer_fingerprint(tok)
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab_size() == len(tok)


def test_digits_merge_so_the_two_tokenizations_of_an_answer_differ():
    tok = bpe.bpe_tokenizer()

    def pieces(text):
        return tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False))

    # a number's digits before the last merge; the last digit stands alone
    assert pieces("99+99=198") == ["9", "9", "+", "9", "9", "=", "19", "8"]
    assert pieces("407+141=548") == ["40", "7", "+", "14", "1", "=", "54", "8"]
    assert pieces("100") == ["10", "0"]
    assert len(char_tokenizer().encode("100", add_special_tokens=False)) == 3
    # one- and two-digit numbers are spelled digit by digit, as with the character tokenizer
    assert pieces("23+45=68") == ["2", "3", "+", "4", "5", "=", "6", "8"]
    assert tokenizer_fingerprint(tok) != tokenizer_fingerprint(char_tokenizer())


def test_a_changed_tokenizer_changes_the_warm_start_keys(monkeypatch):
    from ftis.tasks.arithmetic import ArithmeticTaskConfig
    from ftis.warmstart import WarmStartConfig, base_key, cache_key

    ws, task = WarmStartConfig(steps=1), ArithmeticTaskConfig()
    cfg, char_cfg = ModelConfig(preset="qwen2-bpe"), ModelConfig(preset="llama-xs")
    keys = (cache_key(cfg, ws, task), base_key(cfg, ws, task))
    char_keys = (cache_key(char_cfg, ws, task), base_key(char_cfg, ws, task))
    monkeypatch.setattr(bpe, "bpe_digest", lambda: "0" * 16)
    new_keys = (cache_key(cfg, ws, task), base_key(cfg, ws, task))
    assert new_keys[0] != keys[0] and new_keys[1] != keys[1]
    # the character presets' keys (and their shipped bases) do not depend on the BPE
    assert (cache_key(char_cfg, ws, task), base_key(char_cfg, ws, task)) == char_keys


def test_bpe_presets_build_on_their_tokenizer():
    assert {n for n, p in PRESETS.items() if p.tokenizer == "bpe"} >= {"qwen2-bpe", "llama-bpe"}
    for name in ("qwen2-bpe", "llama-bpe"):
        cfg = ModelConfig(preset=name)
        tok = load_tokenizer(cfg)
        model = build_model(cfg)
        ids = torch.tensor([tok.encode("23+45=", add_special_tokens=False)])
        assert model(input_ids=ids).logits.shape == (1, ids.shape[1], bpe.VOCAB_SIZE)
        assert model.config.eos_token_id == tok.eos_token_id == 2
