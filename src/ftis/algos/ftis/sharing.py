"""Who samples what under F-TIS's sharing schemes, and what a peer may send (ftis-method §6).

vertical: the step's prompts are dealt out among the nodes; each samples whole groups of G.
horizontal: every node samples its share of the G completions of every prompt.
joint: every node samples G completions of every prompt (HACPO's setting): a prompt's joint
group holds n x G completions, G from each node, in completion slots rank * G ... rank * G + G - 1.
"""

from __future__ import annotations

import random

from ftis.rollout.types import RolloutBatch


def step_prompts(seed: int, step: int, num_prompts: int, train_size: int) -> list[int]:
    """The train-split indices of one step. Every node computes the same list from (seed, step)."""
    rng = random.Random(f"ftis-prompts:{seed}:{step}")
    if num_prompts > train_size:
        raise ValueError(
            f"train.prompts_per_step={num_prompts} exceeds the {train_size} train problems"
        )
    return rng.sample(range(train_size), num_prompts)


def assign_prompts(indices: list[int], *, rank: int, world_size: int, scheme: str) -> list[int]:
    """This node's prompt indices under a sharing scheme.

    vertical: prompts are dealt out round-robin; each node samples whole groups of G.
    horizontal: every node samples its share of G for every prompt (`sample_slots`).
    joint: every node samples G for every prompt.
    """
    if scheme == "vertical":
        return indices[rank::world_size]
    return indices


def sample_slots(*, rank: int, world_size: int, scheme: str, group_size: int) -> tuple[int, int]:
    """(first slot, number of slots) of a group's G completion slots that this node samples."""
    if scheme == "vertical":
        return 0, group_size
    if scheme == "joint":
        return rank * group_size, group_size
    base, extra = divmod(group_size, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def peer_prompt_quota(
    indices: list[int], *, peer: int, world_size: int, scheme: str, group_size: int
) -> dict[int, int]:
    """{prompt index: most sequences `peer` may send for it} at a step with prompts `indices`."""
    prompts = assign_prompts(indices, rank=peer, world_size=world_size, scheme=scheme)
    _, share = sample_slots(rank=peer, world_size=world_size, scheme=scheme, group_size=group_size)
    return dict.fromkeys(prompts, share) if share else {}


def check_peer_batch(batch: RolloutBatch, quota: dict[int, int], *, train_size: int) -> str | None:
    """Why a decoded peer batch must be rejected, or None when it is acceptable.

    The wire decoder has already checked the format, ids, log-probs, lengths and generator; this
    checks what only the trainer knows: every prompt index lies in the train split and is one the
    peer was assigned at this step, with no more sequences than its share (so a peer cannot
    flood a group or answer prompts it was not given).
    """
    idx = batch.prompt_index.tolist()
    if idx and (min(idx) < 0 or max(idx) >= train_size):
        bad = next(i for i in idx if not 0 <= i < train_size)
        return f"prompt index {bad} is outside the train split (size {train_size})"
    counts: dict[int, int] = {}
    for i in idx:
        counts[i] = counts.get(i, 0) + 1
    for i, c in counts.items():
        if i not in quota:
            return f"prompt index {i} was not assigned to this peer at this step"
        if c > quota[i]:
            return f"{c} sequences for prompt {i}, more than the peer's share of {quota[i]}"
    return None
