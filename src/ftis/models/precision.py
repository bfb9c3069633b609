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


class CastWeights:
    """The update's forward and backward passes on a low-precision working copy of the weights
    (`model.compute_mode: cast_weights`): entering swaps every floating-point parameter of the
    model for a copy in `dtype` (made once, at entry, so once per update rather than once per
    weight use and micro-batch as under autocast; tied parameters stay tied), so activations,
    matmuls and their gradients run in `dtype` end to end with no cast between ops;
    :meth:`accumulate`, after each micro-batch's backward, adds the copies' gradients into the
    float32 master parameters' `.grad` (in float32, so micro-batches sum without bf16 rounding)
    and frees them; leaving puts the masters back, for the optimizer to step in float32.
    Buffers keep their dtype (RoPE's inverse frequencies, as in SamplerCopy)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        self._slots: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
        self._pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []

    def __enter__(self) -> CastWeights:
        work: dict[int, torch.nn.Parameter] = {}
        for module in self.model.modules():
            for name, p in list(module._parameters.items()):
                if p is None or not p.is_floating_point() or p.dtype == self.dtype:
                    continue
                w = work.get(id(p))
                if w is None:
                    w = torch.nn.Parameter(p.detach().to(self.dtype), requires_grad=p.requires_grad)
                    work[id(p)] = w
                    if p.requires_grad:
                        self._pairs.append((p, w))
                self._slots.append((module, name, p))
                module._parameters[name] = w
        return self

    def forward(self):
        """The context of one forward pass: none is needed, the weights are already cast."""
        return contextlib.nullcontext()

    def accumulate(self) -> None:
        """Add the working copies' gradients into the masters' (float32) and free them."""
        with torch.no_grad():
            for master, w in self._pairs:
                if w.grad is None:
                    continue
                if master.grad is None:
                    master.grad = w.grad.to(master.dtype)
                else:
                    master.grad.add_(w.grad)  # f32 += bf16 in one pass, no cast copy
                w.grad = None

    def __exit__(self, *exc) -> None:
        for module, name, p in reversed(self._slots):
            module._parameters[name] = p
        self._slots.clear()
        self._pairs.clear()


class _Autocast:
    """CastWeights's interface for `model.compute_mode: autocast`: each forward under
    `compute_context` (backward outside it), gradients land on the masters already."""

    def __init__(self, device: torch.device, dtype: torch.dtype | None) -> None:
        self.device, self.dtype = device, dtype

    def __enter__(self) -> _Autocast:
        return self

    def forward(self):
        return compute_context(self.device, self.dtype)

    def accumulate(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


def update_compute(model: torch.nn.Module, model_cfg) -> CastWeights | _Autocast:
    """How the update (and the forward whose log-probs its ratios may divide by, the own ratio's
    reference) runs a node's model under `model_cfg` (its `compute_dtype` and
    `compute_mode`): a context to hold while the update runs, with `.forward()`, the context of
    each forward pass, and `.accumulate()`, to call after each backward. Under cast_weights a
    separate reference model (the KL term's) still runs as its weights are."""
    dtype = model_compute_dtype(model_cfg.compute_dtype)
    if dtype is not None and getattr(model_cfg, "compute_mode", "autocast") == "cast_weights":
        return CastWeights(model, dtype)
    return _Autocast(next(model.parameters()).device, dtype)
