"""Evaluation: greedy accuracy on each eval split, and pass@k from samples."""

from __future__ import annotations

import torch

from ftis.config import EvalConfig, TrainConfig
from ftis.core.passk import pass_at_k
from ftis.rollout.sampler import decode_completions, sample
from ftis.tasks.base import Task
from ftis.train.node import Node


def _rewards(
    node: Node,
    task: Task,
    problems,
    *,
    num_samples: int,
    temperature: float,
    max_new_tokens: int,
    batch_size: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """(len(problems), num_samples) rewards."""
    tok = node.tokenizer
    per_batch = max(1, batch_size // num_samples)
    out = []
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
        )
        texts = decode_completions(tok, s.completion_ids, s.lengths)
        out += [task.reward(chunk[j // num_samples], t) for j, t in enumerate(texts)]
    return torch.tensor(out, dtype=torch.float32).view(len(problems), num_samples)


def evaluate(
    node: Node, task: Task, cfg: EvalConfig, train: TrainConfig, *, seed: int
) -> dict[str, float]:
    """`eval/accuracy` is greedy accuracy on the first (in-distribution) eval split; every split
    also gets `eval/<split>/accuracy`; pass@k on the in-distribution split as `eval/pass@k`."""
    g = torch.Generator().manual_seed(seed)
    metrics: dict[str, float] = {}
    for i, split in enumerate(task.eval_splits):
        ds = task.split(split)
        problems = [ds[j] for j in range(min(cfg.size, len(ds)))]
        r = _rewards(
            node,
            task,
            problems,
            num_samples=1,
            temperature=0.0,
            max_new_tokens=train.max_new_tokens,
            batch_size=cfg.batch_size,
            generator=g,
        )
        acc = float(r.mean())
        metrics[f"eval/{split}/accuracy"] = acc
        if i == 0:
            metrics["eval/accuracy"] = acc
    if cfg.pass_samples > 0:
        ds = task.split(task.eval_splits[0])
        problems = [ds[j] for j in range(min(cfg.pass_problems, len(ds)))]
        r = _rewards(
            node,
            task,
            problems,
            num_samples=cfg.pass_samples,
            temperature=train.temperature,
            max_new_tokens=train.max_new_tokens,
            batch_size=cfg.batch_size,
            generator=g,
        )
        correct = r.sum(dim=1)
        for k in cfg.pass_k:
            metrics[f"eval/pass@{k}"] = float(pass_at_k(cfg.pass_samples, correct, k).mean())
    return metrics
