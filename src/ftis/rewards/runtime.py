"""A configured reward at run time: a weighted sum of functions scored over a batch, with the
errors of each function caught per completion and counted, and a bound on their share that
stops the run (`RewardFailure`); and the task wrapper that makes it a task's verifier
(`RewardedTask`), so every caller of `task.reward` uses it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import traceback
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ftis.rewards import (
    NOT_COLUMNS,
    RewardFn,
    RewardTerm,
    describe,
    finite_number,
    frame_of,
    is_batched,
    resolve_reward,
    short_name,
)
from ftis.tasks.base import Problem, TaskDataError

log = logging.getLogger(__name__)

DEFAULT_MAX_ERROR_SHARE = 0.5  # TaskConfigBase.reward_max_error_share's default
# A step's failure share is checked as soon as a function has been asked this many times in the
# step (so an always-failing reward stops before the step's update), and at the end of every step
MIN_CALLS_TO_STOP_EARLY = 8


class RewardFailure(TaskDataError):
    """A reward function failed on more than `task.reward_max_error_share` of the completions
    it scored in a step: the run stops, the message naming the function, its first failure of
    the step and where it happened."""


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


def defined_at(fn: Any) -> str | None:
    """`file:line` of `fn`'s definition (a callable object's `__call__`), None if unknown."""
    target = inspect.unwrap(fn)
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        target = type(target).__dict__.get("__call__", target)
    try:
        code = target.__code__
    except AttributeError:
        return None
    return f"{code.co_filename}:{code.co_firstlineno}"


class _BadValue(Exception):
    """A function returned something that is not a reward (its message says what)."""


@dataclass
class _Term:
    name: str
    fn: RewardFn
    weight: float
    per_problem: bool = False  # fn(problem, completion): a task's own method
    report: bool = False  # its mean is a row's `reward/<name>` (fn.report_mean is true)
    batched: bool | None = None  # TRL's form, fn(prompts=, completions=, **columns); None: detect
    accepts: frozenset[str] | None = field(default=None, init=False)  # None: **kwargs


class Reward:
    """Weighted sum of reward functions. `score(problems, completions)` returns one float per
    completion: a per-completion function is called as fn(prompt, completion, fields)
    (`reward_fields`) on every completion, a batched one once as fn(prompts=, completions=,
    **columns); async functions run concurrently. `score_masked` also says which completions
    no function gave a number (a batched function's None): they are left out of advantages.

    Counters since the last `pop_stats()`: completions scored, how many earned a non-zero
    reward, how many were excluded, and each function's errors. A function failing on more
    than `max_error_share` of the completions it scored since the last `pop_stats()` raises
    `RewardFailure` (checked in `score` once it has scored `MIN_CALLS_TO_STOP_EARLY`, and in
    `pop_stats`); 1 never stops."""

    def __init__(
        self,
        terms: Sequence[RewardTerm | tuple],
        *,
        max_error_share: float = DEFAULT_MAX_ERROR_SHARE,
    ) -> None:
        self.terms: list[_Term] = []
        for t in terms:
            if isinstance(t, RewardTerm):
                self.terms.append(
                    _Term(
                        short_name(t.function),
                        resolve_reward(t.function, batched=t.batched),
                        t.weight,
                        batched=t.is_batched,
                    )
                )
            else:
                self.terms.append(_Term(*t))
        for term in self.terms:
            term.report = term.report or getattr(term.fn, "report_mean", False) is True
            if term.batched is None:
                term.batched = not term.per_problem and is_batched(term.fn)
            if term.batched:
                term.accepts = _keyword_names(term.fn)
        if not self.terms:
            raise ValueError("a reward needs at least one function")
        self.max_error_share = max_error_share
        # the chat of a problem whose row is one (TRL's conversational form), else None
        self.chat_of: Callable[[Problem], Any] | None = None
        self.errors: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()  # completions each function was asked to score
        self.sums: Counter[str] = Counter()  # unweighted values of the reported terms
        self.scored = 0
        self.nonzero = 0
        self.excluded = 0
        self.total_scored = 0  # since the start, for the zero-reward warning
        self.total_nonzero = 0
        self.first_errors: dict[str, str] = {}  # each function's first failure, ever
        self._step_first: dict[str, str] = {}  # ... and since the last pop_stats
        self._unreported: list[str] = []  # first failures not yet in a row

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.terms]

    @property
    def has_batched(self) -> bool:
        return any(t.batched for t in self.terms)

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        return self.score_masked(problems, completions)[0]

    def score_masked(
        self, problems: Sequence[Problem], completions: Sequence[str]
    ) -> tuple[list[float], list[bool]]:
        """(rewards, excluded): excluded[i] when no function gave completion i a number (every
        function is batched and returned None for it; its reward is then 0)."""
        n = len(completions)
        completions = list(completions)
        fields: list[Mapping[str, Any]] = [reward_fields(p) for p in problems]
        total = [0.0] * n
        got = [False] * n  # some function gave a number, or failed to
        pending: list[tuple[_Term, int | None, Any]] = []
        for term in self.terms:
            self.calls[term.name] += n
            if term.batched:
                if not n:
                    continue
                try:
                    value = self._call_batched(term, problems, completions, fields)
                except Exception as e:
                    self._failed(term, e, count=n, got=got)
                    continue
                if inspect.isawaitable(value):
                    pending.append((term, None, value))
                else:
                    self._add_batch(term, total, got, value)
                continue
            for i in range(n):
                got[i] = True
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
                if i is None:
                    if isinstance(value, BaseException):
                        self._failed(term, value, count=n, got=got)
                    else:
                        self._add_batch(term, total, got, value)
                elif isinstance(value, BaseException):
                    self._failed(term, value)
                else:
                    self._add(term, total, i, value)
        excluded = [not g for g in got]
        self.scored += n
        self.nonzero += sum(1 for r in total if r != 0)
        self.excluded += sum(excluded)
        self.total_scored += n
        self.total_nonzero += sum(1 for r in total if r != 0)
        self._check_share(final=False)
        return total, excluded

    def _call_batched(
        self,
        term: _Term,
        problems: Sequence[Problem],
        completions: list[str],
        fields: list[Mapping[str, Any]],
    ) -> Any:
        """fn(prompts=, completions=, **columns), TRL's way: a chat row's prompt is its
        messages and its completion [{"role": "assistant", "content": text}]; every column is a
        list, one value per completion (None where a row lacks it). A function without
        **kwargs gets only the arguments it names."""
        chats = [self.chat_of(p) if self.chat_of is not None else None for p in problems]
        prompts = [p.question if c is None else c for p, c in zip(problems, chats)]
        texts: list[Any] = [
            t if c is None else [{"role": "assistant", "content": t}]
            for t, c in zip(completions, chats)
        ]
        names = dict.fromkeys(k for f in fields for k in f if k not in NOT_COLUMNS)
        kwargs: dict[str, Any] = {"prompts": prompts, "completions": texts}
        kwargs.update({k: [f.get(k) for f in fields] for k in names})
        if term.accepts is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in term.accepts}
        return term.fn(**kwargs)

    def _add(self, term: _Term, total: list[float], i: int, value: Any) -> None:
        try:
            value = finite_number(value)
        except (TypeError, ValueError) as e:
            self._failed(term, _BadValue(str(e)))
            return
        total[i] += term.weight * value
        if term.report:
            self.sums[term.name] += value

    def _add_batch(self, term: _Term, total: list[float], got: list[bool], values: Any) -> None:
        n = len(total)
        if isinstance(values, str | bytes | Mapping) or not hasattr(values, "__len__"):
            bad = _BadValue(f"returned {describe(values)}, not a list of {n} rewards")
            self._failed(term, bad, count=n, got=got)
            return
        values = list(values)
        if len(values) != n:
            bad = _BadValue(f"returned {len(values)} values for {n} completions")
            self._failed(term, bad, count=n, got=got)
            return
        for i, value in enumerate(values):
            if value is None:  # no reward from this function for this completion
                continue
            got[i] = True
            self._add(term, total, i, value)

    def _failed(
        self,
        term: _Term,
        exc: BaseException,
        *,
        count: int = 1,
        got: list[bool] | None = None,
    ) -> None:
        if got is not None:  # a batched call that failed as a whole: every completion scores 0
            got[:] = [True] * len(got)
        self.errors[term.name] += count
        message = self._describe(term, exc)
        self._step_first.setdefault(term.name, message)
        if term.name in self.first_errors:
            log.debug("reward %s %s", term.name, message)
            return
        self.first_errors[term.name] = message
        self._unreported.append(term.name)
        log.warning(
            "reward %s %s (the completion scores 0 from it; counted in reward/errors/%s)",
            term.name,
            message,
            term.name,
        )

    @staticmethod
    def _describe(term: _Term, exc: BaseException) -> str:
        """`returned str '1.0', not a number (fn defined at f.py:3)` for a bad value, `raised
        ZeroDivisionError: division by zero at f.py:5 in fn` for an exception."""
        home = defined_at(term.fn)
        if isinstance(exc, _BadValue):
            return f"{exc}" + (f" (defined at {home})" if home else "")
        frame = frame_of(exc, home.rpartition(":")[0] if home else None)
        where = f" at {frame.filename}:{frame.lineno} in {frame.name}" if frame else ""
        return f"raised {type(exc).__name__}: {exc}{where}"

    def _check_share(self, *, final: bool) -> None:
        """RewardFailure when a function failed on more than `max_error_share` of what it
        scored since the last pop_stats (before the end of a step: only once it scored
        MIN_CALLS_TO_STOP_EARLY completions)."""
        if self.max_error_share >= 1:
            return
        for term in self.terms:
            calls, errors = self.calls[term.name], self.errors[term.name]
            if not calls or (not final and calls < MIN_CALLS_TO_STOP_EARLY):
                continue
            if errors / calls > self.max_error_share:
                first = self._step_first.get(term.name) or self.first_errors.get(term.name, "")
                raise RewardFailure(
                    f"reward {term.name} failed on {errors} of the {calls} completions it "
                    f"scored in this step ({errors / calls:.0%}, more than "
                    f"task.reward_max_error_share = {self.max_error_share:g}); the first: "
                    f"{first}. Fix the function, or set task.reward_max_error_share: 1 to score "
                    "such completions 0 and go on"
                )

    def pop_stats(self) -> dict[str, Any]:
        """The metrics row's reward counters since the last call: `reward/scored`,
        `reward/nonzero`, `reward/excluded` (when a function is batched) and
        `reward/errors/<function>` (every function that is not built in gets a value, 0
        included; a built-in one only when it failed); `reward/<function>`, the mean unweighted
        value of each function with `report_mean = True` (a failure counts 0), when a
        completion was scored; and `reward/first_error/<function>`, the text of a function's
        first failure, in the row of the step it happened in (once per run).

        Raises RewardFailure when a function failed on more than `max_error_share` of the
        completions it scored since the last call."""
        self._check_share(final=True)
        out: dict[str, Any] = {
            "reward/scored": float(self.scored),
            "reward/nonzero": float(self.nonzero),
        }
        if self.has_batched:
            out["reward/excluded"] = float(self.excluded)
        for t in self.terms:
            if self.errors[t.name] or not t.name.startswith("builtin:"):
                out[f"reward/errors/{t.name}"] = float(self.errors[t.name])
            if t.report and self.scored:
                out[f"reward/{t.name}"] = self.sums[t.name] / self.scored
        for name in self._unreported:
            out[f"reward/first_error/{name}"] = self.first_errors[name]
        self._unreported.clear()
        self.errors.clear()
        self.calls.clear()
        self.sums.clear()
        self._step_first.clear()
        self.scored = self.nonzero = self.excluded = 0
        return out


def _keyword_names(fn: Any) -> frozenset[str] | None:
    """The keyword arguments `fn` takes, None when it takes any (**kwargs or no signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )


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
    the batch forms `rewards(problems, completions)` and `rewards_masked` (which also says
    which completions are excluded); everything else is the task's. The reward's error bound
    is the task config's `reward_max_error_share`, and a task's `row_chat(problem)` (the row's
    chat, or None) gives batched functions TRL's conversational form."""

    def __init__(self, task: Any, reward: Reward) -> None:
        self.task = task
        self.reward_fn = reward
        self.name = task.name
        self.eval_splits = task.eval_splits
        self._skipped_reported = False
        share = getattr(getattr(task, "cfg", None), "reward_max_error_share", None)
        if isinstance(share, int | float) and not isinstance(share, bool):
            reward.max_error_share = float(share)
        chat = getattr(task, "row_chat", None)
        if callable(chat):
            reward.chat_of = chat

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

    def rewards_masked(
        self, problems: Sequence[Problem], completions: Sequence[str]
    ) -> tuple[list[float], list[bool]]:
        return self.reward_fn.score_masked(problems, list(completions))

    def reward(self, problem: Problem, completion: str) -> float:
        return self.rewards([problem], [completion])[0]

    def pop_reward_stats(self) -> dict[str, Any]:
        """The reward's counters (`Reward.pop_stats`); the first row also gets
        `data/skipped_rows` when the task counts malformed rows it skipped
        (`task.skip_bad_rows`)."""
        out = self.reward_fn.pop_stats()
        skipped = getattr(self.task, "skipped_rows", None)
        if isinstance(skipped, int) and not self._skipped_reported:
            self._skipped_reported = True
            out["data/skipped_rows"] = float(skipped)
        return out


def task_rewards(task: Any, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
    """Rewards of `completions` (one per problem), through the task's batch `rewards` when it
    has one (a `RewardedTask`: async functions run concurrently), else `reward` one by one.
    A completion excluded by a batched function (None) counts 0 here."""
    batch = getattr(task, "rewards", None)
    if callable(batch):
        return list(batch(problems, completions))
    return [float(task.reward(p, c)) for p, c in zip(problems, completions)]


def task_rewards_masked(
    task: Any, problems: Sequence[Problem], completions: Sequence[str]
) -> tuple[list[float], list[bool]]:
    """(rewards, excluded) of `completions`: `task_rewards` and which completions no function
    gave a number (none excluded for a task without `rewards_masked`)."""
    masked = getattr(task, "rewards_masked", None)
    if callable(masked):
        rewards, excluded = masked(problems, completions)
        return list(rewards), list(excluded)
    rewards = task_rewards(task, problems, completions)
    return rewards, [False] * len(rewards)
