"""Seeded perturbations of a model, applied from a stored copy of its weights.

What is perturbed: the model's trainable parameters (every weight of a full model, the LoRA
adapters of a peft model), in a fixed order (sorted by name), each perturbed tensor drawn in
float32 on the CPU (`ftis.core.population.seeded_noise`) and moved to the parameter's device.
A candidate is always written as `center + delta` from the stored copy of the center weights,
never by subtracting noise back, so scoring a thousand members leaves the weights bit-exact.

A direction is a list of stages, each a list of (seed, sigma, weight) triples; the weights it
describes are rebuilt stage by stage: theta = theta_0; theta = theta + sum(stage) for each stage.
`rebuild` does exactly what the algorithm did, so a saved direction reproduces the consolidated
checkpoint bit for bit (tests/test_randopt.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ftis.core.population import Triple, combine_noise

DIRECTION_FORMAT = "ftis-population-direction/1"


def perturbable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every trainable parameter, sorted by name (tied weights once)."""
    return sorted(
        ((n, p) for n, p in model.named_parameters() if p.requires_grad), key=lambda t: t[0]
    )


def weights_sha256(model: torch.nn.Module) -> str:
    """Hex sha256 of every parameter (trainable or not), by name, dtype, shape and bytes: two
    nodes with the same digest hold the same weights bit for bit."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda t: t[0]):
        t = p.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(p.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tensors_sha256(tensors: Sequence[torch.Tensor]) -> str:
    """Hex sha256 of a list of tensors (dtype, shape and bytes, in order)."""
    h = hashlib.sha256()
    for t in tensors:
        c = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{c.dtype}|{tuple(t.shape)}|".encode())
        h.update(c.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Perturber:
    """Writes seeded perturbations of the center weights into a model.

    center: a stored copy of the perturbed parameters that every candidate starts from (the
    model's weights when the Perturber is made, until `recenter`).
    """

    def __init__(self, model: torch.nn.Module, *, stream: str = "independent") -> None:
        self.named = perturbable(model)
        if not self.named:
            raise ValueError("the model has no trainable parameters to perturb")
        self.stream = stream
        self.shapes = [tuple(p.shape) for _, p in self.named]
        self.center = [p.detach().clone() for _, p in self.named]

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.named)

    @torch.no_grad()
    def apply(self, triples: Sequence[Triple]) -> None:
        """model <- center + sum_j weight_j * sigma_j * eps(seed_j) (added in float32, then cast
        to each parameter's dtype)."""
        if not triples:  # an empty direction (a stage that kept its center): exactly the center
            self.restore()
            return
        delta = combine_noise(self.shapes, triples, stream=self.stream)
        for (_, p), c, d in zip(self.named, self.center, delta, strict=True):
            p.copy_((c.float() + d.to(c.device)).to(p.dtype))

    @torch.no_grad()
    def restore(self) -> None:
        """model <- center, exactly."""
        for (_, p), c in zip(self.named, self.center, strict=True):
            p.copy_(c)

    def rebuilt_sha256(self, triples: Sequence[Triple]) -> str:
        """sha256 of the perturbed tensors of center + direction `triples` (the model is left at
        the center): two parties with the same digest rebuild the same weights bit for bit."""
        self.apply(triples)
        try:
            return tensors_sha256([p for _, p in self.named])
        finally:
            self.restore()

    def recenter(self) -> None:
        """Make the model's current weights the new center."""
        self.center = [p.detach().clone() for _, p in self.named]


def rebuild(model: torch.nn.Module, stages: Sequence[Sequence[Triple]], *, stream: str) -> None:
    """Apply a saved direction to `model` (holding theta_0): stage after stage, each from the
    weights the previous one left."""
    for triples in stages:
        p = Perturber(model, stream=stream)
        p.apply(triples)


def save_direction(path: Path, stages: Sequence[Sequence[Triple]], **meta: Any) -> None:
    """Write a direction (and what it was chosen with) as JSON; floats round-trip exactly."""
    doc = {
        "format": DIRECTION_FORMAT,
        **meta,
        "stages": [
            [{"seed": int(s), "sigma": float(sg), "weight": float(w)} for s, sg, w in stage]
            for stage in stages
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def load_direction(path: Path) -> tuple[list[list[Triple]], dict[str, Any]]:
    """(stages, the rest of the document) of a direction written by `save_direction`."""
    doc = json.loads(Path(path).read_text())
    if doc.get("format") != DIRECTION_FORMAT:
        raise ValueError(f"{path}: not a population direction ({DIRECTION_FORMAT})")
    stages = [
        [(int(t["seed"]), float(t["sigma"]), float(t["weight"])) for t in stage]
        for stage in doc.pop("stages")
    ]
    return stages, doc
