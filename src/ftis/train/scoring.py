"""Rewards and advantages of a step's batch: every node scores every sample with its own
verifier (a peer's claim is never used), then advantages per group (docs/math.md §2).

A completion that no reward function gave a number (a batched function's None) is *excluded*:
`score` gives it reward 0 and remembers it (this thread's latest `score`, by prompt, generator
and tokens, so the memory survives the batch's selections and re-concatenations), and
`advantages_for` gives it advantage 0 and leaves it out of its group's mean and std
(`flat_group_advantages(valid=)`). The callers need not carry a mask (docs/tasks.md)."""

from __future__ import annotations

import threading

import torch

from ftis.core.advantages import flat_group_advantages
from ftis.rewards.decode import decode_for_reward
from ftis.rewards.runtime import task_rewards_masked
from ftis.rollout.types import RolloutBatch
from ftis.tasks.base import Task


def score(task: Task, tokenizer, batch: RolloutBatch) -> torch.Tensor:
    """(N,) rewards recomputed by this node's own configured reward (`ftis.rewards`; the
    completions decoded with the tokenizer's added special tokens kept); a peer's claim is
    never used."""
    train = task.split("train")
    texts = decode_for_reward(tokenizer, batch.completion_ids, batch.lengths)
    problems = [train[i] for i in batch.prompt_index.tolist()]
    rewards, excluded = task_rewards_masked(task, problems, texts)
    keys = _row_keys(batch) if any(excluded) else []
    _latest.excluded = frozenset(k for k, out in zip(keys, excluded) if out)
    return torch.tensor(rewards, dtype=torch.float32)


_latest = threading.local()  # .excluded: row keys the latest `score` of this thread excluded


def _row_keys(batch: RolloutBatch) -> list[tuple]:
    """(prompt, generator, completion tokens) of each sequence: what identifies it across
    `select` and `concat` (which pad the ids)."""
    ids = batch.completion_ids.detach().cpu()
    return [
        (p, g, tuple(ids[i, :n].tolist()))
        for i, (p, g, n) in enumerate(
            zip(batch.prompt_index.tolist(), batch.generator.tolist(), batch.lengths.tolist())
        )
    ]


def excluded_rows(batch: RolloutBatch) -> torch.Tensor:
    """(N,) bool: the sequences of `batch` that this thread's latest `score` excluded (no
    reward function gave them a number)."""
    keys = getattr(_latest, "excluded", frozenset())
    if not keys or batch.num_sequences == 0:
        return torch.zeros(batch.num_sequences, dtype=torch.bool)
    return torch.tensor([k in keys for k in _row_keys(batch)], dtype=torch.bool)


GroupBy = str  # "prompt" or "generator"


def group_ids(batch: RolloutBatch, by: GroupBy = "prompt") -> torch.Tensor:
    """(N,) the group of each sequence: its prompt ("prompt": every model's completions of a
    prompt share one baseline), or its (prompt, generator) pair ("generator": each model's
    completions of a prompt are their own group)."""
    if by == "prompt":
        return batch.prompt_index
    if by != "generator":
        raise ValueError(f"unknown grouping {by!r}; choose prompt or generator")
    if batch.num_sequences == 0:
        return batch.prompt_index
    pairs = torch.stack([batch.prompt_index, batch.generator], dim=1)
    return torch.unique(pairs, dim=0, return_inverse=True)[1]


def advantages_for(
    batch: RolloutBatch,
    rewards: torch.Tensor,
    scale: str,
    *,
    by: GroupBy = "prompt",
    excluded: torch.Tensor | None = None,
) -> torch.Tensor:
    """Group-relative advantages; a group is every sequence of one prompt, or of one prompt
    and one generator (`group_ids`; docs/math.md §2). `excluded` (N,) bool (default: those
    the latest `score` excluded, `excluded_rows`) get advantage 0 and take no part in their
    group's mean and std."""
    if excluded is None:
        excluded = excluded_rows(batch)
    if not bool(excluded.any()):
        return flat_group_advantages(rewards, group_ids(batch, by), scale=scale)
    valid = ~excluded.to(device=rewards.device, dtype=torch.bool)
    return flat_group_advantages(rewards, group_ids(batch, by), scale=scale, valid=valid)


def advantages_with_withheld(
    batch: RolloutBatch,
    rewards: torch.Tensor,
    scale: str,
    withheld: dict[int, int],
    *,
    excluded: torch.Tensor | None = None,
) -> torch.Tensor:
    """`advantages_for` grouped by prompt, where a prompt's group also holds `withheld[p]`
    completions the batch does not carry, counted at reward 0 in its mean and std (success-
    gated sharing: a peer's failures, which it answered but did not send; docs/math.md §17).
    With every failure's reward 0 this is exactly the advantage full sharing gives each sequence
    that was sent."""
    extra = [(p, c) for p, c in sorted(withheld.items()) if c > 0]
    if not extra:
        return advantages_for(batch, rewards, scale, by="prompt", excluded=excluded)
    if excluded is None:
        excluded = excluded_rows(batch)
    n = batch.num_sequences
    ids = torch.cat(
        [
            batch.prompt_index,
            torch.tensor([p for p, c in extra for _ in range(c)], dtype=torch.long),
        ]
    )
    phantom = sum(c for _, c in extra)
    r = torch.cat([rewards, torch.zeros(phantom, dtype=rewards.dtype, device=rewards.device)])
    valid = torch.cat([~excluded.to(dtype=torch.bool), torch.ones(phantom, dtype=torch.bool)])
    adv = flat_group_advantages(r, ids.to(r.device), scale=scale, valid=valid.to(r.device))
    return adv[:n]


def finite_rewards(rewards: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(rewards with every NaN/inf replaced by 0, how many were replaced): a verifier that cannot
    decide gives no reward, and a NaN never reaches the advantages."""
    bad = ~torch.isfinite(rewards)
    n_bad = int(bad.sum())
    return (torch.where(bad, torch.zeros_like(rewards), rewards) if n_bad else rewards), n_bad


def lonely_groups(
    batch: RolloutBatch, *, min_size: int = 2, by: GroupBy = "prompt"
) -> torch.Tensor:
    """(N,) bool: True for sequences whose group (prompt) has fewer than `min_size` sequences.

    A group of one has no baseline (its std is undefined). It happens under horizontal sharing
    when a node's own share of a group is one completion and a peer's share was lost or
    rejected; such groups are skipped (counted by the caller), never allowed to stop the node.
    """
    if batch.num_sequences == 0:
        return torch.zeros(0, dtype=torch.bool)
    _, inverse, counts = torch.unique(group_ids(batch, by), return_inverse=True, return_counts=True)
    return counts[inverse] < min_size


def model_logprobs(
    node, task: Task, batch: RolloutBatch, *, temperature: float, micro_batch_size: int = 0
) -> torch.Tensor:
    """(N, T) per-token log-probs of `batch`'s completions under `node`'s current model at the
    sampling `temperature`, without gradient (0 at padding). Receivers screen peers' samples with
    it (ftis.algos.ftis.defence); a poisoning test adversary rescores its rewritten samples."""
    from ftis.models.logprobs import shared_prompt_completion_logprobs
    from ftis.rollout.sampler import left_pad

    n = batch.num_sequences
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
    if n == 0:
        return out
    tok = node.tokenizer
    train = task.split("train")
    mb = micro_batch_size or n
    mask_all = batch.mask
    with torch.no_grad():
        for start in range(0, n, mb):
            sl = slice(start, min(start + mb, n))
            unique, prompt_of = torch.unique(batch.prompt_index[sl], return_inverse=True)
            prompt_ids, prompt_mask = left_pad(
                [task.prompt_ids(train[i], tok) for i in unique.tolist()], tok.pad_token_id
            )
            width = max(int(batch.lengths[sl].max()), 1)
            mask = mask_all[sl, :width]
            lp = shared_prompt_completion_logprobs(
                node.model,
                prompt_ids=prompt_ids,
                prompt_mask=prompt_mask,
                prompt_of=prompt_of,
                completion_ids=batch.completion_ids[sl, :width],
                completion_mask=mask.long(),
                temperature=temperature,
            )
            out[sl, :width] = torch.where(mask.cpu(), lp.float().cpu(), torch.zeros(()))
    return out
