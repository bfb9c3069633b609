"""Launch a multi-node run on this machine: one process per node (`python -m ftis.launch.worker`) with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), gloo-free: the
nodes exchange samples through a TCP key-value store that this parent process hosts.

Why not torch's launcher: torchrun tears every worker down when one fails. Here a node that dies
is only marked as gone in the store (its peers stop waiting for it at once and carry on), and
the run's report is written from the nodes that finished. The parent draws progress from the
nodes' status files, forwards SIGINT and SIGTERM to the nodes (each writes a checkpoint), and
reports their errors. On Linux a node also gets SIGTERM when the parent dies, even by SIGKILL.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from ftis.config import RunConfig
from ftis.exchange.store import HOSTED_ENV, SECRET_ENV, Signer, host_store, mark_left, new_secret
from ftis.launch.progress import progress_columns
from ftis.launch.stop import DISK_FULL, INTERRUPTED, StopSignals, die_with_parent

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """No node finished; the message carries the nodes' own error messages."""


class DiskFullError(LaunchError):
    """Every node stopped because its disk filled up; the message says how to resume."""


class StoreOverflow(LaunchError):
    """The exchange's store grew past `exchange.store_budget_mb`: something outside the run
    wrote to it. The nodes were stopped after their checkpoints; the message says how to go
    on."""


def resident_mib() -> float | None:
    """This process's resident memory in MiB (Linux's /proc/self/statm), or None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class StoreBudget:
    """The store's bound: it lives in this process (torch's TCPStore server is a thread of the
    launcher), so what it holds is this process's growth in resident memory since the nodes
    started. `exceeded()` names the growth once it passes `budget_mib`; `read` (MiB or None)
    is `resident_mib` unless a test gives its own."""

    def __init__(self, budget_mib: float, read: Callable[[], float | None] = resident_mib) -> None:
        self.budget_mib, self.read = budget_mib, read
        self.baseline = read()

    def exceeded(self) -> float | None:
        now = self.read()
        if now is None or self.baseline is None:
            return None
        grown = now - self.baseline
        return grown if grown > self.budget_mib else None


class BackendLost(RuntimeError):
    """The engine a run depends on (Ray, under Flower's simulation) died mid-run; the run
    checkpointed what it had and stopped. The CLI adds how to continue and exits 1."""


class NodesLostError(LaunchError):
    """Some nodes failed while the others finished (their rows and checkpoints are written);
    `result` says which. The CLI writes the report and exits 1."""

    def __init__(self, result: MultiResult) -> None:
        super().__init__(
            f"the run finished without {', '.join(result.failed)}: {result.describe_failures()}"
        )
        self.result = result


@dataclass
class MultiResult:
    """How each node's process ended: name -> exit code (0 finished, 130 stopped by Ctrl-C with a
    checkpoint, 2 user error, other: crash), and the nodes' error messages."""

    exit_codes: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    store_overflow: float | None = None  # MiB the store grew past its budget, if it did

    @property
    def failed(self) -> list[str]:
        return [n for n, c in self.exit_codes.items() if c not in (0, INTERRUPTED)]

    @property
    def interrupted(self) -> bool:
        return any(c == INTERRUPTED for c in self.exit_codes.values())

    def describe_failures(self) -> str:
        return "; ".join(
            f"{n} (exit code {self.exit_codes[n]}): {self.errors.get(n) or 'see its log'}"
            for n in self.failed
        )


def worker_command(run_dir: Path, *, resume: bool = False) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "ftis.launch.worker",
        str(run_dir / "config.yaml"),
        "--out",
        str(run_dir),
    ]
    return cmd + (["--resume"] if resume else [])


def run_multi(
    cfg: RunConfig, run_dir: Path, *, console: Console | None = None, resume: bool = False
) -> MultiResult:
    """Run every node to the end. Raises LaunchError when no node finished (every node failed,
    e.g. a config or model error), NodesLostError when some failed and the others finished,
    KeyboardInterrupt after passing SIGINT or SIGTERM on to the nodes (they checkpoint first)
    and waiting for them."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("rank*.error"):
        old.unlink()
    clear_status(run_dir)
    names = cfg.rank_names  # the nodes, then the algorithm's service ranks (e.g. a server)
    world = len(names)
    server, store, port = host_store()
    # The run's store secret reaches the nodes through their environment, not their command
    # line (which any local user can read): only they and this launcher can write the store.
    secret = new_secret()
    signer = Signer(bytes.fromhex(secret))
    base_env = dict(os.environ)
    base_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    base_env.update(
        PYTHONUNBUFFERED="1",
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **{HOSTED_ENV: "1", SECRET_ENV: secret},
    )
    for k in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID"):
        base_env.pop(k, None)
    columns = progress_columns()
    result = MultiResult()
    budget = StoreBudget(cfg.exchange.store_budget_mb)
    procs: list[subprocess.Popen] = []
    log_files = []
    stop = StopSignals()
    preexec = die_with_parent()
    try:
        with (
            stop.installed(),
            Progress(*columns, console=console, disable=not cfg.log.progress) as progress,
        ):
            for rank, name in enumerate(names):
                if stop.requested:
                    break
                f = (logs / f"{name}.log").open("a")
                log_files.append(f)
                procs.append(
                    subprocess.Popen(
                        worker_command(run_dir, resume=resume),
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        env={**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                        start_new_session=True,  # Ctrl-C reaches the parent only: it forwards
                        preexec_fn=preexec,
                    )
                )
            watch = {"signer": signer, "budget": budget}
            _watch(procs, names, cfg, store, result, progress, {}, run_dir, stop, **watch)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in log_files:
            f.close()
        del store, server
    for rank, name in enumerate(names):
        err = logs / f"rank{rank}.error"
        if err.exists():
            result.errors[name] = err.read_text().strip()
    finished = len(result.exit_codes) == world and set(result.exit_codes.values()) == {0}
    if result.store_overflow is not None:
        raise StoreOverflow(
            f"the exchange's store grew by {result.store_overflow:.0f} MiB in this process, past "
            f"exchange.store_budget_mb ({cfg.exchange.store_budget_mb}): something outside the "
            "run is writing to it (the run's own payloads are deleted two steps after they are "
            "posted). The nodes stopped after their checkpoints; find the writer (any local "
            "process can reach the store's loopback port), then continue with: ftis run "
            f"--resume {run_dir} (or raise exchange.store_budget_mb if the run's own payloads "
            "are that large)"
        )
    if result.interrupted or (stop.requested and not finished):
        raise KeyboardInterrupt  # the nodes were stopped by a signal, after their checkpoints
    if not any(c == 0 for c in result.exit_codes.values()):
        # Root causes first: a peer that only saw another node leave adds nothing.
        causes = {n: e for n, e in result.errors.items() if "before the group formed" not in e}
        detail = "\n".join(f"{n}: {e}" for n, e in (causes or result.errors).items()) or (
            f"see the logs in {logs}"
        )
        codes = sorted(set(result.exit_codes.values()))
        if codes == [DISK_FULL]:
            raise DiskFullError(
                next(iter(result.errors.values()), f"no space left on device under {run_dir}")
            )
        raise LaunchError(f"every node failed (exit codes {codes}): {detail}")
    if result.failed:
        raise NodesLostError(result)
    return result


def _watch(
    procs, names, cfg, store, result, progress, bars, run_dir, stop, *, signer, budget=None
) -> None:
    """Until every node has exited: pass signals on, draw progress; mark a node that exited
    without finishing or leaving (130) as gone in the store, so that its peers stop waiting for
    it at once; stop every node (SIGTERM: a checkpoint, then exit) once the store passes its
    budget."""
    while len(result.exit_codes) < len(procs):
        grown = budget.exceeded() if budget is not None else None
        if grown is not None and result.store_overflow is None:
            result.store_overflow = grown
            log.error(
                "the exchange's store grew by %.0f MiB, past exchange.store_budget_mb (%d): "
                "stopping the nodes after their checkpoints",
                grown,
                cfg.exchange.store_budget_mb,
            )
            stop(signal.SIGTERM)
        stop.forward(procs)
        for rank, (p, name) in enumerate(zip(procs, names)):
            if name in result.exit_codes or p.poll() is None:
                continue
            result.exit_codes[name] = p.returncode
            if p.returncode not in (0, INTERRUPTED):
                try:
                    mark_left(
                        store, rank, f"its process exited with code {p.returncode}", signer=signer
                    )
                except RuntimeError:
                    pass
        _update_bars(progress, bars, cfg, run_dir)
        time.sleep(0.2)
    _update_bars(progress, bars, cfg, run_dir)


def clear_status(run_dir: Path) -> None:
    """Remove the nodes' status files. A resumed run's are the previous launch's (its step and
    train.steps): drawn before the nodes rewrite them, they showed e.g. 9/6 after
    --resume --set train.steps=9."""
    for old in (run_dir / ".status").glob("*.json"):
        old.unlink(missing_ok=True)


def _update_bars(progress: Progress, bars: dict, cfg: RunConfig, run_dir: Path) -> None:
    for node in cfg.nodes:
        path = run_dir / ".status" / f"{node.name}.json"
        try:
            state = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        # the training phase is named by its algorithm (ftis, randopt, dpo, ...)
        phase = "warm start" if state["event"] == "warm" else cfg.algorithm.kind
        key = (node.name, phase)
        if key not in bars:
            bars[key] = progress.add_task(f"{node.name} {phase}", total=state["total"], info="")
        if phase == "warm start":
            info = f"loss {state['loss']:.3f}"
        else:
            parts = []
            if "reward/mean" in state:
                parts.append(f"reward {state['reward/mean']:.2f}")
            if "eval/accuracy" in state:
                parts.append(f"acc {100 * state['eval/accuracy']:.1f}%")
            info = " ".join(parts)
        progress.update(bars[key], completed=state["step"], total=state["total"], info=info)
