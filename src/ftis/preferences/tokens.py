"""Preference pairs as token ids, and batches of them in the layout `ftis.models.logprobs` scores.

A pair becomes a prompt (the task's plain format `[bos] + tokens(text)`, or the tokenizer's chat
template for a conversation; a tokenizer without one gets HH-RLHF-style text) and two responses
(`tokens(text) + [eos]`). Lengths: a prompt keeps its last `max_prompt_length` tokens; each
response keeps its first `max_length - len(prompt)` tokens.

A batch of B pairs holds 2B rows, chosen rows first then rejected rows, with prompts left-padded
and responses right-padded (every response starts at the same column). With
`include_prompt=True` the prompt's own tokens (all but the first, which nothing predicts) are
scored as well: they move into the scored part of each row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ftis.preferences.data import PreferencePair, render_plain
from ftis.tasks.base import as_id_list, plain_prompt_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class TokenizedPairs:
    """N pairs as token-id lists (responses end with EOS unless cut)."""

    prompts: list[list[int]]
    chosen: list[list[int]]
    rejected: list[list[int]]

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass(frozen=True)
class PreferenceBatch:
    """2B rows (chosen 0..B-1, rejected B..2B-1): prompt_ids/prompt_mask (2B, P) left-padded,
    completion_ids/completion_mask (2B, T) right-padded; mask True = the token is scored."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor

    @property
    def num_pairs(self) -> int:
        return self.prompt_ids.shape[0] // 2


def prompt_ids(prompt: str | tuple, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The prompt's ids: plain text as the embedded tasks encode it; a conversation through the
    tokenizer's chat template (ending with the assistant's cue), or as HH-RLHF text."""
    if isinstance(prompt, str):
        return plain_prompt_ids(tokenizer, prompt)
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": r, "content": c} for r, c in prompt]
        return as_id_list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        )
    return plain_prompt_ids(tokenizer, render_plain(prompt))


def tokenize_pairs(
    pairs: Sequence[PreferencePair],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    max_prompt_length: int,
) -> TokenizedPairs:
    """Token ids of every pair, cut to the lengths above."""
    if max_prompt_length >= max_length:
        raise ValueError("max_prompt_length must be below max_length")
    eos = tokenizer.eos_token_id
    out = TokenizedPairs([], [], [])
    for pair in pairs:
        p = prompt_ids(pair.prompt, tokenizer)[-max_prompt_length:]
        room = max_length - len(p)
        for text, dest in ((pair.chosen, out.chosen), (pair.rejected, out.rejected)):
            ids = as_id_list(tokenizer.encode(text, add_special_tokens=False)) + [eos]
            dest.append(ids[:room])
        out.prompts.append(p)
    return out


def collate(
    data: TokenizedPairs, indices: Sequence[int], *, pad_id: int, include_prompt: bool = False
) -> PreferenceBatch:
    """The batch of pairs `indices` (see the module docstring for the layout)."""
    prompts, responses = [], []
    for side in (data.chosen, data.rejected):
        for i in indices:
            p = data.prompts[i]
            if include_prompt:  # score every prompt token but the first
                prompts.append(p[:1])
                responses.append(p[1:] + side[i])
            else:
                prompts.append(p)
                responses.append(side[i])
    width_p = max(len(p) for p in prompts)
    width_t = max(len(r) for r in responses)
    n = len(prompts)
    pid = torch.full((n, width_p), pad_id, dtype=torch.long)
    pmask = torch.zeros((n, width_p), dtype=torch.bool)
    cid = torch.full((n, width_t), pad_id, dtype=torch.long)
    cmask = torch.zeros((n, width_t), dtype=torch.bool)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        pid[row, width_p - len(p) :] = torch.tensor(p, dtype=torch.long)
        pmask[row, width_p - len(p) :] = True
        cid[row, : len(r)] = torch.tensor(r, dtype=torch.long)
        cmask[row, : len(r)] = True
    return PreferenceBatch(pid, pmask, cid, cmask)
