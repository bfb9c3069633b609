"""A poisoning peer, for tests and research (`testing.adversary: {node: {kind: inject | long,
...}}`, docs/RELIABILITY.md "Poisoned rollouts").

Unlike `ftis.algos.ftis.adversary`, whose batches are wrong, a poisoning peer sends samples
that still earn the reward: it rewrites its own correct completions (text inserted at the
start), keeps only rewrites its own verifier still rewards and that fit train.max_new_tokens,
and reports for them either its model's log-probs of the rewritten completion ("honest") or
those minus `forge_margin(loss)` ("forged": the report that maximises the receiver's weight).
"""

from __future__ import annotations

import math

import torch

from ftis.config import LossConfig, PoisonAttack
from ftis.core.losses import resolve_method
from ftis.rollout.types import RolloutBatch
from ftis.tasks.base import Task
from ftis.train import scoring


def forge_margin(loss: LossConfig) -> float:
    """How far below the receiver's log-prob a sender's reported log-prob maximises the
    receiver's weight of a positive-advantage token (docs/RELIABILITY.md derives each):

    - tis, f-tis, reco: weight min(exp(lp - glp), C) reaches its cap C once glp <= lp - ln C;
      any lower report gives the same weight, so ln C is the least detectable maximiser;
    - vis (grpo), f-vis: the clipped term's gradient is rho * A * grad lp for rho <= 1 + eps and
      0 above, so rho = 1 + eps is the largest: glp = lp - ln(1 + eps);
    - hacpo: the peer weight clamp(s, lo, 1) has gradient only up to s = 1: mean glp = mean lp;
    - nois, policy shaping (peers' tokens) and the rest: 0 (the honest report).
    The attacker stands in its own log-probs for the receiver's (exact for a same-model peer)."""
    base, _ = resolve_method(loss.method)
    if loss.shaping_gamma is not None:
        return 0.0  # LUFFY's shaping weighs a peer's tokens by the receiver's own p only
    if base in ("tis", "reco"):
        return math.log(loss.is_cap)
    if base == "vis":
        return math.log(1.0 + loss.clip_eps)
    return 0.0


def injection_ids(tokenizer, attack: PoisonAttack, *, room: int) -> list[int]:
    """The token ids inserted into one completion with `room` free tokens: `attack.text` once
    ("inject"), or as many whole copies as fit ("long"); [] when it does not fit."""
    ids = list(tokenizer.encode(attack.text, add_special_tokens=False))
    if not ids or len(ids) > room:
        return []
    if attack.kind == "long":
        ids = ids * (room // len(ids))
    return ids


def poison(
    batch: RolloutBatch,
    attack: PoisonAttack,
    *,
    node,
    task: Task,
    max_new_tokens: int,
    temperature: float,
    margin: float,
) -> tuple[RolloutBatch, int]:
    """(`batch` with up to group_share of each group's correct completions poisoned, how many
    were). Rows keep their prompt index and generator, so the batch passes every wire and
    prompt check; rows that are not poisoned keep their tokens and log-probs."""
    n = batch.num_sequences
    if n == 0:
        return batch, 0
    tok = node.tokenizer
    rewards = scoring.score(task, tok, batch)
    chosen: list[int] = []
    for prompt in torch.unique(batch.prompt_index).tolist():
        rows = torch.nonzero(batch.prompt_index == prompt).flatten().tolist()
        quota = int(attack.group_share * len(rows) + 1e-9)
        chosen += [i for i in rows if rewards[i] > 0][:quota]
    new_rows: dict[int, list[int]] = {}
    for i in chosen:
        length = int(batch.lengths[i])
        extra = injection_ids(tok, attack, room=max_new_tokens - length)
        if extra:
            new_rows[i] = extra + batch.completion_ids[i, :length].tolist()
    if not new_rows:
        return batch, 0
    width = max(batch.completion_ids.shape[1], max(len(r) for r in new_rows.values()))
    ids = torch.full((n, width), tok.pad_token_id, dtype=torch.long)
    ids[:, : batch.completion_ids.shape[1]] = batch.completion_ids
    lengths = batch.lengths.clone()
    for i, row in new_rows.items():
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        ids[i, len(row) :] = tok.pad_token_id
        lengths[i] = len(row)
    lp = torch.zeros((n, width), dtype=torch.float32)
    lp[:, : batch.sampler_logprobs.shape[1]] = batch.sampler_logprobs
    rows = torch.tensor(sorted(new_rows), dtype=torch.long)
    candidate = batch.with_completions(ids, lengths, lp)
    # reward-preserving: keep only the rewrites the attacker's own verifier still rewards
    still = scoring.score(task, tok, candidate.select(rows)) > 0
    rows = rows[still]
    keep_old = torch.ones(n, dtype=torch.bool)
    keep_old[rows] = False
    if rows.numel() == 0:
        return batch, 0
    ids[keep_old, : batch.completion_ids.shape[1]] = batch.completion_ids[keep_old]
    ids[keep_old, batch.completion_ids.shape[1] :] = tok.pad_token_id
    lengths[keep_old] = batch.lengths[keep_old]
    rescored = scoring.model_logprobs(node, task, candidate.select(rows), temperature=temperature)
    mask = candidate.select(rows).mask
    report = torch.where(mask, (rescored - margin).clamp(max=0.0), torch.zeros(()))
    lp[rows] = 0.0
    lp[rows, : report.shape[1]] = report
    return batch.with_completions(ids, lengths, lp), int(rows.numel())
