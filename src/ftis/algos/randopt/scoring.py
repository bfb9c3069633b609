"""Scoring a model greedily on a problem set, and the private problem sets a node scores on.

Scoring is batched over problems (one greedy generation per `batch_size` prompts, KV-cached,
stopping as soon as every sequence has ended) and counts the forward-pass tokens it costs:
prompt tokens plus completion tokens of every sequence, the compute figure the population's
`train/forward_tokens*` metrics report (docs/randopt.md, "Compute accounting").
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from hashlib import blake2b

import torch

from ftis.rewards.decode import decode_for_reward
from ftis.rewards.runtime import task_rewards
from ftis.rollout.sampler import greedy_samples
from ftis.tasks.base import Problem, Task
from ftis.train.evaluate import answer_extractor
from ftis.train.node import Node


@dataclass
class ProblemSet:
    """Problems and their prompt token ids (tokenized once)."""

    problems: list[Problem]
    prompts: list[list[int]]

    def __len__(self) -> int:
        return len(self.problems)


def problem_set(task: Task, node: Node, problems: list[Problem]) -> ProblemSet:
    return ProblemSet(problems, [task.prompt_ids(p, node.tokenizer) for p in problems])


def private_sets(
    task: Task,
    node: Node,
    *,
    seed: int,
    name: str,
    support: int,
    probe: int,
    validation: int = 0,
) -> tuple[ProblemSet, ProblemSet, ProblemSet]:
    """(support, probe, validation): `support + probe + validation` distinct problems of
    `task`'s train split, drawn from (seed, node name), so every node holds its own problems;
    the three sets are disjoint (the validation set is empty when `validation` is 0).
    Evaluation splits are never used (the train split excludes them)."""
    train = task.split("train")
    want = support + probe + validation
    if want > len(train):
        raise ValueError(
            f"node {name}: support_size + probe_size (+ probe_size again for the validation "
            f"split) = {want} exceeds the {len(train)} train problems of its task; lower "
            "algorithm.support_size or probe_size (or set validation_gate: false)"
        )
    key = blake2b(f"population|{seed}|{name}".encode(), digest_size=8).digest()
    idx = random.Random(int.from_bytes(key, "little")).sample(range(len(train)), want)
    problems = [train[i] for i in idx]
    a, b = support, support + probe
    return (
        problem_set(task, node, problems[:a]),
        problem_set(task, node, problems[a:b]),
        problem_set(task, node, problems[b:]),
    )


@torch.no_grad()
def greedy_completions(
    node: Node, ps: ProblemSet, *, max_new_tokens: int, batch_size: int
) -> tuple[list[str], int]:
    """(decoded greedy completion of every problem, forward-pass tokens spent)."""
    tok = node.tokenizer
    texts: list[str] = []
    tokens = 0
    for s in greedy_samples(
        node.model, ps.prompts, tok, max_new_tokens=max_new_tokens, batch_size=batch_size
    ):
        texts += decode_for_reward(tok, s.completion_ids, s.lengths)
        tokens += int(s.prompt_mask.sum()) + int(s.lengths.sum())
    return texts, tokens


def rewards_of(task: Task, ps: ProblemSet, texts: list[str]) -> tuple[list[float], int]:
    """(each completion's reward, how many were non-finite and counted as 0)."""
    if len(ps.problems) != len(texts):
        raise ValueError(f"{len(texts)} completions for {len(ps.problems)} problems")
    out, bad = [], 0
    for r in task_rewards(task, list(ps.problems), texts):
        if not math.isfinite(r):
            r, bad = 0.0, bad + 1
        out.append(r)
    return out, bad


def answers_of(task: Task, texts: list[str]) -> list[str | None]:
    """The final answers the vote counts: the task's `extract_answer`, else the stripped text."""
    extract = answer_extractor(task)
    if extract is None:
        return [t.strip() or None for t in texts]
    return [extract(t) for t in texts]
