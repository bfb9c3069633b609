"""`ftis run` and `ftis report`: train, then write and print the run's report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import yaml

from ftis.cli.common import console, ended, fail, print_table, setup_logging
from ftis.cli.resume import _resumable_config, _resume_hint, _stopped_message
from ftis.cli.supervisor import _needs_supervisor, _supervise


def run(
    config: Annotated[
        Path | None, typer.Argument(help="YAML config; omit for the embedded default.")
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a field: --set train.steps=20 (repeatable)."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Run directory (default runs/<name>).")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing run directory.")] = False,
    resume: Annotated[
        Path | None,
        typer.Option(
            "--resume",
            help="Continue the run in this directory from every node's last checkpoint "
            "(its config.yaml; --set applies on top).",
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """Train: warm start (cached), then RL with F-TIS. Writes metrics, checkpoints and a report.
    Ctrl-C stops after a checkpoint; --resume RUN_DIR continues from there."""
    setup_logging(verbose)
    from ftis.config import ConfigError, load_config
    from ftis.train.checkpoint import CheckpointError

    if resume is not None:
        if config is not None or out is not None or overwrite:
            fail(
                "--resume RUN_DIR takes its config from RUN_DIR/config.yaml: drop CONFIG, "
                "--out and --overwrite (use --set to change fields)"
            )
        run_dir = resume
        try:
            cfg = _resumable_config(run_dir, set_ or [])
        except (ConfigError, CheckpointError) as e:
            fail(str(e))
    else:
        try:
            cfg = load_config(config, set_ or [])
        except ConfigError as e:
            fail(str(e))
        run_dir = out or Path("runs") / cfg.name
    from ftis.preflight import check_run
    from ftis.rundir import RunDirError, claim

    try:
        check_run(cfg)  # before the run directory is touched or any worker starts
    except ConfigError as e:
        fail(str(e))
    if _needs_supervisor(cfg):
        args = ["run"] + ([str(config)] if config is not None else [])
        args += [x for v in set_ or [] for x in ("--set", v)]
        args += ["--out", str(out)] if out is not None else []
        args += ["--overwrite"] if overwrite else []
        args += ["--resume", str(resume)] if resume is not None else []
        args += ["--verbose"] if verbose else []
        raise typer.Exit(_supervise(cfg, run_dir, args))
    try:
        with claim(run_dir, overwrite=overwrite, resume=resume is not None):
            _run_in(cfg, run_dir, resume=resume is not None)
    except RunDirError as e:
        fail(str(e))


def _run_in(cfg, run_dir: Path, *, resume: bool) -> None:
    """Write config.yaml into the claimed `run_dir`, run, report; errors end in `fail`."""
    from ftis.config import ConfigError
    from ftis.models.loading import ModelLoadError
    from ftis.tasks import TaskDataError
    from ftis.train.checkpoint import CheckpointError

    try:
        (run_dir / "config.yaml").write_text(
            yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
        )
    except OSError as e:
        hint = "" if resume else "; choose another --out"
        fail(f"cannot write the run directory {run_dir}: {e.strerror or e}{hint}")

    from ftis.launch import run_local
    from ftis.launch.multi import (
        BackendLost,
        DiskFullError,
        LaunchError,
        NodesLostError,
        StoreOverflow,
    )
    from ftis.train.loop import NoTrainingSignal, SimulatedCrash

    try:
        run_local(cfg, run_dir, console=console, resume=resume)
    except NodesLostError as e:  # the others finished: report them, then fail
        _finish(run_dir)
        fail(
            f"{e}. The report covers every node's rows; continue the lost nodes with: "
            f"ftis run --resume {run_dir}",
            1,
        )
    except BackendLost as e:  # Ray died under Flower: the server checkpointed, resumable
        fail(f"{e}. {_resume_hint(cfg, run_dir)}", 1)
    except DiskFullError as e:  # a fault of the machine, not of the config: resumable
        fail(f"{e}. Free space under {run_dir}. {_resume_hint(cfg, run_dir)}", 1)
    except StoreOverflow as e:  # an outsider filled the store: resumable
        fail(str(e), 1)
    except (ModelLoadError, TaskDataError, ConfigError, CheckpointError, LaunchError) as e:
        fail(str(e))
    except NoTrainingSignal as e:
        fail(str(e), 1)
    except SimulatedCrash as e:
        fail(f"node crashed on purpose ({e}); continue with: ftis run --resume {run_dir}", 1)
    except KeyboardInterrupt:
        fail(_stopped_message(cfg, run_dir), 130)
    _finish(run_dir)
    ended(0)


def _finish(run_dir: Path) -> None:
    from ftis.report import (
        federated_lines,
        load_rows,
        summary_table,
        write_report,
        zero_reward_warnings,
    )

    report = write_report(run_dir)
    rows = load_rows(run_dir)
    header, body = summary_table(rows)
    print_table(header, body, title=f"ftis run {run_dir.name}")
    for line in federated_lines(rows)[:1]:
        console.print(line)
    for line in zero_reward_warnings(rows):
        console.print(f"[yellow]warning[/yellow]: {line}", markup=True, highlight=False)
    console.print(f"report: {report}")


def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `ftis run`.")],
) -> None:
    """Redraw report.md and the PNG plots of a run from its metrics.jsonl."""
    setup_logging(False)
    from ftis.report import ReportError

    try:
        _finish(run_dir)
    except ReportError as e:
        fail(str(e))
