"""Gossip averaging on a graph (docs/math.md, "DPO and gossip mixing"): Metropolis-Hastings
mixing weights, the spectral quantity that governs how fast agents reach consensus, and the
consensus error.

    W[i, j] = 1 / (1 + max(deg_i, deg_j))   for an edge (i, j)
    W[i, i] = 1 - sum_{j != i} W[i, j]
    W[i, j] = 0                              otherwise

W is symmetric and doubly stochastic for any undirected graph, so repeated mixing converges to
the average at a rate set by rho, the second-largest |eigenvalue| of W (spectral gap 1 - rho^2).
"""

from __future__ import annotations

import torch
from torch import Tensor


def metropolis_hastings(adjacency: Tensor) -> Tensor:
    """(n, n) float64 mixing matrix from a symmetric 0/1 adjacency with zero diagonal."""
    a = torch.as_tensor(adjacency, dtype=torch.float64)
    if a.dim() != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"adjacency must be a square matrix, got shape {tuple(a.shape)}")
    if not bool(((a == 0) | (a == 1)).all()):
        raise ValueError("adjacency must hold only 0 and 1")
    if not torch.equal(a, a.T):
        raise ValueError("adjacency must be symmetric (an undirected graph)")
    if bool(a.diagonal().any()):
        raise ValueError("adjacency must have a zero diagonal (no self-loops)")
    deg = a.sum(1)
    w = a / (1.0 + torch.maximum(deg[:, None], deg[None, :]))
    return w + torch.diag(1.0 - w.sum(1))


def second_eigenvalue(w: Tensor) -> float:
    """rho: the second-largest absolute eigenvalue of a symmetric mixing matrix (0 for n = 1)."""
    w = torch.as_tensor(w, dtype=torch.float64)
    if w.shape[0] < 2:
        return 0.0
    mags = torch.linalg.eigvalsh(w).abs().sort(descending=True).values
    return float(mags[1])


def consensus_error(params: Tensor) -> Tensor:
    """(1/n) sum_i ||theta_i - theta_bar||^2 for n agents' flattened parameters (n, P)."""
    p = torch.as_tensor(params)
    if p.dim() != 2:
        raise ValueError(f"params must be (n agents, P), got shape {tuple(p.shape)}")
    centered = p - p.mean(0, keepdim=True)
    return centered.square().sum(1).mean()


def drop_agents(adjacency: Tensor, lost: list[int] | set[int]) -> Tensor:
    """The adjacency of the remaining graph: every edge of a lost agent removed (it becomes an
    isolated vertex, whose Metropolis-Hastings row is its own 1). `metropolis_hastings` of the
    result renormalises the survivors' weights over the remaining graph."""
    a = torch.as_tensor(adjacency, dtype=torch.float64).clone()
    for k in lost:
        a[k, :] = 0.0
        a[:, k] = 0.0
    return a


def pairwise_weight(degree_i: int, degree_j: int) -> float:
    """W[i, j] = 1 / (1 + max(deg_i, deg_j)) for an edge: what agents i and j each compute from
    their own degree and the one the other announced, so both use the same weight."""
    if degree_i < 1 or degree_j < 1:
        raise ValueError(f"two neighbours have degree >= 1, got {degree_i} and {degree_j}")
    return 1.0 / (1.0 + max(degree_i, degree_j))


def mix(own: Tensor, others: list[Tensor], weights: list[float]) -> Tensor:
    """One gossip step of one agent: (1 - sum_j w_j) * own + sum_j w_j * others[j].

    own and each of others: (P,) parameters; weights: W[i, j] for those neighbours (the self
    weight is what is left, so the row sums to 1). Accumulates in float64, returns own's dtype.
    """
    if len(others) != len(weights):
        raise ValueError(f"{len(others)} neighbours' parameters but {len(weights)} weights")
    self_weight = 1.0 - sum(weights)
    if self_weight < -1e-12:
        raise ValueError(f"the neighbours' weights sum to {sum(weights)} > 1")
    acc = own.double() * self_weight
    for theta, w in zip(others, weights):
        if theta.shape != own.shape:
            raise ValueError(f"a neighbour's parameters have shape {tuple(theta.shape)}")
        acc += theta.double() * w
    return acc.to(own.dtype)


def sketch_plan(num_params: int, size: int, *, seed: int) -> tuple[Tensor, Tensor]:
    """A count sketch of R^P into R^k (k = size), the same on every agent given the same seed:
    (bucket (P,) int64 in [0, k), sign (P,) float32 of +-1). Drawn from a CPU generator."""
    if size < 1 or num_params < 0:
        raise ValueError(f"a sketch needs size >= 1 and P >= 0, got {size} and {num_params}")
    g = torch.Generator().manual_seed(seed)
    bucket = torch.randint(0, size, (num_params,), generator=g)
    sign = torch.randint(0, 2, (num_params,), generator=g).float() * 2 - 1
    return bucket, sign


def sketch(theta: Tensor, plan: tuple[Tensor, Tensor], size: int) -> Tensor:
    """S theta: (k,) float64, where S adds each coordinate, times its sign, into its bucket.

    S is linear and E ||S v||^2 = ||v||^2 for any fixed v (the signs are independent with mean
    0), with Var <= 2 ||v||^4 / k: so the consensus error of the sketches estimates the
    consensus error of the parameters without anyone holding every agent's parameters."""
    bucket, sign = plan
    out = torch.zeros(size, dtype=torch.float64, device=theta.device)
    return out.index_add_(0, bucket.to(theta.device), theta.double() * sign.to(theta.device))
