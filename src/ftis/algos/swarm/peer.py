"""One swarm peer: the process `ftis run` starts per peer, or that you start by hand.

    python -m ftis.algos.swarm.peer CONFIG --out RUN_DIR --node NAME \\
        --initial-peer /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID [--resume] [--leave-at STEP] \\
        [--start-barrier]

NAME picks the node (`nodes[i]`, peer id i). The peer joins the swarm through the initial peers
(a running swarm's multiaddrs: `ftis run` writes its bootstrap node's to RUN_DIR/swarm-peers.txt),
joins at the swarm's current round, and trains to `train.steps`. With --start-barrier (what
`ftis run` passes to the initial peers, those without a churn `join_at`) it first waits until
every initial peer is up (at most `algorithm.start_timeout_s`), so that they start round 1
together. On another machine, listen on a
reachable address with --host 0.0.0.0 --port PORT --announce /ip4/THIS_IP/tcp/PORT.

Every record the peer writes is signed with the swarm's shared secret: FTIS_SWARM_SECRET (hex;
`ftis run` sets it for the peers it starts) or the file `algorithm.secret_file` names. A peer
without one refuses to start (exit 2): its records would be refused by the others.

Exit codes: 0 finished, 130 left (SIGINT/SIGTERM or --leave-at) after a checkpoint, 2 a user
error (the message is in RUN_DIR/logs/<NAME>.error).
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

from ftis.config import ConfigError, load_config
from ftis.train.checkpoint import CheckpointError
from ftis.train.loop import StopFlag, train_node

log = logging.getLogger("ftis.algos.swarm.peer")


def build_transport(
    cfg,
    rank: int,
    initial_peers: list[str],
    stop,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    announce: list[str] | None = None,
    start_barrier: bool = False,
    join_round: int = 0,
):
    """This peer's DHT node and swarm transport (hivemind; loopback unless told otherwise).
    start_barrier: this peer is one of the swarm's initial peers and starts with them.
    join_round: started ahead of its schedule, it waits until the swarm finished this round."""
    from ftis.algos.swarm.config import SWARM_SECRET_ENV, membership_settings
    from ftis.algos.swarm.schedule import resolve_churn
    from ftis.exchange.dht import DHTBoard
    from ftis.exchange.swarm import SwarmSettings, SwarmTransport

    a = cfg.algorithm
    secret = a.shared_secret()
    if secret is None:
        raise ConfigError(
            f"no swarm secret: every peer signs its records with the swarm's shared secret. "
            f"`ftis run` hands its peers one in {SWARM_SECRET_ENV}; for a peer started by hand "
            f"(or on another machine) give `ftis run` and every peer the same one: "
            f"algorithm.secret_file, or {SWARM_SECRET_ENV} (hex) in their environment"
        )
    slow_s = resolve_churn(cfg)[cfg.nodes[rank].name].slow_s
    extra = {"announce_maddrs": announce} if announce else {}
    board = DHTBoard(
        initial_peers,
        secret=secret,
        max_value_bytes=int(a.max_payload_mb * 2**20),
        max_ttl_s=max(a.payload_ttl_s, a.member_ttl_s) + 60,
        max_peers=a.max_peers,
        host_maddrs=[f"/ip4/{host}/tcp/{port}"],
        **extra,
    )
    settings = SwarmSettings(
        name=f"ftis-swarm:{cfg.name}",
        deadline_s=a.deadline_s,
        member_ttl_s=a.member_ttl_s,
        payload_ttl_s=a.payload_ttl_s,
        start_peers=a.start_peers(cfg) if start_barrier else frozenset(),
        start_timeout_s=a.start_timeout_s,
        join_round=join_round,
        max_round=cfg.train.steps,
        publish_delay_s=slow_s,
        **membership_settings(a),
        secret=secret,
    )
    return SwarmTransport(
        board, peer_id=rank, max_peers=a.max_peers, settings=settings, should_stop=stop
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ftis.algos.swarm.peer", description=__doc__.split("\n")[0])
    p.add_argument("config", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--initial-peer", action="append", default=[])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--announce", action="append", default=[])
    p.add_argument("--resume", action="store_true")
    p.add_argument("--leave-at", type=int, default=None)
    p.add_argument(
        "--start-barrier",
        action="store_true",
        help="an initial peer: wait for the other initial peers before round 1",
    )
    p.add_argument(
        "--join-round",
        type=int,
        default=0,
        help="started ahead of its schedule: wait until the swarm finished this round",
    )
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s {args.node} %(name)s %(levelname)s: %(message)s",
    )
    for noisy in ("transformers", "peft", "torch", "httpx", "hivemind"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    run_dir: Path = args.out
    error_file = run_dir / "logs" / f"{args.node}.error"
    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.algorithm.kind != "swarm":
            raise ConfigError(f"algorithm.kind is {cfg.algorithm.kind!r}, not 'swarm'")
        names = [n.name for n in cfg.nodes]
        if args.node not in names:
            raise ConfigError(f"no node {args.node!r} in the config ({', '.join(names)})")
        rank = names.index(args.node)
        initial = args.initial_peer or cfg.algorithm.initial_peers
        # No truncate_rows on --resume: the other peers are appending to metrics.jsonl (a
        # rewrite would lose their rows), and a rejoining peer starts at the swarm's current
        # round, after every row it wrote before it left. `ftis run --resume` truncates for all.
        from ftis.launch.status import StatusFile

        stop = StopFlag()
        status = StatusFile(run_dir, args.node)

        def progress(event: str, **info) -> None:
            status(event, **info)
            if event == "step" and args.leave_at is not None and info["step"] >= args.leave_at:
                stop.requested = True  # leave after this step: checkpoint, goodbye, exit 130

        transport = build_transport(
            cfg,
            rank,
            initial,
            stop,
            host=args.host,
            port=args.port,
            announce=args.announce,
            start_barrier=args.start_barrier,
            join_round=args.join_round,
        )
        result = train_node(
            cfg,
            rank=rank,
            run_dir=run_dir,
            transport=transport,
            progress=progress,
            resume=args.resume,
            stop=stop,
        )
    except (ConfigError, CheckpointError, ImportError) as e:
        error_file.parent.mkdir(parents=True, exist_ok=True)
        error_file.write_text(str(e))
        log.error("%s", e)
        return 2
    if result.interrupted:
        log.warning("left after step %d; checkpoint written", result.last_step)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
