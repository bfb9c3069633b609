"""What the embedded tasks whose problems are made on the fly from a seed share
(``ftis.tasks.arithmetic``, ``ftis.tasks.reasoning``): the held-out partition, the virtual
train split, the evaluation splits (``test`` and the named ``ood`` variants) and the checks
that each has enough distinct held-out problems.

- A question is reserved for evaluation when its blake2b hash falls in bucket 0 of
  ``HELDOUT_BUCKETS``; the partition depends on the question text only (not on the seed), so no
  run ever trains on any run's evaluation questions. Python's ``hash()`` is salted per process
  and is never used.
- A train split is a virtual sequence of ``TRAIN_SIZE`` problems, each a pure function of its
  index, so peers exchange prompt indices, never text.
- An evaluation split keeps ``size`` distinct held-out problems in draw order; small spaces (at
  most ``ENUMERATE_LIMIT`` questions) are enumerated, to check that the size fits and to fill the
  split when random draws stall.
"""

from __future__ import annotations

import math
import operator
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, overload

from pydantic import BaseModel, ConfigDict, Field

from ftis.tasks.base import Problem, TaskConfigBase, TaskDataError, named_split, plain_prompt_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TRAIN_SIZE = 10**9  # length of the virtual train split
HELDOUT_BUCKETS = 16  # 1 bucket in 16 (bucket 0) is reserved for evaluation
ENUMERATE_LIMIT = 200_000  # spaces up to this many questions are enumerated exactly
MAX_DRAWS_PER_PROBLEM = 1_000  # rejection-sampling budget for one train problem

Drawn = tuple[str, int]  # (question, answer value)


def digest(text: str) -> bytes:
    return blake2b(text.encode(), digest_size=16).digest()


def is_heldout(question: str) -> bool:
    """True when ``question`` belongs to the evaluation partition (bucket 0 of 16)."""
    return int.from_bytes(digest(question)[:8], "little") % HELDOUT_BUCKETS == 0


class SeededTaskConfig(TaskConfigBase):
    """Base of a seeded task's config."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(
        default=0, description="Seed of every split; all peers must share it to share indices."
    )


def merged(cfg: BaseModel, variant: BaseModel | None, field: str) -> Any:
    """A variant's value of ``field``, or the train config's where the variant has none."""
    value = None if variant is None else getattr(variant, field)
    return getattr(cfg, field) if value is None else value


def weighted_names(
    weights: Mapping[str, float],
    known: Sequence[str],
    where: str,
    field: str,
    *,
    unknown_what: str,
    choices: str,
    example: str,
    zero_hint: str,
) -> list[str]:
    """The names in ``known`` (in that order) with a positive weight, after checking that
    ``weights`` names no other, and that every weight is finite and >= 0 and one positive."""
    unknown = sorted(set(weights) - set(known))
    if unknown:
        raise ValueError(
            f"{where}{field} has unknown {unknown_what} {unknown}: use any of {choices}, "
            f"e.g. {field}: {example}"
        )
    bad = {k: w for k, w in weights.items() if not (math.isfinite(w) and w >= 0)}
    if bad:
        raise ValueError(f"{where}{field} weights must be finite and >= 0, got {bad}")
    names = [k for k in known if weights.get(k, 0.0) > 0]
    if not names:
        raise ValueError(f"{where}{field} weights are all zero ({weights}): {zero_hint}")
    return names


class Space(Protocol):
    """A validated problem space: how many distinct questions it has, and a line saying what."""

    @property
    def size(self) -> int: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class Generator:
    """How one seeded task makes its problems, and the words of its errors.

    ``space_from(cfg, variant, where)``: the validated space of the train split (variant None)
    or of a named variant merged over it (``where`` prefixes field names in errors);
    ``draw(space, seed, stream, j, attempt)``: one (question, value), None when it does not fit
    the space; ``pool(space)``: every held-out (question, value) of a small space, in a fixed
    order; ``widen``: the fields that grow a space; ``split_name``/``split_name_chars``: the
    names a variant may have; ``too_few(space, field, found, budget)``: the end of the error when
    a split has too few distinct held-out problems; ``nothing_fits(space, field, draws)``: the
    error when none of the first draws fits (None: every draw fits)."""

    space_from: Callable[[Any, Any, str], Any]
    draw: Callable[[Any, int, str, int, int], Drawn | None]
    pool: Callable[[Any], Sequence[Drawn]]
    widen: str
    split_name_chars: str  # besides letters and digits, e.g. "_.-"
    too_few: Callable[[Any, str, int, int], str]
    nothing_fits: Callable[[Any, str, int], str] | None = None

    def check_pool(self, field: str, size: int, space: Space) -> None:
        """Fail early when a held-out split asks for more distinct problems than exist."""
        if size < 1:
            raise ValueError(f"{field}={size}: an evaluation split needs at least 1 problem")
        if space.size <= ENUMERATE_LIMIT:
            available = len(self.pool(space))
        else:  # about size/16 are held out; ask for at most half of them so draws stay fast
            available = space.size // (2 * HELDOUT_BUCKETS)
        if size > available:
            raise ValueError(
                f"{field}={size} is more than the {available} held-out problems available "
                f"({space.describe()}; 1 in {HELDOUT_BUCKETS} is held out for evaluation). "
                f"Lower {field}, or widen the space ({self.widen})."
            )

    def eval_spaces(self, cfg: Any) -> Iterator[tuple[str, str, Any, int, str]]:
        """(split, stream, space, size, field) of each evaluation split of a task config with
        ``test_size`` and ``ood`` (named variants of the train space, each with a ``size``):
        ``test`` first, then the variants in order."""
        yield "test", "test", self.space_from(cfg, None, ""), cfg.test_size, "test_size"
        for name, variant in cfg.ood.items():
            allowed = self.split_name_chars
            ok = re.fullmatch(f"[A-Za-z0-9{re.escape(allowed)}]+", name)
            if not ok or name in ("train", "test"):
                raise ValueError(
                    f"ood split name {name!r} is not allowed: use letters, digits, "
                    f"{', '.join(map(repr, allowed))} and not 'train' or 'test' (the name "
                    "appears in metric keys)"
                )
            where = f"ood[{name!r}]."
            space = self.space_from(cfg, variant, where)
            yield name, f"ood:{name}", space, variant.size, where + "size"

    def heldout_split(
        self, space: Space, seed: int, stream: str, size: int, field: str
    ) -> tuple[Problem, ...]:
        """``size`` distinct held-out problems, drawn from ``(seed, stream, j)`` for j = 0, 1,
        ... Random draws stall near the end of a small pool (coupon collector): the rest comes
        from the enumerated pool in a seeded order."""
        seen: dict[str, int] = {}
        budget = 64 * HELDOUT_BUCKETS * size + 10_000
        fitting = 0  # draws that fit the space
        for j in range(budget):
            if len(seen) == size:
                break
            drawn = self.draw(space, seed, stream, j, 0)
            if drawn is None:
                if j + 1 == MAX_DRAWS_PER_PROBLEM and fitting == 0 and self.nothing_fits:
                    raise TaskDataError(self.nothing_fits(space, field, j + 1))
                continue
            fitting += 1
            if drawn[0] not in seen and is_heldout(drawn[0]):
                seen[drawn[0]] = drawn[1]
        if len(seen) < size and space.size <= ENUMERATE_LIMIT:
            rest = [qa for qa in self.pool(space) if qa[0] not in seen]
            random.Random(int.from_bytes(digest(f"{seed}|{stream}|fill"), "little")).shuffle(rest)
            seen.update(rest[: size - len(seen)])
        if len(seen) < size:
            raise TaskDataError(f"{field}={size}: {self.too_few(space, field, len(seen), budget)}")
        return tuple(
            Problem(index=k, question=q, answer=str(v)) for k, (q, v) in enumerate(seen.items())
        )


class SeededTask:
    """Base of a task made from a seed (implements ``ftis.tasks.base.Task`` with its
    subclass): validates its config (again, so that a ``model_copy(update=...)``, which skips
    pydantic validation, is checked like any other config), builds the evaluation splits, and
    gives the splits by name and the plain prompt. A subclass sets ``name``, ``config`` and
    ``generator`` and builds ``self._train``."""

    name: ClassVar[str]
    config: ClassVar[type[BaseModel]]
    generator: ClassVar[Generator]

    def __init__(self, cfg: BaseModel | Mapping[str, Any] | None = None) -> None:
        raw = {} if cfg is None else (cfg if isinstance(cfg, Mapping) else dict(cfg))
        self.cfg: Any = self.config.model_validate(raw)
        self._train: Sequence[Problem] = ()
        gen, seed = self.generator, self.cfg.seed
        self._eval: dict[str, tuple[Problem, ...]] = {
            split: gen.heldout_split(space, seed, stream, size, field)
            for split, stream, space, size, field in gen.eval_spaces(self.cfg)
        }
        self.eval_splits: tuple[str, ...] = tuple(self._eval)

    def split(self, name: str) -> Sequence[Problem]:
        return named_split(self.name, name, self._train, self._eval)

    def prompt_ids(self, problem: Problem, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """``[bos] + tokens(question)``: no chat template; BOS only if the tokenizer has one."""
        return plain_prompt_ids(tokenizer, problem.question)


class VirtualSplit(Sequence[Problem]):
    """A split of ``size`` problems (``TRAIN_SIZE`` unless said), each made on access by
    ``make(i)``; ``label`` opens the IndexError's message ("train " -> "train index 7 out of
    range ...")."""

    def __init__(
        self, make: Callable[[int], Problem], label: str = "", size: int = TRAIN_SIZE
    ) -> None:
        self._make, self._label, self._size = make, label, size

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, i: int) -> Problem: ...
    @overload
    def __getitem__(self, i: slice) -> list[Problem]: ...
    def __getitem__(self, i: int | slice) -> Problem | list[Problem]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._size))]
        i = operator.index(i)
        if i < 0:
            i += self._size
        if not 0 <= i < self._size:
            raise IndexError(f"{self._label}index {i} out of range [0, {self._size})")
        return self._make(i)

    def __contains__(self, item: object) -> bool:  # the inherited one would make every item
        return (
            isinstance(item, Problem) and 0 <= item.index < self._size and self[item.index] == item
        )

    def __iter__(self) -> Iterator[Problem]:
        return (self[i] for i in range(self._size))
