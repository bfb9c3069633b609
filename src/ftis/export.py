"""`ftis export`: a node's checkpoint as a merged, standalone Hugging Face model directory.

The node is rebuilt exactly as a resume rebuilds it (its warm start from the cache, recomputed
if the cache was cleared; a preset's seeded initialisation; `model.path`), the checkpoint's
weights are loaded into it, LoRA adapters are merged into the base (peft's merge_and_unload),
and the result is saved with its tokenizer: `AutoModelForCausalLM.from_pretrained(OUT)` and
`PreTrainedTokenizerFast.from_pretrained(OUT)` load it with no ftis, peft or base model around.
A full fine-tune needs no warm start at all (its checkpoint holds every weight), so none is
retrained for it. The tokenizer prompts as ftis did: it adds the BOS that ftis prepends to plain
prompts, and keeps the model's chat template where the node used one (`prompt_format` in
ftis_export.json); samples.jsonl's `prompt` is the text the model was given, so
`tok(prompt, add_special_tokens=False)` + greedy `generate` reproduces its completions
(tests/test_export_round_trip.py).
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

from ftis.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_meta,
    verify_checkpoint,
)

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
    from ftis.models.saving import save_model
    from ftis.train.node import build_node

    if not (run_dir / "config.yaml").is_file():
        raise ExportError(f"{run_dir} is not a run directory (no config.yaml)")
    # the weights, the model and tokenizer sources and the prompt format are all export needs:
    # the config is checked without importing its reward functions or environments
    cfg = load_config(run_dir / "config.yaml", [], import_code=False)
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
    node_cfg = cfg.nodes[rank]
    if node_cfg.model.lora is None:
        # A full fine-tune's checkpoint holds every weight: no warm start is needed (nor
        # retrained when the cache was cleared), only the base model's tokenizer, which
        # encodes as the warm start's does (tests/test_tokenizer_round_trip.py).
        problems = verify_checkpoint(ckpt)
        if problems:
            raise CheckpointError(f"checkpoint {ckpt} is damaged: {'; '.join(problems)}")
        from transformers import AutoModelForCausalLM

        from ftis.models.loading import DTYPES, load_tokenizer

        model = AutoModelForCausalLM.from_pretrained(
            ckpt / "model", dtype=DTYPES[node_cfg.model.dtype]
        )
        tokenizer = load_tokenizer(node_cfg.model)
    else:  # LoRA: the adapters go on the warm-started base, rebuilt as a resume rebuilds it
        built = build_node(node_cfg, rank=rank, task_cfg=cfg.task)
        load_checkpoint(built, ckpt)
        model, tokenizer = built.model.merge_and_unload(), built.tokenizer
    model.eval()
    prompt_format = _prompt_format(cfg.task, tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        save_model(model, tmp)
        tokenizer.save_pretrained(tmp)
        loader = _tokenizer_loader(tmp, tokenizer)
        (tmp / "README.md").write_text(
            model_card(run_dir, cfg, node, step, prompt_format=prompt_format, out=out)
        )
        (tmp / "ftis_export.json").write_text(
            json.dumps(
                {
                    "run": str(run_dir),
                    "node": node,
                    "step": step,
                    "checkpoint": str(ckpt),
                    "lora_merged": node_cfg.model.lora is not None,
                    "tokenizer_loader": loader,
                    "prompt_format": prompt_format,
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


PLAIN_BOS = "plain text; the tokenizer adds BOS (tok(question) gives the ids ftis used)"
PLAIN = "plain text (tok(question) gives the ids ftis used)"
TEMPLATED = (
    "the chat template (tok.apply_chat_template(messages, add_generation_prompt=True); "
    "samples.jsonl's prompt is the rendered text)"
)


def _prompt_format(task_cfg, tok) -> str:
    """How the node's prompts were made, read off the task's first test problem, and the
    tokenizer set to make them the same way: ftis prepends BOS to a plain prompt when the
    tokenizer has one (ftis.tasks.base.plain_prompt_ids), so the export's tokenizer adds it
    itself (`add_bos_token`). A chat-templated prompt keeps the model's template, which the
    tokenizer saves."""
    from ftis.tasks import get_task

    try:  # the bare task: its prompts, not its reward
        task = get_task(task_cfg.kind).build(task_cfg)
        problem = task.split(task.eval_splits[0])[0]
        ids = list(task.prompt_ids(problem, tok))
    except Exception as e:  # a task whose data is gone: export the model all the same
        log.warning("cannot rebuild the task to read its prompt format (%s); not recorded", e)
        return "unknown (the task could not be rebuilt)"
    bare = list(tok.encode(problem.question, add_special_tokens=False))
    bos = tok.bos_token_id
    if bos is not None and ids == [bos, *bare]:
        if list(tok(problem.question)["input_ids"]) != ids:
            tok.add_bos_token = True
            if list(tok(problem.question)["input_ids"]) != ids:
                raise ExportError(
                    f"cannot make {type(tok).__name__} add BOS as ftis did; export it with "
                    "a tokenizer that has a BOS post-processor"
                )
        return PLAIN_BOS
    if ids == bare:
        return PLAIN
    return TEMPLATED


def model_card(run_dir: Path, cfg, node: str, step: int, *, prompt_format: str, out: Path) -> str:
    """The export's README.md: what the model is, how it was trained and evaluated, and the
    commands that made it; every figure is read from the run directory."""
    node_cfg = next(n for n in cfg.nodes if n.name == node)
    model = node_cfg.model
    base = model.name or model.gguf or model.path or f"ftis preset {model.preset}"
    lora = model.lora
    task = cfg.task
    what = (
        getattr(task, "datasets", None)
        or getattr(task, "skills", None)
        or getattr(task, "ops", None)
    )
    peers = [n.name for n in cfg.nodes if n.name != node]
    method = node_cfg.loss.method
    lines = [
        f"# {node} (ftis run `{cfg.name}`, step {step})",
        "",
        f"Exported by ftis from `{run_dir}`: node `{node}` at step {step}, a standalone Hugging "
        "Face model directory (`AutoModelForCausalLM.from_pretrained` loads it"
        + (", LoRA adapters merged into the base" if lora else "")
        + ").",
        "",
        "| | |",
        "|---|---|",
        f"| base model | {base} |",
        f"| trained | {'LoRA adapters (r ' + str(lora.r) + ', merged)' if lora else 'all weights'} |",
        f"| algorithm | {cfg.algorithm.kind}, loss `{method}` |",
        f"| peers | {', '.join(peers) if peers else 'none (trained alone)'} |",
        f"| task | {task.kind}" + (f": {', '.join(map(str, dict(what)))}" if what else "") + " |",
        f"| steps | {step} of {cfg.train.steps} |",
        f"| prompt format | {prompt_format} |",
        "",
    ]
    evals = _final_evaluation(run_dir, node, step)
    if evals:
        at, values = evals
        lines += [
            f"## The run's evaluation at step {at} (greedy)",
            "",
            "| metric | value |",
            "|---|---|",
            *(f"| {k} | {v:.4g} |" for k, v in values.items()),
            "",
        ]
    else:
        lines += ["The run logged no evaluation of this node up to this step.", ""]
    lines += [
        "## How it was made",
        "",
        "```bash",
        f"ftis run {run_dir / 'config.yaml'}   # the run's resolved config",
        f"ftis export {run_dir} {node} --step {step} --out {out}",
        "```",
        "",
    ]
    return "\n".join(lines)


def _final_evaluation(run_dir: Path, node: str, step: int) -> tuple[int, dict] | None:
    """(step, {eval/... metric: value}) of `node`'s last evaluation at or before `step` in
    metrics.jsonl, or None."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    best: tuple[int, dict] | None = None
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or row.get("node") != node:
            continue
        at = row.get("step")
        vals = {
            k: float(v)
            for k, v in row.items()
            if k.startswith("eval/") and isinstance(v, (int, float)) and not k.startswith("eval/n")
        }
        if isinstance(at, int) and at <= step and vals and (best is None or at >= best[0]):
            best = (at, vals)
    return best


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
