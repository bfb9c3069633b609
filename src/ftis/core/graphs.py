"""Communication graphs for gossip (docs/math.md, "DPO and gossip mixing"): named topologies
built with networkx, turned into the 0/1 adjacency that `ftis.core.mixing` consumes.

    path            0 - 1 - ... - (n-1)
    ring            a path closed into a cycle (n >= 3; n = 2 is the single edge)
    star            agent 0 in the middle, every other agent a leaf
    complete        every pair
    random-regular  every agent has `degree` neighbours, drawn from `seed` (the first connected
                    draw of seed, seed + 1, ...: a random regular graph need not be connected)
    edges           any undirected graph given as a list of (i, j) agent-index pairs

Agents are the integers 0..n-1 (their ranks). Every graph must be connected: gossip cannot bring
agents in different components to consensus. Pure: no I/O, no config objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import networkx as nx
import torch
from torch import Tensor

TOPOLOGIES = ("path", "ring", "star", "complete", "random-regular", "edges")
_RANDOM_REGULAR_TRIES = 100


def build_graph(
    topology: str,
    n: int,
    *,
    degree: int | None = None,
    seed: int = 0,
    edges: Iterable[Sequence[int]] | None = None,
) -> nx.Graph:
    """The undirected graph on agents 0..n-1 that `topology` names; ValueError (saying how to
    fix it) when it cannot be built or is not connected."""
    if n < 1:
        raise ValueError(f"a graph needs at least one agent, got n={n}")
    if topology == "path":
        g = nx.path_graph(n)
    elif topology == "ring":
        g = nx.cycle_graph(n) if n >= 3 else nx.path_graph(n)
    elif topology == "star":
        g = nx.star_graph(n - 1)  # networkx counts the leaves: star_graph(k) has k + 1 nodes
    elif topology == "complete":
        g = nx.complete_graph(n)
    elif topology == "random-regular":
        g = _random_regular(n, degree, seed)
    elif topology == "edges":
        g = _from_edges(n, edges)
    else:
        raise ValueError(f"unknown topology {topology!r}; choose one of: {', '.join(TOPOLOGIES)}")
    if n > 1 and not nx.is_connected(g):
        parts = [sorted(c) for c in nx.connected_components(g)]
        raise ValueError(
            f"the {topology} graph is not connected (components {parts}); gossip cannot reach "
            "consensus across components: add edges that join them"
        )
    return g


def _random_regular(n: int, degree: int | None, seed: int) -> nx.Graph:
    if degree is None:
        raise ValueError("topology random-regular needs a degree")
    if not 1 <= degree < n or (n * degree) % 2:
        raise ValueError(
            f"no {degree}-regular graph on {n} agents: the degree must lie in [1, {n - 1}] and "
            "n * degree must be even"
        )
    for k in range(_RANDOM_REGULAR_TRIES):
        g = nx.random_regular_graph(degree, n, seed=seed + k)
        if nx.is_connected(g):
            return g
    raise ValueError(
        f"no connected {degree}-regular graph on {n} agents in {_RANDOM_REGULAR_TRIES} draws "
        f"from seed {seed}; raise the degree"
    )


def _from_edges(n: int, edges: Iterable[Sequence[int]] | None) -> nx.Graph:
    if edges is None:
        raise ValueError("topology edges needs an edge list, e.g. [[0, 1], [1, 2]]")
    g = nx.Graph()
    g.add_nodes_from(range(n))
    for e in edges:
        if len(e) != 2:
            raise ValueError(f"an edge joins two agents, got {list(e)!r}")
        i, j = int(e[0]), int(e[1])
        if not (0 <= i < n and 0 <= j < n):
            raise ValueError(f"edge ({i}, {j}) names an agent outside 0..{n - 1}")
        if i == j:
            raise ValueError(f"edge ({i}, {j}) is a self-loop; an agent always keeps its own share")
        g.add_edge(i, j)
    return g


def adjacency(graph: nx.Graph, n: int | None = None) -> Tensor:
    """(n, n) float64 symmetric 0/1 adjacency with zero diagonal, rows in agent order 0..n-1."""
    n = graph.number_of_nodes() if n is None else n
    a = torch.zeros((n, n), dtype=torch.float64)
    for i, j in graph.edges():
        if i != j:
            a[i, j] = a[j, i] = 1.0
    return a


def neighbours(adj: Tensor, i: int) -> list[int]:
    """Agent i's neighbours in increasing order."""
    return [int(j) for j in torch.nonzero(torch.as_tensor(adj)[i]).flatten().tolist()]
