"""A configured reward at run time: a weighted sum of functions scored over a batch, with the
errors of each function caught per completion and counted; and the task wrapper that makes it a
task's verifier (`RewardedTask`), so every caller of `task.reward` uses it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import traceback
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ftis.rewards import RewardFn, RewardTerm, finite_number, resolve_reward, short_name
from ftis.tasks.base import Problem

log = logging.getLogger(__name__)


def reward_fields(problem: Problem) -> dict[str, Any]:
    """What a reward function's `fields` holds: the question, the gold answer, then the row's
    own columns (which win on a name clash)."""
    return {"question": problem.question, "answer": problem.answer, **problem.fields}


def where_raised(exc: BaseException) -> str:
    """`file:line in function: Type: message` of the innermost frame of `exc`'s traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    head = f"{type(exc).__name__}: {exc}"
    if not frames:
        return head
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {head}"


@dataclass
class _Term:
    name: str
    fn: RewardFn
    weight: float
    per_problem: bool = False  # fn(problem, completion): a task's own method
    report: bool = False  # its mean is a row's `reward/<name>` (fn.report_mean is true)


class Reward:
    """Weighted sum of reward functions. `score(problems, completions)` returns one float per
    completion; every function is called as fn(prompt, completion, fields) (`reward_fields`) on
    every completion; async functions run concurrently.

    Counters since the last `pop_stats()`: completions scored, how many earned a non-zero
    reward, and each function's errors."""

    def __init__(self, terms: Sequence[RewardTerm | tuple]) -> None:
        self.terms: list[_Term] = []
        for t in terms:
            if isinstance(t, RewardTerm):
                self.terms.append(
                    _Term(short_name(t.function), resolve_reward(t.function), t.weight)
                )
            else:
                self.terms.append(_Term(*t))
        for term in self.terms:
            term.report = term.report or getattr(term.fn, "report_mean", False) is True
        if not self.terms:
            raise ValueError("a reward needs at least one function")
        self.errors: Counter[str] = Counter()
        self.sums: Counter[str] = Counter()  # unweighted values of the reported terms
        self.scored = 0
        self.nonzero = 0
        self.total_scored = 0  # since the start, for the zero-reward warning
        self.total_nonzero = 0
        self._warned: set[str] = set()

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.terms]

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        n = len(completions)
        fields: list[Mapping[str, Any]] = [reward_fields(p) for p in problems]
        total = [0.0] * n
        pending: list[tuple[_Term, int, Any]] = []
        for term in self.terms:
            for i in range(n):
                try:
                    if term.per_problem:
                        value = term.fn(problems[i], completions[i])
                    else:
                        value = term.fn(problems[i].question, completions[i], fields[i])
                except Exception as e:
                    self._failed(term, e)
                    continue
                if inspect.isawaitable(value):
                    pending.append((term, i, value))
                else:
                    self._add(term, total, i, value)
        if pending:
            results = _run_concurrently([aw for _, _, aw in pending])
            for (term, i, _), value in zip(pending, results):
                if isinstance(value, BaseException):
                    self._failed(term, value)
                else:
                    self._add(term, total, i, value)
        self.scored += n
        self.nonzero += sum(1 for r in total if r != 0)
        self.total_scored += n
        self.total_nonzero += sum(1 for r in total if r != 0)
        return total

    def _add(self, term: _Term, total: list[float], i: int, value: Any) -> None:
        try:
            value = finite_number(value)
        except (TypeError, ValueError) as e:
            self._failed(term, e)
            return
        total[i] += term.weight * value
        if term.report:
            self.sums[term.name] += value

    def _failed(self, term: _Term, exc: BaseException) -> None:
        self.errors[term.name] += 1
        if term.name not in self._warned:
            self._warned.add(term.name)
            log.warning(
                "reward %s raised on a completion (it scores 0 there; counted in "
                "reward/errors/%s): %s",
                term.name,
                term.name,
                where_raised(exc),
            )
        else:
            log.debug("reward %s: %s", term.name, where_raised(exc))

    def pop_stats(self) -> dict[str, float]:
        """The metrics row's reward counters since the last call: `reward/scored`,
        `reward/nonzero` and `reward/errors/<function>` (every function that is not built in
        gets a value, 0 included; a built-in one only when it failed); and `reward/<function>`,
        the mean unweighted value of each function with `report_mean = True` (a failure counts
        0), when a completion was scored."""
        out = {"reward/scored": float(self.scored), "reward/nonzero": float(self.nonzero)}
        for t in self.terms:
            if self.errors[t.name] or not t.name.startswith("builtin:"):
                out[f"reward/errors/{t.name}"] = float(self.errors[t.name])
            if t.report and self.scored:
                out[f"reward/{t.name}"] = self.sums[t.name] / self.scored
        self.errors.clear()
        self.sums.clear()
        self.scored = self.nonzero = 0
        return out


def _run_concurrently(awaitables: list[Any]) -> list[Any]:
    """Await every awaitable concurrently; an exception is returned in its place."""

    async def gather() -> list[Any]:
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    # called from inside a running event loop: run ours in a thread of its own
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, gather()).result()


class RewardedTask:
    """`task` with the configured `reward` as its verifier: `reward(problem, completion)` and
    the batch form `rewards(problems, completions)`; everything else is the task's."""

    def __init__(self, task: Any, reward: Reward) -> None:
        self.task = task
        self.reward_fn = reward
        self.name = task.name
        self.eval_splits = task.eval_splits

    def __getattr__(self, attr: str) -> Any:
        if attr in ("task", "reward_fn"):  # not yet set (copy/pickle): no recursion
            raise AttributeError(attr)
        return getattr(self.task, attr)

    def split(self, name: str) -> Sequence[Problem]:
        return self.task.split(name)

    def prompt_ids(self, problem: Problem, tokenizer: Any) -> list[int]:
        return self.task.prompt_ids(problem, tokenizer)

    def rewards(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        return self.reward_fn.score(problems, list(completions))

    def reward(self, problem: Problem, completion: str) -> float:
        return self.rewards([problem], [completion])[0]

    def pop_reward_stats(self) -> dict[str, float]:
        return self.reward_fn.pop_stats()


def task_rewards(task: Any, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
    """Rewards of `completions` (one per problem), through the task's batch `rewards` when it
    has one (a `RewardedTask`: async functions run concurrently), else `reward` one by one."""
    batch = getattr(task, "rewards", None)
    if callable(batch):
        return list(batch(problems, completions))
    return [float(task.reward(p, c)) for p, c in zip(problems, completions)]
