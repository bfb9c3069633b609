"""A user's own rewards for ftis: each is called as fn(prompt, completion, fields) -> float.

`fields` holds the row's columns (here `messages` and `answer`) plus `question`. Named in
config.yaml as `examples/own-reward/my_reward.py:FUNCTION` (a file, from the working
directory) or, with this folder on PYTHONPATH, `my_reward:FUNCTION`.
"""

from __future__ import annotations

import asyncio
import re

_NUMBER = re.compile(r"-?\d+")


def exact_answer_short(prompt: str, completion: str, fields: dict) -> float:
    """1 when the first number of the completion is the answer, minus 0.05 per character of
    the stripped completion beyond the answer's own length (a length penalty): "17" for 17
    scores 1.0, "17 apples" 0.65, "16" 0.0."""
    text = completion.strip()
    found = _NUMBER.search(text)
    if found is None or found.group() != fields["answer"]:
        return 0.0
    return 1.0 - 0.05 * max(0, len(text) - len(fields["answer"]))


async def digits_only(prompt: str, completion: str, fields: dict) -> float:
    """1 when the completion is a bare (signed) integer, else 0: the format the system prompt
    asks for. Async, as a reward that asks a remote judge would be: ftis awaits every
    completion of a batch concurrently."""
    await asyncio.sleep(0)  # stands for the wait on a judge
    return 1.0 if re.fullmatch(r"-?\d+", completion.strip()) else 0.0
