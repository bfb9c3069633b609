"""A KV cache whose storage is allocated once per rollout.

transformers' DynamicCache grows each layer's keys and values with `torch.cat` at every decode
step, copying the whole cache each time: O(T^2) bytes moved over a rollout of T tokens, and
16% of the sampler's time on `llama-20m` at 64 tokens (`aten::cat` in the profile of
docs/BENCHMARKS.md). Here each layer allocates (N, H, capacity, D) buffers on its first update
and writes new states in place; what it returns is a view of the filled part, so attention
still sees exactly the tokens so far (same values, same shapes as DynamicCache: the log-probs
are identical, tested).
"""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers of `capacity` positions, filled in place."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.filled = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        n, h, _, d = key_states.shape
        self.device = key_states.device
        self._keys = key_states.new_empty((n, h, self.capacity, d))
        self._values = value_states.new_empty((n, h, self.capacity, value_states.shape[-1]))
        self.keys, self.values = self._keys[:, :, :0], self._values[:, :, :0]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.filled, self.filled + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"KV cache capacity {self.capacity} exceeded ({end} positions)")
        self._keys[:, :, start:end].copy_(key_states)
        self._values[:, :, start:end].copy_(value_states)
        self.filled = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.filled

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self.keys = self._keys[:, :, : self.filled]
            self.values = self._values[:, :, : self.filled]

    def crop(self, tokens_to_remove: int) -> None:  # pragma: no cover - not used by ftis
        raise NotImplementedError("PreallocatedLayer does not crop")

    def batch_repeat_interleave(self, repeats: int) -> None:  # pragma: no cover
        raise NotImplementedError("PreallocatedLayer does not repeat")


def preallocated_cache(capacity: int) -> DynamicCache:
    """A DynamicCache whose layers hold `capacity` positions each (prompt width + new tokens)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = functools.partial(PreallocatedLayer, capacity)
    return cache
