"""`ftis export`: a node's checkpoint as a merged, standalone Hugging Face model directory.

The node is rebuilt exactly as a resume rebuilds it (its warm start from the cache, recomputed
if the cache was cleared; a preset's seeded initialisation; `model.path`), the checkpoint's
weights are loaded into it, LoRA adapters are merged into the base (peft's merge_and_unload),
and the result is saved with its tokenizer: `AutoModelForCausalLM.from_pretrained(OUT)` and
`PreTrainedTokenizerFast.from_pretrained(OUT)` load it with no ftis, peft or base model around.
(`AutoTokenizer` does too, except where transformers rebuilds the model type's own tokenizer
from the vocabulary, as transformers 5 does for qwen2: then the export's log and
`ftis_export.json` (`tokenizer_loader`) say so, since that rebuild tokenizes otherwise.)
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from ftis.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, read_meta

log = logging.getLogger(__name__)


class ExportError(ValueError):
    """The export cannot be made; the message says what to give instead."""


def export_node(
    run_dir: Path, node: str, *, out: Path | None = None, step: int | None = None
) -> Path:
    """Write node `node`'s checkpoint of `step` (default: the one a resume would load) in
    `run_dir` to `out` (default RUN_DIR/export/<node>-step-NNNNNN) as a merged model directory;
    returns `out`. ExportError for an unknown node, a missing step or an existing `out`."""
    from ftis.config import load_config
    from ftis.models.loading import save_model
    from ftis.train.node import build_node

    if not (run_dir / "config.yaml").is_file():
        raise ExportError(f"{run_dir} is not a run directory (no config.yaml)")
    cfg = load_config(run_dir / "config.yaml", [])
    names = [n.name for n in cfg.nodes]
    if node not in names:
        raise ExportError(f"no node {node!r} in {run_dir}; its nodes are: {', '.join(names)}")
    node_dir = run_dir / "nodes" / node
    ckpt = _checkpoint(node_dir, step)
    step = int(read_meta(ckpt)["step"])
    out = out or run_dir / "export" / f"{node}-step-{step:06d}"
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty; choose another --out or remove it")
    rank = names.index(node)
    built = build_node(cfg.nodes[rank], rank=rank, task_cfg=cfg.task)
    load_checkpoint(built, ckpt)
    model = built.model
    if hasattr(model, "merge_and_unload"):  # LoRA: fold the adapters into the base weights
        model = model.merge_and_unload()
    model.eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        save_model(model, tmp)
        built.tokenizer.save_pretrained(tmp)
        loader = _tokenizer_loader(tmp, built.tokenizer)
        (tmp / "ftis_export.json").write_text(
            json.dumps(
                {
                    "run": str(run_dir),
                    "node": node,
                    "step": step,
                    "checkpoint": str(ckpt),
                    "lora_merged": cfg.nodes[rank].model.lora is not None,
                    "tokenizer_loader": loader,
                },
                indent=2,
            )
        )
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s step %d to %s", node, step, out)
    return out


def _tokenizer_loader(path: Path, tok) -> str:
    """The transformers class that loads the tokenizer saved in `path` as `tok` encodes:
    "AutoTokenizer" when it does, else "PreTrainedTokenizerFast" (with a warning)."""
    from transformers import AutoTokenizer

    from ftis.models.loading import tokenizer_fingerprint

    if tokenizer_fingerprint(AutoTokenizer.from_pretrained(path)) == tokenizer_fingerprint(tok):
        return "AutoTokenizer"
    log.warning(
        "AutoTokenizer.from_pretrained(%s) rebuilds this model type's own tokenizer, which "
        "encodes otherwise than the one the node trained with: load it with "
        "PreTrainedTokenizerFast.from_pretrained(...) instead",
        path.name,
    )
    return "PreTrainedTokenizerFast"


def _checkpoint(node_dir: Path, step: int | None) -> Path:
    """The checkpoint directory of `step`, or the one a resume loads when `step` is None."""
    if step is None:
        ckpt = latest_checkpoint(node_dir)
        if ckpt is None:
            raise ExportError(f"{node_dir} has no checkpoint to export")
        return ckpt
    ckpt = node_dir / f"step-{step:06d}"
    if not ckpt.is_dir():
        have = sorted(
            p.name.removeprefix("step-").lstrip("0") or "0"
            for p in node_dir.glob("step-*")
            if p.is_dir()
        )
        raise ExportError(
            f"{node_dir} has no checkpoint of step {step}; it has steps: {', '.join(have) or 'none'}"
        )
    return ckpt


__all__ = ["CheckpointError", "ExportError", "export_node"]
