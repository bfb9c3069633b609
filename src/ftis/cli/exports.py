"""`ftis export` and `ftis eval`: a node's checkpoint as a model directory, and its score."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ftis.cli.common import console, fail, setup_logging


def export(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `ftis run`.")],
    node: Annotated[str, typer.Argument(help="The node to export (its name in the config).")],
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Output directory (default RUN_DIR/export/<node>-step-N)."),
    ] = None,
    step: Annotated[
        int | None,
        typer.Option("--step", help="Checkpoint step (default: the newest that verifies)."),
    ] = None,
) -> None:
    """Write a node's checkpoint as a standalone Hugging Face model directory: LoRA adapters
    merged into their base, tokenizer included; AutoModelForCausalLM.from_pretrained(OUT)
    loads it."""
    setup_logging(False)
    from ftis.config import ConfigError
    from ftis.export import ExportError, export_node
    from ftis.models.loading import ModelLoadError
    from ftis.train.checkpoint import CheckpointError

    try:
        path = export_node(run_dir, node, out=out, step=step)
    except (ExportError, ConfigError, CheckpointError, ModelLoadError) as e:
        fail(str(e))
    console.print(f"exported: {path}")


def eval_(
    source: Annotated[
        Path, typer.Argument(help="A run directory (a node's checkpoint) or a model directory.")
    ],
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", help="Run config naming the task (default: the run's config.yaml)."
        ),
    ] = None,
    node: Annotated[
        str | None, typer.Option("--node", help="The node (default: the run's only node).")
    ] = None,
    step: Annotated[
        int | None,
        typer.Option("--step", help="Checkpoint step (default: the one a resume would load)."),
    ] = None,
    split: Annotated[
        str | None, typer.Option("--split", help="Only this evaluation split.")
    ] = None,
    pass_k: Annotated[
        list[int] | None,
        typer.Option("--pass-k", help="Also pass@k (repeatable; samples per problem = max k)."),
    ] = None,
    size: Annotated[
        int | None, typer.Option("--size", min=1, help="Problems per split (default eval.size).")
    ] = None,
) -> None:
    """Score a run's checkpoint, or an exported model directory, on the task's evaluation
    splits: greedy accuracy (mean reward where the reward gives partial credit) and pass@k when
    asked, as the run's own evaluation computes them: a table on stderr, one JSON line on
    stdout."""
    setup_logging(False)

    from ftis.config import ConfigError
    from ftis.models.loading import ModelLoadError
    from ftis.offline_eval import EvalError, evaluate_source
    from ftis.train.checkpoint import CheckpointError

    try:
        res = evaluate_source(
            source, config=config, node=node, step=step, split=split, pass_k=pass_k, size=size
        )
    except (EvalError, ConfigError, CheckpointError, ModelLoadError) as e:
        fail(str(e))
    rows = [[k, f"{v:.4f}"] for k, v in res.metrics.items()]
    where = f"{res.source} node {res.node}" + (f" step {res.step}" if res.step is not None else "")
    table = Table(title=where)  # on stderr: stdout holds the JSON line alone, for scripts
    for h in ("metric", "value"):
        table.add_column(h)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    print(json.dumps(res.as_json()), flush=True)
