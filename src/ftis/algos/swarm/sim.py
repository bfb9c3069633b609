"""`run_sim`: a simulated swarm, every peer in this one process (`algorithm.backend: sim`).

    board       a `SimBoard` (the DHT's records, expiries and size limit, in memory) on the
                scheduler's virtual clock
    peers       each node runs the ordinary node shell (`train_node`: build, warm start, resume,
                eval, rows, checkpoints) with the ordinary `SwarmTransport`, as a simulated
                thread of a deterministic scheduler (`ftis.exchange.swarm_sim`): one peer
                computes at a time, waiting costs no real time, and a run is the same every time
    churn       the resolved schedule (`ftis.algos.swarm.schedule`, written to
                RUN_DIR/swarm-schedule.json): initial peers meet at the start barrier; a late
                joiner starts once the swarm reached its `join_at`; a leaver stops after
                `leave_at` (checkpoint, goodbye) or crashes there (no checkpoint beyond its last
                regular one, no goodbye: the others wait for it until its heartbeat expires); a
                rejoin restarts from the peer's own newest checkpoint at `rejoin_at`; a slow
                peer's payloads reach the board `slow_s` virtual seconds late
    rows        the standard run directory: metrics.jsonl (step = round), nodes/<peer>/

The swarm's round is the newest step any peer has finished. A peer that left or crashed as the
schedule said counts as finished; one that failed otherwise fails the run (NodesLostError)
after the others finished.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from ftis.algos.swarm.config import ChurnConfig, SwarmConfig, membership_settings
from ftis.algos.swarm.schedule import presence, resolve_churn
from ftis.config import RunConfig
from ftis.exchange.store import new_secret
from ftis.exchange.swarm import SwarmSettings, SwarmTransport
from ftis.exchange.swarm_sim import Scheduler, SimBoard, SimTask
from ftis.launch.multi import INTERRUPTED, LaunchError, MultiResult, NodesLostError
from ftis.launch.progress import progress_columns
from ftis.launch.stop import interrupt_on_sigterm
from ftis.train.checkpoint import checkpoint_step
from ftis.train.loop import SimulatedCrash, StopFlag, train_node
from ftis.train.metrics import truncate_run_rows

log = logging.getLogger(__name__)
SIM_POLL_S = 0.5  # virtual seconds between a waiting peer's reads of the board


class PlannedCrash(SimulatedCrash):
    """The schedule's crash of a simulated peer (escapes the shell like a kill)."""


@dataclass
class _SimPeer:
    name: str
    rank: int
    churn: ChurnConfig
    phase: str = "waiting"  # waiting -> running -> away -> running (rejoined) -> done
    rejoined: bool = False
    step: int = 0  # the newest step it finished
    task: SimTask | None = None
    stop: StopFlag | None = None
    code: int | None = None
    error: str = ""


def write_schedule(run_dir: Path, churn: dict[str, ChurnConfig], steps: int) -> None:
    """RUN_DIR/swarm-schedule.json: every peer's churn entry and rounds present."""
    present = presence(churn, steps)
    doc = {
        "steps": steps,
        "peers": {
            n: {
                **c.model_dump(exclude_defaults=True),
                "present_rounds": sum(present[n]),
            }
            for n, c in churn.items()
        },
        "absent_per_round": [sum(not present[n][r] for n in churn) for r in range(steps)],
    }
    (run_dir / "swarm-schedule.json").write_text(json.dumps(doc, indent=1) + "\n")


def run_sim(
    cfg: RunConfig, run_dir: Path, *, console: Console | None = None, resume: bool = False
) -> MultiResult:
    a: SwarmConfig = cfg.algorithm  # type: ignore[assignment]
    run_dir.mkdir(parents=True, exist_ok=True)
    churn = resolve_churn(cfg)
    write_schedule(run_dir, churn, cfg.train.steps)
    if resume:  # drop each peer's rows after its checkpoint
        for n in cfg.nodes:
            step = checkpoint_step(run_dir / "nodes" / n.name)
            truncate_run_rows(run_dir, n.name, after_step=step)
    sched = Scheduler()
    board = SimBoard(sched, max_value_bytes=int(a.max_payload_mb * 2**20))
    # every record is signed, as on the DHT: the configured secret, else one for this run
    secret = a.shared_secret() or bytes.fromhex(new_secret())
    start_ids = a.start_peers(cfg)
    peers = [_SimPeer(n.name, i, churn[n.name]) for i, n in enumerate(cfg.nodes)]

    def start(p: _SimPeer, *, rejoin: bool) -> None:
        stop = StopFlag()
        settings = SwarmSettings(
            name=f"ftis-swarm:{cfg.name}",
            deadline_s=a.deadline_s,
            member_ttl_s=a.member_ttl_s,
            payload_ttl_s=a.payload_ttl_s,
            poll_s=SIM_POLL_S,
            start_peers=start_ids if (not rejoin and p.churn.join_at == 0) else frozenset(),
            start_timeout_s=a.start_timeout_s,
            max_round=cfg.train.steps,
            publish_delay_s=p.churn.slow_s,
            **membership_settings(a),
            secret=secret,
        )
        transport = SwarmTransport(
            board.view(),
            peer_id=p.rank,
            max_peers=a.max_peers,
            settings=settings,
            should_stop=stop,
            clock=sched.clock,
        )
        leave = None if rejoin else p.churn.leave_at

        def progress(event: str, **info) -> None:
            if event != "step":
                return
            p.step = max(p.step, int(info["step"]))
            acc = info.get("metrics", {}).get("eval/accuracy")
            bar.update(bars[p.name], completed=p.step, info=_info(p, acc))
            if leave is not None and info["step"] >= leave:
                if p.churn.crash:
                    raise PlannedCrash(f"{p.name}: the schedule's crash after round {leave}")
                stop.requested = True  # leave after this step: checkpoint, goodbye

        p.stop = stop
        p.phase, p.rejoined = "running", rejoin
        p.task = sched.spawn(
            p.name,
            p.rank,
            lambda: train_node(
                cfg,
                rank=p.rank,
                run_dir=run_dir,
                transport=transport,
                progress=progress,
                resume=resume or rejoin,
                stop=stop,
            ),
        )
        log.info(
            "swarm sim: %s %s at virtual %.1f s", p.name, "rejoins" if rejoin else "joins", sched.t
        )

    stopping = False

    def between() -> None:
        for p in peers:
            if p.phase == "running" and p.task is not None and p.task.done:
                _finished(p)
        swarm_round = max(p.step for p in peers)
        # every started peer is gone: start the rest now rather than never
        idle = any(p.phase != "waiting" for p in peers) and not any(
            p.phase == "running" for p in peers
        )
        for p in peers:
            if stopping:
                if p.phase in ("waiting", "away"):
                    p.phase, p.code = "done", INTERRUPTED
                continue
            if p.phase == "waiting" and (swarm_round >= p.churn.join_at or idle):
                start(p, rejoin=False)
            elif p.phase == "away" and p.churn.rejoin_at is not None:
                if swarm_round >= p.churn.rejoin_at or idle:
                    start(p, rejoin=True)
            elif p.phase == "away":
                p.phase = "done"

    def _finished(p: _SimPeer) -> None:
        t = p.task
        planned = not p.rejoined and p.churn.leave_at is not None
        if t.error is None:
            left = t.result.interrupted
            if left and planned and not stopping:
                p.phase, p.code = "away", 0
            else:
                p.phase, p.code = "done", INTERRUPTED if left else 0
        elif isinstance(t.error, PlannedCrash) and not stopping:
            p.phase, p.code = "away", 0
        else:
            log.error("swarm sim: peer %s failed: %r", p.name, t.error)
            p.phase, p.code, p.error = "done", 1, f"{type(t.error).__name__}: {t.error}"
        p.task = None

    columns = progress_columns()
    with (
        interrupt_on_sigterm(),  # SIGTERM stops the swarm as Ctrl-C does
        Progress(*columns, console=console, disable=not cfg.log.progress) as bar,
    ):
        bars = {p.name: bar.add_task(p.name, total=cfg.train.steps, info="") for p in peers}
        try:
            sched.run(between)
        except KeyboardInterrupt:
            stopping = True
            for p in peers:
                if p.stop is not None:
                    p.stop.requested = True
            sched.run(between)  # every running peer checkpoints and leaves
            raise
    result = MultiResult()
    for p in peers:
        result.exit_codes[p.name] = p.code if p.code is not None else 0
        if p.error:
            result.errors[p.name] = p.error
    if not any(c == 0 for c in result.exit_codes.values()):
        raise LaunchError(f"every peer failed: {result.describe_failures()}")
    if result.failed:
        raise NodesLostError(result)
    return result


def _info(p: _SimPeer, acc: float | None) -> str:
    return f"{p.phase} acc {100 * acc:.1f}%" if acc is not None else p.phase
