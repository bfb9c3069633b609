"""The federated server as a Flower strategy: Flower's FedAvg with ftis's client sampling,
per-reply validation, evaluation rounds, rows and checkpoints. An algorithm (FGRPO, FedDPO)
subclasses `FederatedStrategy` and brings what its server does with accepted replies.

Flower's own `Strategy.start` runs the rounds (configure_train -> send -> aggregate_train ->
configure_evaluate -> send -> aggregate_evaluate). This class adds, around it:

    identify       a query to every node: its client name (the stable id rows and server
                   state are keyed by)
    eval round 0   every client evaluates the initial global model (skipped on resume)
    rounds         numbered from the resumed round on (`first_round`)

and overrides:

    configure_train     the round's clients, sampled by (train.seed, round), get the model
                        `train_arrays(name, round)` (by default the global one) and the round
    aggregate_train     each reply is checked on its own (`read_train_reply`: names, shapes,
                        dtype, finite values, a positive count, the sender's identity, and
                        whatever the algorithm adds); a bad one is rejected and counted, an
                        error reply or a missing one is a dropout (one saying that the worker
                        process running the client died is also counted as a lost worker,
                        `server/workers_lost`); the accepted ones go to the algorithm's
                        `aggregate`, never the others
    configure_evaluate  every client, on the eval.every cadence (and the last round)
    aggregate_evaluate  writes the round's rows (one per client, one `server` row) and the
                        server checkpoint (theta + the server's state) on checkpoint.every

FedAvg's all-or-nothing reply check (`validate_message_reply_consistency`) is never called: one
bad client must not stop a round.

The server's state object (`server`) has `params` (the global trainable parameters, CPU
tensors), `totals` (a dict with at least `rejected_total` and `dropped_total`, which this class
counts) and `state_dict()` (plain data for the checkpoint; theta itself is the checkpoint's
model).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.result import Result

from ftis.algos.federated.config import SERVER_NAME
from ftis.algos.federated.records import (
    ARRAYS,
    CLIENT_KEY,
    CONFIG,
    COUNT_KEY,
    METRICS,
    ROUND_KEY,
    array_record,
    read_params,
    to_numpy,
)
from ftis.config import RunConfig
from ftis.exchange.wire import PayloadError
from ftis.launch.multi import LaunchError
from ftis.train.loop import peak_rss_mb
from ftis.train.metrics import MetricLogger

log = logging.getLogger(__name__)

IDENTIFY = "identify"
# progress(round, total, metrics of the server row)
ProgressFn = Callable[[int, int, dict[str, float]], None]
CheckpointFn = Callable[[int, dict[str, Any]], None]


class FederatedStrategy(FedAvg):
    """A federated server. `server`: the server's state (module docstring); `loggers`: one
    MetricLogger per client name and one for "server"; `checkpoint(round, algorithm_state)`
    saves theta and the state; `first_round`: the first round this process runs (1, or one
    past the resumed checkpoint); `resumed`: the run continues a checkpoint (its round-0
    evaluation is already in the rows).

    Subclasses set `prefix` (the clients' row keys: `<prefix>/participated`, `/rejected`,
    `/dropped`, `/accepted`), `sampling_key` (keys the seeded client draws) and `label` (log
    lines), and implement `read_train_reply` and `aggregate`."""

    prefix = "fed"
    sampling_key = "fed-clients"
    label = "federated"

    def __init__(
        self,
        *,
        cfg: RunConfig,
        server: Any,
        loggers: dict[str, MetricLogger],
        checkpoint: CheckpointFn,
        first_round: int = 1,
        resumed: bool = False,
        progress: ProgressFn | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        identify_timeout_s: float = 600.0,
    ) -> None:
        names = [n.name for n in cfg.nodes]
        super().__init__(
            fraction_train=1.0,
            fraction_evaluate=1.0,
            min_train_nodes=1,
            min_evaluate_nodes=1,
            min_available_nodes=len(names),
        )
        self.cfg = cfg
        self.algo = cfg.algorithm
        self.names = names
        self.server = server
        self.loggers = loggers
        self.checkpoint = checkpoint
        self.first_round = first_round
        self.total = cfg.train.steps
        self.progress = progress
        self.should_stop = should_stop
        self.identify_timeout_s = identify_timeout_s
        self.node_of: dict[str, int] = {}  # client name -> Flower node id
        self.name_of: dict[int, str] = {}
        self.resumed = resumed
        self.stopped = False  # a stop was requested; the rounds after it do nothing
        self.last_round = first_round - 1  # the last round whose rows and state are complete
        self.saved_round = first_round - 1 if resumed else -1  # the last round checkpointed
        self.t_start = time.perf_counter()
        self._rows: dict[str, dict[str, Any]] = {}  # the round's client rows, until written
        self._lost: set[str] = set()  # the clients whose worker died this round
        self._eval_round = 0
        self._server_row: dict[str, Any] = {}
        self._sampled: list[str] = []
        self._round_t0 = 0.0
        self._theta: ArrayRecord | None = None  # the round's global model, as sent

    # ---- what a subclass brings -----------------------------------------------------------

    def read_train_reply(self, msg: Message, name: str) -> tuple[Any, dict[str, float], float]:
        """A client's train reply, checked: (its report for `aggregate`, the metrics of its row,
        the bytes it sent). Raise PayloadError naming what is wrong; `check_train_reply` does
        the common part."""
        raise NotImplementedError

    def aggregate(self, r: int, reports: list[Any]) -> dict[str, Any]:
        """Round r's accepted reports (maybe none) -> the server's new state; add to the
        clients' rows (`self._rows`) and return the algorithm's part of the server row."""
        raise NotImplementedError

    def begin_round(self, r: int, sampled: list[str]) -> None:
        """Called when round r's clients are sampled, before their messages are made."""

    def train_arrays(self, name: str, r: int) -> ArrayRecord:
        """The model client `name` starts round r from: the global one by default."""
        if self._theta is None:
            self._theta = array_record(to_numpy(self.server.params))
        return self._theta

    def train_config(self, name: str, r: int) -> dict[str, Any]:
        """What a round-r train message's config holds besides the round (none by default)."""
        return {}

    # ---- the run ------------------------------------------------------------------------

    def round_of(self, server_round: int) -> int:
        """ftis's round number (`step`) of Flower's `server_round` of this process."""
        return self.first_round - 1 + server_round

    def start(  # type: ignore[override]
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Identify the clients, evaluate round 0 (fresh runs), then Flower's own rounds."""
        self.identify(grid, timeout=min(timeout, self.identify_timeout_s))
        if not self.resumed:
            self._round_t0 = time.perf_counter()
            replies = grid.send_and_receive(self._evaluate_messages(0, self.names), timeout=timeout)
            self._finish_round(0, self._read_eval_replies(replies, required=True))
        if num_rounds <= 0 or self._stop_requested():
            return Result()
        return super().start(
            grid,
            initial_arrays,
            num_rounds=num_rounds,
            timeout=timeout,
            train_config=train_config,
            evaluate_config=evaluate_config,
            evaluate_fn=evaluate_fn,
        )

    def identify(self, grid: Grid, *, timeout: float) -> None:
        """Learn every client's name from its node: server state and rows are keyed by name."""
        deadline = time.monotonic() + timeout
        while len(ids := sorted(grid.get_node_ids())) < len(self.names):
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"only {len(ids)} of {len(self.names)} Flower nodes connected in {timeout}s"
                )
            time.sleep(0.1)
        msgs = [
            Message(
                RecordDict({CONFIG: ConfigRecord({"query": IDENTIFY})}),
                dst_node_id=node_id,
                message_type=MessageType.QUERY,
            )
            for node_id in ids
        ]
        errors = []
        for reply in grid.send_and_receive(msgs, timeout=timeout):
            if reply.has_error():
                errors.append(short(reply.error.reason))
                continue
            config = reply.content.get(CONFIG)
            name = str(config.get(CLIENT_KEY, "")) if isinstance(config, ConfigRecord) else ""
            if name in self.names and name not in self.node_of:
                self.node_of[name] = reply.metadata.src_node_id
                self.name_of[reply.metadata.src_node_id] = name
        missing = sorted(set(self.names) - set(self.node_of))
        if missing:
            why = f": {errors[0]}" if errors else ""
            raise LaunchError(f"clients {missing} did not identify themselves to the server{why}")
        log.info("%s: %d clients: %s", self.label, len(self.names), ", ".join(self.names))

    def sample_clients(self, round_: int) -> list[str]:
        """The round's clients: all, or `clients_per_round` of them drawn with a generator
        seeded by (train.seed, round), so a resumed run samples what the uninterrupted one did."""
        m = self.algo.clients_per_round
        if m == 0 or m >= len(self.names):
            return list(self.names)
        rng = random.Random(f"{self.sampling_key}:{self.cfg.train.seed}:{round_}")
        return sorted(rng.sample(sorted(self.names), m), key=self.names.index)

    # ---- training -----------------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        r = self.round_of(server_round)
        if self._stop_requested():
            return []
        self._round_t0 = time.perf_counter()
        self._sampled = self.sample_clients(r)
        self._rows = {n: {f"{self.prefix}/participated": 0.0} for n in self.names}
        self._theta = None
        self.begin_round(r, self._sampled)
        msgs = []
        for name in self._sampled:
            theta = self.train_arrays(name, r)
            self._rows[name].update(
                {
                    f"{self.prefix}/participated": 1.0,
                    "exchange/bytes_received": float(theta.count_bytes()),
                }
            )
            content = RecordDict(
                {
                    ARRAYS: theta,
                    CONFIG: ConfigRecord({ROUND_KEY: r, **self.train_config(name, r)}),
                }
            )
            msgs.append(
                Message(
                    content,
                    dst_node_id=self.node_of[name],
                    message_type=MessageType.TRAIN,
                    group_id=str(r),
                )
            )
        return msgs

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        r = self.round_of(server_round)
        if self.stopped:
            return None, None
        p = self.prefix
        reports: list[Any] = []
        errors: list[str] = []
        replied: set[str] = set()
        rejected, dropped = 0, 0
        for msg in replies:
            name = self.name_of.get(msg.metadata.src_node_id)
            if name is None or name not in self._sampled or name in replied:
                log.warning("round %d: ignored a reply from unexpected node %s", r, name)
                continue
            replied.add(name)
            row = self._rows[name]
            if msg.has_error():
                dropped += 1
                errors.append(short(msg.error.reason))
                row[f"{p}/dropped"] = 1.0
                if worker_lost(msg.error.reason):
                    self._worker_lost(r, name)
                    continue
                log.warning("round %d: client %s dropped out: %s", r, name, short(msg.error.reason))
                log.debug("client %s's error in full: %s", name, msg.error.reason)
                continue
            try:
                report, metrics, nbytes = self.read_train_reply(msg, name)
            except PayloadError as e:
                rejected += 1
                row[f"{p}/rejected"] = 1.0
                log.warning("round %d: rejected client %s's update: %s", r, name, e)
                continue
            row.update(metrics)
            row["exchange/bytes_sent"] = nbytes
            reports.append(report)
        for name in self._sampled:
            if name not in replied:  # no reply within the round's timeout
                dropped += 1
                self._rows[name][f"{p}/dropped"] = 1.0
                log.warning("round %d: client %s did not reply in time", r, name)
        if not reports and errors and len(errors) == len(self._sampled) and r == self.first_round:
            # Every client failed the first round of this process: a broken set-up, not churn.
            raise LaunchError(f"every client failed round {r}; the first said: {errors[0]}")
        self.server.totals["rejected_total"] += rejected
        self.server.totals["dropped_total"] += dropped
        self._counts = {"accepted": len(reports), "rejected": rejected, "dropped": dropped}
        self._server_row = self.aggregate(r, reports)
        for name in self.names:
            self._rows[name].setdefault(f"{p}/rejected", 0.0)
            self._rows[name].setdefault(f"{p}/dropped", 0.0)
        theta = array_record(to_numpy(self.server.params))
        summary = MetricRecord({"accepted": len(reports), "rejected": rejected, "dropped": dropped})
        return theta, summary

    def check_train_reply(
        self, msg: Message, name: str, reference: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], MetricRecord, int, float]:
        """The checks every train reply gets: its records, its sender's name, its arrays against
        `reference` (default: the global parameters; names, shapes, floating dtype, finite) and a
        positive count. Returns (tensors, metrics record, count, bytes); PayloadError otherwise."""
        content = msg.content
        try:
            config, arrays, metrics = content[CONFIG], content[ARRAYS], content[METRICS]
        except KeyError as e:
            raise PayloadError(f"reply lacks its {e.args[0]!r} record") from None
        if not isinstance(config, ConfigRecord) or not isinstance(metrics, MetricRecord):
            raise PayloadError("reply's config or metrics record has the wrong type")
        claimed = config.get(CLIENT_KEY)
        if claimed != name:
            raise PayloadError(f"reply from node of client {name!r} claims to be {claimed!r}")
        tensors = read_params(arrays, self.server.params if reference is None else reference)
        count = metrics.get(COUNT_KEY)
        if isinstance(count, bool) or not isinstance(count, int | float) or not 0 < count < 1e15:
            raise PayloadError(f"num-examples is {count!r}, not a positive count")
        return tensors, metrics, int(count), float(arrays.count_bytes())

    # ---- evaluation and the end of a round ----------------------------------------------

    def eval_due(self, round_: int) -> bool:
        every = self.cfg.eval.every
        return round_ == 0 or round_ == self.total or bool(every and round_ % every == 0)

    def checkpoint_due(self, round_: int) -> bool:
        every = self.cfg.checkpoint.every
        return round_ == self.total or bool(every and round_ % every == 0)

    def _evaluate_messages(self, round_: int, names: list[str]) -> list[Message]:
        self._eval_round = round_
        theta = array_record(to_numpy(self.server.params))
        return [
            Message(
                RecordDict({ARRAYS: theta, CONFIG: ConfigRecord({ROUND_KEY: round_})}),
                dst_node_id=self.node_of[name],
                message_type=MessageType.EVALUATE,
                group_id=f"eval-{round_}",
            )
            for name in names
        ]

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        r = self.round_of(server_round)
        if self.stopped or not self.eval_due(r):
            return []
        return self._evaluate_messages(r, self.names)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        r = self.round_of(server_round)
        if self.stopped:
            return None
        union = self._finish_round(r, self._read_eval_replies(replies))
        return MetricRecord(union) if union else None

    def _read_eval_replies(
        self, replies: Iterable[Message], *, required: bool = False
    ) -> dict[str, dict[str, float]]:
        """Each client's eval metrics. required: a LaunchError when no client could evaluate
        (the round-0 evaluation: a broken ClientApp, not a dropout)."""
        out: dict[str, dict[str, float]] = {}
        errors: list[str] = []
        for msg in replies:
            name = self.name_of.get(msg.metadata.src_node_id)
            if name is None:
                continue
            if msg.has_error():
                errors.append(short(msg.error.reason))
                if worker_lost(msg.error.reason):
                    self._worker_lost(self._eval_round, name)
                    continue
                log.warning("client %s failed its evaluation: %s", name, short(msg.error.reason))
                continue
            metrics = msg.content.get(METRICS)
            claimed = msg.content.get(CONFIG, {}).get(CLIENT_KEY)
            if not isinstance(metrics, MetricRecord) or claimed != name:
                log.warning("client %s sent a malformed evaluation; ignored", name)
                continue
            out[name] = {
                k: float(v)
                for k, v in metrics.items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            }
        if required and not out and errors:
            raise LaunchError(f"no client could evaluate the initial model; one said: {errors[0]}")
        return out

    def _worker_lost(self, r: int, name: str) -> None:
        """The process that ran client `name`'s work died (killed, out of memory): Flower's Ray
        backend restarts it (`max_restarts`), so the client is back for the next round; the
        loss is counted (`server/workers_lost`) and said."""
        self._lost.add(name)
        log.warning(
            "round %d: the worker running client %s died; it is restarted for the next round",
            r,
            name,
        )

    def _finish_round(self, r: int, evals: dict[str, dict[str, float]]) -> dict[str, float]:
        """Write round r's rows (clients in config order, then the server) and checkpoint."""
        rows = self._rows if r > 0 else {n: {} for n in self.names}
        server = dict(self._server_row) if r > 0 else {}
        totals = self.server.totals
        totals["workers_lost_total"] = totals.get("workers_lost_total", 0.0) + len(self._lost)
        server["server/workers_lost"] = float(len(self._lost))
        server["server/workers_lost_total"] = totals["workers_lost_total"]
        for name in self._lost:
            rows.setdefault(name, {})[f"{self.prefix}/worker_lost"] = 1.0
        self._lost = set()
        for name, m in evals.items():
            rows.setdefault(name, {}).update(m)
        union = union_metrics(evals)
        server.update(union)
        server["server/round_seconds"] = time.perf_counter() - self._round_t0
        server["train/elapsed_seconds"] = time.perf_counter() - self.t_start
        server["memory/peak_rss_mb"] = peak_rss_mb()
        for name in self.names:
            self.loggers[name].log(r, rows.get(name, {}))
        self.loggers[SERVER_NAME].log(r, server)
        self.last_round = r
        self._rows, self._server_row = {}, {}
        if r > 0 and self.checkpoint_due(r):
            self._checkpoint(r)
        if r < self.total:
            self._stop_requested()
        if self.progress:
            self.progress(r, self.total, server)
        return union

    def _checkpoint(self, r: int) -> None:
        if r != self.saved_round:
            self.checkpoint(r, self.state_dict(r))
            self.saved_round = r

    def _stop_requested(self) -> bool:
        """True once Ctrl-C / SIGTERM asked to stop: the last completed round is checkpointed
        (once) and every later round does nothing."""
        if self.stopped:
            return True
        if not self.should_stop():
            return False
        self.stopped = True
        self._checkpoint(self.last_round)
        log.warning("stop requested: checkpointed round %d", self.last_round)
        return True

    def state_dict(self, round_: int) -> dict[str, Any]:
        return {"round": round_, **self.server.state_dict()}


def union_metrics(evals: dict[str, dict[str, float]]) -> dict[str, float]:
    """eval/* on the union of the clients' eval sets: each client's accuracy weighted by its
    eval set's size (`eval/size`); pass@k and the like are averaged the same way."""
    if not evals:
        return {}
    keys = sorted(
        {k for m in evals.values() for k in m if k.startswith("eval/") and k != "eval/size"}
    )
    out: dict[str, float] = {}
    for k in keys:
        pairs = [(m.get("eval/size", 1.0), m[k]) for m in evals.values() if k in m]
        total = sum(w for w, _ in pairs)
        if total > 0:
            out[k] = sum(w * v for w, v in pairs) / total
    out["eval/clients"] = float(len(evals))
    return out


# How Flower's Ray backend words the error of a message whose worker process died: the type of
# Ray's exception (ActorDiedError and ActorUnavailableError are RayActorErrors).
WORKER_LOST_ERRORS = ("RayActorError", "ActorDiedError", "ActorUnavailableError")


def worker_lost(reason: str | None) -> bool:
    """Whether an error reply says the worker process running the client died (not that the
    client failed)."""
    head = str(reason or "").split(":<", 1)[0]
    return any(e in head for e in WORKER_LOST_ERRORS)


def short(reason: str | None, limit: int = 200) -> str:
    """The last line of an error reason (Ray wraps the client's exception in tracebacks)."""
    lines = [ln.strip() for ln in str(reason or "").splitlines() if ln.strip()]
    last = lines[-1].removesuffix("'>") if lines else "no reason given"
    return last if len(last) <= limit else last[: limit - 3] + "..."


def server_dir(run_dir: Path) -> Path:
    return run_dir / "nodes" / SERVER_NAME
