"""Supervised warm start: turn a randomly initialised tiny preset into a base model that already
solves part of the task, so that RL has something to sharpen (nothing can be downloaded here).

Deterministic from its seed and cached on disk, keyed by everything that affects the weights.
Trained here, in float32, it also depends on the CPU's instruction set (and the torch build): the
same seed gives different weights on an AVX2 and an AVX-512 machine. So the warm starts of the
configs the documentation quotes are shipped with the package (ftis.basemodels) and used in place
of local training; any other warm start is trained locally and is specific to this machine.
The data mix (`mix`) reweights the arithmetic operations (or the reasoning task's skills), which
makes models with different expertise from one preset. The supervised target is the task's
`warmstart_target(problem)` when it has one (the reasoning task's worked trace and answer, the
GSM8K task's `<think> solution </think><answer> gold </answer>`, a prompts task's
`warmstart_field`), else the bare answer; a task that has none to give refuses the warm start
(`warm_start_refusal`, checked when the config is read).
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

from ftis.basemodels import ShippedBase, find_shipped, sha256_file, verify
from ftis.models.loading import ModelConfig, build_model, load_tokenizer
from ftis.models.logprobs import completion_logprobs
from ftis.models.saving import save_model
from ftis.models.sources import model_label
from ftis.rollout.sampler import left_pad
from ftis.tasks import build_task, get_task
from ftis.tasks.base import Problem, Task
from ftis.warmstart_config import WarmStartConfig

log = logging.getLogger(__name__)

# Bump when the warm-start procedure changes in a way that changes the weights.
WARMSTART_VERSION = 1


def cache_root() -> Path:
    return Path(os.environ.get("FTIS_CACHE", Path.home() / ".cache" / "ftis"))


# task kind -> the task config field that `warm_start.mix` replaces
MIX_FIELDS = {"arithmetic": "ops", "reasoning": "skills"}


# Task fields that only RL reads: never part of a warm start's key.
RL_ONLY_TASK_FIELDS = frozenset({"reward", "reward_max_error_share"})
# Fields added after warm starts were shipped, left out of the key at these values so that the
# keys of every earlier config (and the shipped bases they name) stay what they were.
KEY_NEUTRAL_DEFAULTS = {"skip_bad_rows": False}


def _task_payload(task_cfg: BaseModel) -> dict:
    """What of the task config decides a warm start: everything but what only RL reads (its
    reward and the reward's failure bound), plus the version of the task's supervised target
    format when it declares one."""
    payload = task_cfg.model_dump(exclude=set(RL_ONLY_TASK_FIELDS))
    for field, neutral in KEY_NEUTRAL_DEFAULTS.items():
        if field in payload and payload[field] == neutral:
            del payload[field]
    target = getattr(type(task_cfg), "warmstart_target_format", None)
    return payload if target is None else {**payload, "warmstart_target_format": target}


def warmstart_task(task_cfg: BaseModel, ws: WarmStartConfig) -> Task:
    refuse = getattr(task_cfg, "warm_start_refusal", None)
    reason = refuse() if callable(refuse) else None
    if reason:
        raise ValueError(f"warm_start refused: {reason}")
    if ws.mix is None:
        return _bare_task(task_cfg)
    remix = getattr(task_cfg, "warmstart_mix", None)  # a task that reweights its own mix
    if callable(remix):
        return _bare_task(remix(ws.mix))
    field = MIX_FIELDS.get(getattr(task_cfg, "kind", None))
    if field is None:
        raise ValueError(
            "warm_start.mix only applies to the arithmetic task (operation weights), the "
            "reasoning task (skill weights) and the reasoning-gym task (dataset weights); remove it"
        )
    return _bare_task(task_cfg.model_copy(update={field: ws.mix}))


def _bare_task(task_cfg: BaseModel) -> Task:
    """The task without its reward: a warm start reads prompts and targets only (a prompts
    task whose reward is configured on the nodes alone has none to build)."""
    if isinstance(task_cfg, dict):
        return build_task(task_cfg)
    return get_task(task_cfg.kind).build(task_cfg)


def warmstart_target(task: Task, problem: Problem) -> str:
    """The supervised completion text (without EOS): the task's own target, else the answer."""
    target = getattr(task, "warmstart_target", None)
    return problem.answer if target is None else target(problem)


def _digest(payload: dict) -> str:
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _tokenizer_payload(model_cfg: ModelConfig) -> dict:
    """The digest of a trained embedded tokenizer (the ``*-bpe`` presets), so that a changed
    tokenizer never reuses weights trained on the old one. Empty for the character tokenizer,
    which is fixed, and for a model directory, whose path is in the key; keeping it empty there
    keeps those keys (and the shipped bases they name) unchanged."""
    from ftis.models.presets import PRESETS

    preset = PRESETS.get(model_cfg.preset) if model_cfg.preset else None
    if preset is None or preset.tokenizer != "bpe":
        return {}
    from ftis.models.bpe import bpe_digest

    return {"tokenizer": f"bpe-{bpe_digest()}"}


def cache_key(model_cfg: ModelConfig, ws: WarmStartConfig, task_cfg: BaseModel) -> str:
    """Key of the local cache entry: everything that decides how a local warm start comes out,
    the torch version included."""
    payload = {
        "version": WARMSTART_VERSION,
        "model": model_cfg.model_dump(exclude={"lora", "compute_dtype"}),
        "warm_start": ws.model_dump(),
        "task": _task_payload(task_cfg),
        "torch": torch.__version__.split("+")[0],
        **_tokenizer_payload(model_cfg),
    }
    return _digest(payload)


def base_key(model_cfg: ModelConfig, ws: WarmStartConfig, task_cfg: BaseModel) -> str:
    """Key of a shipped base model (ftis.basemodels): which starting point a config asks for.
    The cache key without the torch version and the model's device, which decide how a local
    warm start comes out but not what a shipped one holds."""
    payload = {
        "version": WARMSTART_VERSION,
        "model": model_cfg.model_dump(exclude={"lora", "device", "compute_dtype"}),
        "warm_start": ws.model_dump(),
        "task": _task_payload(task_cfg),
        **_tokenizer_payload(model_cfg),
    }
    return _digest(payload)


def entry_name(model_cfg: ModelConfig, key: str) -> str:
    return f"{Path(model_label(model_cfg)).name}-{key}"


def starting_model(
    model_cfg: ModelConfig,
    ws: WarmStartConfig | None,
    task_cfg: BaseModel,
    *,
    base_dir: str | Path | None = None,
    progress=None,
) -> ModelConfig:
    """The model config a node is built from: the one place that decides where its starting
    weights come from.

    - `base_dir` given: that directory (a shared base another process warm-started: the
      federated launcher trains it once and hands it to every client and the server);
    - `warm_start` set: the shipped base with its key (verified against the package's
      manifest), else this machine's cache entry, else trained here on first use and cached
      (`warm_start`);
    - otherwise the model as configured: a preset's seeded random initialisation, `model.path`,
      or a GGUF file / named real model, converted once into the cache when it is loaded
      (`ftis.models.real.resolve_model_dir`).

    A starting directory becomes the node's `model.path`; the node's LoRA adapters, dtypes and
    device stay its own.
    """
    if base_dir is None and ws is not None:
        base_dir = warm_start(model_cfg, ws, task_cfg, progress=progress)
    if base_dir is None:
        return model_cfg
    update = {f: None for f in ("preset", "gguf", "name")}
    return model_cfg.model_copy(update={**update, "path": str(base_dir)})


def warm_start(
    model_cfg: ModelConfig,
    ws: WarmStartConfig,
    task_cfg: BaseModel,
    *,
    progress=None,
    use_shipped: bool = True,
) -> Path:
    """Return the directory of the warm-started model, training and caching it if needed.

    A shipped base model with the same `base_key` (ftis.basemodels) is verified against its
    manifest and copied into the cache entry, replacing a locally trained one; without one the
    warm start is trained here. `progress`, if given, is called as progress(step, total, loss)
    during local training. `use_shipped=False` (`ftis basemodels build`) always trains here,
    reusing only a cache entry that was trained here.
    """
    key = cache_key(model_cfg, ws, task_cfg)
    name = Path(model_label(model_cfg)).name
    target = cache_root() / "warmstart" / f"{name}-{key}"
    shipped = find_shipped(base_key(model_cfg, ws, task_cfg)) if use_shipped else None
    if shipped is not None:
        verify(shipped)  # a damaged package is an error, not a reason to train a different base
    elif use_shipped:
        _note_cpu_specific(name, key)
    if _cached(target, shipped, trained_here=not use_shipped):
        return target
    # Several nodes of one run often share a warm start: one computes it, the others wait for
    # it (an advisory lock per entry; where there is no fcntl, each computes its own).
    locks = target.parent / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with _entry_lock(locks / f"{target.name}.lock"):
        if _cached(target, shipped, trained_here=not use_shipped):
            return target
        if shipped is not None:
            return _install_shipped(shipped, key, target)
        return _train_and_cache(model_cfg, ws, task_cfg, key, name, target, progress)


_noted: set[str] = set()


def _note_cpu_specific(name: str, key: str) -> None:
    if key in _noted:
        return
    _noted.add(key)
    log.info(
        "warm start %s-%s is not shipped with ftis: trained on this machine, its weights (and "
        "every accuracy measured from them) are specific to this CPU and torch build",
        name,
        key,
    )


def _cached(
    target: Path, shipped: ShippedBase | None = None, *, trained_here: bool = False
) -> bool:
    """True when `target` holds a complete entry: the shipped base's bytes when there is one (an
    entry trained here before the base was shipped is replaced), one trained on this machine
    when `trained_here`."""
    if not ((target / "meta.json").exists() and (target / "config.json").exists()):
        return False
    if shipped is not None or trained_here:
        try:
            meta = json.loads((target / "meta.json").read_text())
        except (OSError, ValueError):
            return False
        if trained_here and "shipped" in meta:
            return False
    if shipped is not None:
        if meta.get("shipped") != shipped.name or any(
            not (target / f).is_file() or sha256_file(target / f) != digest
            for f, digest in shipped.files.items()
        ):
            return False
    log.info("warm start: cache hit %s", target)
    return True


def _install_shipped(shipped: ShippedBase, key: str, target: Path) -> Path:
    """Copy a verified shipped base into the cache entry `target` (replacing what is there)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    for fname in shipped.files:
        shutil.copyfile(shipped.path / fname, tmp / fname)
    meta = {"key": key, "shipped": shipped.name, "base_key": shipped.key}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    _set_aside(target)
    os.replace(tmp, target)
    log.info("warm start: shipped base %s (identical on every machine) -> %s", shipped.name, target)
    return target


def _set_aside(target: Path) -> None:
    """Remove an entry that `_cached` refused (trained here before its base was shipped, a
    shipped copy that `ftis basemodels build` must retrain, or a damaged one); the caller holds
    the entry's lock."""
    if target.exists():
        old = Path(tempfile.mkdtemp(dir=target.parent, prefix=".old-"))
        os.replace(target, old / target.name)
        shutil.rmtree(old, ignore_errors=True)


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
    meta = {
        "key": key,
        "seconds": seconds,
        "final_loss": loss_value,
        "steps": ws.steps,
        # what the weights depend on besides the config (they differ across these)
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "device": str(model.device),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    _set_aside(target)
    try:
        os.replace(tmp, target)  # atomic: readers see the whole directory or none of it
    except OSError:  # another process won the race; keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return target
