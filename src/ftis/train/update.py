"""The policy-gradient update: receiver log-probs, the policy loss, one optimizer step
(`update`). Shared by every algorithm that trains with a GRPO-family loss.

Several optimizer steps per generation round (PPO-style reuse of the round's samples,
``train.update_epochs`` x ``train.mini_batches``) are planned by `round_plan`, their metrics
summarised by `mean_step_metrics`; ReCo's response weights, normalised within whole groups, are
computed once per round by `response_weights` and sliced into every step.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math

import torch

from ftis.config import LossConfig, TrainConfig
from ftis.core.bridge import bridged_loss
from ftis.core.hacpo import peer_clip_lower
from ftis.core.kl import kl_penalty
from ftis.core.losses import drop_mode_grad_scale, policy_loss, resolve_method
from ftis.core.reco import reco_weights, variance_ratio_summary
from ftis.models.logprobs import shared_prompt_completion_logprobs
from ftis.models.precision import update_compute
from ftis.rollout.sampler import left_pad
from ftis.rollout.types import RolloutBatch
from ftis.tasks.base import Task
from ftis.train.node import Node

log = logging.getLogger(__name__)


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
    sequence_weights: torch.Tensor | None = None,
    group_size: int | None = None,
    own: torch.Tensor | None = None,
    peer_scale: torch.Tensor | None = None,
    update_index: int = 0,
    withheld: float = 0.0,
    old_logprobs: torch.Tensor | None = None,
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

    sequence_weights: (N,) per-sequence weights passed to the loss (ReCo's response weights,
    docs/math.md §8.1), computed over the whole round's batch when `batch` is one of its
    mini-batches. None: under a reco method with `reco_response_weights`, computed here over
    `batch` (with `group_size`, default the largest group's size), else no weights.

    own: (N,) bool, True for this node's own sequences (None: all own): peers' sequences get
    the loss's peer treatment (policy shaping, HACPO's peer term). peer_scale: (N,) HACPO's
    discrepancy coefficient per sequence. update_index: m, the optimizer updates already made
    on this round's batch (HACPO's stepwise clip lower bound rises with it).

    old_logprobs: (N, T) the log-probs the loss's ratios divide by, in place of the sampler's
    (`train_on_round`'s trainer-recomputed ones for own samples under a bf16 sampler, issue
    56); the sampler/trainer mismatch statistic still compares with the sampler's.

    withheld: members of the batch's groups that are not in it (success-gated sharing's withheld
    failures, docs/math.md §17), counted in N: the accumulated gradient and the loss are scaled
    by N / (N + withheld), so each sequence's term has the weight full sharing gives it and the
    update's scale does not grow as a peer sends less. Not under filter_mode "drop", which
    already divides by the sequences kept.

    loss_cfg.beta > 0 adds beta x the k3 KL to the node's reference (`Node.reference`), scored
    without grad per micro-batch at the same temperature, averaged like the loss (docs/math.md
    §14); every sequence then runs (zero-advantage ones have a KL gradient) and the metrics gain
    `kl` (before beta; `loss` includes it). Under `hacpo` the KL covers the own sequences only
    (`own`; peers' rows add 0 and still count in N), as in the paper.

    Bridged sequences (`batch.bridged`: a peer's on another tokenizer, docs/math.md §16) take
    the sequence-level terms of `ftis.core.bridge.bridged_loss` with the same global N; the
    others `policy_loss` as always (its metrics then describe them alone). The metrics gain
    `bridge_sequences`, `bridge_weight_mean`, `bridge_filtered` and `bridge_filter_stat_mean`
    over the bridged sequences that ran; under `hacpo`, `peer_frac` and `peer_clipped_frac`
    count the bridged peers with the exact ones (over every sequence that ran). A batch without
    bridged sequences runs exactly as before.
    """
    tok = node.tokenizer
    n_total = batch.num_sequences
    reco = resolve_method(loss_cfg.method)[0] == "reco"
    beta = loss_cfg.beta
    kl_own_only = resolve_method(loss_cfg.method)[0] == "hacpo"
    if sequence_weights is None:
        sequence_weights = response_weights(batch, loss_cfg, group_size=group_size)
    # Under a KL term (beta > 0) a zero-advantage sequence still has a gradient (its KL), so
    # every sequence runs.
    if skip_zero_advantage and loss_cfg.filter_mode == "zero" and beta == 0:
        active = advantages != 0
        if not bool(active.all()):
            batch, advantages = batch.select(active), advantages[active]
            if sequence_weights is not None:
                sequence_weights = sequence_weights[active]
            own = None if own is None else own[active]
            peer_scale = None if peer_scale is None else peer_scale[active]
            old_logprobs = None if old_logprobs is None else old_logprobs[active]
    n = batch.num_sequences
    ratio_base = batch.sampler_logprobs if old_logprobs is None else old_logprobs
    bridged_all, bridge_total, bridge_length = batch.bridge_columns()
    n_bridged = int(bridged_all.sum())
    n_exact = n - n_bridged
    bridge_sums = {"weight": 0.0, "filtered": 0.0, "stat": 0.0, "clipped": 0.0}
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
    # train.sampler_dtype bfloat16 or a vLLM engine: the sampler/trainer mismatch on own tokens, at
    # the weights they were sampled with (the round's first update, before its step)
    track_mismatch = node.samples_elsewhere and update_index == 0
    mismatch = [0.0, 0]  # sum of k3 over own tokens, their count
    lower = peer_clip_lower(update_index, loss_cfg.hacpo_clip_lower, loss_cfg.hacpo_clip_step)
    # model.compute_dtype bfloat16: under compute_mode autocast, forward passes under autocast
    # (weights, gradients and the optimizer stay in model.dtype; log-probs come out in f32) and
    # backward outside it; under cast_weights, forward and backward on a bf16 copy of the
    # weights made here once, gradients summed into the f32 masters after each backward.
    compute = update_compute(node.model, node.cfg.model)
    with compute:
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
            # the micro-batch's completion log-probs under a model (the node's, its reference)
            completion_logprobs = functools.partial(
                shared_prompt_completion_logprobs,
                prompt_ids=prompt_ids,
                prompt_mask=prompt_mask,
                prompt_of=prompt_of,
                completion_ids=comp,
                completion_mask=mask.long(),
                temperature=temperature,
            )
            with compute.forward():
                logprobs = completion_logprobs(node.model)
            dev = logprobs.device  # the model's: a GPU node trains on the GPU, batches stay on CPU
            if track_mismatch:
                with torch.no_grad():
                    where = mask.to(dev) & ~bridged_all[sl].to(dev)[:, None]
                    if own is not None:
                        where = where & own[sl].to(dev)[:, None]
                    d = logprobs.detach() - batch.sampler_logprobs[sl, :width].to(dev)
                    d = torch.where(where, d.clamp(-20.0, 20.0), torch.zeros_like(d))
                    mismatch[0] += float((torch.expm1(d) - d).sum())  # k3 = e^d - 1 - d
                    mismatch[1] += int(where.sum())
            br = bridged_all[sl].to(dev)
            ex = ~br
            all_exact = not bool(br.any())
            sel = slice(None) if all_exact else ex  # the rows policy_loss sees
            loss, metrics = policy_loss(
                logprobs[sel],
                ratio_base[sl, :width].to(dev)[sel],
                advantages[sl].to(dev)[sel],
                mask.to(dev)[sel],
                method=loss_cfg.method,
                is_cap=loss_cfg.is_cap,
                clip_eps=loss_cfg.clip_eps,
                filter_threshold=loss_cfg.filter_threshold,
                filter_stat_norm=loss_cfg.filter_stat_norm,
                filter_mode=loss_cfg.filter_mode,
                num_sequences=n_total,
                padded_width=width_all,
                sequence_weights=None
                if sequence_weights is None
                else sequence_weights[sl].to(dev)[sel],
                reco_token_ratio=loss_cfg.reco_token_ratio,
                reco_tis=loss_cfg.reco_tis,
                reco_clip=loss_cfg.reco_clip,
                own=None if own is None else own[sl].to(dev)[sel],
                shaping_gamma=loss_cfg.shaping_gamma,
                peer_scale=None if peer_scale is None else peer_scale[sl].to(dev)[sel],
                peer_clip_lower=lower,
                hacpo_alpha=loss_cfg.hacpo_alpha,
                gspo_eps_low=loss_cfg.gspo_eps_low,
                gspo_eps_high=loss_cfg.gspo_eps_high,
                peer_dual_clip=loss_cfg.peer_dual_clip,
            )
            if not all_exact:
                base, use_filter = resolve_method(loss_cfg.method)
                out = bridged_loss(
                    logprobs[br],
                    mask.to(dev)[br],
                    advantages[sl].to(dev)[br],
                    sampler_total=bridge_total[sl].to(dev)[br],
                    sampler_length=bridge_length[sl].to(dev)[br],
                    method=base,
                    use_filter=use_filter,
                    is_cap=loss_cfg.is_cap,
                    clip_eps=loss_cfg.clip_eps,
                    filter_threshold=loss_cfg.filter_threshold,
                    shaping_gamma=loss_cfg.shaping_gamma,
                    peer_scale=None if peer_scale is None else peer_scale[sl].to(dev)[br],
                    peer_clip_lower=lower,
                    hacpo_alpha=loss_cfg.hacpo_alpha,
                    gspo_eps=(loss_cfg.gspo_eps_low, loss_cfg.gspo_eps_high),
                    peer_dual_clip=loss_cfg.peer_dual_clip,
                )
                weights = out.per_sequence
                if sequence_weights is not None:
                    weights = weights * sequence_weights[sl].to(dev)[br].detach()
                bridged_part = weights.sum() / float(max(n_total, 1))
                loss = loss + bridged_part
                metrics["loss"] = metrics["loss"] + bridged_part.detach()
                metrics["kept_sequences"] = metrics["kept_sequences"] + (~out.filtered).sum()
                bridge_sums["weight"] += float(out.weight.sum())
                bridge_sums["filtered"] += float(out.filtered.sum())
                bridge_sums["stat"] += float(out.divergence.sum())
                bridge_sums["clipped"] += float(out.clipped.sum())
            if reco and loss_cfg.reco_token_ratio:
                metrics.update(
                    variance_ratio_summary(
                        logprobs, batch.sampler_logprobs[sl, :width].to(dev), mask.to(dev)
                    )
                )
            if beta > 0:
                with (
                    torch.no_grad(),
                    node.reference() as ref_model,
                    compute.forward(),
                ):
                    ref_logprobs = completion_logprobs(ref_model)
                kl_mask = mask.to(dev)
                if kl_own_only and own is not None:
                    # HACPO: the KL term on the learner's own sequences only (the paper's); a
                    # peer's row counts in N but adds nothing (docs/math.md §12, §14)
                    kl_mask = kl_mask & own[sl].to(dev)[:, None]
                kl = kl_penalty(
                    logprobs,
                    ref_logprobs=ref_logprobs.to(dev),
                    mask=kl_mask,
                    num_sequences=n_total,
                )
                loss = loss + beta * kl
                metrics["loss"] = loss.detach()
                metrics["kl"] = kl.detach()  # summed over micro-batches below: already / global N
            if not torch.isfinite(loss):
                node.optimizer.zero_grad(set_to_none=True)
                raise NonFiniteError(
                    f"non-finite loss {float(loss.detach())} in micro-batch at {start}"
                )
            loss.backward()
            compute.accumulate()
            # policy_loss's means describe the exact rows of the micro-batch
            exact_rows = (sl.stop - sl.start) if all_exact else int(ex.sum())
            weight = exact_rows / n_exact if n_exact else 0.0
            for k, v in metrics.items():
                v = float(v)
                if k.endswith("_max"):
                    totals[k] = max(totals.get(k, -math.inf), v)
                elif k == "kept_sequences":
                    kept_total += v
                elif k in ("loss", "kl"):
                    totals[k] = totals.get(k, 0.0) + v  # already divided by the global N
                else:
                    totals[k] = totals.get(k, 0.0) + v * weight
    params = [p for p in node.model.parameters() if p.requires_grad]
    if n == 0:
        # Nothing to run: the exact gradient is 0. Adam still steps (its moments move), as it
        # would have after a full backward pass of zeros. The loss's own quantities (its value,
        # IS weights, clip and filter fractions) were not computed over any sequence, so they
        # are left out of the metrics, never written as 0 (issue 55).
        for p in params:
            p.grad = torch.zeros_like(p)
    else:
        filtered_count = totals.get("filtered_frac", 0.0) * n_exact + bridge_sums["filtered"]
        totals["filtered_frac"] = filtered_count / n_total
        totals["kept_sequences"] = kept_total
        if loss_cfg.filter_mode == "drop":
            scale = drop_mode_grad_scale(n_total, kept_total)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
            totals["loss"] *= scale
        elif withheld > 0:
            scale = n_total / (n_total + withheld)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
            totals["loss"] *= scale
            if "kl" in totals:
                totals["kl"] *= scale
    totals["active_frac"] = n / n_total if n_total else 0.0
    if track_mismatch and mismatch[1]:
        totals["sampler_mismatch_k3"] = mismatch[0] / mismatch[1]
    if n_bridged or batch.bridged is not None:
        totals["bridge_sequences"] = float(n_bridged)
        totals["bridge_filtered"] = bridge_sums["filtered"]
        if n_bridged:  # means over no bridged sequence are left out
            totals["bridge_weight_mean"] = bridge_sums["weight"] / n_bridged
            totals["bridge_filter_stat_mean"] = bridge_sums["stat"] / n_bridged
        if n_bridged and "peer_frac" in totals:
            # HACPO: every bridged sequence is a peer's; peer_frac and peer_clipped_frac then
            # count the exact and the bridged peers over every sequence that ran
            exact_peers = totals["peer_frac"] * n_exact
            exact_clipped = totals["peer_clipped_frac"] * n_exact
            totals["peer_frac"] = (exact_peers + n_bridged) / n
            totals["peer_clipped_frac"] = (exact_clipped + bridge_sums["clipped"]) / n
    if sequence_weights is not None and n:
        totals["reco_weight_max"] = float(sequence_weights.max())
        totals["reco_weight_min"] = float(sequence_weights.min())
    grad_norm = torch.nn.utils.clip_grad_norm_(params, node.cfg.optim.grad_clip)
    if not torch.isfinite(grad_norm):
        node.optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(f"non-finite gradient norm {float(grad_norm)}")
    node.optimizer.step()
    node.optimizer.zero_grad(set_to_none=True)
    totals["grad_norm"] = float(grad_norm)
    return totals


def response_weights(
    batch: RolloutBatch, loss_cfg: LossConfig, *, group_size: int | None = None
) -> torch.Tensor | None:
    """(N,) ReCo response weights of `batch` (docs/math.md §8.1), or None when the loss does not
    use them (not a reco method, or `reco_response_weights` off). A group is every sequence of
    one prompt; `group_size` is G (train.group_size), by default the largest group's size.
    Compute them over a round's whole batch: they are normalised within each group."""
    if resolve_method(loss_cfg.method)[0] != "reco" or not loss_cfg.reco_response_weights:
        return None
    if group_size is None:
        counts = torch.unique(batch.prompt_index, return_counts=True)[1]
        group_size = int(counts.max()) if counts.numel() else 1
    return reco_weights(
        batch.sampler_logprobs,
        batch.mask,
        batch.prompt_index,
        group_size,
        w_max=loss_cfg.reco_w_max,
    )


def minibatch_seed(seed: int, step: int) -> int:
    """The seed of the mini-batch shuffles of round `step` (keyed by (train.seed, step), so a
    resumed run shuffles as the uninterrupted one did)."""
    key = hashlib.blake2b(f"ftis-minibatch:{seed}:{step}".encode(), digest_size=8)
    return int.from_bytes(key.digest(), "little") & ((1 << 63) - 1)


def round_plan(
    num_sequences: int, *, epochs: int = 1, mini_batches: int = 1, seed: int = 0
) -> list[torch.Tensor | None]:
    """The sequences of each optimizer step of one generation round, in order.

    `epochs` passes over the round's `num_sequences` sequences; each pass is shuffled with a
    generator seeded by `seed` and split into `mini_batches` parts of near-equal size (empty
    parts, when there are fewer sequences than mini-batches, are left out). None stands for the
    whole batch in its own order: with one mini-batch nothing is shuffled, so the default (1, 1)
    is exactly one step on the batch as it came.
    """
    if epochs < 1 or mini_batches < 1:
        raise ValueError(f"epochs and mini_batches must be >= 1, got {epochs}, {mini_batches}")
    if mini_batches == 1:
        return [None] * epochs
    gen = torch.Generator().manual_seed(seed)
    plan: list[torch.Tensor | None] = []
    for _ in range(epochs):
        order = torch.randperm(num_sequences, generator=gen)
        plan += [part for part in torch.tensor_split(order, mini_batches) if part.numel()]
    return plan


def own_ratio_reference(
    node: Node,
    task: Task,
    batch: RolloutBatch,
    *,
    own: torch.Tensor | None,
    train: TrainConfig,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Under a bf16 sampler (train.sampler_dtype) and a GSPO-family loss (gspo, hacpo) with
    `loss.own_ratio_reference: trainer` (docs/math.md §12, issue 56): ((N, T) log-probs the
    ratios divide by, the trainer's own at the sampling weights on own sequences and the
    sampler's elsewhere; (N,) weights min(exp(mean_t(trainer - sampler)), is_cap) on own
    sequences, 1 elsewhere, which correct the sampler's precision gap at the sequence level).
    (None, None) otherwise: the ratios divide by the sampler's log-probs, as before.

    Called before the round's first optimizer step, so the node's weights are those its own
    samples were drawn with; the forward runs as the update's does (model.compute_dtype), so the
    first update's own ratios are exactly 1 and GSPO's clip window sees only the policy's change
    over the round, not the sampler's rounding."""
    from ftis.train.scoring import model_logprobs

    loss_cfg = node.cfg.loss
    if (
        not node.samples_elsewhere
        or (node.engine is None and train.sampler_dtype == "float32")
        or loss_cfg.own_ratio_reference != "trainer"
        or resolve_method(loss_cfg.method)[0] not in ("gspo", "hacpo")
        or batch.num_sequences == 0
    ):
        return None, None
    mine = torch.ones(batch.num_sequences, dtype=torch.bool) if own is None else own.cpu().bool()
    bridged, _, _ = batch.bridge_columns()
    mine = mine & ~bridged.cpu().bool()  # a bridged peer has no per-token sampler log-probs
    if not bool(mine.any()):
        return None, None
    compute = update_compute(node.model, node.cfg.model)
    with compute, compute.forward():
        trainer = model_logprobs(
            node,
            task,
            batch.select(mine),
            temperature=train.temperature,
            micro_batch_size=train.micro_batch_size,
        )
    sampler = batch.sampler_logprobs.float().cpu()
    old = sampler.clone()
    old[mine] = trainer[:, : old.shape[1]]
    mask = batch.mask[mine].cpu()
    length = mask.sum(dim=1).clamp(min=1)
    gap = torch.where(mask, trainer[:, : mask.shape[1]] - sampler[mine], 0.0).sum(dim=1) / length
    weights = torch.ones(batch.num_sequences)
    weights[mine] = torch.exp(gap.clamp(-20.0, 20.0)).clamp(max=loss_cfg.is_cap)
    return old, weights


def mean_step_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of a round's optimizer steps in one dict: keys ending in `_max` take the
    maximum, `_min` the minimum, every other key the mean over the steps that report it."""
    out: dict[str, float] = {}
    seen: dict[str, int] = {}
    for metrics in steps:
        for k, v in metrics.items():
            if k not in out:
                out[k], seen[k] = v, 1
            elif k.endswith("_max"):
                out[k] = max(out[k], v)
            elif k.endswith("_min"):
                out[k] = min(out[k], v)
            else:
                out[k] += v
                seen[k] += 1
    return {k: v if k.endswith(("_max", "_min")) else v / seen[k] for k, v in out.items()}


def train_on_round(
    node: Node,
    task: Task,
    batch: RolloutBatch,
    advantages: torch.Tensor,
    *,
    train: TrainConfig,
    step: int,
    own: torch.Tensor | None = None,
    peer_scale: torch.Tensor | None = None,
    withheld: int = 0,
) -> tuple[dict[str, float], int]:
    """The optimizer steps of one generation round: one on the whole batch by default, else
    `train.update_epochs` passes of `train.mini_batches` shuffled mini-batches. Advantages and
    ReCo's response weights come from the whole round (whole groups); the sampler log-probs stay
    the sampler's in every pass. Returns (`loss/*` metrics: means over the steps, maxima for
    *_max, minima for *_min, `train/optimizer_steps`, and `train/no_signal`: 1 when no
    advantage was non-zero, so no step was taken; the number of steps skipped as non-finite: the
    others still run). `own` and `peer_scale` are per sequence of `batch`, as in `update`; the
    m-th optimizer step of the round gets update_index m. `withheld`: the round's withheld
    failures (success-gated sharing), counted in every step's N pro rata of its mini-batch."""
    if not bool((advantages != 0).any()):
        # No usable group (every group skipped, or all rewards equal in each): the gradient is
        # exactly 0, yet an optimizer step would still move the weights (Adam's moments, weight
        # decay) with no training signal. No step; the row says so (issue 22). The loss's
        # quantities were not computed, so the row leaves them out (issue 55); only the share of
        # sequences that would have trained, 0, is a measurement.
        log.warning("node %s step %d: no usable group; no optimizer step", node.name, step)
        return {"loss/active_frac": 0.0, "train/optimizer_steps": 0.0, "train/no_signal": 1.0}, 0
    loss_cfg = node.cfg.loss
    weights = response_weights(batch, loss_cfg, group_size=train.group_size)
    old, gap = own_ratio_reference(node, task, batch, own=own, train=train)
    if gap is not None:
        weights = gap if weights is None else weights * gap
    plan = round_plan(
        batch.num_sequences,
        epochs=train.update_epochs,
        mini_batches=train.mini_batches,
        seed=minibatch_seed(train.seed, step),
    )
    done: list[dict[str, float]] = []
    skipped = 0
    for m, idx in enumerate(plan):
        part, part_adv, part_w, part_own, part_scale = batch, advantages, weights, own, peer_scale
        part_old = old
        if idx is not None:
            part_old = None if old is None else old[idx]
            part, part_adv = batch.select(idx), advantages[idx]
            part_w = None if weights is None else weights[idx]
            part_own = None if own is None else own[idx]
            part_scale = None if peer_scale is None else peer_scale[idx]
        try:
            done.append(
                update(
                    node,
                    task,
                    part,
                    part_adv,
                    loss_cfg=loss_cfg,
                    micro_batch_size=train.micro_batch_size,
                    temperature=train.temperature,
                    sequence_weights=part_w,
                    group_size=train.group_size,
                    own=part_own,
                    peer_scale=part_scale,
                    update_index=m,
                    withheld=withheld * part.num_sequences / batch.num_sequences,
                    old_logprobs=part_old,
                )
            )
        except NonFiniteError as e:
            log.warning("node %s step %d: update skipped: %s", node.name, step, e)
            skipped += 1
    out = {f"loss/{k}": v for k, v in mean_step_metrics(done).items()}
    if "loss/sampler_mismatch_k3" in out:  # a property of the rollout, not of the loss
        out["rollout/mismatch_k3"] = out.pop("loss/sampler_mismatch_k3")
    out["train/optimizer_steps"] = float(len(done))
    out["train/no_signal"] = 0.0
    return out, skipped
