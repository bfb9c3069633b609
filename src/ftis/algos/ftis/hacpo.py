"""HACPO's bookkeeping for one learner (docs/math.md §12; shared/spec/hacpo.md): the capability
of every agent (mechanism 1) and, from it, a step's capability-aware advantages (mechanism 2)
and discrepancy coefficients (mechanism 3). The loss (mechanism 4) is ftis.core.losses'
``hacpo`` method.

**ftis:** the learner computes every agent's success rate itself, from the rewards its own
verifier gives that agent's completions at the step, instead of trusting a rate the agent
reports in its payload. With one task the two are the same number; a peer cannot inflate its
capability (and so the weight of its samples) by lying about it, and nothing extra travels.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from ftis.core.hacpo import capability_weights, discrepancy, hacpo_advantages, max_reward_of
from ftis.rollout.types import RolloutBatch


class Capabilities:
    """P_j: each agent's mean success rate (reward > 0) over its last `window` training steps
    (the steps so far, before `window` of them), keyed by the agent's rank.

    In a swarm, where peers come and go, `forget(step)` drops every agent not recorded in the
    last `window` steps: a peer that left (or lags beyond the window) starts from nothing when it
    is back, instead of being weighted by what it could do long ago."""

    def __init__(self, window: int = 5) -> None:
        self.window = window
        self.history: dict[int, deque[float]] = {}
        self.last_seen: dict[int, int] = {}  # rank -> the last step it was recorded at

    def record(
        self,
        batch: RolloutBatch,
        rewards: torch.Tensor,
        withheld: dict[int, int] | None = None,
        *,
        step: int | None = None,
    ) -> None:
        """Add this step's success rate of every agent that has completions in `batch` (or, under
        success-gated sharing, withheld ones: `withheld[j]` completions agent j answered but did
        not send, each a failure, so its rate is what it sent over what it answered)."""
        withheld = withheld or {}
        for j in sorted(set(batch.generator.tolist()) | {j for j, c in withheld.items() if c}):
            mine = rewards[batch.generator == j]
            answered = mine.numel() + withheld.get(j, 0)
            rate = float((mine > 0).sum()) / answered
            self.history.setdefault(j, deque(maxlen=self.window)).append(rate)
            if step is not None:
                self.last_seen[j] = step

    def forget(self, step: int) -> list[int]:
        """Drop the agents last recorded more than `window` steps before `step`; their ranks."""
        gone = [j for j, s in self.last_seen.items() if step - s > self.window]
        for j in gone:
            self.history.pop(j, None)
            del self.last_seen[j]
        return gone

    def get(self, rank: int) -> float:
        h = self.history.get(rank)
        return sum(h) / len(h) if h else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "history": {j: list(h) for j, h in self.history.items()},
            "last_seen": dict(self.last_seen),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = {
            int(j): deque(h, maxlen=self.window) for j, h in state.get("history", {}).items()
        }
        self.last_seen = {int(j): int(s) for j, s in state.get("last_seen", {}).items()}


def hacpo_max_reward(loss: Any, task: Any) -> float:
    """The largest reward of a node's task, HACPO's `max_reward`: `loss.hacpo_max_reward` when
    set, else the sum of the positive weights of the configured reward terms (each function
    taken to score in [0, 1]: `ftis.core.hacpo.max_reward_of`), else 1 (a built-in verifier)."""
    if loss.hacpo_max_reward is not None:
        return float(loss.hacpo_max_reward)
    reward_fn = getattr(task, "reward_fn", None)
    if reward_fn is None:
        return 1.0
    return max_reward_of(t.weight for t in reward_fn.terms)


def joint_advantages(
    batch: RolloutBatch,
    rewards: torch.Tensor,
    caps: Capabilities,
    *,
    learner: int,
    max_reward: float = 1.0,
    names: dict[int, str] | None = None,
    withheld: dict[tuple[int, int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(N,) capability-aware advantages, (N,) discrepancy coefficients (1 on own sequences) and
    metrics, for a batch of joint groups (one per prompt) and the learner of rank `learner`.

    With n >= 3 agents nothing changes in the formulas: the capability weight w(k, j), the
    discrepancy omega(j, k) and the stepwise clip are each per (learner, peer) pair, and the
    baseline averages over the n x G rewards of the group. Per pair the metrics add
    `hacpo/capability/<peer>`, `hacpo/weight/<peer>` (w(k, j), the peer's rewards' weight in
    the learner's baseline) and `hacpo/discrepancy/<peer>` (omega(j, k), the peer's samples'
    scale in the loss), `<peer>` the peer's name in `names` (rank -> name), else its rank.

    A group's agents are those with completions for its prompt; an agent whose count differs
    from the learner's own in that group (a short or lost share) is left out of the group
    (advantage 0, counted as ``hacpo/irregular_sequences``): the joint group is (n, G).
    `withheld[(prompt, j)]`: completions agent j answered for the prompt but did not send
    (success-gated sharing: its failures); they fill j's row of the group at reward 0, so the
    baseline and the std are those of the full (n, G) group (docs/math.md §17).
    """
    adv = torch.zeros(batch.num_sequences, dtype=torch.float32)
    omega = torch.ones(batch.num_sequences, dtype=torch.float32)
    irregular = 0
    withheld = withheld or {}
    prompts = set(batch.prompt_index.tolist()) | {p for (p, _), c in withheld.items() if c}
    for prompt in sorted(prompts):
        in_group = batch.prompt_index == prompt
        agents = set(batch.generator[in_group].tolist())
        agents |= {j for (p, j), c in withheld.items() if p == prompt and c}
        agents = sorted(agents)
        if learner not in agents:
            irregular += int(in_group.sum())
            continue
        rows = {j: torch.nonzero(in_group & (batch.generator == j)).flatten() for j in agents}
        size = rows[learner].numel()
        answered = {j: rows[j].numel() + withheld.get((prompt, j), 0) for j in agents}
        kept = [j for j in agents if answered[j] == size]
        irregular += sum(rows[j].numel() for j in agents if j not in kept)
        if size == 0:
            continue
        cap = torch.tensor([caps.get(j) for j in kept], dtype=torch.float32)
        k = kept.index(learner)
        group_rewards = torch.zeros(len(kept), size, dtype=torch.float32)
        for r, j in enumerate(kept):  # a withheld completion: a failure, reward 0
            group_rewards[r, : rows[j].numel()] = rewards[rows[j]].float()
        group_adv = hacpo_advantages(group_rewards, cap, k, max_reward=max_reward)
        group_omega = discrepancy(cap, k)
        for r, j in enumerate(kept):
            adv[rows[j]] = group_adv[r, : rows[j].numel()]
            omega[rows[j]] = group_omega[r]
    peers = batch.generator != learner
    # a peer that sent nothing (every completion withheld as a failure) is a peer all the same
    present = set(batch.generator.tolist()) | {j for (_, j), c in withheld.items() if c}
    peer_ranks = sorted(j for j in present if j != learner)
    metrics = {
        "hacpo/capability": caps.get(learner),
        "hacpo/irregular_sequences": float(irregular),
    }
    if peer_ranks:
        metrics["hacpo/peer_capability"] = sum(caps.get(j) for j in peer_ranks) / len(peer_ranks)
        metrics["hacpo/discrepancy"] = float(omega[peers].mean())
        everyone = [learner, *peer_ranks]
        cap = torch.tensor([caps.get(j) for j in everyone], dtype=torch.float32)
        w, om = capability_weights(cap, 0), discrepancy(cap, 0)
        for i, j in enumerate(peer_ranks, start=1):
            peer = (names or {}).get(j, str(j))
            metrics[f"hacpo/capability/{peer}"] = float(cap[i])
            metrics[f"hacpo/weight/{peer}"] = float(w[i])
            metrics[f"hacpo/discrepancy/{peer}"] = float(om[i])
    return adv, omega, metrics
