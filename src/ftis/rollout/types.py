"""The rollout batch: what a node generates, what goes over the wire, what every node trains on.

Shapes: N sequences (completions), T = padded completion length.
A group is the set of sequences that share a ``prompt_index``; advantages are computed per group
(docs/math.md section 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RolloutBatch:
    """Completions with the per-token log-probs of the model that sampled them.

    Attributes:
        prompt_index: (N,) int64. Index of the prompt in the task's ``train`` split. Peers share
            the task definition, so an index is all a receiver needs to rebuild the prompt.
        generator: (N,) int64. Rank of the node whose model sampled each sequence.
        completion_ids: (N, T) int64. Sampled token ids, right-padded with ``pad_id``.
        lengths: (N,) int64. Number of real completion tokens (including a final EOS if sampled).
        sampler_logprobs: (N, T) float32. Log-prob of each sampled token under the sampling
            distribution of the generator; 0.0 at padding.
    """

    prompt_index: torch.Tensor
    generator: torch.Tensor
    completion_ids: torch.Tensor
    lengths: torch.Tensor
    sampler_logprobs: torch.Tensor

    def __post_init__(self) -> None:
        n = self.completion_ids.shape[0]
        for name in ("prompt_index", "generator", "lengths"):
            t = getattr(self, name)
            if t.shape != (n,):
                raise ValueError(
                    f"RolloutBatch.{name} must have shape ({n},), got {tuple(t.shape)}"
                )
        if self.sampler_logprobs.shape != self.completion_ids.shape:
            raise ValueError(
                "RolloutBatch.sampler_logprobs must match completion_ids' shape "
                f"{tuple(self.completion_ids.shape)}, got {tuple(self.sampler_logprobs.shape)}"
            )

    @staticmethod
    def empty(pad_id: int) -> RolloutBatch:
        """A batch of no sequences."""
        return RolloutBatch(
            prompt_index=torch.zeros(0, dtype=torch.long),
            generator=torch.zeros(0, dtype=torch.long),
            completion_ids=torch.full((0, 1), pad_id, dtype=torch.long),
            lengths=torch.zeros(0, dtype=torch.long),
            sampler_logprobs=torch.zeros((0, 1), dtype=torch.float32),
        )

    @property
    def num_sequences(self) -> int:
        return int(self.completion_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Total number of real completion tokens (the denominator of bytes per token)."""
        return int(self.lengths.sum())

    @property
    def mask(self) -> torch.Tensor:
        """(N, T) bool, True on real completion tokens."""
        t = self.completion_ids.shape[1]
        return torch.arange(t, device=self.lengths.device)[None, :] < self.lengths[:, None]

    def select(self, idx: torch.Tensor) -> RolloutBatch:
        """Sub-batch of the sequences at ``idx`` (an index or bool mask over N)."""
        return RolloutBatch(
            prompt_index=self.prompt_index[idx],
            generator=self.generator[idx],
            completion_ids=self.completion_ids[idx],
            lengths=self.lengths[idx],
            sampler_logprobs=self.sampler_logprobs[idx],
        )

    @staticmethod
    def concat(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
        """Join batches along N, right-padding to the longest T."""
        if not batches:
            raise ValueError("RolloutBatch.concat needs at least one batch")
        t = max(b.completion_ids.shape[1] for b in batches)

        def pad(x: torch.Tensor, value: float) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, t - x.shape[1]), value=value)

        return RolloutBatch(
            prompt_index=torch.cat([b.prompt_index for b in batches]),
            generator=torch.cat([b.generator for b in batches]),
            completion_ids=torch.cat([pad(b.completion_ids, pad_id) for b in batches]),
            lengths=torch.cat([b.lengths for b in batches]),
            sampler_logprobs=torch.cat([pad(b.sampler_logprobs, 0.0) for b in batches]),
        )
