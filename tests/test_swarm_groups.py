"""The swarm's advantage groups (docs/swarm.md, "Advantage groups"): one peer's completions of a
prompt by default, every peer's as an option; and a peer's sampler log-probs reach the loss.

Phase-level: crafted rollout batches and a llama-xs node built in-process; no transport."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ftis.algos.base import NodeContext
from ftis.algos.ftis.algorithm import FTISAlgorithm
from ftis.algos.swarm.config import SwarmConfig
from ftis.config import LossConfig, RunConfig
from ftis.exchange.transport import LocalTransport
from ftis.rollout.types import RolloutBatch
from ftis.tasks import ArithmeticTaskConfig, build_task
from ftis.train import sampling, scoring
from ftis.train.timing import PhaseTimer
from tests.conftest import tiny_node, tiny_run_config

TASK = build_task(ArithmeticTaskConfig(ops={"+": 1.0}))


def _crafted(prompt: list[int], generator: list[int]) -> RolloutBatch:
    n = len(prompt)
    return RolloutBatch(
        prompt_index=torch.tensor(prompt),
        generator=torch.tensor(generator),
        completion_ids=torch.zeros((n, 2), dtype=torch.long),
        lengths=torch.ones(n, dtype=torch.long),
        sampler_logprobs=torch.zeros((n, 2)),
    )


def test_group_ids_and_advantages_by_hand():
    """Prompt 5: peer 0 sampled rewards (1, 0), peer 1 (1, 1); prompt 9: peer 0 (0, 1).
    generator: groups {0,1}, {2,3}, {4,5}: peer 0 on prompt 5 -> +-0.5 / (std 0.7071 + 1e-4),
    peer 1's all-equal group -> 0, prompt 9 -> -+0.5 / (0.7071 + 1e-4).
    prompt: prompt 5's four share mean 0.75, std 0.5 -> (0.25, -0.75, 0.25, 0.25) / 0.5001."""
    batch = _crafted([5, 5, 5, 5, 9, 9], [0, 0, 1, 1, 0, 0])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    ids = scoring.group_ids(batch, "generator").tolist()
    assert ids[0] == ids[1] != ids[2] == ids[3] != ids[4] == ids[5] and ids[0] != ids[4]
    assert scoring.group_ids(batch, "prompt").tolist() == [5, 5, 5, 5, 9, 9]
    s = math.sqrt(0.5) + 1e-4
    per_generator = scoring.advantages_for(batch, rewards, "std", by="generator")
    torch.testing.assert_close(
        per_generator,
        torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0, -0.5 / s, 0.5 / s]),
        atol=1e-6,
        rtol=0,
    )
    mixed = scoring.advantages_for(batch, rewards, "std", by="prompt")
    t = 0.5 + 1e-4
    torch.testing.assert_close(
        mixed,
        torch.tensor([0.25 / t, -0.75 / t, 0.25 / t, 0.25 / t, -0.5 / s, 0.5 / s]),
        atol=1e-6,
        rtol=0,
    )
    # a single completion of one generator is a lonely group per generator, not per prompt
    lone = _crafted([5, 5, 5], [0, 0, 1])
    assert scoring.lonely_groups(lone, by="generator").tolist() == [False, False, True]
    assert scoring.lonely_groups(lone, by="prompt").tolist() == [False, False, False]
    with pytest.raises(ValueError, match="grouping"):
        scoring.group_ids(batch, "peer")


def test_per_generator_groups_are_the_swarms_default():
    assert SwarmConfig().groups == "generator"
    assert SwarmConfig(groups="prompt").groups == "prompt"


def _algorithm(method: str):
    node = tiny_node(method, lr=1e-2)
    node.cfg = node.cfg.model_copy(update={"loss": LossConfig(method=method)})
    data = tiny_run_config()
    data["nodes"][0]["loss"] = node.cfg.loss.model_dump()
    cfg = RunConfig.model_validate(data)
    ctx = NodeContext(cfg, 0, node, TASK, LocalTransport(), PhaseTimer(), first_step=1)
    return FTISAlgorithm(ctx)


def _learn(algo: FTISAlgorithm, received, own, groups: str, monkeypatch):
    """learn() with rewards fixed by position; returns (advantages, the model's weights after)."""
    n = sum(b.num_sequences for b in received)
    rewards = torch.tensor([float(i % 3 == 0) for i in range(n)])
    monkeypatch.setattr(scoring, "score", lambda task, tok, batch: rewards.clone())
    seen = {}
    real = algo._update

    def capture(batch, adv, step, **kw):
        seen["adv"] = adv.clone()
        return real(batch, adv, step, **kw)

    algo._update = capture
    algo.learn(received, own, 1, groups=groups)
    return seen["adv"], [p.detach().clone() for p in algo.node.model.parameters()]


def test_learn_groups_and_a_peers_sampler_logprobs_reach_the_loss(monkeypatch):
    """Two generators answering the same 2 prompts x 4 completions. Per-generator and mixed
    groups give different advantages (so the option changes training); and shifting only the
    peer's sampler log-probs changes the TIS update (they reach the loss)."""
    torch.manual_seed(0)
    base = _algorithm("tis")
    problems = [TASK.split("train")[i] for i in range(2)]
    from ftis.config import TrainConfig

    tc = TrainConfig(max_new_tokens=4, group_size=4)
    own = sampling.generate(base.node, TASK, problems, slots=(0, 4), cfg=tc, step=1)
    peer = sampling.generate(base.node, TASK, problems, slots=(0, 4), cfg=tc, step=2)
    peer.generator = torch.ones_like(peer.generator)
    start = copy.deepcopy(base.node.model.state_dict())

    def run(groups, shift):
        algo = _algorithm("tis")
        algo.node.model.load_state_dict(start)
        p = copy.deepcopy(peer)
        p.sampler_logprobs = p.sampler_logprobs - shift * p.mask
        return _learn(algo, [own, p], own, groups, monkeypatch)

    adv_gen, after_gen = run("generator", 0.0)
    adv_mix, _ = run("prompt", 0.0)
    assert not torch.allclose(adv_gen, adv_mix, atol=1e-3)
    _, after_shifted = run("generator", 0.5)
    assert any(not torch.equal(a, b) for a, b in zip(after_gen, after_shifted, strict=True))
