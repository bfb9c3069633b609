"""Trainable parameters in and out of a model, and the keys of a federated run's messages
(`ftis.algos.federated.records` describes the messages). torch only, no Flower: a client's
training code imports this, not flwr."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

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


def params_delta(
    model: torch.nn.Module, params: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """What local training changed: the model's trainable parameters minus the `params` it
    started from (CPU, the model's dtype): a client's reply."""
    return {
        name: p.detach().to("cpu") - params[name].to("cpu", p.dtype)
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def save_client_checkpoint(
    client: Any, run_dir: Path, round_: int, state: dict[str, Any] | None = None
) -> None:
    """Checkpoint a client's local model (its `node`) after round `round_` under
    nodes/<its name>/, keeping `cfg.checkpoint.keep`; the algorithm state is the round and
    `state`."""
    from ftis.train.checkpoint import save_checkpoint

    save_checkpoint(
        client.node,
        run_dir / "nodes" / client.name,
        round_,
        keep=client.cfg.checkpoint.keep,
        algorithm_state={"round": round_, **(state or {})},
    )
