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
    node: Node, node_dir: Path, step: int, *, keep: int, extra_rng: dict | None = None
) -> Path:
    node_dir.mkdir(parents=True, exist_ok=True)
    final = node_dir / f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(dir=node_dir, prefix=".tmp-"))
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
    _prune(node_dir, keep)
    return final


def _prune(node_dir: Path, keep: int) -> None:
    ckpts = sorted(p for p in node_dir.glob("step-*") if p.is_dir())
    for old in ckpts[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(node_dir: Path) -> Path | None:
    marker = node_dir / "latest"
    if not marker.exists():
        return None
    path = node_dir / marker.read_text().strip()
    return path if (path / "meta.json").exists() else None
