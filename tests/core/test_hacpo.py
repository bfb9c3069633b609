"""GSPO, HACPO and LUFFY's policy shaping: values derived by hand in each test's comment."""

from __future__ import annotations

import math

import pytest
import torch

from ftis.core.hacpo import (
    capability_weights,
    discrepancy,
    gspo_ratio,
    gspo_term,
    hacpo_advantages,
    max_reward_of,
    peer_clip_lower,
    peer_term,
)
from ftis.core.losses import policy_loss
from ftis.core.shaping import luffy_weight


def test_gspo_ratio_is_length_normalised_over_own_tokens():
    # row 0: differences 0.5 and -1.0 over its 2 real tokens -> mean -0.25 -> exp(-0.25);
    # the masked third position holds NaN and must be ignored.
    # row 1: one token, difference +0.2 -> exp(0.2). row 2: empty -> ratio 1.
    lp = torch.tensor([[-1.0, -2.0, float("nan")], [-0.3, 0.0, 0.0], [0.0, 0.0, 0.0]])
    old = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    s = gspo_ratio(lp, old, mask)
    torch.testing.assert_close(
        s, torch.tensor([math.exp(-0.25), math.exp(0.2), 1.0]), rtol=1e-6, atol=0
    )


def test_gspo_term_clips_with_gspo_ranges():
    # s = 1.0002 inside [1 - 3e-4, 1 + 4e-4]: loss -s A = -1.0002, gradient -A = -1.
    # s = 1.001, A = 1: min(1.001, 1.0004) = 1.0004 (clipped): loss -1.0004, no gradient.
    # s = 0.99, A = -1: min(-0.99, -0.9997) = -0.9997 (clipped): loss 0.9997, no gradient.
    s = torch.tensor([1.0002, 1.001, 0.99], requires_grad=True)
    a = torch.tensor([1.0, 1.0, -1.0])
    loss = gspo_term(s, a)
    torch.testing.assert_close(loss.detach(), torch.tensor([-1.0002, -1.0004, 0.9997]))
    loss.sum().backward()
    torch.testing.assert_close(s.grad, torch.tensor([-1.0, 0.0, 0.0]))


def test_capability_weights_and_discrepancy():
    p = torch.tensor([0.5, 0.25, 0.0])
    # w(0, j) = clip(P_0 / max(P_j, 1e-8), 0.1, 10): [1, 0.5/0.25 = 2, 0.5/1e-8 -> 10]
    torch.testing.assert_close(capability_weights(p, 0), torch.tensor([1.0, 2.0, 10.0]))
    # omega(j, 0) = clip(P_j / P_0, 0.1, 10): [1, 0.25/0.5 = 0.5, 0/0.5 = 0 -> 0.1]
    torch.testing.assert_close(discrepancy(p, 0), torch.tensor([1.0, 0.5, 0.1]))
    # learner 1: w = [0.25/0.5 = 0.5, 1, 10]; omega = [0.5/0.25 = 2, 1, 0 -> 0.1]
    torch.testing.assert_close(capability_weights(p, 1), torch.tensor([0.5, 1.0, 10.0]))
    torch.testing.assert_close(discrepancy(p, 1), torch.tensor([2.0, 1.0, 0.1]))


def test_hacpo_advantage_with_equal_capabilities_is_the_joint_groups_grpo():
    # rewards [[1, 0], [1, 1]]: mean 0.75; unbiased std: squares .0625 .5625 .0625 .0625 sum
    # .75, / 3 = .25 -> 0.5; A = (r - 0.75) / (0.5 + 1e-6) = [[.5, -1.5], [.5, .5]] / 1.000002
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    a = hacpo_advantages(r, torch.tensor([0.4, 0.4]), learner=0)
    torch.testing.assert_close(
        a, torch.tensor([[0.5, -1.5], [0.5, 0.5]]) / 1.000002, rtol=1e-6, atol=0
    )
    # the learner's index does not matter when capabilities are equal
    torch.testing.assert_close(a, hacpo_advantages(r, torch.tensor([0.4, 0.4]), learner=1))


def test_hacpo_advantage_weights_the_baseline_by_capability():
    # learner 0 with P = [0.25, 0.5]: w = [1, 0.5]; mu = (1 + 0 + 0.5 + 0.5) / 4 = 0.5;
    # sigma = 0.5 (as above) + 1e-6: A = (r - 0.5) / 0.500001 = [[1, -1], [1, 1]] / 1.000002
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    a = hacpo_advantages(r, torch.tensor([0.25, 0.5]), learner=0)
    torch.testing.assert_close(a, torch.tensor([[1.0, -1.0], [1.0, 1.0]]) / 1.000002)


def test_three_agents_by_hand():
    """n = 3 (issue 35): every formula is per (learner, peer) pair; only the group grows.
    P = (0.5, 0.25, 1.0). Learner 0: w(0, j) = P_0 / P_j = (1, 2, 0.5), omega(j, 0) = P_j / P_0
    = (1, 0.5, 2). Learner 1: w(1, j) = (0.5, 1, 0.25), omega(j, 1) = (2, 1, 4).
    Rewards (3 x 2) [[1, 0], [0, 0], [1, 1]]: sigma = std([1,0,0,0,1,1]) = sqrt(0.3) (unbiased:
    6 x 0.25 / 5). Learner 0: mu = (1 + 0 + 0 + 0 + 0.5 + 0.5) / 6 = 1/3; learner 1:
    mu = (0.5 + 0 + 0 + 0 + 0.25 + 0.25) / 6 = 1/6."""
    cap = torch.tensor([0.5, 0.25, 1.0])
    torch.testing.assert_close(capability_weights(cap, 0), torch.tensor([1.0, 2.0, 0.5]))
    torch.testing.assert_close(discrepancy(cap, 0), torch.tensor([1.0, 0.5, 2.0]))
    torch.testing.assert_close(capability_weights(cap, 1), torch.tensor([0.5, 1.0, 0.25]))
    torch.testing.assert_close(discrepancy(cap, 1), torch.tensor([2.0, 1.0, 4.0]))
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    sigma = math.sqrt(0.3) + 1e-6
    torch.testing.assert_close(hacpo_advantages(r, cap, 0), (r - 1 / 3) / sigma)
    torch.testing.assert_close(hacpo_advantages(r, cap, 1), (r - 1 / 6) / sigma)
    # learner 2 (P = 1, the strongest): w(2, j) = (2, 4, 1) clipped to [0.1, 10]: unchanged;
    # mu = (2 + 0 + 0 + 0 + 1 + 1) / 6 = 2/3
    torch.testing.assert_close(hacpo_advantages(r, cap, 2), (r - 2 / 3) / sigma)


def test_hacpo_baseline_falls_back_to_own_mean_above_max_reward():
    # learner 0 with P = [1.0, 0.1]: w = [1, 10]; rewards [[0, 1], [1, 1]]:
    # mu = (0 + 1 + 10 + 10) / 4 = 5.25 > 1 -> mu = mean of own row = 0.5; sigma = 0.5 + 1e-6
    r = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    a = hacpo_advantages(r, torch.tensor([1.0, 0.1]), learner=0)
    torch.testing.assert_close(a, torch.tensor([[-1.0, 1.0], [1.0, 1.0]]) / 1.000002)


def test_hacpo_advantage_of_equal_rewards_is_zero():
    r = torch.ones(3, 4)
    assert torch.equal(hacpo_advantages(r, torch.tensor([0.1, 0.5, 0.9]), 2), torch.zeros(3, 4))


def test_peer_clip_lower_rises_per_update_and_stops_at_one():
    assert peer_clip_lower(0) == 0.8
    assert peer_clip_lower(3) == pytest.approx(0.875)
    assert peer_clip_lower(10) == 1.0  # 0.8 + 0.25 > 1
    assert peer_clip_lower(2, lower=0.9, step=0.01) == pytest.approx(0.92)


def test_peer_term_value_gradient_and_window():
    # s = 0.9 in [0.8, 1]: value -c sg(c) omega A = -0.9 * 0.9 * 0.5 * 2 = -0.81,
    # d/ds = -sg(c) omega A = -0.9. s = 0.7 (below 0.8) and 1.2 (above 1) are clamped: no
    # gradient, values -0.8 * 0.8 * 1 and -1 * 1 * 1.
    s = torch.tensor([0.9, 0.7, 1.2], requires_grad=True)
    a = torch.tensor([2.0, 1.0, 1.0])
    omega = torch.tensor([0.5, 1.0, 1.0])
    loss = peer_term(s, a, omega, lower=0.8, alpha=1.0)
    torch.testing.assert_close(loss.detach(), torch.tensor([-0.81, -0.64, -1.0]))
    loss.sum().backward()
    torch.testing.assert_close(s.grad, torch.tensor([-0.9, 0.0, 0.0]))


def test_peer_term_alpha_is_a_stop_gradient_power():
    # alpha = 3, s = 0.9, A = omega = 1: value -0.9^4 = -0.6561, d/ds = -0.9^3 = -0.729
    s = torch.tensor([0.9], requires_grad=True)
    loss = peer_term(s, torch.ones(1), torch.ones(1), lower=0.8, alpha=3.0)
    torch.testing.assert_close(loss.detach(), torch.tensor([-0.6561]))
    loss.sum().backward()
    torch.testing.assert_close(s.grad, torch.tensor([-0.729]))


def test_luffy_weight_value_and_gradient_peak_at_gamma():
    # f(p) = p / (p + 0.1): f(0.1) = 0.5, f(0.3) = 0.75. d f / d log p = gamma p / (p + gamma)^2:
    # at p = 0.1: 0.01 / 0.04 = 0.25 (the peak); at p = 0.05 and 0.2: 0.005/0.0225 = 0.02/0.09
    # = 2/9.
    lp = torch.log(torch.tensor([0.1, 0.3, 0.05, 0.2])).requires_grad_(True)
    f = luffy_weight(lp, gamma=0.1)
    torch.testing.assert_close(f[:2].detach(), torch.tensor([0.5, 0.75]))
    f.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([0.25, 0.1875, 2 / 9, 2 / 9]))
    with pytest.raises(ValueError, match="gamma must be > 0"):
        luffy_weight(lp, gamma=0.0)


def test_policy_loss_hacpo_sums_own_gspo_and_peer_terms():
    # Two one-token sequences. Own: lp = glp -> s = 1, A = 1: GSPO term -1, gradient -1.
    # Peer: lp - glp = log 0.9 -> s = 0.9, A = 2, omega 0.5: term -0.81; d/dlp = s * d/ds
    # = 0.9 * -0.9 * 0.5 * 2 = -0.81. Loss = (-1 - 0.81) / N=2 = -0.905.
    lp = torch.tensor([[-1.0], [math.log(0.9) - 1.0]], requires_grad=True)
    glp = torch.tensor([[-1.0], [-1.0]])
    mask = torch.ones(2, 1, dtype=torch.bool)
    loss, m = policy_loss(
        lp,
        glp,
        torch.tensor([1.0, 2.0]),
        mask,
        method="hacpo",
        own=torch.tensor([True, False]),
        peer_scale=torch.tensor([1.0, 0.5]),
        peer_clip_lower=0.8,
    )
    torch.testing.assert_close(loss.detach(), torch.tensor(-0.905))
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5], [-0.405]]))
    assert float(m["peer_frac"]) == 0.5 and float(m["peer_clipped_frac"]) == 0.0


def test_policy_loss_hacpo_peer_outside_window_gives_no_gradient():
    # peer ratio exp(-0.5) = 0.61 < 0.8: clamped, no gradient; counted in peer_clipped_frac
    lp = torch.tensor([[-1.5]], requires_grad=True)
    loss, m = policy_loss(
        lp,
        torch.tensor([[-1.0]]),
        torch.tensor([1.0]),
        torch.ones(1, 1, dtype=torch.bool),
        method="hacpo",
        own=torch.tensor([False]),
    )
    loss.backward()
    assert float(lp.grad.abs().sum()) == 0.0
    assert float(m["peer_clipped_frac"]) == 1.0


def test_policy_loss_shaping_replaces_peer_token_term_only():
    # tis, two one-token sequences with A = 1. Own (lp = glp = log 0.5): -1 * exp(lp - sg lp) A,
    # value -1, gradient -1. Peer (p = 0.1, glp = log 0.9): shaped -p/(p + 0.1) = -0.5, gradient
    # -0.25. Loss = (-1 - 0.5) / 2 = -0.75; grads / 2.
    lp = torch.log(torch.tensor([[0.5], [0.1]])).requires_grad_(True)
    glp = torch.log(torch.tensor([[0.5], [0.9]]))
    loss, _ = policy_loss(
        lp,
        glp,
        torch.ones(2),
        torch.ones(2, 1, dtype=torch.bool),
        method="tis",
        own=torch.tensor([True, False]),
        shaping_gamma=0.1,
    )
    torch.testing.assert_close(loss.detach(), torch.tensor(-0.75))
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5], [-0.125]]))
    # without shaping, the peer token's TIS weight is p/q = 0.1/0.9: gradient -(1/9) / 2
    lp.grad = None
    loss, _ = policy_loss(
        lp,
        glp,
        torch.ones(2),
        torch.ones(2, 1, dtype=torch.bool),
        method="tis",
        own=torch.tensor([True, False]),
    )
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5], [-1 / 18]]))


def test_max_reward_of_a_weighted_reward_is_the_sum_of_its_positive_weights():
    assert max_reward_of([1.0]) == 1.0
    assert max_reward_of([1.0, 0.5, -0.2]) == 1.5  # a penalty term is at most 0
    assert max_reward_of([2.0], function_max=3.0) == 6.0
    with pytest.raises(ValueError, match="positive finite"):
        max_reward_of([-1.0, 0.0])


def test_hacpo_baseline_under_a_weighted_reward_keeps_its_range():
    # reward = 1 x correct + 0.5 x format: the largest reward is 1.5. Learner 0 with
    # P = [0.5, 0.25]: w = [1, 2]; rewards [[1.5, 0], [1.5, 0]]: mu = (1.5 + 0 + 3 + 0) / 4
    # = 1.125, inside [0, 1.5]: no fallback. sigma: mean .75, squares 4 x .5625 / 3 = .75 ->
    # sqrt(.75) + 1e-6. The fixed max_reward = 1 took mu for out of range and fell back to the
    # own mean 0.75 instead.
    r = torch.tensor([[1.5, 0.0], [1.5, 0.0]])
    cap = torch.tensor([0.5, 0.25])
    sigma = math.sqrt(0.75) + 1e-6
    a = hacpo_advantages(r, cap, 0, max_reward=max_reward_of([1.0, 0.5]))
    torch.testing.assert_close(a, (r - 1.125) / sigma)
    torch.testing.assert_close(hacpo_advantages(r, cap, 0), (r - 0.75) / sigma)


def test_loss_config_hacpo_max_reward_and_peer_dual_clip():
    from pydantic import ValidationError

    from ftis.config import LossConfig

    cfg = LossConfig(method="hacpo")
    assert cfg.hacpo_max_reward is None and cfg.peer_dual_clip == 3.0
    assert LossConfig(method="hacpo", hacpo_max_reward=1.5).hacpo_max_reward == 1.5
    assert LossConfig(method="vis", peer_dual_clip=math.inf).peer_dual_clip == math.inf
    for bad in ({"hacpo_max_reward": 0.0}, {"peer_dual_clip": 1.0}, {"peer_dual_clip": 0.5}):
        with pytest.raises(ValidationError):
            LossConfig(method="hacpo", **bad)


def test_hacpo_kl_applies_to_own_sequences_only():
    # loss.beta > 0 under hacpo: the k3 KL of the own rows, summed over them and divided by
    # the batch's N (peers' rows count in N and add 0), as in the paper (docs/math.md §12, §14).
    import copy

    from ftis.config import LossConfig, TrainConfig
    from ftis.core.kl import kl_penalty
    from ftis.models.logprobs import completion_logprobs
    from ftis.rollout.sampler import left_pad
    from ftis.tasks import ArithmeticTaskConfig, build_task
    from ftis.train import sampling
    from ftis.train import update as update_mod
    from tests.conftest import tiny_node

    task = build_task(ArithmeticTaskConfig(ops={"+": 1.0}))
    node = tiny_node("hacpo")
    node.ref_model = copy.deepcopy(node.model).eval().requires_grad_(False)
    problems = [task.split("train")[i] for i in range(2)]
    batch = sampling.generate(
        node, task, problems, slots=(0, 4), cfg=TrainConfig(max_new_tokens=5, group_size=4), step=1
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # move the model away from its reference
        for p in node.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    n = batch.num_sequences
    own = torch.arange(n) % 2 == 0
    adv = torch.linspace(-1, 1, n)
    loss_cfg = LossConfig(method="hacpo", beta=0.5)

    def run(own_rows, beta):
        nd = copy.deepcopy(node)
        nd.optimizer = torch.optim.SGD(nd.model.parameters(), lr=0.0)
        grads = {}
        step = nd.optimizer.step

        def capture():
            grads["g"] = torch.cat([p.grad.flatten() for p in nd.model.parameters()])
            step()

        nd.optimizer.step = capture
        cfg = loss_cfg.model_copy(update={"beta": beta})
        m = update_mod.update(nd, task, batch, adv, loss_cfg=cfg, micro_batch_size=3, own=own_rows)
        return m, grads["g"]

    train = task.split("train")
    prompts = [task.prompt_ids(train[i], node.tokenizer) for i in batch.prompt_index.tolist()]
    ids, pmask = left_pad(prompts, node.tokenizer.pad_token_id)
    kw = dict(
        prompt_ids=ids,
        prompt_mask=pmask,
        completion_ids=batch.completion_ids,
        completion_mask=batch.mask.long(),
    )
    with torch.no_grad():
        lp = completion_logprobs(node.model, **kw)
        ref = completion_logprobs(node.ref_model, **kw)
    own_kl = float(
        kl_penalty(lp, ref_logprobs=ref, mask=batch.mask & own[:, None], num_sequences=n)
    )
    all_kl = float(kl_penalty(lp, ref_logprobs=ref, mask=batch.mask, num_sequences=n))
    assert 1e-4 < own_kl < all_kl
    m, _ = run(own, 0.5)
    assert m["kl"] == pytest.approx(own_kl, rel=1e-4)
    # every row a peer's: the KL adds nothing, to the loss or to the gradient
    peers = torch.zeros(n, dtype=torch.bool)
    m, g_kl = run(peers, 0.5)
    m0, g0 = run(peers, 0.0)
    assert m["kl"] == 0.0
    assert m["loss"] == pytest.approx(m0["loss"], abs=1e-7)
    torch.testing.assert_close(g_kl, g0, atol=1e-7, rtol=1e-6)
