"""The phases of one training step, as plain functions the loop calls in order.

sample -> exchange -> score -> advantages -> filter/loss -> update. No config object reaches
`ftis.core`: the loop unpacks the fields the math needs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from ftis.config import LossConfig, TrainConfig
from ftis.core.advantages import flat_group_advantages
from ftis.core.losses import policy_loss
from ftis.models.logprobs import completion_logprobs
from ftis.rollout.sampler import left_pad, sample
from ftis.rollout.types import RolloutBatch
from ftis.tasks.base import Problem, Task
from ftis.train.node import Node


class NonFiniteError(RuntimeError):
    """A loss or gradient was NaN/inf; the update was skipped."""


def step_prompts(seed: int, step: int, num_prompts: int, train_size: int) -> list[int]:
    """The train-split indices of one step. Every node computes the same list from (seed, step)."""
    rng = random.Random(f"ftis-prompts:{seed}:{step}")
    if num_prompts > train_size:
        raise ValueError(
            f"train.prompts_per_step={num_prompts} exceeds the {train_size} train problems"
        )
    return rng.sample(range(train_size), num_prompts)


def assign_prompts(
    indices: list[int], *, rank: int, world_size: int, scheme: str, group_size: int
) -> tuple[list[int], int]:
    """(this node's prompt indices, completions per prompt) under a sharing scheme.

    vertical: prompts are dealt out round-robin; each node samples whole groups of G.
    horizontal: every node samples its share of G for every prompt (shares differ by at most 1).
    """
    if scheme == "vertical":
        return indices[rank::world_size], group_size
    share = group_size // world_size + (1 if rank < group_size % world_size else 0)
    return (indices if share > 0 else []), share


def generate(
    node: Node,
    task: Task,
    problems: Sequence[Problem],
    *,
    num_samples: int,
    cfg: TrainConfig,
    generator: torch.Generator,
) -> RolloutBatch:
    """Sample `num_samples` completions per problem with the node's current model."""
    tok = node.tokenizer
    if not problems or num_samples == 0:
        return empty_batch(tok.pad_token_id)
    prompts = [task.prompt_ids(p, tok) for p in problems]
    out = sample(
        node.model,
        prompts,
        num_samples=num_samples,
        max_new_tokens=cfg.max_new_tokens,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
        temperature=cfg.temperature,
        generator=generator,
    )
    n = out.completion_ids.shape[0]
    index = torch.tensor([p.index for p in problems], dtype=torch.long)
    return RolloutBatch(
        prompt_index=index.repeat_interleave(num_samples),
        generator=torch.full((n,), node.rank, dtype=torch.long),
        completion_ids=out.completion_ids.cpu(),
        lengths=out.lengths.cpu(),
        sampler_logprobs=out.logprobs.cpu(),
    )


def empty_batch(pad_id: int) -> RolloutBatch:
    return RolloutBatch(
        prompt_index=torch.zeros(0, dtype=torch.long),
        generator=torch.zeros(0, dtype=torch.long),
        completion_ids=torch.full((0, 1), pad_id, dtype=torch.long),
        lengths=torch.zeros(0, dtype=torch.long),
        sampler_logprobs=torch.zeros((0, 1), dtype=torch.float32),
    )


def decode_completions(tokenizer, batch: RolloutBatch) -> list[str]:
    ids = [row[:n].tolist() for row, n in zip(batch.completion_ids, batch.lengths.tolist())]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def score(task: Task, tokenizer, batch: RolloutBatch) -> torch.Tensor:
    """(N,) rewards recomputed by this node's own verifier; a peer's claim is never used."""
    train = task.split("train")
    texts = decode_completions(tokenizer, batch)
    rewards = [task.reward(train[i], text) for i, text in zip(batch.prompt_index.tolist(), texts)]
    return torch.tensor(rewards, dtype=torch.float32)


def update(
    node: Node,
    task: Task,
    batch: RolloutBatch,
    advantages: torch.Tensor,
    *,
    loss_cfg: LossConfig,
    micro_batch_size: int,
    skip_zero_advantage: bool = True,
) -> dict[str, float]:
    """One optimizer step on `batch`: receiver log-probs, policy loss, backward, clip, step.

    Micro-batches accumulate gradients; the loss divides by the global N, so the update is the
    same however the batch is split (docs/math.md §3). A non-finite loss or gradient skips the
    step and raises NonFiniteError after zeroing the gradients.

    Sequences whose advantage is exactly 0 (groups whose rewards were all equal) contribute
    exactly 0 to the loss and its gradient under every method, so with filter_mode "zero" they are
    not run through the model at all (`skip_zero_advantage`); N still counts them. The IS and
    filter statistics are then over the sequences that were run (`loss/active_frac` of N).
    """
    tok = node.tokenizer
    n_total = batch.num_sequences
    if skip_zero_advantage and loss_cfg.filter_mode == "zero":
        active = advantages != 0
        if not bool(active.all()):
            batch, advantages = batch.select(active), advantages[active]
    n = batch.num_sequences
    train = task.split("train")
    prompt_cache: dict[int, list[int]] = {}
    for i in batch.prompt_index.tolist():
        if i not in prompt_cache:
            prompt_cache[i] = task.prompt_ids(train[i], tok)
    mb = micro_batch_size or max(n, 1)
    totals: dict[str, float] = {}
    node.optimizer.zero_grad(set_to_none=True)
    mask_all = batch.mask
    for start in range(0, n, mb):
        sl = slice(start, min(start + mb, n))
        prompt_ids, prompt_mask = left_pad(
            [prompt_cache[i] for i in batch.prompt_index[sl].tolist()], tok.pad_token_id
        )
        # Trim the micro-batch to its own longest completion: padding costs compute.
        width = max(int(batch.lengths[sl].max()), 1)
        comp = batch.completion_ids[sl, :width]
        mask = mask_all[sl, :width]
        logprobs = completion_logprobs(
            node.model,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=comp,
            completion_mask=mask.long(),
        )
        loss, metrics = policy_loss(
            logprobs,
            batch.sampler_logprobs[sl, :width],
            advantages[sl],
            mask,
            method=loss_cfg.method,
            is_cap=loss_cfg.is_cap,
            clip_eps=loss_cfg.clip_eps,
            filter_threshold=loss_cfg.filter_threshold,
            filter_stat_norm=loss_cfg.filter_stat_norm,
            filter_mode=loss_cfg.filter_mode,
            num_sequences=n_total if loss_cfg.filter_mode == "zero" else None,
        )
        if not torch.isfinite(loss):
            node.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(
                f"non-finite loss {float(loss.detach())} in micro-batch at {start}"
            )
        loss.backward()
        weight = (sl.stop - sl.start) / n
        for k, v in metrics.items():
            v = float(v)
            if k.endswith("_max"):
                totals[k] = max(totals.get(k, -math.inf), v)
            elif k == "loss":
                totals[k] = totals.get(k, 0.0) + v  # already divided by the global N
            else:
                totals[k] = totals.get(k, 0.0) + v * weight
    params = [p for p in node.model.parameters() if p.requires_grad]
    if n == 0:
        # Nothing to run: the exact gradient is 0. Adam still steps (its moments move), as it
        # would have after a full backward pass of zeros.
        for p in params:
            p.grad = torch.zeros_like(p)
    else:
        totals["filtered_frac"] = totals.get("filtered_frac", 0.0) * n / n_total
    totals["active_frac"] = n / n_total if n_total else 0.0
    grad_norm = torch.nn.utils.clip_grad_norm_(params, node.cfg.optim.grad_clip)
    if not torch.isfinite(grad_norm):
        node.optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(f"non-finite gradient norm {float(grad_norm)}")
    node.optimizer.step()
    node.optimizer.zero_grad(set_to_none=True)
    totals["grad_norm"] = float(grad_norm)
    return totals


def advantages_for(batch: RolloutBatch, rewards: torch.Tensor, scale: str) -> torch.Tensor:
    """Group-relative advantages; a group is every sequence of one prompt (docs/math.md §2)."""
    return flat_group_advantages(rewards, batch.prompt_index, scale=scale)
