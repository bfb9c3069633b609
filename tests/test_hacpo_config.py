"""HACPO / shaping configs that cannot work are refused with one clear error; the joint
scheme's sample slots and HACPO's per-learner bookkeeping."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from ftis.algos.ftis import sharing
from ftis.algos.ftis.hacpo import Capabilities, joint_advantages
from ftis.config import RunConfig
from ftis.rollout.types import RolloutBatch


def _cfg(method="hacpo", scheme="joint", nodes=2, **loss):
    return {
        "nodes": [
            {"name": f"n{i}", "model": {"preset": "llama-xs"}, "loss": {"method": method, **loss}}
            for i in range(nodes)
        ],
        "sharing": {"scheme": scheme},
    }


def test_hacpo_without_joint_groups_is_refused_naming_the_fix():
    with pytest.raises(ValidationError, match="set sharing.scheme: joint"):
        RunConfig.model_validate(_cfg(scheme="vertical"))
    with pytest.raises(ValidationError, match="use loss.method gspo"):
        RunConfig.model_validate(_cfg(nodes=1))
    RunConfig.model_validate(_cfg())  # the working config


@pytest.mark.parametrize("gamma", [0.0, -0.1])
def test_shaping_gamma_must_be_positive(gamma):
    with pytest.raises(ValidationError, match="shaping_gamma must be > 0"):
        RunConfig.model_validate(_cfg(method="f-tis", scheme="vertical", shaping_gamma=gamma))


def test_shaping_is_refused_on_sequence_methods():
    with pytest.raises(ValidationError, match="token-level methods"):
        RunConfig.model_validate(_cfg(method="gspo", scheme="vertical", shaping_gamma=0.1))


def test_joint_scheme_gives_every_node_g_slots_of_every_prompt():
    idx = [5, 2, 7]
    assert sharing.assign_prompts(idx, rank=1, world_size=2, scheme="joint") == idx
    assert sharing.sample_slots(rank=0, world_size=2, scheme="joint", group_size=4) == (0, 4)
    assert sharing.sample_slots(rank=1, world_size=2, scheme="joint", group_size=4) == (4, 4)
    quota = sharing.peer_prompt_quota(idx, peer=1, world_size=2, scheme="joint", group_size=4)
    assert quota == {5: 4, 2: 4, 7: 4}


def _batch(prompt, gen):
    n = len(prompt)
    return RolloutBatch(
        prompt_index=torch.tensor(prompt),
        generator=torch.tensor(gen),
        completion_ids=torch.ones(n, 1, dtype=torch.long),
        lengths=torch.ones(n, dtype=torch.long),
        sampler_logprobs=torch.zeros(n, 1),
    )


def test_capability_is_a_moving_average_over_the_window():
    caps = Capabilities(window=2)
    b = _batch([0, 0, 0, 0], [0, 0, 1, 1])
    caps.record(b, torch.tensor([1.0, 0.0, 1.0, 1.0]))  # rates: agent 0 0.5, agent 1 1.0
    caps.record(b, torch.tensor([0.0, 0.0, 0.0, 1.0]))  # 0.0, 0.5
    caps.record(b, torch.tensor([1.0, 1.0, 0.0, 0.0]))  # 1.0, 0.0
    assert caps.get(0) == pytest.approx((0.0 + 1.0) / 2)  # the last 2 steps only
    assert caps.get(1) == pytest.approx((0.5 + 0.0) / 2)
    assert caps.get(9) == 0.0
    again = Capabilities(window=2)
    again.load_state_dict(caps.state_dict())
    assert again.get(0) == caps.get(0) and again.get(1) == caps.get(1)


def test_joint_advantages_per_prompt_with_discrepancy_and_an_irregular_share():
    # prompt 3: learner 0's two completions rewards [1, 0], peer 1's [1, 1];
    # capabilities after recording this step: P_0 = 1/2... computed over the whole batch:
    # agent 0: rewards [1, 0, 0, 0] -> 0.25; agent 1: [1, 1, 1] -> 1.0
    # prompt 3: w = [1, clip(0.25/1) = 0.25]; mu = (1 + 0 + 0.25 + 0.25)/4 = 0.375;
    # sigma = std([1,0,1,1]) = 0.5 (+1e-6): A = (r - 0.375)/0.500001
    # omega of peer 1 = clip(1.0/0.25) = 4.
    # prompt 8: learner has 2 completions, the peer only 1: the peer is left out (irregular),
    # and the learner's own group [0, 0] has equal rewards: A = 0.
    b = _batch([3, 3, 3, 3, 8, 8, 8], [0, 0, 1, 1, 0, 0, 1])
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    caps = Capabilities(window=5)
    caps.record(b, r)
    adv, omega, m = joint_advantages(b, r, caps, learner=0)
    expect = (torch.tensor([1.0, 0.0, 1.0, 1.0]) - 0.375) / 0.500001
    torch.testing.assert_close(adv[:4], expect)
    assert torch.equal(adv[4:], torch.zeros(3))
    torch.testing.assert_close(omega, torch.tensor([1.0, 1.0, 4.0, 4.0, 1.0, 1.0, 1.0]))
    assert m["hacpo/irregular_sequences"] == 1.0
    assert m["hacpo/capability"] == 0.25 and m["hacpo/peer_capability"] == 1.0


def test_joint_advantages_of_three_agents_log_each_pair():
    """Three agents on one prompt, G = 2: learner 0 ([1, 0]), peer 1 ([0, 0]), peer 2 ([1, 1]):
    capabilities 0.5, 0, 1. Per pair: w(0, 1) = clip(0.5 / 1e-8) = 10 (the clip's top),
    w(0, 2) = 0.5; omega(1, 0) = clip(0 / 0.5) = 0.1 (the bottom), omega(2, 0) = 2.
    mu = (1 + 0 + 0 + 0 + 0.5 + 0.5) / 6 = 1/3; sigma = sqrt(0.3) + 1e-6."""
    b = _batch([5] * 6, [0, 0, 1, 1, 2, 2])
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    caps = Capabilities(window=5)
    caps.record(b, r)
    adv, omega, m = joint_advantages(b, r, caps, learner=0, names={1: "sub", 2: "mul"})
    torch.testing.assert_close(adv, (r - 1 / 3) / (math.sqrt(0.3) + 1e-6))
    torch.testing.assert_close(omega, torch.tensor([1.0, 1.0, 0.1, 0.1, 2.0, 2.0]))
    assert m["hacpo/capability/sub"] == 0.0 and m["hacpo/capability/mul"] == 1.0
    assert m["hacpo/weight/sub"] == pytest.approx(10.0)
    assert m["hacpo/weight/mul"] == pytest.approx(0.5)
    assert m["hacpo/discrepancy/sub"] == pytest.approx(0.1)
    assert m["hacpo/discrepancy/mul"] == pytest.approx(2.0)
    assert m["hacpo/peer_capability"] == pytest.approx(0.5)  # the mean over both peers


def test_hacpo_in_a_swarm_is_accepted():
    data = _cfg()
    data["algorithm"] = {"kind": "swarm", "backend": "sim"}
    assert RunConfig.model_validate(data).algorithm.max_staleness == 4


def test_the_learner_passes_the_rewards_largest_value_to_hacpo():
    """The max_reward HACPO's baseline fallback uses: the configured value, else the sum of
    the positive reward weights (1.5 for 1 x correct + 0.5 x format), else 1."""
    from types import SimpleNamespace

    from ftis.algos.ftis.hacpo import hacpo_max_reward

    terms = [SimpleNamespace(weight=1.0), SimpleNamespace(weight=0.5), SimpleNamespace(weight=-2)]
    task = SimpleNamespace(reward_fn=SimpleNamespace(terms=terms))
    assert hacpo_max_reward(SimpleNamespace(hacpo_max_reward=None), task) == 1.5
    assert hacpo_max_reward(SimpleNamespace(hacpo_max_reward=4.0), task) == 4.0
    assert hacpo_max_reward(SimpleNamespace(hacpo_max_reward=None), SimpleNamespace()) == 1.0
