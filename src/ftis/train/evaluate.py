"""Evaluation: greedy accuracy on each eval split, pass@k and distinct answers from samples.

Besides its metrics, an evaluation has per-problem greedy outcomes and a few sample completions
per split (`evaluate_detailed`). `evaluate` returns the metrics only and hands the rest to the
collector the node shell installs around an algorithm's evaluation (`collect_outcomes`), which
writes them to evals.jsonl and samples.jsonl: every algorithm that calls `evaluate` gets them.

Within a `greedy_cache()` block (the node shell's evaluation before training), greedy
completions are read from, or written to, an on-disk cache keyed by everything they depend on
(:func:`greedy_key`): a sweep evaluates the same base model before every method and seed, and
only the first run pays for it. Rewards are always computed afresh from the completions.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ftis.config import EvalConfig, TrainConfig
from ftis.core.passk import pass_at_k
from ftis.models.precision import node_compute_dtype
from ftis.rewards.decode import decode_for_reward
from ftis.rewards.runtime import task_rewards
from ftis.rollout.sampler import greedy_samples, right_pad, sample
from ftis.tasks.base import Task
from ftis.train.node import Node
from ftis.warmstart import cache_root

log = logging.getLogger(__name__)


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
    cached = None
    if num_samples == 1 and temperature == 0 and _GREEDY_CACHE.get() is not None:
        cached = _cached_greedy(node, task, problems, max_new_tokens, per_batch)
    for start in range(0, len(problems), per_batch):
        chunk = problems[start : start + per_batch]
        if cached is not None:
            ids, lengths = right_pad(cached[start : start + per_batch], tok.pad_token_id)
        else:
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
            ids, lengths = s.completion_ids, s.lengths
        texts = decode_for_reward(tok, ids, lengths)
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


# --- the greedy-evaluation cache ---------------------------------------------------------------

# Bump when greedy generation changes in a way that changes its tokens.
GREEDY_CACHE_VERSION = 1

# None: off; else the block's digests of the weights, by id(model) (fixed within the block)
_GREEDY_CACHE: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar(
    "ftis_greedy_cache", default=None
)


@contextlib.contextmanager
def greedy_cache(enabled: bool = True) -> Iterator[None]:
    """Within the block (in this thread), `evaluate`'s greedy completions come from the on-disk
    cache when an earlier evaluation of the same weights on the same prompts with the same
    settings made them here, and are stored there otherwise. The weights must not change within
    the block (they are hashed once). FTIS_EVAL_CACHE=0 turns it off."""
    on = enabled and os.environ.get("FTIS_EVAL_CACHE", "1") != "0"
    token = _GREEDY_CACHE.set({} if on else None)
    try:
        yield
    finally:
        _GREEDY_CACHE.reset(token)


def greedy_cache_dir() -> Path:
    """``$FTIS_CACHE/evals`` (default ``~/.cache/ftis/evals``)."""
    return cache_root() / "evals"


def weights_digest(model: torch.nn.Module) -> str:
    """blake2b of every tensor of the model's state dict (name, dtype, shape and bytes) and of
    its config, when it has one: equal only for models that compute the same function."""
    from transformers import PretrainedConfig

    h = hashlib.blake2b(digest_size=32)
    config = getattr(model, "config", None)
    h.update(type(model).__name__.encode())
    if isinstance(config, PretrainedConfig):
        h.update(config.to_json_string(use_diff=False).encode())
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def greedy_key(
    node: Node, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int
) -> str:
    """The cache key of greedy completions: the weights (:func:`weights_digest`), the prompts'
    ids in order, the generation settings (max_new_tokens, batching, EOS and padding ids, the
    compute dtype), and what picks the kernels (torch's version, its CPU instruction set and
    thread count, the device): floating-point results may differ where any of them does."""
    model = node.model
    device = next(model.parameters()).device
    memo = _GREEDY_CACHE.get()
    if memo is None:
        digest = weights_digest(model)
    elif id(model) in memo:
        digest = memo[id(model)]
    else:
        digest = memo[id(model)] = weights_digest(model)
    setting = {
        "v": GREEDY_CACHE_VERSION,
        "weights": digest,
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "eos": node.tokenizer.eos_token_id,
        "pad": node.tokenizer.pad_token_id,
        "dtype": str(node_compute_dtype(node)),
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }
    h = hashlib.blake2b(json.dumps(setting, sort_keys=True).encode(), digest_size=32)
    for p in prompts:
        h.update(json.dumps(list(p)).encode())
    return h.hexdigest()


def _read_entry(path: Path, n: int, max_new_tokens: int) -> list[list[int]] | None:
    """The completions stored at `path`, or None when it is absent or not `n` rows of at most
    `max_new_tokens` integer ids (a damaged entry is regenerated, never trusted)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or len(rows) != n:
        return None
    for row in rows:
        if not (
            isinstance(row, list)
            and len(row) <= max_new_tokens
            and all(type(t) is int and t >= 0 for t in row)
        ):
            return None
    return rows


def _cached_greedy(
    node: Node, task: Task, problems, max_new_tokens: int, batch_size: int
) -> list[list[int]]:
    """Every problem's greedy completion ids (its real tokens, EOS included), from the cache or
    generated `batch_size` prompts at a time exactly as an uncached evaluation does."""
    tok = node.tokenizer
    prompts = [task.prompt_ids(p, tok) for p in problems]
    key = greedy_key(node, prompts, max_new_tokens, batch_size)
    path = greedy_cache_dir() / key[:2] / f"{key}.json"
    rows = _read_entry(path, len(prompts), max_new_tokens)
    if rows is not None:
        log.debug("greedy evaluation of %d prompts read from %s", len(prompts), path)
        return rows
    rows = []
    dtype = node_compute_dtype(node)
    for s in greedy_samples(
        node.model,
        prompts,
        tok,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        compute_dtype=dtype,
    ):
        rows += [r[:n].tolist() for r, n in zip(s.completion_ids, s.lengths.tolist())]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": GREEDY_CACHE_VERSION, "rows": rows}))
        tmp.replace(path)
    except OSError as e:  # a full or read-only cache costs the next run time, nothing else
        log.warning("could not store a greedy evaluation in %s: %s", path.parent, e)
    return rows


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
