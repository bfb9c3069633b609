"""Each agent's preference pairs, from the run config (docs/dpo.md, "Data").

embedded: the run's task with the agent's overrides (`data.agents.<name>.task`) gives the
prompts: `train_pairs` from its train split (from an offset keyed by the agent's name) and
`eval_pairs` from its held-out test split; each pair's rejected response is a mistake drawn
from the agent's corruption weights. Agents with different overrides or mistakes hold
different preference distributions (non-IID).

jsonl: an agent's own file (`agents.<name>.path`), or its round-robin shard of the shared
`data.path`; held out: `eval_path`, else the first `eval_pairs` rows of a seeded shuffle.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ftis.config import RunConfig
from ftis.preferences.data import PreferencePair, read_pairs
from ftis.preferences.embedded import heldout_problems, pairs_for, train_problems
from ftis.tasks import build_task
from ftis.tasks.base import Problem, Task, TaskDataError

if TYPE_CHECKING:
    from ftis.algos.dpo.local import Reference
    from ftis.preferences.tokens import TokenizedPairs


def agent_pairs(
    cfg: RunConfig, rank: int, *, answer: Callable[[list[Problem]], list[str]] | None = None
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(training pairs, held-out pairs) of node `rank`. `answer(problems)`: the starting
    model's greedy completions, needed by the embedded mistake kind `own`."""
    d = cfg.algorithm.data
    name = cfg.nodes[rank].name
    agent = d.agents.get(name)
    if d.source == "embedded":
        overrides = agent.task if agent is not None else {}
        task = build_task({**cfg.task.model_dump(), **overrides})
        corruptions = (agent.corruptions if agent is not None else None) or d.corruptions
        try:
            out = []
            for problems, salt in (
                (train_problems(task, d.train_pairs, seed=d.seed, salt=name), name),
                (heldout_problems(task, d.eval_pairs), f"{name}/eval"),
            ):
                own = answer(problems) if answer is not None and corruptions.get("own") else None
                out.append(
                    pairs_for(
                        task, problems, corruptions=corruptions, seed=d.seed, salt=salt, own=own
                    )
                )
            train, heldout = out
        except ValueError as e:
            raise TaskDataError(f"algorithm.data (node {name}): {e}") from e
        return train, heldout
    own = agent is not None and agent.path is not None
    rows = read_pairs(agent.path if own else d.path, format=d.format)
    eval_file = (agent.eval_path if agent is not None else None) or d.eval_path
    order = _shuffled(len(rows), d.seed, agent.path if own else d.path)
    if eval_file is not None:
        heldout = read_pairs(eval_file, format=d.format)[: d.eval_pairs]
        rest = order
    else:
        if len(rows) <= d.eval_pairs:
            raise TaskDataError(
                f"preferences file {(agent.path if own else d.path)!r} has {len(rows)} pairs, "
                f"not more than algorithm.data.eval_pairs ({d.eval_pairs}) held out; lower "
                "eval_pairs or give an eval_path"
            )
        heldout = [rows[i] for i in order[: d.eval_pairs]]
        rest = order[d.eval_pairs :]
    if not own:  # a round-robin shard of the shared file
        rest = rest[rank :: len(cfg.nodes)]
    train = [rows[i] for i in rest]
    if d.train_pairs:
        train = train[: d.train_pairs]
    if not train:
        raise TaskDataError(f"node {name} has no training pairs left; give it more data")
    return train, heldout


def _shuffled(n: int, seed: int, key: str | None) -> list[int]:
    digest = hashlib.blake2b(f"ftis-prefs-split:{seed}:{key}".encode(), digest_size=8).digest()
    order = list(range(n))
    random.Random(int.from_bytes(digest, "little")).shuffle(order)
    return order


def greedy_answers(
    reference: Reference,
    tokenizer: Any,
    task: Task,
    problems: list[Problem],
    *,
    batch_size: int,
    max_new_tokens: int,
) -> list[str]:
    """The reference's (starting model's) greedy completions of `problems`: the embedded mistake
    kind `own`. Deterministic, so a resumed run (or another worker) rebuilds the same pairs."""
    import torch

    from ftis.rollout.sampler import decode_completions, greedy_samples

    out: list[str] = []
    prompts = [task.prompt_ids(p, tokenizer) for p in problems]
    with torch.no_grad(), reference.active():
        for s in greedy_samples(
            reference.model,
            prompts,
            tokenizer,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
        ):
            out += decode_completions(tokenizer, s.completion_ids, s.lengths)
    return out


def tokenized_agent_pairs(
    cfg: RunConfig, rank: int, tokenizer: Any, *, reference: Reference, task: Task
) -> tuple[TokenizedPairs, TokenizedPairs]:
    """Node `rank`'s (training, held-out) pairs as token ids: `agent_pairs` with the mistakes of
    kind `own` answered greedily by `reference` on `task`'s prompts, cut to the data section's
    lengths."""
    from ftis.preferences.tokens import tokenize_pairs

    d = cfg.algorithm.data

    def answer(problems: list[Problem]) -> list[str]:
        return greedy_answers(
            reference,
            tokenizer,
            task,
            problems,
            batch_size=cfg.eval.batch_size,
            max_new_tokens=cfg.train.max_new_tokens,
        )

    train, heldout = agent_pairs(cfg, rank, answer=answer)
    lengths = {"max_length": d.max_length, "max_prompt_length": d.max_prompt_length}
    return tokenize_pairs(train, tokenizer, **lengths), tokenize_pairs(
        heldout, tokenizer, **lengths
    )


def agent_task(cfg: RunConfig, rank: int) -> Task:
    """Node `rank`'s own task: the run's task with its `data.agents.<name>.task` overrides (the
    prompts its embedded preferences are about)."""
    agent = cfg.algorithm.data.agents.get(cfg.nodes[rank].name)
    overrides = agent.task if agent is not None else {}
    return build_task({**cfg.task.model_dump(), **overrides})
