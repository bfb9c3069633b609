"""What a task is: prompt sources with stable indices, a tokenizer-aware prompt format, a verifier."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
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

    Optional (not part of the protocol, looked up with ``getattr``):
    ``extract_answer(completion) -> str | None``, the final answer of a decoded completion in a
    canonical form (None when it has none); evaluation then logs the number of distinct answers
    among each problem's pass@k samples (``eval/<split>/distinct_answers``).
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


class TaskDataError(ValueError):
    """A task's data or problem space cannot be built: a missing file, a bad record, too few
    held-out problems. The message names the config field to change."""


def as_id_list(encoded: object) -> list[int]:
    """Normalise what a tokenizer returns (list, tensor, dict/BatchEncoding, batch of one) to ids.

    ``apply_chat_template`` returns a plain list in transformers 4 and a ``BatchEncoding`` in 5.
    """
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):  # torch / numpy
        encoded = encoded.tolist()
    ids = list(encoded)  # type: ignore[call-overload]
    if ids and isinstance(ids[0], (list, tuple)):
        if len(ids) != 1:
            raise ValueError(f"expected the ids of one sequence, got a batch of {len(ids)}")
        ids = list(ids[0])
    return [int(i) for i in ids]


def plain_prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Encode a prompt without a chat template: ``[bos] + tokens(text)``.

    BOS is prepended when the tokenizer defines one (the char tokenizer, Llama-style tokenizers),
    because that is how such models saw text in pre-training; tokenizers without one (Qwen2.5)
    get the bare tokens. No other special tokens are added.
    """
    ids = as_id_list(tokenizer.encode(text, add_special_tokens=False))
    bos = tokenizer.bos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, int(bos))
    return ids
