"""A character-level tokenizer, saved and loaded as a real Hugging Face fast tokenizer.

Tiny presets use it so the embedded task needs nothing from a hub. It covers printable ASCII plus
newline and tab, so the GSM8K-style fixtures tokenize too (with long sequences).
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARS = string.printable[
    :-2
]  # printable ASCII without \x0b \x0c: digits, letters, punctuation, space, \t, \n, \r


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character tokenizer: ids 0-3 are <pad> <bos> <eos> <unk>, then one id per char."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # One token per character: split on every char and keep it.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return as_fast_tokenizer(backend)


def as_fast_tokenizer(backend: Tokenizer) -> PreTrainedTokenizerFast:
    """A `tokenizers` backend as the Hugging Face fast tokenizer every embedded tokenizer is:
    <pad> <bos> <eos> <unk> special tokens, left padding, no clean-up of spaces."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tok.model_input_names = ["input_ids", "attention_mask"]
    return tok
