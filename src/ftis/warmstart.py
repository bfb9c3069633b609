"""Supervised warm start: turn a randomly initialised tiny preset into a base model that already
solves part of the task, so that RL has something to sharpen (nothing can be downloaded here).

Deterministic from its seed and cached on disk, keyed by everything that affects the weights.
The data mix (`mix`) reweights the arithmetic operations (or the reasoning task's skills), which
makes models with different expertise from one preset. The supervised target is the task's
`warmstart_target(problem)` when it has one (the reasoning task's worked trace and answer), else
the bare answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
from pydantic import BaseModel

from ftis.models.loading import ModelConfig, build_model, load_tokenizer, save_model
from ftis.models.logprobs import completion_logprobs
from ftis.rollout.sampler import left_pad
from ftis.tasks import build_task
from ftis.tasks.base import Problem, Task
from ftis.warmstart_config import WarmStartConfig

log = logging.getLogger(__name__)

# Bump when the warm-start procedure changes in a way that changes the weights.
WARMSTART_VERSION = 1


def cache_root() -> Path:
    return Path(os.environ.get("FTIS_CACHE", Path.home() / ".cache" / "ftis"))


# task kind -> the task config field that `warm_start.mix` replaces
MIX_FIELDS = {"arithmetic": "ops", "reasoning": "skills"}


def warmstart_task(task_cfg: BaseModel, ws: WarmStartConfig) -> Task:
    if ws.mix is None:
        return build_task(task_cfg)
    field = MIX_FIELDS.get(getattr(task_cfg, "kind", None))
    if field is None:
        raise ValueError(
            "warm_start.mix only applies to the arithmetic task (operation weights) and the "
            "reasoning task (skill weights); remove it"
        )
    return build_task(task_cfg.model_copy(update={field: ws.mix}))


def warmstart_target(task: Task, problem: Problem) -> str:
    """The supervised completion text (without EOS): the task's own target, else the answer."""
    target = getattr(task, "warmstart_target", None)
    return problem.answer if target is None else target(problem)


def cache_key(model_cfg: ModelConfig, ws: WarmStartConfig, task_cfg: BaseModel) -> str:
    payload = {
        "version": WARMSTART_VERSION,
        "model": model_cfg.model_dump(exclude={"lora"}),
        "warm_start": ws.model_dump(),
        "task": task_cfg.model_dump(),
        "torch": torch.__version__.split("+")[0],
    }
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def warm_start(
    model_cfg: ModelConfig, ws: WarmStartConfig, task_cfg: BaseModel, *, progress=None
) -> Path:
    """Return the directory of the warm-started model, training and caching it if needed.

    `progress`, if given, is called as progress(step, total, loss) during training.
    """
    key = cache_key(model_cfg, ws, task_cfg)
    name = model_cfg.preset or Path(str(model_cfg.path)).name
    target = cache_root() / "warmstart" / f"{name}-{key}"
    if _cached(target):
        return target
    # Several nodes of one run often share a warm start: one computes it, the others wait for
    # it (an advisory lock per entry; where there is no fcntl, each computes its own).
    locks = target.parent / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with _entry_lock(locks / f"{target.name}.lock"):
        if _cached(target):
            return target
        return _train_and_cache(model_cfg, ws, task_cfg, key, name, target, progress)


def _cached(target: Path) -> bool:
    if (target / "meta.json").exists() and (target / "config.json").exists():
        log.info("warm start: cache hit %s", target)
        return True
    return False


@contextlib.contextmanager
def _entry_lock(path: Path):
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _train_and_cache(model_cfg, ws, task_cfg, key, name, target, progress) -> Path:
    task = warmstart_task(task_cfg, ws)
    tok = load_tokenizer(model_cfg)
    model = build_model(model_cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.0)
    rng = random.Random(ws.seed)
    torch.manual_seed(ws.seed)
    split = getattr(task, "warmstart_split", None)  # a task's own pre-training mix, if any
    train = task.split("train") if split is None else split()
    t0 = time.perf_counter()
    loss_value = float("nan")
    for step in range(ws.steps):
        problems = [train[rng.randrange(len(train))] for _ in range(ws.batch_size)]
        prompts = [task.prompt_ids(p, tok) for p in problems]
        answers = [
            tok.encode(warmstart_target(task, p), add_special_tokens=False) + [tok.eos_token_id]
            for p in problems
        ]
        prompt_ids, prompt_mask = left_pad(prompts, tok.pad_token_id)
        width = max(len(a) for a in answers)
        comp = torch.full((len(answers), width), tok.pad_token_id, dtype=torch.long)
        comp_mask = torch.zeros_like(comp)
        for i, a in enumerate(answers):
            comp[i, : len(a)] = torch.tensor(a)
            comp_mask[i, : len(a)] = 1
        lp = completion_logprobs(
            model,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=comp,
            completion_mask=comp_mask,
        )
        comp_mask = comp_mask.to(lp.device)
        loss = -(lp * comp_mask).sum() / comp_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = float(loss.detach())
        if progress is not None:
            progress(step + 1, ws.steps, loss_value)
    seconds = time.perf_counter() - t0
    log.info(
        "warm start of %s: %d steps in %.1fs, final loss %.3f", name, ws.steps, seconds, loss_value
    )

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    save_model(model, tmp)
    tok.save_pretrained(tmp)
    meta = {"key": key, "seconds": seconds, "final_loss": loss_value, "steps": ws.steps}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    try:
        os.replace(tmp, target)  # atomic: readers see the whole directory or none of it
    except OSError:  # another process won the race; keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return target
