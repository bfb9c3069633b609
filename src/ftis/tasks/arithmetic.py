"""The embedded arithmetic task: problems like "23+45=" -> "68", made on the fly from a seed.

Design (see ftis-method.md section 1: peers rebuild a prompt from its index, never ship text):
- Train problem ``i`` is a pure function of ``(seed, "train", i)``: a blake2b digest seeds a
  private ``random.Random``, so any process rebuilds it in O(1) without a materialised list.
  The train split is a virtual sequence of ``TRAIN_SIZE`` items.
- Held-out partition: a question is reserved for evaluation when ``blake2b(question) % 16 == 0``.
  The partition depends on the question text only (not on the seed), so no run ever trains on any
  run's evaluation questions. Train sampling rejects held-out questions; test and OOD splits keep
  only held-out ones (distinct, in draw order). Python's ``hash()`` is salted per process and is
  never used.
- Operands: a digit count uniform in [min_digits, max_digits], then a value uniform among numbers
  with that many digits (1 digit includes 0). Operations are drawn per gap from the ``ops``
  weights. The answer is the exact integer value with normal precedence ("*" before "+"/"-").
- "*" can make answers long: problems whose answer has more than ``max_answer_digits`` digits are
  resampled (rejection), which leans "*"-heavy mixes toward smaller operands.
- Small problem spaces (at most ``ENUMERATE_LIMIT`` questions) are enumerated to check that
  ``test_size`` fits the held-out pool exactly, and to fill the split when random draws stall.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ftis.tasks.base import Problem, TaskDataError, as_id_list
from ftis.tasks.generated import (  # noqa: F401  (TRAIN_SIZE, HELDOUT_BUCKETS, is_heldout: its API)
    ENUMERATE_LIMIT,
    HELDOUT_BUCKETS,
    MAX_DRAWS_PER_PROBLEM,
    TRAIN_SIZE,
    Generator,
    SeededTask,
    SeededTaskConfig,
    VirtualSplit,
    digest,
    is_heldout,
    merged,
    weighted_names,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

OPS = ("+", "-", "*")


# --------------------------------------------------------------------------------------- config


class ArithmeticVariant(BaseModel):
    """A named out-of-distribution split: overrides some of the train space, with its own size."""

    model_config = ConfigDict(extra="forbid")

    ops: dict[str, float] | None = Field(
        default=None, description="Operation weights for this split; null keeps the train ones."
    )
    min_digits: int | None = Field(
        default=None, description="Fewest digits per operand; null keeps the train value."
    )
    max_digits: int | None = Field(
        default=None, description="Most digits per operand; null keeps the train value."
    )
    terms: int | None = Field(
        default=None, description="Operands per question; null keeps the train value."
    )
    max_answer_digits: int | None = Field(
        default=None,
        description="Longest answer (digits, sign excluded); null keeps the train one.",
    )
    size: int = Field(default=256, description="Number of distinct held-out problems in the split.")


class ArithmeticTaskConfig(SeededTaskConfig):
    """The embedded arithmetic task: a problem space, a seed and the evaluation splits."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["arithmetic"] = Field(default="arithmetic", description="Task selector.")
    default_reward: ClassVar[str | None] = "builtin:exact_match"
    ops: dict[str, float] = Field(
        default_factory=lambda: {"+": 1.0, "-": 1.0},
        description='Sampling weights over the operations "+", "-", "*" (need not sum to 1).',
    )
    min_digits: int = Field(default=1, description="Fewest digits per operand (1 includes 0).")
    max_digits: int = Field(default=2, description="Most digits per operand.")
    terms: int = Field(default=2, description="Operands per question: 2 gives 'a+b=', 3 'a+b-c='.")
    max_answer_digits: int = Field(
        default=6,
        description="Problems whose answer has more digits (sign excluded) are resampled; "
        'keeps "*" results in a range a small model can write.',
    )
    test_size: int = Field(
        default=256, description="Distinct held-out problems in the in-distribution test split."
    )
    ood: dict[str, ArithmeticVariant] = Field(
        default_factory=lambda: {"ood": ArithmeticVariant(terms=3)},
        description="Named out-of-distribution splits, evaluated after 'test'. The default 'ood' "
        "split has 3-term problems with the train digits (e.g. '12+5-30=').",
    )

    @model_validator(mode="after")
    def _check(self) -> ArithmeticTaskConfig:
        for _, _, space, size, field in _GENERATOR.eval_spaces(self):
            _GENERATOR.check_pool(field, size, space)
        return self


@dataclass(frozen=True)
class _Space:
    """A validated problem space (hashable: used as a cache key)."""

    ops: tuple[tuple[str, float], ...]  # operations with positive weight, in OPS order
    min_digits: int
    max_digits: int
    terms: int
    max_answer_digits: int

    @property
    def lo(self) -> int:
        return 0 if self.min_digits == 1 else 10 ** (self.min_digits - 1)

    @property
    def hi(self) -> int:
        return 10**self.max_digits - 1

    @property
    def size(self) -> int:
        """Number of distinct questions (before the answer-length filter)."""
        return (self.hi - self.lo + 1) ** self.terms * len(self.ops) ** (self.terms - 1)

    def describe(self) -> str:
        names = "".join(op for op, _ in self.ops)
        return (
            f"ops '{names}', {self.min_digits}-{self.max_digits} digits, {self.terms} terms: "
            f"{self.size} questions"
        )


def _space_from(cfg: ArithmeticTaskConfig, variant: ArithmeticVariant | None, where: str) -> _Space:
    """Merge a variant over the train space and validate it; ``where`` prefixes field names."""

    def pick(field: str) -> Any:
        return merged(cfg, variant, field)

    ops, min_d, max_d, terms, max_ans = (
        pick(f) for f in ("ops", "min_digits", "max_digits", "terms", "max_answer_digits")
    )
    names = weighted_names(
        ops,
        OPS,
        where,
        "ops",
        unknown_what="operation(s)",
        choices="'+', '-', '*'",
        example="{'+': 1.0, '*': 0.5}",
        zero_hint="give at least one operation a positive weight",
    )
    positive = tuple((op, float(ops[op])) for op in names)
    if not 1 <= min_d <= max_d <= 9:
        raise ValueError(
            f"{where}min_digits={min_d}, max_digits={max_d}: need 1 <= min_digits <= max_digits <= 9"
        )
    if not 2 <= terms <= 8:
        raise ValueError(f"{where}terms={terms}: use 2 to 8 operands per question")
    if max_ans < 1:
        raise ValueError(f"{where}max_answer_digits={max_ans}: must be at least 1")
    return _Space(positive, min_d, max_d, terms, max_ans)


# ------------------------------------------------------------------------------------ generation


def evaluate(operands: Sequence[int], ops: Sequence[str]) -> int:
    """Exact value of ``o0 op0 o1 op1 ...`` with "*" binding tighter than "+" and "-"."""
    total, sign, term = 0, 1, operands[0]
    for op, x in zip(ops, operands[1:], strict=True):
        if op == "*":
            term *= x
        else:
            total += sign * term
            sign, term = (1 if op == "+" else -1), x
    return total + sign * term


def _format(operands: Sequence[int], ops: Sequence[str]) -> str:
    parts = [str(operands[0])]
    for op, x in zip(ops, operands[1:], strict=True):
        parts += [op, str(x)]
    return "".join(parts) + "="


def _fits(space: _Space, value: int) -> bool:
    return len(str(abs(value))) <= space.max_answer_digits


def _draw(space: _Space, seed: int, stream: str, i: int, attempt: int) -> tuple[str, int] | None:
    """One random question from ``(seed, stream, i, attempt)``; None if its answer is too long."""
    rng = random.Random(int.from_bytes(digest(f"{seed}|{stream}|{i}|{attempt}"), "little"))
    operands = []
    for _ in range(space.terms):
        digits = rng.randint(space.min_digits, space.max_digits)
        operands.append(rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1))
    names = [op for op, _ in space.ops]
    weights = [w for _, w in space.ops]
    ops = rng.choices(names, weights, k=space.terms - 1)
    value = evaluate(operands, ops)
    return (_format(operands, ops), value) if _fits(space, value) else None


def _heldout_pool(space: _Space) -> tuple[tuple[str, int], ...]:
    """Every held-out (question, answer) of a small space, in a fixed enumeration order."""
    names = tuple(op for op, _ in space.ops)  # weights do not change the pool: cache without them
    return _enumerate_heldout(
        names, space.min_digits, space.max_digits, space.terms, space.max_answer_digits
    )


@lru_cache(maxsize=32)
def _enumerate_heldout(
    names: tuple[str, ...], min_digits: int, max_digits: int, terms: int, max_answer_digits: int
) -> tuple[tuple[str, int], ...]:
    space = _Space(
        tuple((op, 1.0) for op in names), min_digits, max_digits, terms, max_answer_digits
    )
    assert space.size <= ENUMERATE_LIMIT
    pool = []
    for operands in itertools.product(range(space.lo, space.hi + 1), repeat=terms):
        for ops in itertools.product(names, repeat=terms - 1):
            question = _format(operands, ops)
            value = evaluate(operands, ops)
            if _fits(space, value) and is_heldout(question):
                pool.append((question, value))
    return tuple(pool)


def _train_problem(space: _Space, seed: int, i: int) -> Problem:
    for attempt in range(MAX_DRAWS_PER_PROBLEM):
        drawn = _draw(space, seed, "train", i, attempt)
        if drawn is not None and not is_heldout(drawn[0]):
            return Problem(index=i, question=drawn[0], answer=str(drawn[1]))
    raise TaskDataError(
        f"could not draw train problem {i} in {MAX_DRAWS_PER_PROBLEM} tries ({space.describe()}): "
        "almost every answer is longer than max_answer_digits; raise max_answer_digits or use "
        "fewer digits, fewer terms or less '*'"
    )


_GENERATOR = Generator(
    space_from=_space_from,
    draw=_draw,
    pool=_heldout_pool,
    widen="max_digits, terms, ops",
    split_name_chars="_.-",
    too_few=lambda space, field, found, budget: (
        f"found only {found} distinct held-out problems in {budget} draws "
        f"({space.describe()}); lower {field}, raise max_answer_digits or widen the space"
    ),
    nothing_fits=lambda space, field, draws: (
        f"{field}: no problem among the first {draws} draws has an answer of at most "
        f"max_answer_digits={space.max_answer_digits} digits ({space.describe()}); "
        "raise max_answer_digits or use fewer digits, fewer terms or less '*'"
    ),
)


# ------------------------------------------------------------------------------------------ task


class ArithmeticTask(SeededTask):
    """Embedded arithmetic task; implements ``ftis.tasks.base.Task``.

    The config is re-validated here, so ``ArithmeticTask(cfg.model_copy(update={"ops": {...}}))``
    (which skips pydantic validation) is checked like any other config.
    """

    name = "arithmetic"
    config = ArithmeticTaskConfig
    generator = _GENERATOR

    def __init__(self, cfg: ArithmeticTaskConfig | Mapping[str, Any] | None = None) -> None:
        super().__init__(cfg)
        space, seed = _space_from(self.cfg, None, ""), self.cfg.seed
        self._train = VirtualSplit(lambda i: _train_problem(space, seed, i), "train ")
        logger.debug("arithmetic task: %s", {k: len(v) for k, v in self._eval.items()})

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 when the completion, stripped of surrounding whitespace, is the exact answer."""
        return 1.0 if completion.strip() == problem.answer else 0.0

    @staticmethod
    def extract_answer(completion: str) -> str | None:
        """The answer the reward compares: the completion stripped of whitespace (None when
        empty); eval counts distinct answers with it."""
        return completion.strip() or None

    @staticmethod
    def warmstart_example(problem: Problem) -> str:
        """Supervised warm-start text: question and answer, e.g. "23+45=68" (caller adds EOS)."""
        return problem.question + problem.answer

    def warmstart_ids(
        self, problem: Problem, tokenizer: PreTrainedTokenizerBase
    ) -> tuple[list[int], list[int]]:
        """(prompt ids exactly as ``prompt_ids`` gives them, answer ids); caller adds EOS.

        Use this rather than encoding ``warmstart_example`` when the warm start must condition on
        the very prompt that RL later uses (BOS included).
        """
        answer = as_id_list(tokenizer.encode(problem.answer, add_special_tokens=False))
        return self.prompt_ids(problem, tokenizer), answer
