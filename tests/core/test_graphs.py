"""Gossip graphs and the agent-side mixing pieces: expected values derived by hand."""

from __future__ import annotations

import math

import pytest
import torch

from ftis.core.graphs import adjacency, build_graph, neighbours
from ftis.core.mixing import (
    consensus_error,
    drop_agents,
    metropolis_hastings,
    mix,
    pairwise_weight,
    second_eigenvalue,
    sketch,
    sketch_plan,
)


def _w(topology: str, n: int, **kw) -> torch.Tensor:
    return metropolis_hastings(adjacency(build_graph(topology, n, **kw), n))


def test_named_topologies_have_the_edges_by_hand():
    assert sorted(build_graph("path", 4).edges()) == [(0, 1), (1, 2), (2, 3)]
    assert sorted(build_graph("ring", 4).edges()) == [(0, 1), (0, 3), (1, 2), (2, 3)]
    assert sorted(build_graph("star", 4).edges()) == [(0, 1), (0, 2), (0, 3)]
    assert build_graph("complete", 4).number_of_edges() == 6  # 4 * 3 / 2
    assert sorted(build_graph("ring", 2).edges()) == [(0, 1)]  # a cycle needs 3 agents
    assert build_graph("complete", 1).number_of_nodes() == 1
    g = build_graph("edges", 3, edges=[[0, 1], [2, 1]])
    assert sorted(g.edges()) == [(0, 1), (1, 2)]
    assert neighbours(adjacency(g), 1) == [0, 2]


def test_star_and_ring_mixing_matrices_by_hand():
    # star of 4: centre degree 3, leaves 1 -> every edge 1/(1+3); centre keeps 1 - 3/4,
    # a leaf 1 - 1/4. Eigenvalues: 3/4 twice (leaf vectors summing to 0, centre 0), and on
    # span(centre, all leaves) the 2x2 [[1/4, 3/4], [1/4, 3/4]]: 1 and 0 -> rho = 3/4.
    w = _w("star", 4)
    want = torch.full((4, 4), 0.0, dtype=torch.float64)
    want[0, :] = want[:, 0] = 0.25
    for leaf in (1, 2, 3):
        want[leaf, leaf] = 0.75
    torch.testing.assert_close(w, want)
    assert second_eigenvalue(w) == pytest.approx(0.75, abs=1e-12)
    # ring of 4: W = I/3 + (S + S^-1)/3, eigenvalues (1 + 2 cos(2 pi k / 4)) / 3 = 1, 1/3, -1/3
    assert second_eigenvalue(_w("ring", 4)) == pytest.approx(1 / 3, abs=1e-12)
    # complete graph: W = J / n, one step reaches consensus
    assert second_eigenvalue(_w("complete", 5)) == pytest.approx(0.0, abs=1e-12)


def test_random_regular_is_regular_connected_and_reproducible():
    a = adjacency(build_graph("random-regular", 6, degree=3, seed=7), 6)
    assert a.sum(1).tolist() == [3.0] * 6
    torch.testing.assert_close(a, adjacency(build_graph("random-regular", 6, degree=3, seed=7)))
    # a 3-regular graph's MH weights are all 1/4 on edges, 1/4 kept
    w = metropolis_hastings(a)
    torch.testing.assert_close(w.diagonal(), torch.full((6,), 0.25, dtype=torch.float64))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"topology": "edges", "n": 3, "edges": [[0, 1]]}, "not connected"),
        ({"topology": "edges", "n": 3, "edges": [[0, 3], [1, 2]]}, "outside 0..2"),
        ({"topology": "edges", "n": 3, "edges": [[1, 1]]}, "self-loop"),
        ({"topology": "edges", "n": 3}, "edge list"),
        ({"topology": "random-regular", "n": 5, "degree": 3}, "even"),
        ({"topology": "random-regular", "n": 5}, "degree"),
        ({"topology": "hypercube", "n": 4}, "unknown topology"),
    ],
)
def test_bad_graphs_are_refused_with_a_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_graph(kwargs.pop("topology"), kwargs.pop("n"), **kwargs)


def test_dropping_an_agent_renormalises_over_the_remaining_graph():
    # ring of 4 without agent 2: the path 1 - 0 - 3. Degrees 0: 2, 1: 1, 3: 1, so the edges
    # get 1/(1+2) = 1/3, agent 0 keeps 1/3, agents 1 and 3 keep 2/3; agent 2 is alone (1).
    w = metropolis_hastings(drop_agents(adjacency(build_graph("ring", 4)), {2}))
    t = 1 / 3
    want = torch.tensor(
        [[t, t, 0, t], [t, 2 * t, 0, 0], [0, 0, 1, 0], [t, 0, 0, 2 * t]], dtype=torch.float64
    )
    torch.testing.assert_close(w, want)


def test_pairwise_weights_from_announced_degrees_rebuild_metropolis_hastings():
    """Each agent computes W[i, j] from its own degree and the one j announced: over any graph
    (here a random 3-regular graph of 8 and a star with an extra edge, minus a lost agent) the
    rows equal metropolis_hastings of the remaining graph."""
    graphs = [
        (adjacency(build_graph("random-regular", 8, degree=3, seed=1)), set()),
        (adjacency(build_graph("edges", 5, edges=[[0, 1], [0, 2], [0, 3], [0, 4], [3, 4]])), {1}),
    ]
    for a, lost in graphs:
        a = drop_agents(a, lost)
        deg = a.sum(1).long().tolist()
        w = torch.eye(a.shape[0], dtype=torch.float64)
        for i in range(a.shape[0]):
            for j in neighbours(a, i):
                w[i, j] = pairwise_weight(deg[i], deg[j])
            w[i, i] = 1 - sum(w[i, j] for j in neighbours(a, i))
        torch.testing.assert_close(w, metropolis_hastings(a))
    with pytest.raises(ValueError, match="degree"):
        pairwise_weight(0, 2)


def test_mix_by_hand_and_one_round_matches_w_theta():
    # own (0, 0), neighbours (3, 0) and (0, 6) with 1/3 each: self keeps 1/3 -> (1, 2)
    out = mix(torch.zeros(2), [torch.tensor([3.0, 0.0]), torch.tensor([0.0, 6.0])], [1 / 3, 1 / 3])
    torch.testing.assert_close(out, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="sum"):
        mix(torch.zeros(1), [torch.zeros(1), torch.zeros(1)], [0.6, 0.6])
    # every agent mixing on its own equals W @ theta, and the consensus error shrinks
    a = adjacency(build_graph("ring", 5))
    w = metropolis_hastings(a)
    theta = torch.arange(15, dtype=torch.float64).view(5, 3) ** 2
    rows = [
        mix(theta[i], [theta[j] for j in neighbours(a, i)], [w[i, j] for j in neighbours(a, i)])
        for i in range(5)
    ]
    torch.testing.assert_close(torch.stack(rows), w @ theta)
    assert consensus_error(torch.stack(rows)) < consensus_error(theta)


def test_sketch_is_linear_exact_on_one_coordinate_and_unbiased():
    p, k = 50, 16
    plan = sketch_plan(p, k, seed=3)
    # one nonzero coordinate lands in one bucket with sign +-1: ||S v||^2 = v_p^2 exactly
    v = torch.zeros(p)
    v[17] = -2.5
    assert float(sketch(v, plan, k).square().sum()) == pytest.approx(6.25)
    u = torch.randn(p, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        sketch(u + 2 * v, plan, k), sketch(u, plan, k) + 2 * sketch(v, plan, k)
    )
    assert torch.equal(plan[0], sketch_plan(p, k, seed=3)[0])  # every agent draws the same S
    # E ||S u||^2 = ||u||^2; Var <= 2 ||u||^4 / k, so the mean of 400 draws has a relative std
    # of at most sqrt(2 / 16) / 20 = 0.018: 5 of those is a tolerance that can still fail
    est = [float(sketch(u, sketch_plan(p, k, seed=s), k).square().sum()) for s in range(400)]
    assert sum(est) / len(est) == pytest.approx(
        float(u.square().sum()), rel=5 * math.sqrt(2 / k) / 20
    )
