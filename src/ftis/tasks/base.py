"""What a task is: prompt sources with stable indices, a tokenizer-aware prompt format, a verifier."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Problem:
    """One question. ``index`` is stable within its split: peers rebuild a problem from it."""

    index: int
    question: str
    answer: str


@runtime_checkable
class Task(Protocol):
    """A task with a verifiable reward.

    ``split(name)`` returns a sequence of problems (``__len__`` and ``__getitem__``) for "train",
    "test" (held-out, in distribution) and any out-of-distribution splits in ``eval_splits``.
    """

    name: str
    eval_splits: tuple[str, ...]  # e.g. ("test", "ood"); the first is in distribution

    def split(self, name: str) -> Sequence[Problem]: ...

    def prompt_ids(self, problem: Problem, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """Token ids the model is conditioned on (chat template applied where the task uses one)."""
        ...

    def reward(self, problem: Problem, completion: str) -> float:
        """Verifier: reward of a decoded completion (special tokens removed)."""
        ...
