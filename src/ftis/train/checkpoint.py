"""Complete, versioned, atomic checkpoints: weights (HF save_pretrained), optimizer, RNG, step.

Layout: RUN_DIR/nodes/<name>/step-000123/{model/, trainer_state.pt, meta.json} and a `latest`
file naming the newest one. A checkpoint directory is written under a temporary name and
renamed into place, so a crash mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

from ftis import __version__
from ftis.models.loading import save_model
from ftis.train.node import Node

CHECKPOINT_VERSION = 1


def save_checkpoint(
    node: Node,
    node_dir: Path,
    step: int,
    *,
    keep: int,
    extra_rng: dict | None = None,
    counters: dict[str, float] | None = None,
) -> Path:
    """Write step-NNNNNN/ atomically; on any failure the temporary directory is removed and the
    previous checkpoints and `latest` are untouched."""
    node_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=node_dir, prefix=".tmp-"))
    try:
        final = _write(node, node_dir, tmp, step, extra_rng, counters)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(node_dir, keep)
    return final


def _write(
    node: Node, node_dir: Path, tmp: Path, step: int, extra_rng: dict | None, counters: dict | None
) -> Path:
    final = node_dir / f"step-{step:06d}"
    save_model(node.model, tmp / "model")
    node.tokenizer.save_pretrained(tmp / "model")
    state = {
        "version": CHECKPOINT_VERSION,
        "step": step,
        "optimizer": node.optimizer.state_dict(),
        "rng": {
            "python": random.getstate(),
            "torch": torch.get_rng_state(),
            **(extra_rng or {}),
        },
        "counters": dict(counters or {}),
    }
    torch.save(state, tmp / "trainer_state.pt")
    meta = {
        "version": CHECKPOINT_VERSION,
        "ftis": __version__,
        "step": step,
        "node": node.name,
        "lora": node.cfg.model.lora is not None,
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = node_dir / ".latest.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, node_dir / "latest")
    return final


def _prune(node_dir: Path, keep: int) -> None:
    ckpts = sorted(p for p in node_dir.glob("step-*") if p.is_dir())
    for old in ckpts[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(node_dir: Path) -> Path | None:
    """The checkpoint `latest` names; if that one is missing or incomplete, the newest complete
    step-* directory; None when there is none."""
    marker = node_dir / "latest"
    if marker.exists():
        path = node_dir / marker.read_text().strip()
        if (path / "meta.json").exists() and (path / "trainer_state.pt").exists():
            return path
    done = sorted(
        p
        for p in node_dir.glob("step-*")
        if (p / "meta.json").exists() and (p / "trainer_state.pt").exists()
    )
    return done[-1] if done else None


def load_checkpoint(node: Node, ckpt: Path) -> dict:
    """Restore weights (full model or LoRA adapters) and optimizer state from `ckpt` into
    `node`, and the python and torch RNGs; returns the trainer state (step, rng, counters)."""
    state = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=False)
    if state.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{ckpt} has checkpoint version {state.get('version')}, this ftis reads "
            f"{CHECKPOINT_VERSION}"
        )
    model_dir = ckpt / "model"
    if hasattr(node.model, "peft_config"):
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights

        set_peft_model_state_dict(node.model, load_peft_weights(str(model_dir)))
    else:
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(model_dir, dtype=node.model.dtype)
        node.model.load_state_dict(saved.state_dict())
    node.optimizer.load_state_dict(state["optimizer"])
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    return state


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used for a resume; the message says which and why."""


def checkpoint_step(node_dir: Path) -> int | None:
    """Step of the newest complete checkpoint in `node_dir`, or None."""
    ckpt = latest_checkpoint(node_dir)
    if ckpt is None:
        return None
    return int(json.loads((ckpt / "meta.json").read_text())["step"])
