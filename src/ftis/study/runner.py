"""Run a study: every run not done yet, one after another (or `--jobs N` at a time, each in a
process of its own), each an ordinary run directory. The one loop of every study kind; a kind may bring its own `status` and `execute` hooks (FGRPO's
centralized runs are evaluated on every client after training).

Resume rule: a run whose metrics.jsonl has its final step for every node is done and skipped; any
other existing run directory is incomplete and is deleted and run again from scratch (runs are
short; redoing one is simpler and safer than resuming it mid-way).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from rich.console import Console
from rich.progress import Progress

from ftis import rundir
from ftis.config import RunConfig
from ftis.launch.progress import progress_columns
from ftis.launch.stop import on_signals
from ftis.study.spec import RunSpec, Study
from ftis.train.metrics import read_metrics

log = logging.getLogger(__name__)

RUN_META = "study-run.json"  # written into each run directory: grid position, seconds, status
STUDY_LOG = "study.json"  # written into the study's folder: one entry per `ftis sweep` invocation

Status = Literal["done", "incomplete", "todo"]


def read_meta(run_dir: Path) -> dict:
    """A run's study-run.json ({} when it is missing or unreadable)."""
    try:
        meta = json.loads((Path(run_dir) / RUN_META).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


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


def complete_runs(
    study: Any, out_dir: Path, status: Callable[[Any, Path], str] | None = None
) -> tuple[list[tuple[Any, Path, dict]], list[str]]:
    """(run, its directory, its study-run.json) of every complete run of a study, in the study's
    order, and the ids of the runs that are not complete: what every renderer's collect reads.
    `status(run, run_dir)` says "done" of a complete run (default: every node logged its last
    step), as a study kind's status hook does (FGRPO's: a centralized run is done once its
    clients' evaluation is)."""
    done, missing = [], []
    for run in study.runs:
        d = Path(out_dir) / run.id
        state = run_status(d, run.config) if status is None else status(run, d)
        if state != "done":
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
    meta = {
        **run.meta(),
        "status": "running",
        "started": time.time(),
        "code": code_version(),
        "machine": machine_kernels(),
    }
    _write_json(run_dir / RUN_META, meta)
    t0 = time.perf_counter()
    run_local(cfg, run_dir, console=console)
    seconds = time.perf_counter() - t0
    _write_json(run_dir / RUN_META, {**meta, "status": "done", "seconds": seconds})
    return seconds


def machine_kernels() -> dict[str, str]:
    """What decides a float32 run's last bits on this machine besides the code: torch's version
    and the CPU instruction set its kernels use (ATEN_CPU_CAPABILITY forces one). Recorded with
    each run, so that a study made on several machines says which runs came from which."""
    import torch

    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability()}


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
    jobs: int = 1,
) -> SweepOutcome:
    """Run every selected run not already done (`status` says which are done, `execute` runs
    one; by default: every node logged its last step, and an ordinary run from scratch). With
    `jobs` 1 the runs go one after another in this process; with more, `jobs` runs at a time,
    each in a process of its own with its torch threads set so that the total matches the
    machine (:func:`threads_per_node`). A failing run is logged and recorded, and the sweep
    goes on; Ctrl-C stops it (an interrupted run is redone next time)."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
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
        "study %s: %d runs selected, %d already done, %d to run, into %s%s",
        study.spec.name,
        len(runs),
        len(outcome.skipped),
        len(todo),
        out_dir,
        f", {jobs} at a time" if jobs > 1 else "",
    )
    t_start = time.time()
    columns = progress_columns()
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task(f"study {study.spec.name}", total=len(todo), info="")
        sweep = _Sweep(outcome, progress, bar, len(todo), t_start)
        if jobs == 1:
            for run, state in todo:
                sweep.started([run.id])
                try:
                    seconds = execute(run, out_dir / run.id, state, console=console)
                except KeyboardInterrupt:
                    raise
                except Exception as e:  # one failed run must not stop the study
                    sweep.finished(run.id, error=e)
                else:
                    sweep.finished(run.id, seconds=seconds)
        else:
            _run_parallel(todo, out_dir, execute, jobs, sweep)
    outcome.seconds = time.time() - t_start
    _record_invocation(out_dir, study, outcome, t_start, only, jobs)
    return outcome


class _Sweep:
    """The progress bar, the log lines and the outcome, as runs start and finish."""

    def __init__(self, outcome: SweepOutcome, progress: Progress, bar: Any, total: int, t0: float):
        self.outcome, self.progress, self.bar, self.total, self.t0 = (
            outcome,
            progress,
            bar,
            total,
            t0,
        )
        self.done = 0

    def started(self, running: list[str]) -> None:
        eta = ""
        if self.done:  # mean time per finished run (failed ones included) x runs left
            per = (time.time() - self.t0) / self.done
            eta = f", about {_fmt_s(per * (self.total - self.done))} left"
        first = self.done + 1
        which = (
            f"run {first}/{self.total}"
            if len(running) == 1
            else (f"runs {first}-{first + len(running) - 1}/{self.total}")
        )
        self.progress.update(self.bar, info=f"{which}: {', '.join(running)}{eta}")

    def finished(
        self, run_id: str, *, seconds: float = 0.0, error: BaseException | str | None = None
    ):
        self.done += 1
        if error is not None:
            why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            self.outcome.failed[run_id] = why
            log.error("run %s failed: %s", run_id, self.outcome.failed[run_id])
        else:
            self.outcome.executed.append(run_id)
            elapsed = time.time() - self.t0
            log.info(
                "run %d/%d %s: %.0f s (study %s so far, about %s left)",
                self.done,
                self.total,
                run_id,
                seconds,
                _fmt_s(elapsed),
                _fmt_s(elapsed / self.done * (self.total - self.done)),
            )
        self.progress.advance(self.bar)


def busy_of(run: RunSpec) -> int:
    """How many of a run's processes compute at once (its algorithm's `busy_processes`: one
    per node, one for the swarm's simulator)."""
    busy = getattr(run.config.algorithm, "busy_processes", None)
    return max(1, int(busy(run.config) if callable(busy) else len(run.config.nodes)))


def slots_of(run: RunSpec, jobs: int) -> int:
    """The sweep's slots a run takes (`--jobs N` is N slots, one core's share each): one per
    process that computes at once (a 2-node run counts as 2), at most all N."""
    return min(busy_of(run), jobs)


def threads_per_node(jobs: int, nodes: int, cpus: int | None = None, slots: int = 1) -> int:
    """Torch threads for each of a run's `nodes` busy processes when it holds `slots` of the
    sweep's `jobs` on `cpus` cores: the run's share of the cores split among its processes, at
    least 1. $OMP_NUM_THREADS, when set, wins (the caller's choice, e.g. 1 for timings)."""
    env = os.environ.get("OMP_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    cpus = cpus or os.cpu_count() or 1
    return max(1, cpus * slots // (jobs * max(1, nodes)))


def _execute_in_child(
    execute: ExecuteHook, run: RunSpec, run_dir: Path, state: str, threads: int
) -> float:
    """A run in a process of its own (`ftis sweep --jobs N`), with its thread count: node
    processes it launches inherit $OMP_NUM_THREADS; a run in this process sets torch's."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    return execute(run, run_dir, state, console=None)


def _child_main(
    conn: Any, execute: ExecuteHook, run: RunSpec, run_dir: Path, state: str, threads: int
):
    """The body of a run's process: its outcome goes back through `conn`, ("ok", seconds) or
    ("error", message); a process that dies without sending is a failed run too."""
    try:
        outcome = ("ok", _execute_in_child(execute, run, run_dir, state, threads))
    except BaseException as e:  # every way a run ends is reported
        outcome = ("error", f"{type(e).__name__}: {e}")
    try:
        conn.send(outcome)
    except OSError:  # the sweep is gone (stopped while this run checkpointed): nobody to tell
        pass
    finally:
        conn.close()


# What a run's process imports anyway, imported once by the fork server that starts every run
# process (`_run_context`): a spawned child spent seconds on these imports per run.
PRELOAD = ("torch", "transformers", "ftis.study.engine", "ftis.train.node")


def _run_context():
    """The multiprocessing context `--jobs N` starts runs with: a fork server that has imported
    `PRELOAD` once (no torch thread pool or CUDA started in it), so that each run's process is
    forked from it ready to run, instead of a spawned interpreter importing torch and
    transformers for every run; each run's process is still new (nothing carries from one run to
    the next). Off Linux, spawned interpreters: Windows has no fork server, and on macOS a
    process forked after importing torch's native libraries is not safe."""
    import multiprocessing
    import sys

    if not sys.platform.startswith("linux"):
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _run_parallel(
    todo: list[tuple[RunSpec, str]], out_dir: Path, execute: ExecuteHook, jobs: int, sweep: _Sweep
) -> None:
    """Runs in `jobs` slots, each in a new process of its own (`_run_context`; no state carries
    from one run to the next, and a run whose process dies, killed or crashed, fails alone), started
    in the sweep's order as their slots free up: a run takes one slot per process that computes
    at once (`slots_of`), so that a 2-node run on 2 slots runs alone instead of three processes
    sharing two cores (its nodes wait for each other every step: a descheduled node stalls
    both)."""
    from multiprocessing.connection import wait

    ctx = _run_context()
    # sentinel -> (process, pipe end, run id, slots)
    running: dict[Any, tuple[Any, Any, str, int]] = {}
    queue = list(todo)

    def on_sigterm(signum, frame):
        # SIGTERM to the sweep alone (a scheduler, `kill`): the runs in flight get it too (each
        # checkpoints and stops, as under Ctrl-C), then the sweep stops as under Ctrl-C
        for proc, *_ in list(running.values()):
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGTERM)
        raise KeyboardInterrupt

    with on_signals(on_sigterm, (signal.SIGTERM,)):
        try:
            while queue or running:
                while queue and slots_of(queue[0][0], jobs) <= jobs - sum(
                    r[3] for r in running.values()
                ):
                    run, state = queue.pop(0)
                    slots = slots_of(run, jobs)
                    threads = threads_per_node(jobs, busy_of(run), slots=slots)
                    recv, send = ctx.Pipe(duplex=False)
                    proc = ctx.Process(
                        target=_child_main,
                        args=(send, execute, run, out_dir / run.id, state, threads),
                        name=f"ftis-sweep-{run.id}",
                    )
                    proc.start()
                    send.close()
                    running[proc.sentinel] = (proc, recv, run.id, slots)
                    sweep.started([r[2] for r in running.values()])
                for sentinel in wait(list(running)):
                    proc, recv, run_id, _ = running.pop(sentinel)
                    proc.join()
                    outcome = recv.recv() if recv.poll() else None
                    recv.close()
                    if outcome is None:
                        sweep.finished(
                            run_id, error=f"its process died (exit code {proc.exitcode})"
                        )
                    elif outcome[0] == "ok":
                        sweep.finished(run_id, seconds=outcome[1])
                    else:
                        sweep.finished(run_id, error=outcome[1])
                if running:
                    sweep.started([r[2] for r in running.values()])
        except KeyboardInterrupt:
            # the children got the same Ctrl-C (one process group), or the SIGTERM forwarded
            # above, and stop their runs themselves
            for proc, *_ in running.values():
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.terminate()
            raise


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
    out_dir: Path,
    study: Study,
    outcome: SweepOutcome,
    t_start: float,
    only: str | None,
    jobs: int = 1,
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
            "jobs": jobs,
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
