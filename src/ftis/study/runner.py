"""Run a study: every run not done yet, one after another, each an ordinary run directory. The
one loop of every study kind; a kind may bring its own `status` and `execute` hooks (FGRPO's
centralized runs are evaluated on every client after training).

Resume rule: a run whose metrics.jsonl has its final step for every node is done and skipped; any
other existing run directory is incomplete and is deleted and run again from scratch (runs are
short; redoing one is simpler and safer than resuming it mid-way).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ftis import rundir
from ftis.config import RunConfig
from ftis.study.spec import RunSpec, Study
from ftis.train.metrics import read_metrics

log = logging.getLogger(__name__)

RUN_META = "study-run.json"  # written into each run directory: grid position, seconds, status
STUDY_LOG = "study.json"  # written into the study's folder: one entry per `ftis sweep` invocation

Status = Literal["done", "incomplete", "todo"]


def run_status(run_dir: Path, cfg: RunConfig) -> Status:
    """'done' when metrics.jsonl has step == train.steps for every node of `cfg`, or when the
    sweep recorded the run as done (study-run.json; a swarm peer that left for good by plan has
    no last-step row)."""
    path = run_dir / "metrics.jsonl"
    if not run_dir.exists():
        return "todo"
    if not path.exists():
        return "incomplete"
    try:
        if json.loads((run_dir / RUN_META).read_text()).get("status") == "done":
            return "done"
    except (OSError, ValueError, AttributeError):
        pass
    try:
        rows = read_metrics(path)
    except (OSError, ValueError):
        return "incomplete"
    last = {r.get("node") for r in rows if r.get("step") == cfg.train.steps}
    return "done" if all(n.name in last for n in cfg.nodes) else "incomplete"


def complete_runs(study: Any, out_dir: Path) -> tuple[list[tuple[Any, Path, dict]], list[str]]:
    """(run, its directory, its study-run.json) of every complete run of a study, in the study's
    order, and the ids of the runs that are not complete: what every renderer's collect reads."""
    done, missing = [], []
    for run in study.runs:
        d = Path(out_dir) / run.id
        if run_status(d, run.config) != "done":
            missing.append(run.id)
            continue
        try:
            meta = json.loads((d / RUN_META).read_text())
        except (OSError, ValueError):
            meta = {}
        done.append((run, d, meta))
    return done, missing


@dataclass
class SweepOutcome:
    selected: int = 0
    skipped: list[str] = field(default_factory=list)
    executed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def execute_run(run: RunSpec, run_dir: Path, *, console: Console | None = None) -> float:
    """Train one run from scratch into `run_dir` (deleted first if it exists); return seconds."""
    from ftis.launch import run_local

    if run_dir.exists():
        written = any((run_dir / f).is_file() for f in (RUN_META, "config.yaml", "metrics.jsonl"))
        if written and not rundir.is_ftis_run_dir(run_dir):
            rundir.mark(run_dir)  # a run of this study written before the marker existed
        rundir.clear(run_dir)  # only a directory ftis created (RunDirError otherwise)
    rundir.mark(run_dir)
    cfg = run.config.model_copy(
        update={"log": run.config.log.model_copy(update={"progress": False})}
    )
    (run_dir / "config.yaml").write_text(
        yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    )
    meta = {**run.meta(), "status": "running", "started": time.time(), "code": code_version()}
    _write_json(run_dir / RUN_META, meta)
    t0 = time.perf_counter()
    run_local(cfg, run_dir, console=console)
    seconds = time.perf_counter() - t0
    _write_json(run_dir / RUN_META, {**meta, "status": "done", "seconds": seconds})
    return seconds


def _fmt_s(s: float) -> str:
    m, s = divmod(int(s), 60)
    return f"{m}m{s:02d}s"


# status(run, run_dir) -> "done" | "todo" | "incomplete" | a kind's own state
StatusHook = Callable[[RunSpec, Path], str]
# execute(run, run_dir, status, *, console) -> seconds: bring the run to "done"
ExecuteHook = Callable[..., float]


def default_status(run: RunSpec, run_dir: Path) -> str:
    return run_status(run_dir, run.config)


def default_execute(
    run: RunSpec, run_dir: Path, status: str, *, console: Console | None = None
) -> float:
    return execute_run(run, run_dir, console=console)


def run_study(
    study: Study,
    *,
    out_dir: Path | None = None,
    only: str | None = None,
    console: Console | None = None,
    status: StatusHook | None = None,
    execute: ExecuteHook | None = None,
) -> SweepOutcome:
    """Run every selected run not already done, sequentially (`status` says which are done,
    `execute` runs one; by default: every node logged its last step, and an ordinary run from
    scratch). A failing run is logged and recorded, and the sweep goes on; Ctrl-C stops it (the
    interrupted run is redone next time)."""
    status = status or default_status
    execute = execute or default_execute
    out_dir = Path(out_dir) if out_dir else study.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = study.select(only)
    outcome = SweepOutcome(selected=len(runs))
    todo = []
    # seed-major order: an interrupted study has every method for its first seeds
    for r in sorted(
        runs, key=lambda r: study.spec.seeds.index(r.seed) if r.seed in study.spec.seeds else 0
    ):
        state = status(r, out_dir / r.id)
        if state == "done":
            outcome.skipped.append(r.id)
        else:
            todo.append((r, state))
    log.info(
        "study %s: %d runs selected, %d already done, %d to run, into %s",
        study.spec.name,
        len(runs),
        len(outcome.skipped),
        len(todo),
        out_dir,
    )
    t_start = time.time()
    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
    ]
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task(f"study {study.spec.name}", total=len(todo), info="")
        for k, (run, state) in enumerate(todo, start=1):
            eta = ""
            if k > 1:  # mean time of the runs so far (failed ones included) x runs left
                eta = f", about {_fmt_s((time.time() - t_start) / (k - 1) * (len(todo) - k + 1))} left"
            progress.update(bar, info=f"run {k}/{len(todo)}: {run.id}{eta}")
            try:
                seconds = execute(run, out_dir / run.id, state, console=console)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # one failed run must not stop the study
                outcome.failed[run.id] = f"{type(e).__name__}: {e}"
                log.error("run %s failed: %s", run.id, outcome.failed[run.id])
            else:
                outcome.executed.append(run.id)
                elapsed = time.time() - t_start
                left = elapsed / k * (len(todo) - k)
                log.info(
                    "run %d/%d %s: %.0f s (study %s so far, about %s left)",
                    k,
                    len(todo),
                    run.id,
                    seconds,
                    _fmt_s(elapsed),
                    _fmt_s(left),
                )
            progress.advance(bar)
    outcome.seconds = time.time() - t_start
    _record_invocation(out_dir, study, outcome, t_start, only)
    return outcome


# What a run's results depend on in the checkout: the code, the study files and the configs
# they name. An uncommitted edit to a tracked file under any of them marks the code '+dirty'.
DIRTY_PATHS = ("src", "studies", "configs")


def code_version(root: Path | None = None) -> str | None:
    """The git commit of the checkout being run (with '+dirty' for uncommitted changes to
    tracked files under src/, studies/ or configs/, DIRTY_PATHS), or None outside a git
    checkout. `root`: the checkout (default: the one holding this ftis source). Recorded so
    that results name the code and the configs behind them."""
    import subprocess

    root = Path(root) if root is not None else Path(__file__).resolve().parents[3]
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--"]
            + list(DIRTY_PATHS),
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+dirty" if dirty else "")


def _record_invocation(
    out_dir: Path, study: Study, outcome: SweepOutcome, t_start: float, only: str | None
) -> None:
    path = out_dir / STUDY_LOG
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {"study": study.spec.name, "invocations": []}
    data["invocations"].append(
        {
            "started": t_start,
            "seconds": outcome.seconds,
            "only": only,
            "selected": outcome.selected,
            "executed": len(outcome.executed),
            "skipped": len(outcome.skipped),
            "failed": sorted(outcome.failed),
            "code": code_version(),
        }
    )
    _write_json(path, data)


def plan(
    study: Study,
    *,
    out_dir: Path | None = None,
    only: str | None = None,
    status: StatusHook | None = None,
) -> list[tuple]:
    """(run, status) for every selected run, without running anything (`--dry-run`)."""
    status = status or default_status
    out_dir = Path(out_dir) if out_dir else study.out_dir
    return [(r, status(r, out_dir / r.id)) for r in study.select(only)]
