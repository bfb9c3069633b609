"""DPO loss and gossip mixing: expected values derived by hand in each test."""

from __future__ import annotations

import math

import networkx as nx
import pytest
import torch

from ftis.core.dpo import dpo_loss
from ftis.core.mixing import consensus_error, metropolis_hastings, second_eigenvalue


def test_dpo_loss_by_hand():
    # pair 0: policy margin (pc - pr) = -1 - (-3) = 2, reference margin 0 - 0 = 0 -> m = 0.1 * 2
    # pair 1: policy margin -2 - (-1) = -1, reference margin -1 - 0 = -1 -> m = 0.1 * 0 = 0
    pc = torch.tensor([-1.0, -2.0], requires_grad=True)
    pr = torch.tensor([-3.0, -1.0], requires_grad=True)
    rc, rr = torch.tensor([0.0, -1.0]), torch.tensor([0.0, 0.0])
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.1)
    want = (math.log1p(math.exp(-0.2)) + math.log(2.0)) / 2
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert m["reward_margin"].item() == pytest.approx(0.1, abs=1e-7)  # (0.2 + 0) / 2
    assert m["accuracy"].item() == 0.5  # only pair 0 has margin > 0
    loss.backward()
    # d/dpc_b = -(1/B) * beta * sigmoid(-m_b); pr gets the opposite sign
    s0, s1 = 1 / (1 + math.exp(0.2)), 0.5
    torch.testing.assert_close(pc.grad, torch.tensor([-0.05 * s0, -0.05 * s1]))
    torch.testing.assert_close(pr.grad, -pc.grad)


def test_dpo_loss_is_finite_for_huge_margins_and_zero_for_no_pairs():
    big = torch.tensor([1e4, -1e4], requires_grad=True)
    loss, _ = dpo_loss(big, torch.zeros(2), torch.zeros(2), torch.zeros(2), beta=1.0)
    # softplus(-1e4) ~ 0 and softplus(1e4) = 1e4: mean 5e3, finite
    assert loss.item() == pytest.approx(5e3, rel=1e-6)
    empty = torch.zeros(0, requires_grad=True)
    loss, m = dpo_loss(empty, empty, empty, empty)
    assert loss.item() == 0.0 and m["accuracy"].item() == 0.0
    loss.backward()


def test_dpo_loss_rejects_bad_input():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="four"):
        dpo_loss(x, torch.zeros(2), x, x)


def test_metropolis_hastings_on_a_path_by_hand():
    # path 0 - 1 - 2: degrees 1, 2, 1. Edge weights 1 / (1 + 2) = 1/3.
    a = torch.tensor(nx.to_numpy_array(nx.path_graph(3)))
    w = metropolis_hastings(a)
    third = 1 / 3
    want = torch.tensor(
        [[2 * third, third, 0.0], [third, third, third], [0.0, third, 2 * third]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(w, want)
    # eigenvalues of this W: 1, 2/3 - ... ; by hand: W = I - L/3 with the path Laplacian L,
    # whose eigenvalues are 0, 1, 3 -> W has 1, 2/3, 0 -> rho = 2/3
    assert second_eigenvalue(w) == pytest.approx(2 / 3, abs=1e-12)


def test_complete_graph_mixes_in_one_step_and_rows_sum_to_one():
    n = 4
    w = metropolis_hastings(torch.tensor(nx.to_numpy_array(nx.complete_graph(n))))
    # every degree is 3: edge weights 1/4, self weight 1 - 3/4 = 1/4 -> W = J / n, rho = 0
    torch.testing.assert_close(w, torch.full((n, n), 0.25, dtype=torch.float64))
    assert second_eigenvalue(w) == pytest.approx(0.0, abs=1e-12)
    ring = metropolis_hastings(torch.tensor(nx.to_numpy_array(nx.cycle_graph(6))))
    torch.testing.assert_close(ring.sum(1), torch.ones(6, dtype=torch.float64))
    torch.testing.assert_close(ring, ring.T)
    # ring of 6: W = I/3 + (shift + shift^-1)/3, eigenvalues (1 + 2 cos(2 pi k / 6)) / 3:
    # k = 0: 1; k = 1: 2/3; k = 3: -1/3 -> rho = 2/3
    assert second_eigenvalue(ring) == pytest.approx(2 / 3, abs=1e-12)


def test_metropolis_hastings_rejects_what_is_not_an_undirected_simple_graph():
    with pytest.raises(ValueError, match="symmetric"):
        metropolis_hastings(torch.tensor([[0, 1], [0, 0]]))
    with pytest.raises(ValueError, match="diagonal"):
        metropolis_hastings(torch.tensor([[1, 1], [1, 0]]))
    with pytest.raises(ValueError, match="only 0 and 1"):
        metropolis_hastings(torch.tensor([[0, 2], [2, 0]]))
    with pytest.raises(ValueError, match="square"):
        metropolis_hastings(torch.zeros(2, 3))


def test_consensus_error_by_hand_and_mixing_shrinks_it():
    # agents at 0 and 2 (P = 1): mean 1, squared distances 1 and 1 -> error 1
    assert consensus_error(torch.tensor([[0.0], [2.0]])).item() == pytest.approx(1.0)
    theta = torch.tensor([[0.0, 1.0], [4.0, -1.0], [2.0, 3.0]], dtype=torch.float64)
    w = metropolis_hastings(torch.tensor(nx.to_numpy_array(nx.path_graph(3))))
    before, after = consensus_error(theta), consensus_error(w @ theta)
    # doubly stochastic W keeps the mean and contracts deviations by at most rho^2
    torch.testing.assert_close((w @ theta).mean(0), theta.mean(0))
    assert after <= second_eigenvalue(w) ** 2 * before + 1e-12
