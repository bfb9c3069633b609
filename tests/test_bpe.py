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
PINNED_DIGEST = "e864b88e98cc9a36"


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
    # frequent two-digit numbers and "100" are single tokens, "45" too; a rare one splits
    assert tok.convert_ids_to_tokens(tok.encode("23+45=68", add_special_tokens=False)) == [
        "23",
        "+",
        "45",
        "=",
        "68",
    ]
    assert len(tok.encode("100", add_special_tokens=False)) == 1
    assert len(char_tokenizer().encode("100", add_special_tokens=False)) == 3
    assert tokenizer_fingerprint(tok) != tokenizer_fingerprint(char_tokenizer())


def test_bpe_presets_build_on_their_tokenizer():
    assert {n for n, p in PRESETS.items() if p.tokenizer == "bpe"} >= {"qwen2-bpe", "llama-bpe"}
    for name in ("qwen2-bpe", "llama-bpe"):
        cfg = ModelConfig(preset=name)
        tok = load_tokenizer(cfg)
        model = build_model(cfg)
        ids = torch.tensor([tok.encode("23+45=", add_special_tokens=False)])
        assert model(input_ids=ids).logits.shape == (1, ids.shape[1], bpe.VOCAB_SIZE)
        assert model.config.eos_token_id == tok.eos_token_id == 2
