"""The phases of one training step, as plain functions the loop calls in order.

sample -> exchange -> score -> advantages -> filter/loss -> update. No config object reaches
`ftis.core`: the loop unpacks the fields the math needs.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence

import torch

from ftis.config import LossConfig, TrainConfig
from ftis.core.advantages import flat_group_advantages
from ftis.core.losses import policy_loss
from ftis.models.logprobs import shared_prompt_completion_logprobs
from ftis.rollout.sampler import decode_completions, left_pad, sample
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


def assign_prompts(indices: list[int], *, rank: int, world_size: int, scheme: str) -> list[int]:
    """This node's prompt indices under a sharing scheme.

    vertical: prompts are dealt out round-robin; each node samples whole groups of G.
    horizontal: every node samples its share of G for every prompt (`sample_slots`).
    """
    if scheme == "vertical":
        return indices[rank::world_size]
    return indices


def sample_slots(*, rank: int, world_size: int, scheme: str, group_size: int) -> tuple[int, int]:
    """(first slot, number of slots) of a group's G completion slots that this node samples."""
    if scheme == "vertical":
        return 0, group_size
    base, extra = divmod(group_size, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def group_noise(
    seed: int, step: int, prompt_index: int, group_size: int, length: int
) -> torch.Tensor:
    """(G, length) uniforms that drive the sampling of one prompt's group at one step.

    Keyed by (seed, step, prompt) only, so a completion slot gets the same randomness whichever
    node samples it: splitting a step's prompts among identical nodes gives the same samples as
    one node sampling them all, and a resumed run samples what the uninterrupted one did.
    """
    key = hashlib.blake2b(f"ftis-sample:{seed}:{step}:{prompt_index}".encode(), digest_size=8)
    g = torch.Generator().manual_seed(int.from_bytes(key.digest(), "little") & ((1 << 63) - 1))
    return torch.rand((group_size, length), generator=g)


def generate(
    node: Node,
    task: Task,
    problems: Sequence[Problem],
    *,
    slots: tuple[int, int],
    cfg: TrainConfig,
    step: int,
) -> RolloutBatch:
    """Sample the completion slots `slots` = (first, count) of each problem's group with the
    node's current model, with the step's per-prompt noise (see `group_noise`)."""
    tok = node.tokenizer
    first, num_samples = slots
    if not problems or num_samples == 0:
        return empty_batch(tok.pad_token_id)
    prompts = [task.prompt_ids(p, tok) for p in problems]
    noise = torch.cat(
        [
            group_noise(cfg.seed, step, p.index, cfg.group_size, cfg.max_new_tokens)[
                first : first + num_samples
            ]
            for p in problems
        ]
    )
    out = sample(
        node.model,
        prompts,
        num_samples=num_samples,
        max_new_tokens=cfg.max_new_tokens,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
        temperature=cfg.temperature,
        noise=noise,
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


def score(task: Task, tokenizer, batch: RolloutBatch) -> torch.Tensor:
    """(N,) rewards recomputed by this node's own verifier; a peer's claim is never used."""
    train = task.split("train")
    texts = decode_completions(tokenizer, batch.completion_ids, batch.lengths)
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
        # Each prompt of the micro-batch runs through the model once; its G completions share
        # its KV cache (models/logprobs.py). Trim to the micro-batch's longest completion.
        unique, prompt_of = torch.unique(batch.prompt_index[sl], return_inverse=True)
        prompt_ids, prompt_mask = left_pad(
            [prompt_cache[i] for i in unique.tolist()], tok.pad_token_id
        )
        width = max(int(batch.lengths[sl].max()), 1)
        comp = batch.completion_ids[sl, :width]
        mask = mask_all[sl, :width]
        logprobs = shared_prompt_completion_logprobs(
            node.model,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            prompt_of=prompt_of,
            completion_ids=comp,
            completion_mask=mask.long(),
        )
        dev = logprobs.device  # the model's: a GPU node trains on the GPU, batches stay on CPU
        loss, metrics = policy_loss(
            logprobs,
            batch.sampler_logprobs[sl, :width].to(dev),
            advantages[sl].to(dev),
            mask.to(dev),
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
        # The loss's own metrics over no sequence (0, as for any empty mask), so that every row
        # carries the same loss/* keys.
        _, empty = policy_loss(
            torch.zeros(0, 1),
            torch.zeros(0, 1),
            torch.zeros(0),
            torch.zeros(0, 1, dtype=torch.bool),
            method=loss_cfg.method,
            num_sequences=n_total if loss_cfg.filter_mode == "zero" else None,
        )
        totals.update({k: float(v) for k, v in empty.items()})
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


ADVERSARIES = ("zero-logprobs", "random-tokens", "duplicate")


def adversarial(
    batch: RolloutBatch, kind: str, *, vocab_size: int, generator: torch.Generator
) -> RolloutBatch:
    """A well-formed but dishonest version of `batch` (testing and research only).

    zero-logprobs: every real token claims log-prob 0 (probability 1).
    random-tokens: every real token is a uniform random id in [0, vocab_size); log-probs as sent.
    duplicate: every row is a copy of the first sample's tokens and log-probs (prompt indices
        kept, so the rows still pass the prompt check and answer the wrong prompts).
    """
    if kind not in ADVERSARIES:
        raise ValueError(f"unknown adversary {kind!r}; choose one of: {', '.join(ADVERSARIES)}")
    if batch.num_sequences == 0:
        return batch
    mask = batch.mask
    ids, lp, lengths = batch.completion_ids.clone(), batch.sampler_logprobs.clone(), batch.lengths
    if kind == "zero-logprobs":
        lp = torch.where(mask, torch.zeros_like(lp), lp)
    elif kind == "random-tokens":
        noise = torch.randint(0, vocab_size, ids.shape, generator=generator)
        ids = torch.where(mask, noise, ids)
    else:
        n = batch.num_sequences
        ids, lp = ids[:1].expand(n, -1).clone(), lp[:1].expand(n, -1).clone()
        lengths = lengths[:1].expand(n).clone()
    return RolloutBatch(
        prompt_index=batch.prompt_index.clone(),
        generator=batch.generator.clone(),
        completion_ids=ids,
        lengths=lengths,
        sampler_logprobs=lp,
    )


def finite_rewards(rewards: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(rewards with every NaN/inf replaced by 0, how many were replaced): a verifier that cannot
    decide gives no reward, and a NaN never reaches the advantages."""
    bad = ~torch.isfinite(rewards)
    n_bad = int(bad.sum())
    return (torch.where(bad, torch.zeros_like(rewards), rewards) if n_bad else rewards), n_bad
