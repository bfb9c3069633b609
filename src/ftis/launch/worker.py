"""One node of a collaborative run: the process `ftis run` (or torchrun) starts once per node.

    ftis run CONFIG                       # one machine: ftis starts the nodes and hosts the store
    torchrun --nnodes 2 --node-rank R --nproc-per-node 1 \\
             --master-addr HOST --master-port 29500 -m ftis.launch.worker CONFIG --out RUN_DIR

RANK picks the node (`nodes[RANK]` in the config). Before any warm start, the group checks that
every peer has the same shared settings (task, train, sharing, algorithm), since prompt indices
are exchanged as they are, and that peers on different tokenizers can take the bridged path
(docs/math.md §16; each pair's path is logged). Samples travel through a key-value store
(`ftis.exchange.store`), not a collective, so a node that dies only costs its peers its samples.

Exit codes: 0 finished, 130 stopped by SIGINT/SIGTERM after a checkpoint, 2 a user error (the
message is in RUN_DIR/logs/rank<R>.error), anything else a crash.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import logging
import os
import sys
import warnings
from pathlib import Path

import torch

from ftis.algos.ftis.bridge import bridge_blocker
from ftis.config import ConfigError, RunConfig, load_config
from ftis.exchange.group import GroupMismatchError, check_group
from ftis.exchange.store import Membership, PeerGroupError, StoreTransport, connect_store
from ftis.exchange.transport import TransportLost
from ftis.launch.status import StatusFile
from ftis.launch.stop import DISK_FULL
from ftis.models.loading import ModelLoadError, load_tokenizer, tokenizer_fingerprint
from ftis.plugins import get_algorithm
from ftis.tasks import TaskDataError
from ftis.train.checkpoint import CheckpointError, checkpoint_step
from ftis.train.context import ServiceContext
from ftis.train.loop import NoTrainingSignal, StopFlag, train_node
from ftis.train.metrics import MetricLogger, truncate_run_rows

log = logging.getLogger("ftis.launch.worker")

CRASH_EXIT_CODE = 17  # `crash_at_step`: the process exits hard, as if killed


def disk_full(err: BaseException) -> bool:
    """Whether `err` (or an exception it was raised from) is a full disk or quota: an OSError
    with ENOSPC/EDQUOT, or a library's error that only carries the OS message (safetensors)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(err) or "os error 28" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _last_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[-1][:300] if text else type(err).__name__


USER_ERRORS = (
    ConfigError,
    ModelLoadError,
    TaskDataError,
    GroupMismatchError,
    PeerGroupError,
    CheckpointError,
    TransportLost,
    NoTrainingSignal,
)

# What every rank must agree on: the task (prompt indices), the step schedule, the sharing
# scheme and the algorithm. Node-specific settings (model, optimizer, loss) may differ.
SHARED_SECTIONS = ("task", "train", "sharing", "algorithm")


def shared_settings_digest(cfg: RunConfig) -> str:
    """Digest of the sections every rank must share, and the names of the ranks."""
    dumped = cfg.model_dump(mode="json")
    shared = {k: dumped[k] for k in SHARED_SECTIONS}
    shared["ranks"] = cfg.rank_names
    return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


def _hard_exit(step: int) -> None:
    log.error("crash_at_step=%d: exiting hard (testing)", step)
    logging.shutdown()
    os._exit(CRASH_EXIT_CODE)


def _serve(cfg, rank, name, transport, run_dir, stop, membership) -> int:
    """Run a service rank (a server, an aggregator: not a training node) to the end."""
    logger = MetricLogger.for_run(cfg, run_dir, name)
    try:
        with stop.installed():
            transport.ready()
            get_algorithm(cfg.algorithm.kind).serve(
                ServiceContext(
                    cfg=cfg,
                    rank=rank,
                    name=name,
                    transport=transport,
                    run_dir=run_dir,
                    logger=logger,
                    should_stop=stop,
                )
            )
    finally:
        logger.close()
    membership.leave("stopped" if stop() else "finished")
    return 130 if stop() else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ftis.launch.worker", description=__doc__.split("\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument(
        "--resume", action="store_true", help="Continue from this node's newest checkpoint."
    )
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s",
    )
    for noisy in ("transformers", "peft", "torch", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    # transformers' own tqdm bars ("Loading weights", "Writing model shards") would
    # interleave with ftis's progress display.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    run_dir: Path = args.out
    run_dir.mkdir(parents=True, exist_ok=True)
    error_file = run_dir / "logs" / f"rank{rank}.error"
    membership: Membership | None = None
    try:
        cfg = load_config(args.config, args.overrides)
        names = cfg.rank_names
        if world != len(names):
            raise ConfigError(
                f"the config declares {len(names)} ranks ({', '.join(names)}) but {world} "
                f"processes were started; start exactly one process per rank "
                f"(--nproc-per-node {len(names)})"
            )
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        is_node = rank < len(cfg.nodes)
        done = 0
        if is_node and args.resume:
            # Before the group forms, so that no peer is appending to metrics.jsonl yet.
            step = checkpoint_step(run_dir / "nodes" / names[rank])
            truncate_run_rows(run_dir, names[rank], after_step=step)
            done = step or 0
        store, rank, world = connect_store(cfg.exchange.timeout_s)
        membership = Membership(store, rank, world, timeout_s=cfg.exchange.timeout_s)
        tok = load_tokenizer(cfg.nodes[rank].model) if is_node else None
        fingerprints: list[str] = []
        first_steps = check_group(
            membership,
            names=names,
            # a service rank has no model: it takes part with an empty fingerprint
            fingerprint=tokenizer_fingerprint(tok) if tok is not None else "",
            settings_digest=shared_settings_digest(cfg),
            first_step=done + 1,
            timeout_s=max(cfg.exchange.timeout_s, 120.0),
            bridge_blocker=bridge_blocker(cfg, rank, tok) if tok is not None else None,
            tokenizers_out=fingerprints,
        )
        stop = StopFlag()
        transport = StoreTransport(
            membership,
            first_steps=first_steps,
            should_stop=stop,
            on_store_lost=cfg.exchange.on_store_lost,
            max_missed=cfg.exchange.max_missed,
        )
        if not is_node:
            return _serve(cfg, rank, names[rank], transport, run_dir, stop, membership)
        result = train_node(
            cfg,
            rank=rank,
            transport=transport,
            run_dir=run_dir,
            progress=StatusFile(run_dir, names[rank]),
            resume=args.resume,
            stop=stop,
            crash=_hard_exit,
            peer_tokenizers=fingerprints,
        )
    except USER_ERRORS as e:
        error_file.parent.mkdir(parents=True, exist_ok=True)
        error_file.write_text(str(e))
        log.error("%s", e)
        if membership is not None:
            membership.leave(f"error: {e}"[:500])
        return 2
    except BaseException as e:
        if disk_full(e):
            # not a crash: the disk is full. One line, no traceback; the last complete
            # checkpoint is intact (a half-written one is removed), so --resume continues
            msg = (
                f"no space left on device while this node wrote to {run_dir} ({_last_line(e)}); "
                "its last complete checkpoint is intact (a half-written one is removed)"
            )
            log.error("%s", msg)
            with contextlib.suppress(OSError):
                error_file.parent.mkdir(parents=True, exist_ok=True)
                error_file.write_text(msg)
            if membership is not None:
                membership.leave("error: no space left on device")
            return DISK_FULL
        if membership is not None:
            membership.leave(f"crashed: {type(e).__name__}: {e}"[:500])
        raise
    if result.interrupted:
        membership.leave(f"stopped after step {result.last_step}")
        log.warning("stopped after step %d; checkpoint written", result.last_step)
        return 130
    membership.leave(f"finished step {result.last_step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
