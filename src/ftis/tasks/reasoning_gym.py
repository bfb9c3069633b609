"""reasoning-gym's procedural datasets as a task (`task.kind: reasoning-gym`; docs/tasks.md).

reasoning-gym (``pip install 'ftis[reasoning-gym]'``) generates questions with verifiable
answers from a seed: ``reasoning_gym.create_dataset(name, seed=, size=, **options)`` gives items
``{question, answer, metadata}`` and ``dataset.score_answer(answer=, entry=)`` scores an answer.
SAPO / RL Swarm trained on it.

    task:
      kind: reasoning-gym
      datasets: {basic_arithmetic: 1, chain_sum: {weight: 2, options: {min_terms: 2}}}
      size: 100000     # train items per dataset
      test_size: 128   # held-out questions per dataset
      seed: 0

Choices where nothing else decides:
- names and options pass to ``create_dataset`` unchanged (``seed`` and ``size`` are the task's);
  the config is checked when it is read: an unknown name, or a dataset that does not build or
  generate its first item with its options, is one error naming the dataset;
- item ``j`` of a reasoning-gym dataset is generated from ``Random(seed + j)``. Train problem
  ``i`` is item ``i`` of dataset ``seed`` (``size`` items), of the dataset picked for ``i`` by the
  weights (a blake2b digest of ``(seed, i)``); the held-out items come from the next seeds
  (``seed + size`` on), ``test_size`` distinct questions per dataset. A train item whose question
  is held out is replaced by item ``i`` of a further seed range: no held-out question is ever
  trained on, checked by question text;
- eval splits: ``test`` (every dataset of positive weight, interleaved one by one: each counts
  the same), then, when there are several datasets, one split per dataset named after it (a
  weight-0 dataset is evaluated, never trained on);
- prompt: a system prompt asking for ``<answer>...</answer>`` (``system_prompt``: a name from
  ``reasoning_gym.utils.SYSTEM_PROMPTS``, default "direct", or the text itself) and the question,
  through the tokenizer's chat template when it has one, else gsm8k's plain text format;
- reward: ``builtin:reasoning_gym`` (the dataset's ``score_answer`` on the last
  ``<answer>...</answer>`` block, reasoning-gym's ``extract_answer``; 0 without one; some
  datasets give partial credit) with weight 1, and ``builtin:reasoning_gym_format`` (1 when such
  a block holds an answer) with weight 0, so that eval accuracy stays the dataset's score while
  each row shows both (``reward/builtin:reasoning_gym``, ``reward/builtin:reasoning_gym_format``);
  give the format term a weight in ``task.reward`` to train on it;
- warm-start target: ``<answer>GOLD</answer>``.
"""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import lru_cache
from hashlib import blake2b
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ftis.rewards import RewardTerm, register_reward
from ftis.tasks.base import (
    Problem,
    TaskConfigBase,
    TaskDataError,
    named_split,
    plain_prompt_ids,
)
from ftis.tasks.generated import VirtualSplit
from ftis.tasks.gsm8k import (
    PLAIN_PROMPT,
    chat_prompt_ids,
    chat_template_field,
    chat_template_in_use,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'ftis[reasoning-gym]'"
CORRECT = "builtin:reasoning_gym"
FORMAT = "builtin:reasoning_gym_format"
RESERVED_OPTIONS = ("seed", "size")  # the task's own
MAX_SEED_SPAN = 2**31  # every seed a dataset is built with stays below this
REPLACEMENT_ROUNDS = 16  # further seed ranges a held-out train question is replaced from
HELDOUT_DRAWS = 8  # draw at most this many times test_size items for the distinct held-out ones


def reasoning_gym() -> Any:
    """The `reasoning_gym` module, or a TaskDataError saying how to install it."""
    try:
        import reasoning_gym as rg
    except ImportError as e:
        raise TaskDataError(
            f"task kind reasoning-gym needs the reasoning-gym package: {INSTALL_HINT} "
            f"(import failed: {e})"
        ) from None
    return rg


def known_datasets() -> list[str]:
    """Every dataset name reasoning-gym has registered."""
    return sorted(reasoning_gym().factory.DATASETS)


def _options_key(options: Mapping[str, Any]) -> str:
    return json.dumps(options, sort_keys=True, default=repr)


_built: dict[tuple[str, str, int, int], Any] = {}


def build_dataset(name: str, options: Mapping[str, Any], *, seed: int, size: int) -> Any:
    """`reasoning_gym.create_dataset(name, seed=seed, size=size, **options)`, cached; a
    TaskDataError naming the dataset when it does not build."""
    key = (name, _options_key(options), seed, size)
    if key not in _built:
        rg = reasoning_gym()
        try:
            _built[key] = rg.create_dataset(name, seed=seed, size=size, **options)
        except Exception as e:
            raise TaskDataError(
                f"reasoning-gym dataset {name!r} does not build with options {dict(options)}: "
                f"{type(e).__name__}: {e}"
            ) from None
    return _built[key]


# --------------------------------------------------------------------------------------- config


class ReasoningGymDataset(BaseModel):
    """One reasoning-gym dataset of the mix: its sampling weight and its options."""

    model_config = ConfigDict(extra="forbid")
    weight: float = Field(
        1.0,
        ge=0,
        allow_inf_nan=False,
        description="Share of train problems (need not sum to 1); 0 = evaluated, never trained.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword options of reasoning_gym.create_dataset (its config dataclass), "
        "passed unchanged; not seed or size.",
    )


_checked: set[tuple[str, str]] = set()


class ReasoningGymTaskConfig(TaskConfigBase):
    """reasoning-gym's procedural datasets: a weighted mix, held-out splits per dataset."""

    kind: Literal["reasoning-gym"] = Field(default="reasoning-gym", description="Task selector.")
    default_reward: ClassVar[str | None] = CORRECT
    warmstart_target_format: ClassVar[str] = "answer-tag-1"
    datasets: dict[str, ReasoningGymDataset] = Field(
        description="reasoning-gym dataset names with a weight, or {weight:, options: {...}}; "
        "a list of names weighs each 1."
    )
    seed: int = Field(
        0, ge=0, description="Seed of every split; all peers must share it to share indices."
    )
    size: int = Field(
        100_000, ge=1, description="Train problems: items 0 to size-1 of each dataset."
    )
    test_size: int = Field(
        128, ge=1, description="Distinct held-out questions per dataset (seeds after the train's)."
    )
    system_prompt: str = Field(
        "direct",
        description="A name in reasoning_gym.utils.SYSTEM_PROMPTS ('direct', 'default', "
        "'simple', 'chain_of_draft', 'DeepSeekZero') or the system prompt's text; it should ask "
        "for <answer>...</answer>.",
    )
    use_chat_template: bool | None = chat_template_field("plain text prompt")

    @field_validator("datasets", mode="before")
    @classmethod
    def _shorthands(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list | tuple):
            return {str(name): {} for name in value}
        if isinstance(value, Mapping):
            return {
                name: (
                    {}
                    if v is None
                    else {"weight": v}
                    if isinstance(v, int | float) and not isinstance(v, bool)
                    else v
                )
                for name, v in value.items()
            }
        return value

    @field_validator("datasets")
    @classmethod
    def _known_and_buildable(
        cls, value: dict[str, ReasoningGymDataset]
    ) -> dict[str, ReasoningGymDataset]:
        if not value:
            raise ValueError("is empty: name at least one reasoning-gym dataset")
        try:
            known = known_datasets()
        except TaskDataError as e:
            raise ValueError(str(e)) from None
        unknown = [n for n in value if n not in known]
        if unknown:
            hints = {n: difflib.get_close_matches(n, known, n=1) for n in unknown}
            said = ", ".join(
                f"{n!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for n, h in hints.items()
            )
            raise ValueError(f"unknown reasoning-gym dataset(s) {said}; known: {', '.join(known)}")
        if not any(d.weight > 0 for d in value.values()):
            raise ValueError("every weight is 0: give one dataset a positive weight")
        for name, d in value.items():
            if name in ("train", "test"):
                raise ValueError(f"{name!r} names a split: it cannot name a dataset")
            taken = [k for k in RESERVED_OPTIONS if k in d.options]
            if taken:
                raise ValueError(
                    f"{name}: options {taken} are the task's: set task.seed / task.size / "
                    "task.test_size instead"
                )
            key = (name, _options_key(d.options))
            if key in _checked:
                continue
            try:  # cheap for most datasets: build it and generate its first item
                dataset = build_dataset(name, d.options, seed=0, size=1)
                _item(dataset, 0, name)
            except TaskDataError as e:
                raise ValueError(str(e)) from None
            _checked.add(key)
        return value

    @model_validator(mode="after")
    def _default_reward(self) -> ReasoningGymTaskConfig:
        if self.reward is None:  # both terms, so that each row shows both
            self.reward = [
                RewardTerm(function=CORRECT, weight=1.0),
                RewardTerm(function=FORMAT, weight=0.0),
            ]
        return self

    @model_validator(mode="after")
    def _seeds_fit(self) -> ReasoningGymTaskConfig:
        if self.seed + self.size * (REPLACEMENT_ROUNDS + 2) + self._pool() >= MAX_SEED_SPAN:
            raise ValueError(
                f"seed {self.seed} and size {self.size} reach past seed {MAX_SEED_SPAN}: lower them"
            )
        return self

    def _pool(self) -> int:
        return HELDOUT_DRAWS * self.test_size

    def warmstart_mix(self, mix: Mapping[str, float]) -> ReasoningGymTaskConfig:
        """This task with ``warm_start.mix``'s dataset weights (a dataset it leaves out: 0)."""
        unknown = [n for n in mix if n not in self.datasets]
        if unknown:
            raise ValueError(
                f"warm_start.mix names {unknown}, not datasets of the task; use some of "
                f"{sorted(self.datasets)}"
            )
        if any(not w >= 0 for w in mix.values()) or not any(w > 0 for w in mix.values()):
            raise ValueError(
                "warm_start.mix: weights must be >= 0 and one of them positive, e.g. "
                f"{{{next(iter(self.datasets))!r}: 1.0}}"
            )
        datasets = {
            n: d.model_copy(update={"weight": float(mix.get(n, 0.0))})
            for n, d in self.datasets.items()
        }
        return self.model_copy(update={"datasets": datasets})

    def system_text(self) -> str:
        """The system prompt: a reasoning_gym.utils.SYSTEM_PROMPTS entry by name, else as given."""
        from reasoning_gym.utils import SYSTEM_PROMPTS

        return SYSTEM_PROMPTS.get(self.system_prompt, self.system_prompt).strip()


# ------------------------------------------------------------------------------------------ data


def _item(dataset: Any, j: int, name: str) -> dict[str, Any]:
    try:
        item = dataset[j]
    except Exception as e:
        raise TaskDataError(
            f"reasoning-gym dataset {name!r} failed to generate item {j}: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(item, Mapping) or "question" not in item:
        raise TaskDataError(f"reasoning-gym dataset {name!r}: item {j} has no question")
    return dict(item)


def _unit(seed: int, i: int) -> float:
    """A uniform number in [0, 1) from ``(seed, i)``: which dataset train problem ``i`` is."""
    digest = blake2b(f"reasoning-gym|{seed}|pick|{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def _problem(index: int, name: str, options: Mapping[str, Any], item: Mapping[str, Any]) -> Problem:
    answer = item.get("answer")
    return Problem(
        index,
        str(item["question"]),
        "" if answer is None else str(answer),
        fields={"dataset": name, "options": dict(options), "entry": dict(item)},
    )


# ---------------------------------------------------------------------------------------- reward


def extract_answer(completion: str) -> str | None:
    """The last ``<answer>...</answer>`` block's content, stripped (reasoning-gym's own
    ``extract_answer``), or None when there is none or it is empty."""
    from reasoning_gym.utils import extract_answer as rg_extract

    answer = rg_extract(completion) if isinstance(completion, str) else None
    return answer if answer else None


def _scorer(name: str, options: Mapping[str, Any]) -> Any:
    return build_dataset(name, options, seed=0, size=1)  # score_answer needs its config only


def correct(prompt: str, completion: str, fields: Mapping[str, Any]) -> float:
    """The dataset's own ``score_answer`` on the completion's answer block (0 without one)."""
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    dataset = _scorer(str(fields["dataset"]), fields.get("options") or {})
    return float(dataset.score_answer(answer=answer, entry=fields["entry"]))


def answer_format(prompt: str, completion: str, fields: Mapping[str, Any]) -> float:
    """1.0 when the completion has an ``<answer>...</answer>`` block holding an answer."""
    return 0.0 if extract_answer(completion) is None else 1.0


# each metrics row shows each one's mean (`reward/<name>`, ftis.rewards.runtime.Reward.pop_stats)
correct.report_mean = True  # type: ignore[attr-defined]
answer_format.report_mean = True  # type: ignore[attr-defined]
register_reward(CORRECT, correct)
register_reward(FORMAT, answer_format)


# ------------------------------------------------------------------------------------------ task


class ReasoningGymTask:
    """reasoning-gym datasets as a task; implements ``ftis.tasks.base.Task``."""

    name = "reasoning-gym"

    def __init__(self, cfg: ReasoningGymTaskConfig | Mapping[str, Any]) -> None:
        raw = cfg if isinstance(cfg, Mapping) else cfg.model_dump()
        self.cfg = c = ReasoningGymTaskConfig.model_validate(raw)
        self.system_prompt = c.system_text()
        names = list(c.datasets)
        held: dict[str, tuple[Problem, ...]] = {
            n: self._heldout(n, c.datasets[n].options) for n in names
        }
        self._heldout_questions = {p.question for split in held.values() for p in split}
        trained = [n for n in names if c.datasets[n].weight > 0]
        total = sum(c.datasets[n].weight for n in trained)
        self._cumulative: list[tuple[float, str]] = []
        acc = 0.0
        for n in trained:
            acc += c.datasets[n].weight / total
            self._cumulative.append((acc, n))
        mixed: list[Problem] = []
        for j in range(max(len(held[n]) for n in trained)):
            mixed += [held[n][j] for n in trained if j < len(held[n])]
        self._eval: dict[str, tuple[Problem, ...]] = {
            "test": tuple(replace(p, index=k) for k, p in enumerate(mixed))
        }
        if len(names) > 1:
            self._eval.update(held)
        self.eval_splits: tuple[str, ...] = tuple(self._eval)
        self._train = VirtualSplit(lru_cache(maxsize=8192)(self._train_problem), size=c.size)
        logger.info(
            "reasoning-gym task: %d train problems, eval %s",
            c.size,
            {k: len(v) for k, v in self._eval.items()},
        )

    def _heldout(self, name: str, options: Mapping[str, Any]) -> tuple[Problem, ...]:
        """``test_size`` distinct questions from the seeds after the train range."""
        c = self.cfg
        dataset = build_dataset(name, options, seed=c.seed + c.size, size=c._pool())
        seen: set[str] = set()
        out: list[Problem] = []
        for j in range(c._pool()):
            item = _item(dataset, j, name)
            if item["question"] in seen:
                continue
            seen.add(item["question"])
            out.append(_problem(len(out), name, options, item))
            if len(out) == c.test_size:
                return tuple(out)
        raise TaskDataError(
            f"reasoning-gym dataset {name!r} gave only {len(out)} distinct questions in "
            f"{c._pool()} draws, fewer than test_size={c.test_size}: lower task.test_size or "
            "widen its options"
        )

    def _pick(self, i: int) -> str:
        u = _unit(self.cfg.seed, i)
        return next((n for acc, n in self._cumulative if u < acc), self._cumulative[-1][1])

    def _train_problem(self, i: int) -> Problem:
        c = self.cfg
        name = self._pick(i)
        options = c.datasets[name].options
        seeds = [c.seed] + [
            c.seed + c.size + c._pool() + r * c.size for r in range(REPLACEMENT_ROUNDS)
        ]
        for seed in seeds:
            item = _item(build_dataset(name, options, seed=seed, size=c.size), i, name)
            if item["question"] not in self._heldout_questions:
                return _problem(i, name, options, item)
        raise TaskDataError(
            f"reasoning-gym dataset {name!r}: train problem {i} is a held-out question in "
            f"{len(seeds)} seed ranges; its space is too small for test_size={c.test_size}"
        )

    def split(self, name: str) -> Sequence[Problem]:
        return named_split("reasoning-gym", name, self._train, self._eval)

    def uses_chat_template(self, tokenizer: PreTrainedTokenizerBase) -> bool:
        return chat_template_in_use(self.cfg.use_chat_template, tokenizer)

    def prompt_ids(self, problem: Problem, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """[system, user: question] through the chat template when used (gsm8k's
        `chat_prompt_ids`), else gsm8k's plain text `{system}\\n\\nQuestion: ...\\nAnswer: `."""
        if self.uses_chat_template(tokenizer):
            return chat_prompt_ids(tokenizer, self.system_prompt, problem.question)
        text = PLAIN_PROMPT.format(system_prompt=self.system_prompt, question=problem.question)
        return plain_prompt_ids(tokenizer, text)

    def reward(self, problem: Problem, completion: str) -> float:
        """The dataset's score of the completion's answer (the built-in reward's first term)."""
        return correct(problem.question, completion, {"answer": problem.answer, **problem.fields})

    def extract_answer(self, completion: str) -> str | None:
        """The answer block's content (eval counts distinct answers with it)."""
        return extract_answer(completion)

    @staticmethod
    def warmstart_target(problem: Problem) -> str:
        """Supervised warm-start completion: the gold answer in the answer block."""
        return f"<answer>{problem.answer}</answer>"
