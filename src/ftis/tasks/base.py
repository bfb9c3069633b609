"""What a task is: prompt sources with stable indices, a tokenizer-aware prompt format, a verifier."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ftis.rewards import RewardTerm, normalise_reward_spec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Problem:
    """One question. ``index`` is stable within its split: peers rebuild a problem from it.

    ``fields`` are the row's other columns (file-based tasks), handed to a configured reward
    together with ``question`` and ``answer`` (``ftis.rewards``); they take no part in equality.
    """

    index: int
    question: str
    answer: str
    fields: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)


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
        """Verifier: reward of a decoded completion (the task's built-in reward; a run scores
        through the configured reward, ``ftis.rewards.RewardedTask``)."""
        ...


OWN_REWARD = "own"  # TaskConfigBase.default_reward: the task object's own `reward` method


class TaskConfigBase(BaseModel):
    """Base of every task's config: `kind` names the task (`ftis.tasks.register_task`), `reward`
    optionally replaces its built-in reward (`ftis.rewards`; a node's own `reward` wins)."""

    model_config = ConfigDict(extra="forbid")
    kind: str
    reward: list[RewardTerm] | None = Field(
        None,
        description="Reward functions and weights ('module:function', 'file.py:function' or "
        "'builtin:NAME'; docs/tasks.md); null = the task's built-in reward.",
    )
    reward_max_error_share: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Stop the run when a reward function fails (raises, or returns something "
        "that is not a finite number) on more than this share of the completions it scored in "
        "a step; below it a failure scores 0 and is counted. 1 = never stop.",
    )
    # The reward used when none is configured: a registered name ('builtin:gsm8k'), OWN_REWARD
    # (the task's own `reward` method, for plugin tasks), or None (one must be configured).
    default_reward: ClassVar[str | None] = OWN_REWARD
    # A task whose warm start trains on a column of its rows (`warmstart_field`): why it cannot
    # warm start while that column is not set (None: the task needs no such column).
    no_warmstart_field: ClassVar[str | None] = None

    @field_validator("reward", mode="before")
    @classmethod
    def _reward_shorthands(cls, v: Any) -> Any:
        return normalise_reward_spec(v)

    def warm_start_refusal(self) -> str | None:
        """Why this task cannot give a supervised warm start (None when it can)."""
        if self.no_warmstart_field and getattr(self, "warmstart_field", None) is None:
            return self.no_warmstart_field
        return None


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


def named_split(
    task: str, name: str, train: Sequence[Problem], evals: Mapping[str, Sequence[Problem]]
) -> Sequence[Problem]:
    """A task's split by name: "train", or one of its evaluation splits."""
    if name == "train":
        return train
    if name in evals:
        return evals[name]
    raise ValueError(f"{task} task has no split {name!r}; use one of {['train', *evals]}")
