"""Trainable parameters in and out of a model, and the keys of a federated run's messages
(`ftis.algos.federated.records` describes the messages). torch only, no Flower: a client's
training code imports this, not flwr."""

from __future__ import annotations

from collections.abc import Mapping

import torch

ARRAYS, METRICS, CONFIG = "arrays", "metrics", "config"
ROUND_KEY = "round"
CLIENT_KEY = "client"
PERF_KEY = "performance"  # FGRPO's performance signal (after local training)
PERF_BEFORE_KEY = "performance-before"  # ...and before it (the pre-round baseline)
COUNT_KEY = "num-examples"


def trainable_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that train (every weight, or LoRA adapters only), detached CPU copies."""
    return {
        name: p.detach().to("cpu", copy=True)
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def load_params(model: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    """Copy `params` into the model's trainable parameters (same names and shapes, or
    ValueError)."""
    own = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if set(own) != set(params):
        diff = sorted(set(own) ^ set(params))
        raise ValueError(f"parameters differ from the model's trainable ones: {diff[:5]}")
    with torch.no_grad():
        for name, p in own.items():
            src = params[name]
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"parameter {name!r}: {tuple(src.shape)} vs {tuple(p.shape)}")
            p.copy_(src.to(device=p.device, dtype=p.dtype))
