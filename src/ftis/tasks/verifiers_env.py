"""verifiers environments as a task (`task: {kind: verifiers, env: ...}`; docs/tasks.md).

An environment of the `verifiers` library (PyPI `verifiers`, Prime Intellect's Environments Hub)
is taken as its author wrote it: its dataset (rows `prompt`, `answer`, `info`), its rubric (the
reward functions, their weights and its parser) and its message type. Where it comes from:

- `env: my_envs:make_env` or `env: path/to/envs.py:make_env`: an attribute of a module, either
  an Environment or a function returning one (called with `args`);
- `env: NAME`: an installed environment, through `verifiers.load_environment(NAME, **args)`.

Choices where nothing else decides:
- single-turn environments only (`vf.SingleTurnEnv`); a multi-turn or tool environment is one
  clear error, as is a rubric with group-level reward functions;
- each of the rubric's functions becomes a reward term `verifiers-rubric:<function>` with the rubric's
  weight, so its mean, its failures and their bound are ftis's (a function that raises counts
  as a failure, where verifiers would log it and score 0); it is called with the keyword
  arguments verifiers gives (`prompt`, `completion`, `answer`, `info`, `state`, `task`,
  `parser` and the row's other columns), `completion` in the environment's message type: a
  list with one assistant message for chat environments, the text for completion ones;
- the test split is the environment's eval dataset when it has one, else `test_size` rows of its
  dataset chosen by `split_seed` and held out of training;
- prompts go through the node's chat template when its tokenizer has one, else as
  "role: content" lines followed by "assistant: " (as the prompts task does);
- a warm start needs `warmstart_field`, a column holding completions in the rubric's format.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import random
import signal
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, model_validator

from ftis.rewards import imports_code
from ftis.tasks.base import (
    Problem,
    TaskConfigBase,
    TaskDataError,
    as_id_list,
    plain_prompt_ids,
)
from ftis.tasks.gsm8k import chat_template_field, chat_template_in_use
from ftis.tasks.prompts import plain_chat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

INSTALL = "pip install 'ftis[verifiers]'"
PREFIX = "verifiers-rubric:"  # "-": no module has this name, so no import is tried


def verifiers() -> Any:
    try:
        import verifiers as vf
    except ImportError as e:
        raise TaskDataError(
            f"task kind 'verifiers' needs the verifiers package ({INSTALL}): {e}"
        ) from None
    return vf


class VerifiersTaskConfig(TaskConfigBase):
    """A single-turn verifiers environment: its dataset, its rubric and its parser."""

    kind: Literal["verifiers"] = Field(default="verifiers", description="Task selector.")
    default_reward: ClassVar[str | None] = None  # the rubric's terms are filled in below
    no_warmstart_field: ClassVar[str | None] = (
        "a verifiers environment has no supervised target: set task.warmstart_field to "
        "a column holding completions in the rubric's format, or remove warm_start"
    )
    env: str = Field(
        description="'module:attr' or 'path/to/file.py:attr' (an Environment, or a function "
        "returning one), or the name of an installed environment (verifiers.load_environment)."
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the environment's loader."
    )
    test_size: int = Field(
        64, ge=1, description="Held-out rows: the eval dataset's first ones, else held out."
    )
    split_seed: int = Field(0, description="Seed of the held-out rows' choice (no eval dataset).")
    use_chat_template: bool | None = chat_template_field("plain 'role: content' text")
    warmstart_field: str | None = Field(
        None,
        description="Column holding a completion in the rubric's format; a warm start trains "
        "on it (a warm start without it is refused).",
    )

    @model_validator(mode="before")
    @classmethod
    def _load_first(cls, value: Any, info: ValidationInfo) -> Any:
        """Load the environment before the fields are checked, so that its rubric's terms are
        registered when `reward` names them (a run directory's config.yaml does)."""
        if not imports_code(info):
            return value
        if isinstance(value, Mapping) and isinstance(value.get("env"), str):
            if not value["env"].strip():
                raise ValueError("env is empty: name an environment ('my_envs:make_env' or an id)")
            args = value.get("args") or {}
            if isinstance(args, Mapping):
                load_env(value["env"], args)
        return value

    @model_validator(mode="after")
    def _rubric_terms(self, info: ValidationInfo) -> VerifiersTaskConfig:
        if not imports_code(info):
            return self
        loaded = load_env(self.env, self.args)
        if self.reward is None:
            from ftis.rewards import RewardTerm

            self.reward = [RewardTerm(function=n, weight=w) for n, w in loaded.terms]
        return self


class LoadedEnv:
    """An environment, its rows and its reward terms (name, weight), registered under
    `verifiers-rubric:<function>`."""

    def __init__(self, spec: str, env: Any) -> None:
        vf = verifiers()
        if not isinstance(env, vf.SingleTurnEnv):
            raise TaskDataError(
                f"task.env={spec!r} is a {type(env).__name__}, a multi-turn or tool "
                "environment: ftis runs single-turn environments (verifiers.SingleTurnEnv) only"
            )
        self.env = env
        self.chat = getattr(env, "message_type", "chat") != "completion"
        self.terms: list[tuple[str, float]] = []
        from ftis.rewards import register_reward

        for rubric, fn, weight in _rubric_functions(env, spec):
            base = PREFIX + getattr(fn, "__name__", type(fn).__name__)
            taken = {n for n, _ in self.terms}
            name, k = base, 2
            while name in taken:  # two rubrics with a function of the same name
                name, k = f"{base}_{k}", k + 1
            register_reward(name, _term(fn, rubric, self.chat))
            self.terms.append((name, float(weight)))
        if not self.terms:
            raise TaskDataError(f"task.env={spec!r}: its rubric has no reward function")

    def rows(self, which: str) -> list[dict[str, Any]] | None:
        """The rows of the environment's `dataset` or `eval_dataset` (None: it has none)."""
        if which == "eval_dataset":  # get_eval_dataset() falls back to the train rows
            self.env.build_eval_dataset()
            if self.env.eval_dataset is None:
                return None
        try:
            ds = getattr(self.env, f"get_{which}")()
        except Exception as e:
            raise TaskDataError(f"task.env: the environment's {which} cannot be built: {e}") from e
        return None if ds is None else [dict(r) for r in ds]


_loaded: dict[tuple[str, str], LoadedEnv] = {}


def load_env(spec: str, args: Mapping[str, Any]) -> LoadedEnv:
    """The environment `spec` names, loaded once per process for these `args`. verifiers'
    Environment installs SIGINT/SIGTERM handlers of its own when built; ftis's are put back
    (ftis's stop protocol owns the signals: a signal checkpoints every node)."""
    key = (spec, repr(sorted(args.items())))
    if key not in _loaded:
        saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            _loaded[key] = _load(spec, args)
        finally:
            if threading.current_thread() is threading.main_thread():
                for s, handler in saved.items():
                    if handler is not None:
                        signal.signal(s, handler)
    return _loaded[key]


def _load(spec: str, args: Mapping[str, Any]) -> LoadedEnv:
    """Import or load the environment and wrap it."""
    vf = verifiers()
    if ":" in spec:
        module_name, _, attr = spec.rpartition(":")
        target = getattr(_import(module_name, spec), attr, None)
        if target is None:
            raise TaskDataError(f"task.env={spec!r}: {module_name!r} has no {attr!r}")
        env = target
        if callable(target) and not _is_env(target):
            try:
                env = target(**args)
            except Exception as e:
                raise TaskDataError(
                    f"task.env={spec!r}: {attr}(**task.args) raised {type(e).__name__}: {e}"
                ) from None
        if not _is_env(env):
            raise TaskDataError(
                f"task.env={spec!r} gave a {type(env).__name__}, not a verifiers Environment"
            )
    else:
        try:
            env = vf.load_environment(spec, **args)
        except Exception as e:
            raise TaskDataError(
                f"task.env={spec!r}: verifiers cannot load it ({type(e).__name__}: {e}); "
                "install the environment, or name a module's attribute as 'module:attr'"
            ) from None
    return LoadedEnv(spec, env)


def _is_env(obj: Any) -> bool:
    return isinstance(obj, verifiers().Environment)


def _import(module_name: str, spec: str) -> Any:
    from ftis.rewards import _import_file

    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name).expanduser().resolve()
            if not path.is_file():
                raise TaskDataError(f"task.env={spec!r}: no file {str(path)!r}")
            return _import_file(path)
        return importlib.import_module(module_name)
    except TaskDataError:
        raise
    except Exception as e:
        raise TaskDataError(f"task.env={spec!r}: importing {module_name!r} failed: {e}") from None


def _rubric_functions(env: Any, spec: str) -> list[tuple[Any, Any, float]]:
    """(rubric, function, weight) of every reward function of the environment's rubric, groups
    flattened, verifiers' own turn counter left out."""
    vf = verifiers()
    out = []
    todo = [env.rubric]
    while todo:
        rubric = todo.pop(0)
        if hasattr(rubric, "rubrics"):
            todo += list(rubric.rubrics)
            continue
        if _own_monitor(rubric):
            continue
        for fn, weight in zip(rubric.funcs, rubric.weights):
            if isinstance(rubric, vf.Rubric) and rubric._is_group_func(fn):
                raise TaskDataError(
                    f"task.env={spec!r}: reward function {fn.__name__} scores a whole group "
                    "(it takes completions/states); ftis calls rubric functions one completion "
                    "at a time: write it per completion, or give it as a batched task.reward"
                )
            out.append((rubric, fn, weight))
    return out


def _own_monitor(rubric: Any) -> bool:
    """A rubric verifiers adds itself to log figures (e.g. the number of turns): weight 0 only,
    a class of verifiers' own other than Rubric."""
    cls = type(rubric)
    return (
        cls.__module__.startswith("verifiers.")
        and cls.__name__ != "Rubric"
        and not any(rubric.weights)
    )


def _term(fn: Any, rubric: Any, chat: bool) -> Any:
    """`fn` as ftis's per-completion reward `term(prompt, completion, fields)`, called with the
    keyword arguments verifiers' Rubric gives it."""
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    shared = dict(getattr(rubric, "class_objects", {}))

    async def term(prompt: str, completion: str, fields: Mapping[str, Any]) -> Any:
        said = [{"role": "assistant", "content": completion}] if chat else completion
        row = {k: v for k, v in fields.items() if k != "question"}
        state = {
            "prompt": row.get("prompt"),
            "completion": said,
            "answer": row.get("answer", ""),
            "info": row.get("info") or {},
            "input": row,
        }
        objects = {
            **row,
            **state,
            "state": state,
            "task": row.get("task"),
            **shared,
        }
        kwargs = objects if takes_all else {k: v for k, v in objects.items() if k in params}
        out = fn(**kwargs)
        return await out if inspect.isawaitable(out) else out

    term.__name__ = getattr(fn, "__name__", "reward")
    term.__qualname__ = term.__name__
    term.__wrapped_verifiers__ = fn  # type: ignore[attr-defined]
    term.report_mean = True  # type: ignore[attr-defined]  # each term's mean in the rows
    return term


class VerifiersTask:
    """A verifiers SingleTurnEnv's rows as ftis problems; the reward is the rubric's terms
    (``build_task`` wraps them)."""

    name = "verifiers"

    def __init__(self, cfg: VerifiersTaskConfig | Mapping[str, Any]) -> None:
        raw = cfg if isinstance(cfg, Mapping) else cfg.model_dump()
        self.cfg = VerifiersTaskConfig.model_validate(raw)
        c = self.cfg
        self.loaded = load_env(c.env, c.args)
        rows = self.loaded.rows("dataset")
        if not rows:
            raise TaskDataError(f"task.env={c.env!r}: the environment's dataset is empty")
        test = self.loaded.rows("eval_dataset")
        if test is None:
            order = list(range(len(rows)))
            random.Random(c.split_seed).shuffle(order)
            n_test = min(c.test_size, len(rows) - 1)
            if n_test < 1:
                raise TaskDataError(
                    f"task.env={c.env!r}: {len(rows)} row(s), too few to hold out a test split; "
                    "give the environment an eval dataset or more rows"
                )
            held = sorted(order[:n_test])
            test = [rows[i] for i in held]
            rows = [r for i, r in enumerate(rows) if i not in set(held)]
        self._splits = {
            "train": self._problems(rows, "dataset"),
            "test": self._problems(test[: c.test_size], "eval_dataset"),
        }
        self.eval_splits: tuple[str, ...] = ("test",)
        log.info("verifiers task %s: %s", c.env, {k: len(v) for k, v in self._splits.items()})

    def _problems(self, rows: Sequence[Mapping[str, Any]], where: str) -> tuple[Problem, ...]:
        out = []
        for i, row in enumerate(rows):
            prompt = row.get("prompt")
            if isinstance(prompt, str):
                ok = bool(prompt.strip())
            else:
                ok = (
                    isinstance(prompt, list)
                    and bool(prompt)
                    and all(isinstance(m, Mapping) and "role" in m for m in prompt)
                )
            if not ok:
                raise TaskDataError(
                    f"task.env={self.cfg.env!r}: {where} row {i}: its prompt ({prompt!r:.60}) is "
                    "neither a non-empty string nor a list of {role, content} messages"
                )
            question = prompt if isinstance(prompt, str) else plain_chat(prompt)
            out.append(Problem(len(out), question, str(row.get("answer", "")), dict(row)))
        return tuple(out)

    def split(self, name: str) -> Sequence[Problem]:
        if name not in self._splits:
            raise KeyError(f"verifiers task has no split {name!r}; use one of {list(self._splits)}")
        return self._splits[name]

    def row_chat(self, problem: Problem) -> list[dict[str, Any]] | None:
        """A chat environment's messages: a batched (TRL-form) reward gets them as its prompt
        and the completion as [{"role": "assistant", "content": ...}]; None for completion
        environments."""
        prompt = problem.fields["prompt"]
        return None if isinstance(prompt, str) else [dict(m) for m in prompt]

    def uses_chat_template(self, tokenizer: PreTrainedTokenizerBase) -> bool:
        return chat_template_in_use(self.cfg.use_chat_template, tokenizer)

    def prompt_ids(self, problem: Problem, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """A chat environment's messages through the tokenizer's template (ending in the
        assistant turn) when used, else as "role: content" lines and "assistant: "; a completion
        environment's prompt text as it is."""
        prompt = problem.fields["prompt"]
        if isinstance(prompt, str):
            return plain_prompt_ids(tokenizer, prompt)
        messages = [dict(m) for m in prompt]
        if self.uses_chat_template(tokenizer):
            out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return as_id_list(out)
        return plain_prompt_ids(tokenizer, plain_chat(messages) + "\nassistant: ")

    def reward(self, problem: Problem, completion: str) -> float:
        raise ValueError("the verifiers task's reward is its rubric's terms (build_task)")

    def warmstart_target(self, problem: Problem) -> str:
        if self.cfg.warmstart_field is None:
            raise ValueError(self.cfg.warm_start_refusal())
        return str(problem.fields[self.cfg.warmstart_field])
