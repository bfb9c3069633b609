"""Evaluation: greedy accuracy on each eval split, pass@k and distinct answers from samples.

Besides its metrics, an evaluation has per-problem greedy outcomes and a few sample completions
per split (`evaluate_detailed`). `evaluate` returns the metrics only and hands the rest to the
collector the node shell installs around an algorithm's evaluation (`collect_outcomes`), which
writes them to evals.jsonl and samples.jsonl: every algorithm that calls `evaluate` gets them.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ftis.config import EvalConfig, TrainConfig
from ftis.core.passk import pass_at_k
from ftis.models.precision import node_compute_dtype
from ftis.rewards.decode import decode_for_reward
from ftis.rewards.runtime import task_rewards
from ftis.rollout.sampler import sample
from ftis.tasks.base import Task
from ftis.train.node import Node


def answer_extractor(task: Task) -> Callable[[str], str | None] | None:
    """The task's optional `extract_answer(completion) -> str | None` (the final answer of a
    decoded completion in a canonical form, None when it has none), or None if it has none."""
    fn = getattr(task, "extract_answer", None)
    return fn if callable(fn) else None


def distinct_answers(answers: Sequence[Sequence[str | None]]) -> float:
    """Mean over problems of the number of distinct final answers among a problem's samples.

    `answers[i]` are the extracted answers of problem i's samples; None (a completion without an
    answer, e.g. malformed) is not an answer and is not counted, so a problem whose samples are
    all malformed counts 0. A model that always says the same thing scores 1."""
    if not answers:
        return 0.0
    return sum(len({a for a in row if a is not None}) for row in answers) / len(answers)


def _samples(
    node: Node,
    task: Task,
    problems,
    *,
    num_samples: int,
    temperature: float,
    max_new_tokens: int,
    batch_size: int,
    generator: torch.Generator,
    extract: Callable[[str], str | None] | None = None,
    texts_out: list[str] | None = None,
) -> tuple[torch.Tensor, list[list[str | None]] | None]:
    """(len(problems), num_samples) rewards, and with `extract` each sample's answer; the
    decoded completions are appended to `texts_out` when given."""
    tok = node.tokenizer
    per_batch = max(1, batch_size // num_samples)
    out = []
    answers: list[str | None] = []
    for start in range(0, len(problems), per_batch):
        chunk = problems[start : start + per_batch]
        s = sample(
            node.model,
            [task.prompt_ids(p, tok) for p in chunk],
            num_samples=num_samples,
            max_new_tokens=max_new_tokens,
            eos_id=tok.eos_token_id,
            pad_id=tok.pad_token_id,
            temperature=temperature,
            generator=generator,
            compute_dtype=node_compute_dtype(node),
        )
        texts = decode_for_reward(tok, s.completion_ids, s.lengths)
        if texts_out is not None:
            texts_out += texts
        out += task_rewards(task, [chunk[j // num_samples] for j in range(len(texts))], texts)
        if extract is not None:
            answers += [extract(t) for t in texts]
    rewards = torch.tensor(out, dtype=torch.float32).view(len(problems), num_samples)
    if extract is None:
        return rewards, None
    rows = [answers[i * num_samples : (i + 1) * num_samples] for i in range(len(problems))]
    return rewards, rows


SAMPLES_PER_SPLIT = 3  # greedy completions of a split's first problems kept for samples.jsonl


@dataclass(frozen=True)
class SplitOutcome:
    """One eval split's greedy outcomes: `correct[i]` is 1 when the greedy completion of the
    split's problem i (its fixed order, the first eval.size) earned reward > 0; `samples` are
    (prompt, completion, reward) of the first SAMPLES_PER_SPLIT problems, where `prompt` is the
    text the model was given (`prompt_text`: its chat template and special tokens included);
    `questions` are the same problems' plain questions."""

    split: str
    correct: list[int]
    samples: list[tuple[str, str, float]]
    questions: list[str] = field(default_factory=list)


def prompt_text(tokenizer, ids: Sequence[int]) -> str:
    """The text of prompt ids as the model saw them, every special token written out (BOS, the
    chat template's markers): ``tokenizer(text, add_special_tokens=False)`` gives the ids back
    (checked for every preset and for SmolLM2 by tests/test_export_round_trip.py)."""
    return tokenizer.decode(list(ids), skip_special_tokens=False)


_COLLECTOR: contextvars.ContextVar[list[SplitOutcome] | None] = contextvars.ContextVar(
    "ftis_eval_outcomes", default=None
)


@contextlib.contextmanager
def collect_outcomes() -> Iterator[list[SplitOutcome]]:
    """Within the block, every `evaluate` (in this thread) appends its SplitOutcomes to the
    yielded list. The node shell wraps an algorithm's `evaluate(step)` in it."""
    got: list[SplitOutcome] = []
    token = _COLLECTOR.set(got)
    try:
        yield got
    finally:
        _COLLECTOR.reset(token)


def attack_success(texts: Sequence[str], watch: Sequence[str]) -> float:
    """The fraction of `texts` that contain any of the strings in `watch` (0 for no text)."""
    if not texts:
        return 0.0
    return sum(any(w in t for w in watch) for t in texts) / len(texts)


def evaluate(
    node: Node,
    task: Task,
    cfg: EvalConfig,
    train: TrainConfig,
    *,
    seed: int,
    watch: Sequence[str] = (),
) -> dict[str, float]:
    """`eval/accuracy` is greedy accuracy on the first (in-distribution) eval split; every split
    also gets `eval/<split>/accuracy`; pass@k on the in-distribution split as `eval/pass@k`, and
    from the same samples `eval/<split>/distinct_answers` (the mean number of distinct final
    answers per problem) when the task has an `extract_answer`.

    watch: the texts a poisoning attack injects (testing.adversary). When given, one completion
    per problem of the first split is sampled at train.temperature (after everything else, so
    the other metrics' random draws do not change) and `attack/success` is the fraction that
    contain any of them; `attack/success_greedy` is the same over the greedy completions.

    One SplitOutcome per eval split goes to the active `collect_outcomes` block, if any."""
    g = torch.Generator().manual_seed(seed)
    metrics: dict[str, float] = {}
    outcomes: list[SplitOutcome] = []
    for i, split in enumerate(task.eval_splits):
        ds = task.split(split)
        problems = [ds[j] for j in range(min(cfg.size, len(ds)))]
        texts: list[str] = []
        r, _ = _samples(
            node,
            task,
            problems,
            num_samples=1,
            temperature=0.0,
            max_new_tokens=train.max_new_tokens,
            batch_size=cfg.batch_size,
            generator=g,
            texts_out=texts,
        )
        rewards = r[:, 0].tolist()
        if i == 0 and watch:
            metrics["attack/success_greedy"] = attack_success(texts, watch)
        shown = range(min(SAMPLES_PER_SPLIT, len(problems)))
        outcomes.append(
            SplitOutcome(
                split=split,
                correct=[int(x > 0) for x in rewards],
                samples=[
                    (
                        prompt_text(node.tokenizer, task.prompt_ids(problems[j], node.tokenizer)),
                        texts[j],
                        rewards[j],
                    )
                    for j in shown
                ],
                questions=[problems[j].question for j in shown],
            )
        )
        acc = float(r.mean())
        metrics[f"eval/{split}/accuracy"] = acc
        if i == 0:
            metrics["eval/accuracy"] = acc
    if cfg.pass_samples > 0:
        split = task.eval_splits[0]
        ds = task.split(split)
        problems = [ds[j] for j in range(min(cfg.pass_problems, len(ds)))]
        r, answers = _samples(
            node,
            task,
            problems,
            num_samples=cfg.pass_samples,
            temperature=train.temperature,
            max_new_tokens=train.max_new_tokens,
            batch_size=cfg.batch_size,
            generator=g,
            extract=answer_extractor(task),
        )
        correct = r.sum(dim=1)
        for k in cfg.pass_k:
            metrics[f"eval/pass@{k}"] = float(pass_at_k(cfg.pass_samples, correct, k).mean())
        if answers is not None:
            metrics[f"eval/{split}/distinct_answers"] = distinct_answers(answers)
    if watch:
        ds = task.split(task.eval_splits[0])
        problems = [ds[j] for j in range(min(cfg.size, len(ds)))]
        texts = []
        _samples(
            node,
            task,
            problems,
            num_samples=1,
            temperature=train.temperature,
            max_new_tokens=train.max_new_tokens,
            batch_size=cfg.batch_size,
            generator=g,
            texts_out=texts,
        )
        metrics["attack/success"] = attack_success(texts, watch)
    collector = _COLLECTOR.get()
    if collector is not None:
        collector += outcomes
    return metrics


def evaluate_detailed(
    node: Node, task: Task, cfg: EvalConfig, train: TrainConfig, *, seed: int
) -> tuple[dict[str, float], list[SplitOutcome]]:
    """`evaluate`'s metrics, and one SplitOutcome per eval split (in `task.eval_splits` order).
    These outcomes are returned, not handed to an enclosing `collect_outcomes` block."""
    with collect_outcomes() as outcomes:
        metrics = evaluate(node, task, cfg, train, seed=seed)
    return metrics, outcomes
