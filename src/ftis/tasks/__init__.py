"""Prompt sources and verifiers: the embedded arithmetic and reasoning tasks, GSM8K-style tasks,
prompt datasets of one's own (`prompts`), and tasks registered by plugins.

A task is registered once with its config class (a `TaskConfigBase` with a `kind`) and a factory
(`register_task`); `TaskConfig` validates a mapping by dispatching on `kind` to the registered
class, so a plugin's task ($FTIS_PLUGINS) is validated like a built-in one. `build_task` turns a
config into a task whose verifier is the configured reward (`ftis.rewards`).

    from ftis.tasks import TaskConfigBase, register_task

    class MyTaskConfig(TaskConfigBase):
        kind: Literal["mine"] = "mine"

    register_task("mine", MyTaskConfig, "my_package.my_task:MyTask")
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator, SerializeAsAny, TypeAdapter, ValidationError, ValidationInfo

from ftis.tasks.arithmetic import ArithmeticTask, ArithmeticTaskConfig, ArithmeticVariant
from ftis.tasks.base import OWN_REWARD, Problem, Task, TaskConfigBase, TaskDataError
from ftis.tasks.gsm8k import (
    DEFAULT_SYSTEM_PROMPT,
    GSM8KTask,
    GSM8KTaskConfig,
    answer_matches,
    extract_answer,
    fixture_path,
    gold_answer,
)
from ftis.tasks.prompts import PromptsTask, PromptsTaskConfig
from ftis.tasks.reasoning import ReasoningTask, ReasoningTaskConfig, ReasoningVariant
from ftis.tasks.reasoning_gym import ReasoningGymTask, ReasoningGymTaskConfig
from ftis.tasks.verifiers_env import VerifiersTaskConfig


@dataclass(frozen=True)
class TaskSpec:
    """A registered task: its config class and the factory that builds it from a config
    (a callable or a "module:attr" string, imported on first use)."""

    kind: str
    config: type[TaskConfigBase]
    factory: Callable[[Any], Task] | str

    def build(self, cfg: TaskConfigBase) -> Task:
        factory = self.factory
        if isinstance(factory, str):
            module, _, attr = factory.partition(":")
            factory = getattr(importlib.import_module(module), attr)
        return factory(cfg)


TASKS: dict[str, TaskSpec] = {}


def register_task(
    kind: str, config: type[TaskConfigBase], factory: Callable[[Any], Task] | str
) -> TaskSpec:
    """Make `kind` available to `task.kind` (replacing an earlier registration)."""
    if not (isinstance(config, type) and issubclass(config, TaskConfigBase)):
        raise TypeError(f"task {kind!r}: its config class must subclass ftis.tasks.TaskConfigBase")
    spec = TaskSpec(kind, config, factory)
    TASKS[kind] = spec
    return spec


def get_task(kind: str) -> TaskSpec:
    """The registered task `kind` (plugins loaded if needed), or a ValueError listing them."""
    from ftis.plugins import registered

    return registered(
        TASKS, kind, lambda known: f"unknown task kind {kind!r}; choose one of: {known}"
    )


def _task_config(value: Any, info: ValidationInfo) -> Any:
    """A mapping validated as the registered config class of its `kind` (default arithmetic),
    under the outer validation's context (`import_code: False` reaches the task's rewards)."""
    if isinstance(value, TaskConfigBase):
        return value
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ValueError("must be a mapping with a kind, e.g. {kind: arithmetic}")
    kind = str(value.get("kind", "arithmetic"))
    from ftis.validation import validate_section

    return validate_section(
        get_task(kind).config, {**value, "kind": kind}, "task.", context=info.context
    )


# What a run config's `task` holds: any registered task's config, chosen by `kind`.
TaskConfig = Annotated[SerializeAsAny[TaskConfigBase], BeforeValidator(_task_config)]


def check_task_section(data: Any, where: str) -> None:
    """Validate `data` as a run's `task` section (a node's or client's own task): ValueError
    `<where>: <field>: <what is wrong>` for the first problem."""
    try:
        TypeAdapter(TaskConfig).validate_python(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ValueError(f"{where}: {loc}: {err['msg'].removeprefix('Value error, ')}") from None


def build_task(cfg: TaskConfigBase | Mapping[str, Any], *, reward: Any = None) -> Task:
    """Build the task a config describes, its verifier the configured reward: `reward` (a
    node's `reward` terms) when given, else the config's `reward`, else its built-in one. A
    plain mapping is validated as a `TaskConfig` first."""
    from ftis.rewards.runtime import Reward, RewardedTask

    if isinstance(cfg, Mapping):
        cfg = TypeAdapter(TaskConfig).validate_python(cfg)
    task = get_task(cfg.kind).build(cfg)
    terms = reward or cfg.reward
    if terms:
        return RewardedTask(task, Reward(terms))  # type: ignore[return-value]
    default = type(cfg).default_reward
    if default is None:
        raise ValueError(
            f"task kind {cfg.kind!r} has no built-in reward: set task.reward (e.g. "
            "my_rewards:score) or each node's reward"
        )
    if default == OWN_REWARD:  # a plugin task's own `reward(problem, completion)` method
        return RewardedTask(task, Reward([(f"{cfg.kind}:reward", task.reward, 1.0, True)]))  # type: ignore[return-value]
    from ftis.rewards import resolve_reward

    return RewardedTask(task, Reward([(default, resolve_reward(default), 1.0)]))  # type: ignore[return-value]


register_task("arithmetic", ArithmeticTaskConfig, ArithmeticTask)
register_task("gsm8k", GSM8KTaskConfig, GSM8KTask)
register_task("reasoning", ReasoningTaskConfig, ReasoningTask)
register_task("prompts", PromptsTaskConfig, PromptsTask)
register_task("reasoning-gym", ReasoningGymTaskConfig, ReasoningGymTask)
register_task("verifiers", VerifiersTaskConfig, "ftis.tasks.verifiers_env:VerifiersTask")


__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "TASKS",
    "ArithmeticTask",
    "ArithmeticTaskConfig",
    "ArithmeticVariant",
    "GSM8KTask",
    "GSM8KTaskConfig",
    "Problem",
    "PromptsTask",
    "PromptsTaskConfig",
    "ReasoningGymTask",
    "ReasoningGymTaskConfig",
    "ReasoningTask",
    "ReasoningTaskConfig",
    "ReasoningVariant",
    "Task",
    "TaskConfig",
    "TaskConfigBase",
    "TaskDataError",
    "TaskSpec",
    "answer_matches",
    "build_task",
    "extract_answer",
    "fixture_path",
    "get_task",
    "gold_answer",
    "register_task",
]
