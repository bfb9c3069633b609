"""`run_swarm`: a swarm of peers on this machine, with the config's churn schedule.

`algorithm.backend: sim` hands the run to the in-process simulator (`ftis.algos.swarm.sim`);
`hivemind` runs it as below.

    bootstrap   a DHT node in this process on 127.0.0.1 (unless `algorithm.initial_peers` names
                a running swarm); its multiaddrs go to RUN_DIR/swarm-peers.txt
    peers       one process per node (`python -m ftis.algos.swarm.peer`), all at once: the
                initial peers (no `join_at`) meet at a start barrier before round 1 (so a peer
                slow to start is waited for, not taken for a late joiner); a late joiner waits,
                silent, until the swarm finished its `join_at` round; a peer is stopped at
                `leave_at` (or killed: `crash`) and restarted with --resume at once, to wait
                likewise for its `rejoin_at` (a process's start-up takes seconds, several
                rounds of a small model: started when the swarm got there, it came too late)
    rows        the standard run directory: metrics.jsonl (step = the swarm's round), nodes/
    secret      the swarm's shared secret (signs every record; docs/swarm.md): the configured
                one (algorithm.secret_file or FTIS_SWARM_SECRET), else one drawn for this run,
                handed to the peers in their environment (FTIS_SWARM_SECRET)

Each peer's progress is its last step report (RUN_DIR/.status/<node>.json). A peer that left or
crashed as the schedule said counts as finished; one that failed otherwise fails the run
(NodesLostError) after the others finished.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from ftis.algos.swarm.config import SWARM_SECRET_ENV, ChurnConfig, SwarmConfig
from ftis.config import ConfigError, RunConfig
from ftis.exchange.store import new_secret
from ftis.launch.multi import INTERRUPTED, LaunchError, MultiResult, NodesLostError
from ftis.launch.progress import progress_columns
from ftis.launch.stop import GRACE_S, die_with_parent, interrupt_on_sigterm, reaping_orphans
from ftis.train.checkpoint import checkpoint_step
from ftis.train.metrics import truncate_run_rows

log = logging.getLogger(__name__)
POLL_S = 0.2


@dataclass
class _Peer:
    name: str
    churn: ChurnConfig
    proc: subprocess.Popen | None = None
    phase: str = "waiting"  # waiting -> running -> away -> running (rejoined) -> done
    rejoined: bool = False
    code: int | None = None


def peer_command(
    run_dir: Path,
    name: str,
    initial: list[str],
    *,
    resume: bool,
    leave_at: int | None,
    start_barrier: bool = False,
    join_round: int = 0,
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "ftis.algos.swarm.peer",
        str(run_dir / "config.yaml"),
        "--out",
        str(run_dir),
        "--node",
        name,
    ]
    for m in initial:
        cmd += ["--initial-peer", m]
    if resume:
        cmd.append("--resume")
    if leave_at is not None:
        cmd += ["--leave-at", str(leave_at)]
    if start_barrier:
        cmd.append("--start-barrier")
    if join_round:
        cmd += ["--join-round", str(join_round)]
    return cmd


def _status(run_dir: Path, name: str) -> dict:
    """The peer's last RL step report ({} before its first one: warm start counts no rounds)."""
    try:
        s = json.loads((run_dir / ".status" / f"{name}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return s if s.get("event") == "step" else {}


def run_swarm(
    cfg: RunConfig, run_dir: Path, *, console: Console | None = None, resume: bool = False
) -> MultiResult:
    a: SwarmConfig = cfg.algorithm  # type: ignore[assignment]
    if a.backend == "sim":
        from ftis.algos.swarm.sim import run_sim

        return run_sim(cfg, run_dir, console=console, resume=resume)
    from ftis.algos.swarm.schedule import resolve_churn
    from ftis.algos.swarm.sim import write_schedule

    churn = resolve_churn(cfg)
    # Every record is signed with the swarm's secret, which reaches the peers in their
    # environment (never on a command line): the configured one, else one drawn for this run.
    secret = a.shared_secret()
    if secret is None and a.initial_peers:
        raise ConfigError(
            "algorithm.initial_peers names a swarm started elsewhere: its peers sign their "
            f"records with its shared secret; give it here too (algorithm.secret_file, or "
            f"{SWARM_SECRET_ENV} in the environment)"
        )
    secret = secret or bytes.fromhex(new_secret())
    write_schedule(run_dir, churn, cfg.train.steps)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    board = None
    initial = list(a.initial_peers)
    if not initial:
        from ftis.exchange.dht import DHTBoard

        board = DHTBoard(
            secret=secret,
            max_peers=a.max_peers,
            max_value_bytes=int(a.max_payload_mb * 2**20),
            max_ttl_s=max(a.payload_ttl_s, a.member_ttl_s) + 60,
        )
        initial = board.maddrs()
    (run_dir / "swarm-peers.txt").write_text("\n".join(initial) + "\n")
    if resume:  # before any peer appends: drop each peer's rows after its checkpoint
        for n in cfg.nodes:
            step = checkpoint_step(run_dir / "nodes" / n.name)
            truncate_run_rows(run_dir, n.name, after_step=step)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", SWARM_SECRET_ENV: secret.hex()}
    env.setdefault("OMP_NUM_THREADS", "1")
    peers = [_Peer(n.name, churn[n.name]) for n in cfg.nodes]
    names = [n.name for n in cfg.nodes]
    files = []

    def start(p: _Peer, *, rejoin: bool) -> None:
        f = (logs / f"{p.name}.log").open("a")
        files.append(f)
        leave = None if rejoin or p.churn.crash else p.churn.leave_at  # a crash: killed here
        p.proc = subprocess.Popen(
            peer_command(
                run_dir,
                p.name,
                initial,
                resume=resume or rejoin,
                leave_at=leave,
                # the initial peers meet at the start barrier; late joiners and rejoins start
                # now and wait, silent, until the swarm finished their round: a process's
                # start-up (imports, DHT, model) takes seconds, several rounds of a small model
                start_barrier=not rejoin and p.churn.join_at == 0,
                join_round=(p.churn.rejoin_at or 0) if rejoin else p.churn.join_at,
            ),
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: its DHT process and p2pd with it
            preexec_fn=die_with_parent(),  # SIGTERM (checkpoint, goodbye) if the launcher dies
        )
        p.phase, p.rejoined = "running", rejoin
        log.info("swarm: %s %s", p.name, "rejoins" if rejoin else "joins")

    result = MultiResult()
    columns = progress_columns()
    stopping = False
    # the orphans of the run (a p2pd whose peer died first) are adopted here and ended at the end
    # SIGTERM stops the swarm as Ctrl-C does (a second one while the peers checkpoint: at once)
    with reaping_orphans(what="swarm"), interrupt_on_sigterm():
        try:
            with Progress(*columns, console=console, disable=not cfg.log.progress) as progress:
                bars = {
                    p.name: progress.add_task(p.name, total=cfg.train.steps, info="") for p in peers
                }
                while any(p.phase != "done" for p in peers):
                    states = {p.name: _status(run_dir, p.name) for p in peers}
                    for p in peers:
                        s = states[p.name]
                        if s:
                            acc = s.get("eval/accuracy")
                            progress.update(
                                bars[p.name],
                                completed=s.get("step", 0),
                                info=f"{p.phase} acc {100 * acc:.1f}%"
                                if acc is not None
                                else p.phase,
                            )
                        if stopping:
                            if p.phase == "waiting" or p.phase == "away":
                                p.phase, p.code = "done", INTERRUPTED
                        elif p.phase == "waiting":
                            start(p, rejoin=False)
                        elif p.phase == "away" and p.churn.rejoin_at is not None:
                            start(p, rejoin=True)
                        elif p.phase == "away" and p.churn.rejoin_at is None:
                            p.phase = "done"
                        if (
                            p.phase == "running"
                            and p.churn.crash
                            and not p.rejoined
                            and p.churn.leave_at is not None
                            and s.get("step", 0) >= p.churn.leave_at
                        ):
                            p.proc.kill()  # the planned crash: no checkpoint beyond the last one, no goodbye
                        if p.phase == "running" and p.proc.poll() is not None:
                            code = p.proc.returncode
                            planned = (
                                not p.rejoined
                                and p.churn.leave_at is not None
                                and code in (INTERRUPTED, -signal.SIGKILL)
                            )
                            if planned and not stopping:
                                p.phase, p.code = "away", 0
                            else:
                                p.phase, p.code = "done", code
                            if code not in (0, INTERRUPTED) and board is not None and not planned:
                                # it died without a goodbye (maybe before the start barrier):
                                # say it for it, so nobody waits for it until a timeout
                                from ftis.exchange.swarm import announce_left

                                announce_left(
                                    board,
                                    f"ftis-swarm:{cfg.name}",
                                    names.index(p.name),
                                    ttl_s=a.member_ttl_s,
                                    secret=secret,
                                )
                    time.sleep(POLL_S)
        except KeyboardInterrupt:
            stopping = True
            for p in peers:
                if p.proc is not None and p.proc.poll() is None:
                    p.proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + GRACE_S
            for p in peers:  # each checkpoints its last round and says goodbye
                if p.proc is not None:
                    try:
                        p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        log.warning("swarm: %s did not stop within %.0f s: killed", p.name, GRACE_S)
            raise
        finally:
            for p in peers:
                if p.proc is not None:
                    if p.proc.poll() is None:
                        p.proc.kill()
                        p.proc.wait()
                    with contextlib.suppress(OSError):  # its DHT process and p2pd, if left
                        os.killpg(p.proc.pid, signal.SIGKILL)
            for f in files:
                f.close()
            if board is not None:
                board.close()
    for p in peers:
        result.exit_codes[p.name] = p.code if p.code is not None else 0
        err = logs / f"{p.name}.error"
        if err.exists():
            result.errors[p.name] = err.read_text().strip()
    if not any(c == 0 for c in result.exit_codes.values()):
        raise LaunchError(f"every peer failed: {result.describe_failures()}")
    if result.failed:
        raise NodesLostError(result)
    return result
