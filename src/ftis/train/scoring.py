"""Rewards and advantages of a step's batch: every node scores every sample with its own
verifier (a peer's claim is never used), then advantages per group (docs/math.md §2)."""

from __future__ import annotations

import torch

from ftis.core.advantages import flat_group_advantages
from ftis.rewards.decode import decode_for_reward
from ftis.rewards.runtime import task_rewards
from ftis.rollout.types import RolloutBatch
from ftis.tasks.base import Task


def score(task: Task, tokenizer, batch: RolloutBatch) -> torch.Tensor:
    """(N,) rewards recomputed by this node's own configured reward (`ftis.rewards`; the
    completions decoded with the tokenizer's added special tokens kept); a peer's claim is
    never used."""
    train = task.split("train")
    texts = decode_for_reward(tokenizer, batch.completion_ids, batch.lengths)
    problems = [train[i] for i in batch.prompt_index.tolist()]
    return torch.tensor(task_rewards(task, problems, texts), dtype=torch.float32)


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
    batch: RolloutBatch, rewards: torch.Tensor, scale: str, *, by: GroupBy = "prompt"
) -> torch.Tensor:
    """Group-relative advantages; a group is every sequence of one prompt, or of one prompt
    and one generator (`group_ids`; docs/math.md §2)."""
    return flat_group_advantages(rewards, group_ids(batch, by), scale=scale)


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
