"""Prompt sources and verifiers: the embedded arithmetic and reasoning tasks, GSM8K-style tasks.

``TaskConfig`` is the discriminated union (on ``kind``) that the run config embeds;
``build_task`` turns one into a ``Task``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from ftis.tasks.arithmetic import ArithmeticTask, ArithmeticTaskConfig, ArithmeticVariant
from ftis.tasks.base import Problem, Task, TaskDataError
from ftis.tasks.gsm8k import (
    DEFAULT_SYSTEM_PROMPT,
    GSM8KTask,
    GSM8KTaskConfig,
    answer_matches,
    extract_answer,
    fixture_path,
    gold_answer,
)
from ftis.tasks.reasoning import ReasoningTask, ReasoningTaskConfig, ReasoningVariant

TaskConfig = Annotated[
    ArithmeticTaskConfig | GSM8KTaskConfig | ReasoningTaskConfig, Field(discriminator="kind")
]

# kind -> constructor; a new task is one entry here and one member of TaskConfig.
TASKS: dict[str, Callable[[Any], Task]] = {
    "arithmetic": ArithmeticTask,
    "gsm8k": GSM8KTask,
    "reasoning": ReasoningTask,
}


def build_task(
    cfg: ArithmeticTaskConfig | GSM8KTaskConfig | ReasoningTaskConfig | Mapping[str, Any],
) -> Task:
    """Build the task a config describes; a plain mapping is validated as a ``TaskConfig`` first."""
    if isinstance(cfg, Mapping):
        cfg = TypeAdapter(TaskConfig).validate_python(cfg)
    return TASKS[cfg.kind](cfg)


__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "TASKS",
    "ArithmeticTask",
    "ArithmeticTaskConfig",
    "ArithmeticVariant",
    "GSM8KTask",
    "GSM8KTaskConfig",
    "Problem",
    "ReasoningTask",
    "ReasoningTaskConfig",
    "ReasoningVariant",
    "Task",
    "TaskConfig",
    "TaskDataError",
    "answer_matches",
    "build_task",
    "extract_answer",
    "fixture_path",
    "gold_answer",
]
