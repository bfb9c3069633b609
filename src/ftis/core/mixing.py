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
