"""The built-in tasks' rewards as registered functions of (prompt, completion, fields).

`fields["answer"]` is the task's gold answer (docs/tasks.md gives each format).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ftis.tasks import gsm8k as _gsm8k
from ftis.tasks import reasoning as _reasoning


def exact_match(prompt: str, completion: str, fields: Mapping[str, Any]) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals the gold answer
    (the arithmetic task's reward)."""
    return 1.0 if completion.strip() == str(fields["answer"]).strip() else 0.0


def reasoning(prompt: str, completion: str, fields: Mapping[str, Any]) -> float:
    """1.0 when the completion is a well-formed trace whose answer (after '#') is the gold
    answer (the reasoning task's reward)."""
    return 1.0 if _reasoning.extract_answer(completion) == str(fields["answer"]) else 0.0


def gsm8k(prompt: str, completion: str, fields: Mapping[str, Any]) -> float:
    """1.0 when the completion is exactly `<think> ... </think><answer> ... </answer>` and the
    answer verifies against the gold answer with math-verify (the GSM8K task's reward)."""
    answer = _gsm8k.extract_answer(completion)
    return (
        1.0 if answer is not None and _gsm8k.answer_matches(answer, str(fields["answer"])) else 0.0
    )


def gsm8k_format(prompt: str, completion: str, fields: Mapping[str, Any]) -> float:
    """1.0 when the completion is well formed for the GSM8K reward (one think block, then one
    answer block, nothing after it), whatever the answer."""
    return 0.0 if _gsm8k.extract_answer(completion) is None else 1.0


_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def gsm8k_answer(prompt: str, completion: str, fields: Mapping[str, Any]) -> float:
    """1.0 when the last `<answer> ... </answer>` block verifies against the gold answer with
    math-verify, whatever else the completion holds (no format condition)."""
    blocks = _ANSWER_BLOCK.findall(completion)
    if not blocks:
        return 0.0
    return 1.0 if _gsm8k.answer_matches(blocks[-1].strip(), str(fields["answer"])) else 0.0
