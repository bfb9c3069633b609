"""`ftis check` and `ftis layers`: a config checked as a run would, and the package's layers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ftis.cli.common import fail, print_table, setup_logging, stdout


def check(
    config: Annotated[Path, typer.Argument(help="Run config YAML.")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a field, e.g. train.steps=100.")
    ] = None,
) -> None:
    """Check a config as a run would (fields, rewards, data files, models, warm starts), probe
    one step of each node on this machine, and print the plan: parameters, tokens per step,
    seconds and memory, each reward term on a sample completion, and the estimated total.
    Exit 0 when the run would start, 2 with the problem otherwise; nothing is written."""
    setup_logging(False)
    from ftis.check import fmt_seconds, plan_run
    from ftis.config import ConfigError, load_config
    from ftis.models.loading import ModelLoadError
    from ftis.rewards import RewardError
    from ftis.tasks import TaskDataError

    try:
        cfg = load_config(config, set_ or [])
        plan = plan_run(cfg)
    except (ConfigError, ModelLoadError, TaskDataError, RewardError, ValueError) as e:
        fail(str(e))
    header = ["node", "model", "trainable", "generated tokens/step", "trained seqs/step"]
    header += ["probe step", "one evaluation", "peak RSS"]
    body = [
        [
            n.name,
            n.model,
            f"{n.trainable / 1e6:.2f}M of {n.total / 1e6:.2f}M",
            f"{n.generated_per_step:.0f}",
            str(n.trained_per_step),
            fmt_seconds(n.step_seconds),
            fmt_seconds(n.eval_seconds),
            f"{n.peak_rss_mib / 1024:.2f} GiB",
        ]
        for n in plan.nodes
    ]
    print_table(header, body, title=f"plan: {plan.name}")
    out = stdout()
    for n in plan.nodes:
        out.print(
            f"[bold]{escape(n.name)}[/], a sample completion of {escape(repr(n.sample_question[:80]))}:"
        )
        out.print(f"  {escape(repr(n.sample_completion[:160]))}")
        for term, (hit, of) in n.fired.items():
            warn = "  [bold red]never fired in the probe[/]" if hit == 0 else ""
            out.print(
                f"  {escape(term)}: {n.sample_terms.get(term, 0.0):g} on it; non-zero on {hit} of "
                f"{of} probe completions{warn}"
            )
    out.print(
        f"estimate: {fmt_seconds(plan.total_seconds)} for {plan.steps} steps and "
        f"{plan.evaluations} evaluations on this machine ({len(plan.nodes)} node(s)"
        + (
            f" in {plan.busy} process(es) computing at once"
            if plan.busy is not None and plan.busy != len(plan.nodes)
            else ""
        )
        + f" on {plan.cores} core(s); from one probe step per node, rough)"
    )


def layers(
    write: Annotated[
        Path | None,
        typer.Option(
            "--write",
            metavar="FILE",
            help="Replace FILE's first fenced block with the picture (docs/design.md's), "
            "instead of printing it.",
        ),
    ] = None,
) -> None:
    """Draw the package's layers and where each system lives (docs/design.md opens with it)."""
    from ftis.layers import diagram, write_diagram

    if write is None:
        stdout().out(diagram(), end="")
        return
    changed = write_diagram(write)
    stdout().print(f"{write}: {'redrawn' if changed else 'already the picture the code draws'}")
