"""The rollout batch: what a node generates, what goes over the wire, what every node trains on.

Shapes: N sequences (completions), T = padded completion length.
A group is the set of sequences that share a ``prompt_index``; advantages are computed per group
(docs/math.md section 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CompletionText:
    """What a sender adds to its payload for peers on another tokenizer (the bridged path,
    docs/math.md §16, docs/wire-format.md "Text section"). Shapes as in `RolloutBatch`.

    Attributes:
        texts: N strings: each completion's text, decoded without structural tokens (pad, BOS,
            EOS, UNK, ...) and cut at the last whole character (a completion cut by
            max_new_tokens inside a multi-byte character loses the partial character).
        finished: (N,) bool: the completion's last token is the sender's EOS (not in the text).
        covered: (N,) int64: how many leading tokens spell the text exactly (EOS excluded);
            tokens after them (and before a final EOS) hold only a partial character.
        char_ends: (N, T) int64: after each token, how many whole characters of the text have
            been spelled (non-decreasing; 0 at padding).
    """

    texts: list[str]
    finished: torch.Tensor
    covered: torch.Tensor
    char_ends: torch.Tensor


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
        text: what travels for peers on another tokenizer (outgoing and freshly decoded batches
            only; `select` and `concat` drop it).
        bridged: (N,) bool or None (all False): True for a peer's sequence on another tokenizer,
            re-tokenized by this node; its ids are this node's, its `sampler_logprobs` are 0 and
            unused, and its sender's totals are in the two fields below (docs/math.md §16).
        bridge_sampler_logprob: (N,) float32 or None: the sender's total log-prob of a bridged
            sequence's string (EOS included when it finished); 0 on other rows.
        bridge_sampler_length: (N,) int64 or None: the number of sender tokens in that total.
    """

    prompt_index: torch.Tensor
    generator: torch.Tensor
    completion_ids: torch.Tensor
    lengths: torch.Tensor
    sampler_logprobs: torch.Tensor
    text: CompletionText | None = None
    bridged: torch.Tensor | None = None
    bridge_sampler_logprob: torch.Tensor | None = None
    bridge_sampler_length: torch.Tensor | None = None

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

    def bridge_columns(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(bridged, bridge_sampler_logprob, bridge_sampler_length), with the defaults (all
        False, 0, 0) filled in where the batch has none."""
        n = self.num_sequences
        dev = self.lengths.device
        bridged = self.bridged
        if bridged is None:
            bridged = torch.zeros(n, dtype=torch.bool, device=dev)
        total = self.bridge_sampler_logprob
        if total is None:
            total = torch.zeros(n, dtype=torch.float32, device=dev)
        length = self.bridge_sampler_length
        if length is None:
            length = torch.zeros(n, dtype=torch.long, device=dev)
        return bridged, total, length

    @property
    def has_bridged(self) -> bool:
        return self.bridged is not None and bool(self.bridged.any())

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

    def with_completions(
        self, completion_ids: torch.Tensor, lengths: torch.Tensor, sampler_logprobs: torch.Tensor
    ) -> RolloutBatch:
        """The same prompts and generators (copies) with other completions and log-probs: a
        rewritten batch (an adversary's, an attacker's; no text, nothing bridged)."""
        return RolloutBatch(
            prompt_index=self.prompt_index.clone(),
            generator=self.generator.clone(),
            completion_ids=completion_ids,
            lengths=lengths,
            sampler_logprobs=sampler_logprobs,
        )

    def select(self, idx: torch.Tensor) -> RolloutBatch:
        """Sub-batch of the sequences at ``idx`` (an index or bool mask over N)."""
        return RolloutBatch(
            prompt_index=self.prompt_index[idx],
            generator=self.generator[idx],
            completion_ids=self.completion_ids[idx],
            lengths=self.lengths[idx],
            sampler_logprobs=self.sampler_logprobs[idx],
            bridged=None if self.bridged is None else self.bridged[idx],
            bridge_sampler_logprob=None
            if self.bridge_sampler_logprob is None
            else self.bridge_sampler_logprob[idx],
            bridge_sampler_length=None
            if self.bridge_sampler_length is None
            else self.bridge_sampler_length[idx],
        )

    @staticmethod
    def concat(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
        """Join batches along N, right-padding to the longest T."""
        if not batches:
            raise ValueError("RolloutBatch.concat needs at least one batch")
        t = max(b.completion_ids.shape[1] for b in batches)

        def pad(x: torch.Tensor, value: float) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, t - x.shape[1]), value=value)

        bridge: dict[str, torch.Tensor] = {}
        if any(b.bridged is not None for b in batches):
            cols = [b.bridge_columns() for b in batches]
            bridge = dict(
                bridged=torch.cat([c[0] for c in cols]),
                bridge_sampler_logprob=torch.cat([c[1] for c in cols]),
                bridge_sampler_length=torch.cat([c[2] for c in cols]),
            )
        return RolloutBatch(
            prompt_index=torch.cat([b.prompt_index for b in batches]),
            generator=torch.cat([b.generator for b in batches]),
            completion_ids=torch.cat([pad(b.completion_ids, pad_id) for b in batches]),
            lengths=torch.cat([b.lengths for b in batches]),
            sampler_logprobs=torch.cat([pad(b.sampler_logprobs, 0.0) for b in batches]),
            **bridge,
        )
