"""The policy-gradient update of one step: receiver log-probs, the policy loss, one optimizer
step. Shared by every algorithm that trains with a GRPO-family loss."""

from __future__ import annotations

import math

import torch

from ftis.config import LossConfig
from ftis.core.losses import drop_mode_grad_scale, policy_loss
from ftis.models.logprobs import shared_prompt_completion_logprobs
from ftis.rollout.sampler import left_pad
from ftis.rollout.types import RolloutBatch
from ftis.tasks.base import Task
from ftis.train.node import Node


class NonFiniteError(RuntimeError):
    """A loss or gradient was NaN/inf; the update was skipped."""


def update(
    node: Node,
    task: Task,
    batch: RolloutBatch,
    advantages: torch.Tensor,
    *,
    loss_cfg: LossConfig,
    micro_batch_size: int,
    temperature: float = 1.0,
    skip_zero_advantage: bool = True,
) -> dict[str, float]:
    """One optimizer step on `batch`: receiver log-probs, policy loss, backward, clip, step.

    Micro-batches accumulate gradients; the loss divides by the global N, so the update is the
    same however the batch is split (docs/math.md §3). Under filter_mode "drop" the global count
    of kept sequences is only known after every micro-batch ran, so the accumulated gradient is
    rescaled by N / kept at the end (`drop_mode_grad_scale`); the padded filter statistic uses
    the whole batch's width. A non-finite loss or gradient skips the step and raises
    NonFiniteError after zeroing the gradients.

    temperature: the sampling temperature; the receiver scores the tempered distribution the
    sampler drew from (log softmax(logits / T)), so own samples have ratio 1 at any T.

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
    width_all = max(int(batch.lengths.max()), 1) if n else 1  # for the "padded" filter statistic
    kept_total = 0.0
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
            temperature=temperature,
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
            num_sequences=n_total,
            padded_width=width_all,
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
            elif k == "kept_sequences":
                kept_total += v
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
            num_sequences=n_total,
        )
        totals.update({k: float(v) for k, v in empty.items()})
    else:
        totals["filtered_frac"] = totals.get("filtered_frac", 0.0) * n / n_total
        totals["kept_sequences"] = kept_total
        if loss_cfg.filter_mode == "drop":
            scale = drop_mode_grad_scale(n_total, kept_total)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
            totals["loss"] *= scale
    totals["active_frac"] = n / n_total if n_total else 0.0
    grad_norm = torch.nn.utils.clip_grad_norm_(params, node.cfg.optim.grad_clip)
    if not torch.isfinite(grad_norm):
        node.optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(f"non-finite gradient norm {float(grad_norm)}")
    node.optimizer.step()
    node.optimizer.zero_grad(set_to_none=True)
    totals["grad_norm"] = float(grad_norm)
    return totals
