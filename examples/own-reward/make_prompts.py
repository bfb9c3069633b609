"""Write prompts.jsonl: 48 chat-format arithmetic questions with their answers.

    python examples/own-reward/make_prompts.py      # rewrites examples/own-reward/prompts.jsonl

Each row is {"messages": [system, user], "answer": "..."}; `answer` is both what the reward
(my_reward.py) compares with and the warm start's target (config.yaml: warmstart_field).
Deterministic: the same file on every run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SYSTEM = "Reply with the number only."
ROWS = 48


def rows(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(ROWS):
        a, b = rng.randint(1, 49), rng.randint(1, 49)
        op = rng.choice("+-")
        value = a + b if op == "+" else a - b
        out.append(
            {
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"What is {a}{op}{b}?"},
                ],
                "answer": str(value),
            }
        )
    return out


def text(seed: int = 0) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows(seed))


if __name__ == "__main__":
    path = Path(__file__).with_name("prompts.jsonl")
    path.write_text(text())
    print(f"wrote {ROWS} rows to {path}")
