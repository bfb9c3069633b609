"""The embedded reasoning task: column arithmetic whose completions carry a worked trace.

A CPU-sized stand-in for GSM8K-style reasoning. Every completion is a *trace* of small steps,
then ``#``, then the final answer: a compact analogue of the paper's
``<think>...</think><answer>...</answer>`` that a character-level model can write: 14-29
characters for the default 2-3 digit problems (mean about 22), up to 39 for the 4-digit OOD ones,
one token per character with the character tokenizer (plus EOS).
Completions are long enough that two models' per-token distributions differ, so a peer's samples
are genuinely off-policy.

Skills (chosen per problem by the ``skills`` weights):

- ``add``: column addition of ``terms`` numbers with ``d`` digits each, right to left, one step
  per column, the carry written as an extra term when it is not 0::

      457+386=   ->   7+6=13,5+8+1=14,4+3+1=8#843
      12+34+56=  ->   2+4+6=12,1+3+5+1=10#102

- ``mul``: a ``d``-digit number times one digit (2-9), digit by digit, right to left, the carry
  written as an extra term when it is not 0 (``terms`` does not apply: always two operands)::

      347*6=     ->   7*6=42,4*6+4=28,3*6+2=20#2082

- ``sub``: column subtraction of two ``d``-digit numbers, the larger first (a non-negative
  result), right to left; a column that must borrow is written with its 10 added, and the next
  column subtracts the borrowed 1 (``terms`` does not apply)::

      457-386=   ->   7-6=1,15-8=7,4-3-1=0#71

- ``div``: a ``d``-digit number divided by one digit (2-9), the quotient without its remainder,
  by long division left to right: each step divides the remainder so far (times 10) plus the
  next digit, and its value is one digit of the quotient (``terms`` does not apply)::

      852/4=     ->   8/4=2,5/4=1,12/4=3#213
      347/6=     ->   3/6=0,34/6=5,47/6=7#57

The answer is the last step's value followed by the last digit of every earlier step's value,
last step first (here ``8``, ``4``, ``3``); for ``sub`` every step's value is one digit of the
difference, and the answer drops the leading zeros (``071`` is ``71``); for ``div`` the steps'
values are the quotient's digits in order, leading zeros dropped (``057`` is ``57``).

Completion format (what the verifier accepts), after stripping surrounding whitespace::

    completion := step ("," step)* "#" answer
    step       := number (op number)+ "=" number        op in "+", "*", "-", "/"
    answer     := "-"? number                            number := [0-9]+

Reward (the paper's format + answer reward): 1.0 when the completion is well formed **and** its
answer is the exact value, else 0.0. "Well formed" is checked on syntax only, as the paper checks
its tags: the steps' arithmetic is not graded, only the final answer; a right answer without a
trace, or with a malformed one, gets 0.

Problem generation follows ``ftis.tasks.arithmetic`` (same discipline, same partition):

- Train problem ``i`` is a pure function of ``(seed, "train", i)`` (a blake2b digest seeds a
  private ``random.Random``); the train split is a virtual, index-addressable sequence of
  ``TRAIN_SIZE`` items, so peers exchange prompt indices, never text.
- Held-out partition: a question is reserved for evaluation when its blake2b hash falls in
  bucket 0 of 16 (``ftis.tasks.generated.is_heldout``, the very same function). Train draws
  reject held-out questions; evaluation splits keep only held-out ones (distinct, in draw order).
- A problem: a skill by the ``skills`` weights, a digit count ``d`` uniform in the skill's
  [min_digits, max_digits] (one range for all skills, or one per skill), then operands uniform
  among ``d``-digit numbers (10^(d-1) to 10^d - 1; 1 to 9 for ``d`` = 1).
- Evaluation splits: ``test`` (in distribution) and the named ``ood`` variants, each overriding
  some of skills / digits / terms. The default variant ``ood`` has exactly one digit more than
  trained for every skill (``extra_digits: 1``: one more step in every trace). A variant can also
  be an in-distribution slice, e.g. ``{skills: {add: 1}}`` to measure one skill alone.

Warm start ("pre-training"). Tiny models trained only on 2-3 digit problems solve no 4-digit
problem at all (they do not extrapolate in length), so an OOD split of one more digit would be
0% for every model and method. The paper's base models, by contrast, had seen harder math than
GSM8K before RL, and partly solve MATH-500. The same holds here: the warm start draws from
``warmstart_split()``, the train space plus a ``pretrain_fraction`` share (default 10%) of
problems with 1 to ``pretrain_extra_digits`` more digits (never held-out questions); RL trains
on the ``train`` split only. ``ftis.warmstart`` trains on ``warmstart_target(problem)``, the full
trace and answer.
"""

from __future__ import annotations

import itertools
import logging
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ftis.tasks.base import Problem, TaskDataError
from ftis.tasks.generated import (
    MAX_DRAWS_PER_PROBLEM,
    Generator,
    SeededTask,
    SeededTaskConfig,
    VirtualSplit,
    digest,
    is_heldout,
    merged,
    weighted_names,
)

logger = logging.getLogger(__name__)

SKILLS = ("add", "mul", "sub", "div")  # new skills go last: earlier configs draw as before
MAX_DIGITS = 8
MUL_DIGITS = range(2, 10)  # the one-digit multiplier of "mul", the one-digit divisor of "div"

_STEP = r"\d+(?:[-+*/]\d+)+=\d+"
_COMPLETION = re.compile(rf"(?P<trace>{_STEP}(?:,{_STEP})*)#(?P<answer>-?\d+)")


# --------------------------------------------------------------------------------------- config

Digits = int | dict[str, int]


class ReasoningVariant(BaseModel):
    """A named evaluation split: overrides some of the train space, with its own size."""

    model_config = ConfigDict(extra="forbid")

    skills: dict[str, float] | None = Field(
        default=None, description="Skill weights for this split; null keeps the train ones."
    )
    min_digits: Digits | None = Field(
        default=None,
        description="Fewest digits per operand (or per skill); null keeps the train value.",
    )
    max_digits: Digits | None = Field(
        default=None,
        description="Most digits per operand (or per skill); null keeps the train value.",
    )
    extra_digits: int | None = Field(
        default=None,
        ge=1,
        description="Exactly this many digits more than the train max_digits of each skill "
        "(sets both min and max digits; do not combine with them).",
    )
    terms: int | None = Field(
        default=None, description="Addends per 'add' question; null keeps the train value."
    )
    size: int = Field(default=256, description="Number of distinct held-out problems in the split.")

    @model_validator(mode="after")
    def _one_way(self) -> ReasoningVariant:
        if self.extra_digits is not None and (
            self.min_digits is not None or self.max_digits is not None
        ):
            raise ValueError("give either extra_digits or min_digits/max_digits, not both")
        return self


class ReasoningTaskConfig(SeededTaskConfig):
    """The embedded reasoning task: column arithmetic with a worked trace, from a seed."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["reasoning"] = Field(default="reasoning", description="Task selector.")
    default_reward: ClassVar[str | None] = "builtin:reasoning"
    skills: dict[str, float] = Field(
        default_factory=lambda: {"add": 1.0, "mul": 1.0},
        description='Sampling weights over the skills "add" (column addition with carries), '
        '"mul" (digit-by-digit multiplication by one digit), "sub" (column subtraction with '
        'borrows, the larger number first) and "div" (long division by one digit, the quotient); '
        "need not sum to 1.",
    )
    min_digits: Digits = Field(
        default=2,
        description="Fewest digits per multi-digit operand: one number, or one per skill.",
    )
    max_digits: Digits = Field(
        default=3,
        description="Most digits per multi-digit operand: one number, or one per skill, e.g. "
        "{add: 4, mul: 3}.",
    )
    terms: int = Field(default=2, description="Addends per 'add' question (2 gives 'a+b=').")
    test_size: int = Field(
        default=256, description="Distinct held-out problems in the in-distribution test split."
    )
    ood: dict[str, ReasoningVariant] = Field(
        default_factory=lambda: {"ood": ReasoningVariant(extra_digits=1)},
        description="Named evaluation splits after 'test'. Default: 'ood', every skill with "
        "exactly one digit more than its train max_digits (one more step in every trace).",
    )
    pretrain_fraction: float = Field(
        default=0.1,
        ge=0.0,
        lt=1.0,
        description="Share of warm-start ('pre-training') examples with more digits than RL "
        "trains on (see pretrain_extra_digits), so that the base models partly solve the longer "
        "out-of-distribution problems, as GSM8K's base models had seen harder math. Held-out "
        "questions are never used. RL never trains on these lengths.",
    )
    pretrain_extra_digits: int = Field(
        default=1,
        ge=1,
        description="Those warm-start examples have 1 to this many digits more than max_digits.",
    )

    @model_validator(mode="after")
    def _check(self) -> ReasoningTaskConfig:
        for split, _, space, size, field in _GENERATOR.eval_spaces(self):
            _GENERATOR.check_pool(field, size, space)
            if split == "test":  # the train space
                _pretrain_space(self, space)
        return self


@dataclass(frozen=True)
class _Skill:
    name: str  # one of SKILLS
    weight: float
    min_digits: int
    max_digits: int


@dataclass(frozen=True)
class _Space:
    """A validated problem space (hashable)."""

    skills: tuple[_Skill, ...]  # skills with positive weight, in SKILLS order
    terms: int

    def count(self, skill: _Skill) -> int:
        """Distinct questions of one skill."""
        n = 0
        for d in range(skill.min_digits, skill.max_digits + 1):
            per = 9 if d == 1 else 9 * 10 ** (d - 1)
            if skill.name == "add":
                n += per**self.terms
            elif skill.name == "sub":
                n += per * (per + 1) // 2  # pairs a >= b
            else:  # mul, div: a d-digit number and one digit
                n += per * len(MUL_DIGITS)
        return n

    @property
    def size(self) -> int:
        return sum(self.count(s) for s in self.skills)

    def describe(self) -> str:
        parts = ", ".join(f"{s.name} {s.min_digits}-{s.max_digits} digits" for s in self.skills)
        return f"{parts}, {self.terms} addends: {self.size} questions"


def _per_skill(value: Digits, names: list[str], field: str) -> dict[str, int]:
    if not isinstance(value, dict):
        return dict.fromkeys(names, value)
    unknown = sorted(set(value) - set(SKILLS))
    missing = [s for s in names if s not in value]
    if unknown or missing:
        raise ValueError(
            f"{field}={value} must give a value for each skill in use ({', '.join(names)}) and "
            f"name no other (unknown: {unknown}, missing: {missing})"
        )
    return value


def _space_from(cfg: ReasoningTaskConfig, variant: ReasoningVariant | None, where: str) -> _Space:
    """Merge a variant over the train space and validate it; ``where`` prefixes field names."""

    def pick(field: str) -> Any:
        return merged(cfg, variant, field)

    skills, terms = pick("skills"), pick("terms")
    names = weighted_names(
        skills,
        SKILLS,
        where,
        "skills",
        unknown_what="skill(s)",
        choices=", ".join(SKILLS),
        example="{add: 1.0, mul: 0.5}",
        zero_hint="give one skill a positive weight",
    )
    if variant is not None and variant.extra_digits is not None:
        train_max = _per_skill(cfg.max_digits, names, where + "max_digits (train)")
        lo = hi = {s: train_max[s] + variant.extra_digits for s in names}
    else:
        lo = _per_skill(pick("min_digits"), names, where + "min_digits")
        hi = _per_skill(pick("max_digits"), names, where + "max_digits")
    out = []
    for name in names:
        if not 1 <= lo[name] <= hi[name] <= MAX_DIGITS:
            raise ValueError(
                f"{where}digits of {name}: min {lo[name]}, max {hi[name]}; need "
                f"1 <= min_digits <= max_digits <= {MAX_DIGITS}"
            )
        out.append(_Skill(name, float(skills[name]), lo[name], hi[name]))
    if not 2 <= terms <= 4:
        raise ValueError(f"{where}terms={terms}: use 2 to 4 addends per 'add' question")
    return _Space(tuple(out), terms)


def _pretrain_space(cfg: ReasoningTaskConfig, train: _Space) -> _Space:
    """The longer problems of the warm start: 1 to pretrain_extra_digits more digits."""
    extra = cfg.pretrain_extra_digits
    skills = tuple(
        _Skill(s.name, s.weight, s.max_digits + 1, s.max_digits + extra) for s in train.skills
    )
    if cfg.pretrain_fraction > 0 and any(s.max_digits > MAX_DIGITS for s in skills):
        raise ValueError(
            f"pretrain_extra_digits={extra}: max_digits + pretrain_extra_digits must be at most "
            f"{MAX_DIGITS}"
        )
    return _Space(skills, train.terms)


# ------------------------------------------------------------------------------ traces and answers


def _digits(x: int, width: int) -> list[int]:
    """Digits of ``x``, least significant first, zero-padded to ``width``."""
    return [(x // 10**k) % 10 for k in range(width)]


def _column_steps(operands: Sequence[int], op: str) -> list[tuple[str, int]]:
    """(step text, step value) per column, right to left: '5+8+1=14' -> ('5+8+1', 14); for
    division, per digit of the dividend, left to right: '12/4=3' -> ('12/4', 3)."""
    if op == "/":  # a / m: the remainder so far times 10 plus the next digit, over m
        a, m = operands
        steps, rest = [], 0
        for digit in str(a):
            part = 10 * rest + int(digit)
            steps.append((f"{part}/{m}", part // m))
            rest = part % m
        return steps
    width = len(str(operands[0]))
    cols = [_digits(x, width) for x in operands]
    steps, carry = [], 0
    if op == "-":  # a - b, a >= b: borrow where a column's digit (less a borrow) is too small
        borrow = 0
        for k in range(width):
            a, b = cols[0][k], cols[1][k]
            out = 1 if a - borrow < b else 0
            top = a + 10 * out
            text = f"{top}-{b}" + ("-1" if borrow else "")
            steps.append((text, top - b - borrow))
            borrow = out
        return steps
    for k in range(width):
        if op == "+":
            terms = [c[k] for c in cols]
            value = sum(terms) + carry
        else:  # "*": operands = (a, m); only a has columns
            terms = [cols[0][k], operands[1]]
            value = terms[0] * terms[1] + carry
        text = op.join(str(t) for t in terms) + (f"+{carry}" if carry else "")
        steps.append((text, value))
        carry = value // 10
    return steps


def _answer_from(values: Sequence[int]) -> str:
    """The final answer a trace spells: last value, then earlier values' last digits."""
    return str(values[-1]) + "".join(str(v % 10) for v in reversed(values[:-1]))


def answer_of(skill: str, values: Sequence[int]) -> str:
    """The final answer a trace of `skill` spells from its steps' values (module docstring):
    add and mul as `_answer_from`; sub the same, leading zeros dropped; div the quotient's
    digits in order, leading zeros dropped."""
    if skill == "div":
        return str(int("".join(str(v) for v in values)))
    answer = _answer_from(values)
    return str(int(answer)) if skill == "sub" else answer


def parse_question(question: str) -> tuple[str, list[int]]:
    """('add' | 'mul' | 'sub' | 'div', operands) of a question such as '457+386=', '347*6=',
    '457-386=' or '852/4='."""
    m = re.fullmatch(
        r"(\d+(?:\+\d+)+)=|(\d+)\*(\d)=|(\d+)-(\d+)=|(\d+)/([2-9])=", question
    )  # fmt: skip
    if m is None:
        raise ValueError(f"not a reasoning question: {question!r}")
    if m.group(1) is not None:
        return "add", [int(x) for x in m.group(1).split("+")]
    if m.group(2) is not None:
        return "mul", [int(m.group(2)), int(m.group(3))]
    if m.group(6) is not None:
        return "div", [int(m.group(6)), int(m.group(7))]
    a, b = int(m.group(4)), int(m.group(5))
    if a < b or len(m.group(4)) != len(m.group(5)):  # the larger first, same digit count
        raise ValueError(f"not a reasoning question: {question!r}")
    return "sub", [a, b]


_OPS = {"add": "+", "mul": "*", "sub": "-", "div": "/"}


def solution(question: str) -> str:
    """The reference completion (trace, '#', answer) of a question, without EOS."""
    skill, operands = parse_question(question)
    steps = _column_steps(operands, _OPS[skill])
    trace = ",".join(f"{text}={value}" for text, value in steps)
    return f"{trace}#{answer_of(skill, [v for _, v in steps])}"


def extract_answer(completion: str) -> str | None:
    """The answer of a well-formed completion (see the module docstring), else None."""
    m = _COMPLETION.fullmatch(completion.strip())
    return None if m is None else m.group("answer")


def _value(skill: str, operands: Sequence[int]) -> int:
    if skill == "add":
        return sum(operands)
    if skill == "sub":
        return operands[0] - operands[1]
    if skill == "div":
        return operands[0] // operands[1]
    return operands[0] * operands[1]


def _format(skill: str, operands: Sequence[int]) -> str:
    return _OPS[skill].join(str(x) for x in operands) + "="


# ------------------------------------------------------------------------------------ generation


def _draw(space: _Space, seed: int, stream: str, i: int, attempt: int) -> tuple[str, int]:
    """One random (question, value) from ``(seed, stream, i, attempt)``."""
    rng = random.Random(
        int.from_bytes(digest(f"reasoning|{seed}|{stream}|{i}|{attempt}"), "little")
    )
    skill = rng.choices(space.skills, [s.weight for s in space.skills])[0]
    d = rng.randint(skill.min_digits, skill.max_digits)
    lo, hi = (1 if d == 1 else 10 ** (d - 1)), 10**d - 1
    if skill.name == "add":
        operands = [rng.randint(lo, hi) for _ in range(space.terms)]
    elif skill.name == "sub":
        operands = sorted((rng.randint(lo, hi), rng.randint(lo, hi)), reverse=True)
    else:  # mul, div: a d-digit number and one digit
        operands = [rng.randint(lo, hi), rng.choice(MUL_DIGITS)]
    return _format(skill.name, operands), _value(skill.name, operands)


def _heldout_pool(space: _Space) -> tuple[tuple[str, int], ...]:
    """Every held-out (question, value) of a small space, in a fixed enumeration order."""
    pool: list[tuple[str, int]] = []
    for s in space.skills:  # weights do not change the pool
        pool += _enumerate_heldout(s.name, s.min_digits, s.max_digits, space.terms)
    return tuple(pool)


@lru_cache(maxsize=32)
def _enumerate_heldout(
    skill: str, min_digits: int, max_digits: int, terms: int
) -> tuple[tuple[str, int], ...]:
    pool = []
    for d in range(min_digits, max_digits + 1):
        numbers = range(1 if d == 1 else 10 ** (d - 1), 10**d)
        if skill == "add":
            combos: Iterator[tuple[int, ...]] = itertools.product(numbers, repeat=terms)
        elif skill == "sub":
            combos = ((a, b) for a in numbers for b in numbers if a >= b)
        else:  # mul, div
            combos = itertools.product(numbers, MUL_DIGITS)
        for operands in combos:
            q = _format(skill, operands)
            if is_heldout(q):
                pool.append((q, _value(skill, operands)))
    return tuple(pool)


def _train_problem(space: _Space, seed: int, stream: str, i: int) -> Problem:
    """Problem ``i`` of a virtual split: the first draw whose question is not held out."""
    for attempt in range(MAX_DRAWS_PER_PROBLEM):
        question, value = _draw(space, seed, stream, i, attempt)
        if not is_heldout(question):
            return Problem(index=i, question=question, answer=str(value))
    raise TaskDataError(
        f"could not draw {stream} problem {i} ({space.describe()})"
    )  # pragma: no cover


def _unit(seed: int, stream: str, i: int) -> float:
    """A uniform number in [0, 1) from ``(seed, stream, i)``."""
    return int.from_bytes(digest(f"reasoning|{seed}|{stream}|{i}")[:8], "little") / 2**64


_GENERATOR = Generator(
    space_from=_space_from,
    draw=_draw,
    pool=_heldout_pool,
    widen="max_digits, skills",
    split_name_chars="_.+-",
    too_few=lambda space, field, found, _: (
        f"found only {found} distinct held-out problems ({space.describe()}); "
        f"lower {field} or widen the space"
    ),
)


# ------------------------------------------------------------------------------------------ task


class ReasoningTask(SeededTask):
    """Embedded reasoning task; implements ``ftis.tasks.base.Task``.

    The config is re-validated here, so a ``model_copy(update=...)`` (which skips pydantic
    validation, as the warm start's ``mix`` does) is checked like any other config.
    """

    name = "reasoning"
    config = ReasoningTaskConfig
    generator = _GENERATOR

    def __init__(self, cfg: ReasoningTaskConfig | Mapping[str, Any] | None = None) -> None:
        super().__init__(cfg)
        seed = self.cfg.seed
        train_space = _space_from(self.cfg, None, "")
        longer = _pretrain_space(self.cfg, train_space)
        fraction = self.cfg.pretrain_fraction
        self._train = VirtualSplit(lambda i: _train_problem(train_space, seed, "train", i))
        self._pretrain = VirtualSplit(
            lambda i: _train_problem(
                longer if _unit(seed, "pretrain-pick", i) < fraction else train_space,
                seed,
                "pretrain",
                i,
            )
        )

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 when the completion is well formed and its answer is exact, else 0.0."""
        return 1.0 if extract_answer(completion) == problem.answer else 0.0

    def extract_answer(self, completion: str) -> str | None:
        """The final answer (after '#') of a well-formed completion, else None (the module's
        ``extract_answer``); eval counts distinct answers with it."""
        return extract_answer(completion)

    def warmstart_split(self) -> Sequence[Problem]:
        """The warm start's ("pre-training") examples: the train space, plus a
        ``pretrain_fraction`` share of longer problems (never held-out questions)."""
        return self._pretrain

    @staticmethod
    def warmstart_target(problem: Problem) -> str:
        """Supervised warm-start completion: the worked trace and the answer (caller adds EOS)."""
        return solution(problem.question)
