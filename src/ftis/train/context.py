"""What the node shell hands an algorithm (the protocol an algorithm meets, `Algorithm`, is the
registry's: `ftis.plugins`, re-exported here).

The shell (`ftis.train.loop.train_node`) owns what every algorithm shares: building the node
(model, tokenizer, optimizer, warm start), resume, the step loop with its evaluation cadence,
metric rows, checkpoints, stop signals and progress. An algorithm does one step, evaluates, and
owns its own state. It never writes rows or checkpoints itself: it returns metrics and a
`state_dict` of plain data (tensors, numbers, strings, lists, dicts), which the shell saves in
the node's checkpoint and gives back on resume.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ftis.plugins import Algorithm

if TYPE_CHECKING:
    from ftis.config import RunConfig
    from ftis.exchange.transport import Transport
    from ftis.tasks.base import Task
    from ftis.train.metrics import MetricLogger
    from ftis.train.node import Node
    from ftis.train.timing import PhaseTimer


@dataclass
class NodeContext:
    """Everything an algorithm gets for one node.

    cfg: the whole run config (`cfg.algorithm` is this algorithm's own config).
    rank: this node's rank; `cfg.nodes[rank]` is its config.
    node: its model, tokenizer and optimizer, warm-started and (on resume) restored.
    task: the run's task (prompts, verifier, eval splits).
    transport: moves bytes to and from the peers (a world of one when training alone); compose
        it with a codec (`ftis.exchange.codec`) to trade payloads.
    timer: `with ctx.timer("phase"):` times a phase into the step's `time/<phase>`.
    first_step: the first step this process runs (1, or one past the resumed checkpoint).
    run_dir: the run directory, for an algorithm's own artifacts under `nodes/<node name>/`
        (None when the caller gives none, e.g. in unit tests).
    peer_tokenizers: every rank's tokenizer fingerprint as the group-forming handshake
        gathered it ("" for a rank without a model), or None when no handshake ran (the
        algorithm then works them out from the config).
    """

    cfg: RunConfig
    rank: int
    node: Node
    task: Task
    transport: Transport
    timer: PhaseTimer
    first_step: int
    run_dir: Path | None = None
    peer_tokenizers: list[str] | None = None


@dataclass
class ServiceContext:
    """What a service rank (a rank that is not a training node: a server, an aggregator) gets.

    cfg: the whole run config; rank: its rank (after every node's); name: its name (e.g.
    "server", its rows' `node`); transport: as for nodes; run_dir: the run directory;
    logger: writes its rows to metrics.jsonl (`logger.log(step, metrics)`); should_stop: True
    once Ctrl-C or SIGTERM asked the run to stop.
    """

    cfg: RunConfig
    rank: int
    name: str
    transport: Transport
    run_dir: Path
    logger: MetricLogger
    should_stop: Callable[[], bool]


__all__ = ["Algorithm", "NodeContext", "ServiceContext"]
