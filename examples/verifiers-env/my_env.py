"""A verifiers environment and a TRL-style batched reward, as their authors would write them,
for `ftis run examples/verifiers-env/config.yaml` (README.md beside this file).

The environment is a `verifiers.SingleTurnEnv`: one-digit sums as a chat ("What is 3 + 4?"),
answers parsed by verifiers' own Parser, a rubric of two functions with weights (the second
weighted 0: logged, not rewarded). Nothing here
imports ftis.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def load_environment(max_term: int = 9, system_prompt: str = "Answer with the number only."):
    """The environment: every sum a + b with 0 <= a, b <= max_term, in a fixed order."""
    rows = [
        {"question": f"{a}+{b}=", "answer": str(a + b), "target": str(a + b)}
        for a in range(max_term + 1)
        for b in range(max_term + 1)
    ]
    parser = vf.Parser()

    def correct(completion, answer, parser, **kwargs) -> float:
        """1 when the parsed answer is the sum."""
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    async def brief(completion) -> float:
        """1 for an answer of at most 3 characters (a sum, not a story)."""
        return 1.0 if len(completion[-1]["content"].strip()) <= 3 else 0.0

    rubric = vf.Rubric(funcs=[correct, brief], weights=[1.0, 0.0], parser=parser)
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows), system_prompt=system_prompt, parser=parser, rubric=rubric
    )


def trl_reward(prompts, completions, answer, **kwargs) -> list[float | None]:
    """TRL's batched form: one float per completion (None would leave it out of its group).
    `completions` are chats here ([{"role": "assistant", "content": ...}]), as TRL passes them
    for conversational rows; `answer` is the rows' column."""
    out: list[float | None] = []
    for completion, gold in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        out.append(1.0 if text.strip() == gold else 0.0)
    return out
