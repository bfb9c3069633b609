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
import math
import operator
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from hashlib import blake2b
from typing import TYPE_CHECKING, Any, ClassVar, Literal, overload

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ftis.tasks.base import Problem, TaskConfigBase, TaskDataError, as_id_list, plain_prompt_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

OPS = ("+", "-", "*")
TRAIN_SIZE = 10**9  # length of the virtual train split
HELDOUT_BUCKETS = 16  # 1 bucket in 16 (bucket 0) is reserved for evaluation
ENUMERATE_LIMIT = 200_000  # spaces up to this many questions are enumerated exactly
MAX_DRAWS_PER_PROBLEM = 1_000  # rejection-sampling budget for one train problem
_SPLIT_NAME = re.compile(r"[A-Za-z0-9_.-]+")


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


class ArithmeticTaskConfig(TaskConfigBase):
    """The embedded arithmetic task: a problem space, a seed and the evaluation splits."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["arithmetic"] = Field(default="arithmetic", description="Task selector.")
    default_reward: ClassVar[str | None] = "builtin:exact_match"
    seed: int = Field(
        default=0, description="Seed of every split; all peers must share it to share indices."
    )
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
        space = _space_from(self, None, "")
        _check_pool("test_size", self.test_size, space)
        for name, variant in self.ood.items():
            if not _SPLIT_NAME.fullmatch(name) or name in ("train", "test"):
                raise ValueError(
                    f"ood split name {name!r} is not allowed: use letters, digits, '_', '.', '-' "
                    "and not 'train' or 'test' (the name appears in metric keys)"
                )
            where = f"ood[{name!r}]."
            _check_pool(where + "size", variant.size, _space_from(self, variant, where))
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
        value = None if variant is None else getattr(variant, field)
        return getattr(cfg, field) if value is None else value

    ops, min_d, max_d, terms, max_ans = (
        pick(f) for f in ("ops", "min_digits", "max_digits", "terms", "max_answer_digits")
    )
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise ValueError(
            f"{where}ops has unknown operation(s) {unknown}: use any of '+', '-', '*', "
            "e.g. ops: {'+': 1.0, '*': 0.5}"
        )
    bad = {op: w for op, w in ops.items() if not (math.isfinite(w) and w >= 0)}
    if bad:
        raise ValueError(f"{where}ops weights must be finite and >= 0, got {bad}")
    positive = tuple((op, float(ops[op])) for op in OPS if ops.get(op, 0.0) > 0)
    if not positive:
        raise ValueError(
            f"{where}ops weights are all zero ({ops}): give at least one operation a positive weight"
        )
    if not 1 <= min_d <= max_d <= 9:
        raise ValueError(
            f"{where}min_digits={min_d}, max_digits={max_d}: need 1 <= min_digits <= max_digits <= 9"
        )
    if not 2 <= terms <= 8:
        raise ValueError(f"{where}terms={terms}: use 2 to 8 operands per question")
    if max_ans < 1:
        raise ValueError(f"{where}max_answer_digits={max_ans}: must be at least 1")
    return _Space(positive, min_d, max_d, terms, max_ans)


def _check_pool(field: str, size: int, space: _Space) -> None:
    """Fail early when a held-out split asks for more distinct problems than exist."""
    if size < 1:
        raise ValueError(f"{field}={size}: an evaluation split needs at least 1 problem")
    if space.size <= ENUMERATE_LIMIT:
        available = len(_heldout_pool(space))
    else:  # about size/16 are held out; ask for at most half of them so draws stay fast
        available = space.size // (2 * HELDOUT_BUCKETS)
    if size > available:
        raise ValueError(
            f"{field}={size} is more than the {available} held-out problems available "
            f"({space.describe()}; 1 in {HELDOUT_BUCKETS} is held out for evaluation). "
            f"Lower {field}, or widen the space (max_digits, terms, ops)."
        )


# ------------------------------------------------------------------------------------ generation


def _digest(text: str) -> bytes:
    return blake2b(text.encode(), digest_size=16).digest()


def is_heldout(question: str) -> bool:
    """True when ``question`` belongs to the evaluation partition (bucket 0 of 16)."""
    return int.from_bytes(_digest(question)[:8], "little") % HELDOUT_BUCKETS == 0


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
    rng = random.Random(int.from_bytes(_digest(f"{seed}|{stream}|{i}|{attempt}"), "little"))
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


def _heldout_split(
    space: _Space, seed: int, stream: str, size: int, field: str
) -> tuple[Problem, ...]:
    """``size`` distinct held-out problems, drawn from ``(seed, stream, j)`` for j = 0, 1, ..."""
    seen: dict[str, int] = {}
    budget = 64 * HELDOUT_BUCKETS * size + 10_000
    fitting = 0  # draws whose answer is short enough
    for j in range(budget):
        if len(seen) == size:
            break
        drawn = _draw(space, seed, stream, j, 0)
        if drawn is None:
            if j + 1 == MAX_DRAWS_PER_PROBLEM and fitting == 0:
                raise TaskDataError(
                    f"{field}: no problem among the first {j + 1} draws has an answer of at most "
                    f"max_answer_digits={space.max_answer_digits} digits ({space.describe()}); "
                    "raise max_answer_digits or use fewer digits, fewer terms or less '*'"
                )
            continue
        fitting += 1
        if drawn[0] not in seen and is_heldout(drawn[0]):
            seen[drawn[0]] = drawn[1]
    if len(seen) < size and space.size <= ENUMERATE_LIMIT:
        # Random draws stall near the end of a small pool (coupon collector): fill the rest from
        # the enumerated pool in a seeded order.
        rest = [qa for qa in _heldout_pool(space) if qa[0] not in seen]
        random.Random(int.from_bytes(_digest(f"{seed}|{stream}|fill"), "little")).shuffle(rest)
        seen.update(rest[: size - len(seen)])
    if len(seen) < size:
        raise TaskDataError(
            f"{field}={size}: found only {len(seen)} distinct held-out problems in {budget} draws "
            f"({space.describe()}); lower {field}, raise max_answer_digits or widen the space"
        )
    return tuple(
        Problem(index=k, question=q, answer=str(v)) for k, (q, v) in enumerate(seen.items())
    )


class TrainSplit(Sequence[Problem]):
    """The virtual train split: item ``i`` is generated from ``(seed, "train", i)`` on access."""

    def __init__(self, space: _Space, seed: int) -> None:
        self._space, self._seed = space, seed

    def __len__(self) -> int:
        return TRAIN_SIZE

    @overload
    def __getitem__(self, i: int) -> Problem: ...
    @overload
    def __getitem__(self, i: slice) -> list[Problem]: ...
    def __getitem__(self, i: int | slice) -> Problem | list[Problem]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(TRAIN_SIZE))]
        i = operator.index(i)
        if i < 0:
            i += TRAIN_SIZE
        if not 0 <= i < TRAIN_SIZE:
            raise IndexError(f"train index {i} out of range [0, {TRAIN_SIZE})")
        return _train_problem(self._space, self._seed, i)

    def __contains__(self, item: object) -> bool:  # the inherited one would scan 10**9 items
        return (
            isinstance(item, Problem) and 0 <= item.index < TRAIN_SIZE and self[item.index] == item
        )

    def __iter__(self) -> Iterator[Problem]:
        return (self[i] for i in range(TRAIN_SIZE))


# ------------------------------------------------------------------------------------------ task


class ArithmeticTask:
    """Embedded arithmetic task; implements ``ftis.tasks.base.Task``.

    The config is re-validated here, so ``ArithmeticTask(cfg.model_copy(update={"ops": {...}}))``
    (which skips pydantic validation) is checked like any other config.
    """

    name = "arithmetic"

    def __init__(self, cfg: ArithmeticTaskConfig | Mapping[str, Any] | None = None) -> None:
        raw = {} if cfg is None else (cfg if isinstance(cfg, Mapping) else dict(cfg))
        self.cfg = ArithmeticTaskConfig.model_validate(raw)
        train_space = _space_from(self.cfg, None, "")
        self._train = TrainSplit(train_space, self.cfg.seed)
        self._eval: dict[str, tuple[Problem, ...]] = {
            "test": _heldout_split(
                train_space, self.cfg.seed, "test", self.cfg.test_size, "test_size"
            )
        }
        for name, variant in self.cfg.ood.items():
            where = f"ood[{name!r}]."
            space = _space_from(self.cfg, variant, where)
            self._eval[name] = _heldout_split(
                space, self.cfg.seed, f"ood:{name}", variant.size, where + "size"
            )
        self.eval_splits: tuple[str, ...] = tuple(self._eval)
        logger.debug("arithmetic task: %s", {k: len(v) for k, v in self._eval.items()})

    def split(self, name: str) -> Sequence[Problem]:
        if name == "train":
            return self._train
        if name in self._eval:
            return self._eval[name]
        raise ValueError(
            f"arithmetic task has no split {name!r}; use one of {['train', *self._eval]}"
        )

    def prompt_ids(self, problem: Problem, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """``[bos] + tokens(question)``: no chat template; BOS only if the tokenizer has one."""
        return plain_prompt_ids(tokenizer, problem.question)

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
