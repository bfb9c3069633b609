"""Mixed precision: where `model.compute_dtype` runs the model's matmuls in bf16.

`model.dtype` is what the weights are stored (and trained) in; `model.compute_dtype: bfloat16`
keeps them (and gradients, optimizer state) in `model.dtype` and runs forward passes under
`torch.autocast` in bf16: linear layers and attention in bf16, what autocast keeps in f32 in
f32. Log-probs are always taken in f32 from the (bf16) logits, so the sampler records the exact
f32 log-prob of the distribution each token was drawn from (docs/design.md, "bf16").

Pure bf16 weights (`model.dtype: bfloat16`) are faster still but lose small updates: with
AdamW at lr 1e-5 about 84% of a bf16 weight matrix (std 0.02) does not move in a step, because
the update is below half a bf16 step. Mixed precision does not have that problem.
"""

from __future__ import annotations

import contextlib
import copy

import torch

COMPUTE_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def compute_context(device: torch.device, compute_dtype: torch.dtype | None):
    """A context that runs forward passes on `device` in `compute_dtype` (None: as the weights
    are, no autocast). One context around a whole rollout casts each weight once: autocast
    caches the casts of leaf parameters for the life of the context."""
    if compute_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute_dtype)


def model_compute_dtype(name: str) -> torch.dtype | None:
    """torch dtype of a `model.compute_dtype` name (None for float32: no autocast)."""
    return COMPUTE_DTYPES[name]


def node_compute_dtype(node) -> torch.dtype | None:
    """The compute dtype of a node's `cfg.model` (None: float32, or a node-like object without
    a model config, such as an evaluation harness holding only a model and a tokenizer)."""
    model_cfg = getattr(getattr(node, "cfg", None), "model", None)
    return None if model_cfg is None else model_compute_dtype(model_cfg.compute_dtype)


SAMPLER_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


class SamplerCopy:
    """A low-precision copy of a model for sampling (`train.sampler_dtype`), made once and
    refreshed from the model's current weights by :meth:`synced` before every rollout, so it can
    never sample from stale weights, whatever changed them (an optimizer step, a federated
    round's new weights, a restore). A refresh copies every parameter with a cast: a read of the
    f32 weights, far less than one decode step's. Only the parameters are cast: buffers keep
    their dtype (RoPE's inverse frequencies in bf16 would put an error into every position's
    angle that grows with the position)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.copy: torch.nn.Module | None = None
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def synced(self, model: torch.nn.Module) -> torch.nn.Module:
        """The copy, holding `model`'s current weights in this dtype."""
        if self.copy is None:
            self.copy = copy.deepcopy(model)
            self.copy.requires_grad_(False)
            for p in self.copy.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(self.dtype)
            src, dst = dict(model.named_parameters()), dict(self.copy.named_parameters())
            if src.keys() != dst.keys():
                raise RuntimeError("sampler copy: the model's parameters changed names when cast")
            self._pairs = [(dst[k], src[k]) for k in src if src[k].is_floating_point()]
        with torch.no_grad():
            for d, s_ in self._pairs:
                d.copy_(s_)
        self.copy.train(model.training)
        return self.copy
