"""The text a reward reads: a completion decoded with the tokenizer's own special tokens kept.

Decoding with `skip_special_tokens=True` deletes every special token, so when `<answer>` or
`<think>` is a special (added) token of a tokenizer the tags vanish and a reward that looks for
them gives 0 to every completion, silently. Here only the tokenizer's structural tokens (pad,
BOS, EOS, UNK, SEP, CLS, MASK) are removed; added special tokens such as `<answer>`,
`<|im_start|>` keep their text.
"""

from __future__ import annotations

import torch

_STRUCTURAL = ("pad", "bos", "eos", "unk", "sep", "cls", "mask")


def structural_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's pad/BOS/EOS/UNK/SEP/CLS/MASK tokens (those it defines)."""
    out: set[int] = set()
    for name in _STRUCTURAL:
        value = getattr(tokenizer, f"{name}_token_id", None)
        if isinstance(value, int):
            out.add(value)
        elif isinstance(value, list | tuple):
            out.update(int(v) for v in value if v is not None)
    return out


def decode_for_reward(tokenizer, completion_ids: torch.Tensor, lengths: torch.Tensor) -> list[str]:
    """Text of each completion's real tokens, pad/BOS/EOS/UNK/... removed and every other
    special token kept: what a reward reads. completion_ids (N, T) right-padded, lengths (N,)."""
    drop = structural_ids(tokenizer)
    ids = [
        [t for t in row[:n].tolist() if t not in drop]
        for row, n in zip(completion_ids, lengths.tolist())
    ]
    return tokenizer.batch_decode(ids, skip_special_tokens=False)
