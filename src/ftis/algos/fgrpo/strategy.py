"""The FGRPO server as a Flower strategy: Flower's FedAvg with FGRPO's sampling, validation and
aggregation (docs/fgrpo.md).

Flower's own `Strategy.start` runs the rounds (configure_train -> send -> aggregate_train ->
configure_evaluate -> send -> aggregate_evaluate). This subclass adds, around it:

    identify       a query to every node: its client name (the stable id baselines are keyed by)
    eval round 0   every client evaluates the initial global model (skipped on resume)
    rounds         numbered from the resumed round on (`first_round`)

and overrides:

    configure_train     the round's clients, sampled by (train.seed, round), get theta
    aggregate_train     each reply is checked on its own (names, shapes, dtype, finite values,
                        finite performance, positive count, the sender's identity); a bad one
                        is rejected and counted, an error reply or a missing one is a dropout;
                        the accepted ones are aggregated (`Aggregator`), never the others
    configure_evaluate  every client, on the eval.every cadence (and the last round)
    aggregate_evaluate  writes the round's rows (one per client, one `server` row) and the
                        server checkpoint (theta + baselines) on the checkpoint.every cadence

FedAvg's all-or-nothing reply check (`validate_message_reply_consistency`) is never called: one
bad client must not stop a round.
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

from ftis.algos.fgrpo.aggregator import Aggregator, ClientReport, RoundOutcome
from ftis.algos.fgrpo.config import SERVER_NAME, FGRPOConfig
from ftis.algos.fgrpo.records import (
    ARRAYS,
    CLIENT_KEY,
    CONFIG,
    COUNT_KEY,
    METRICS,
    PERF_KEY,
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


class FGRPOStrategy(FedAvg):
    """The FGRPO server. `loggers`: one MetricLogger per client name and one for "server";
    `checkpoint(round, algorithm_state)` saves theta and the state; `first_round`: the first
    round this process runs (1, or one past the resumed checkpoint); `resumed`: the run
    continues a checkpoint (its round-0 evaluation is already in the rows)."""

    def __init__(
        self,
        *,
        cfg: RunConfig,
        aggregator: Aggregator,
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
        self.algo: FGRPOConfig = cfg.algorithm  # type: ignore[assignment]
        self.names = names
        self.aggregator = aggregator
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
        self._server_row: dict[str, Any] = {}
        self._sampled: list[str] = []
        self._round_t0 = 0.0

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
        """Learn every client's name from its node: baselines and rows are keyed by name."""
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
        log.info("fgrpo: %d clients: %s", len(self.names), ", ".join(self.names))

    def sample_clients(self, round_: int) -> list[str]:
        """The round's clients: all, or `clients_per_round` of them drawn with a generator
        seeded by (train.seed, round), so a resumed run samples what the uninterrupted one did."""
        m = self.algo.clients_per_round
        if m == 0 or m >= len(self.names):
            return list(self.names)
        rng = random.Random(f"fgrpo-clients:{self.cfg.train.seed}:{round_}")
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
        self._rows = {n: {"fgrpo/participated": 0.0} for n in self.names}
        theta = array_record(to_numpy(self.aggregator.params))
        nbytes = float(theta.count_bytes())
        msgs = []
        for name in self._sampled:
            self._rows[name].update({"fgrpo/participated": 1.0, "exchange/bytes_received": nbytes})
            content = RecordDict({ARRAYS: theta, CONFIG: ConfigRecord({ROUND_KEY: r})})
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
        reports: list[ClientReport] = []
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
                row["fgrpo/dropped"] = 1.0
                log.warning("round %d: client %s dropped out: %s", r, name, short(msg.error.reason))
                log.debug("client %s's error in full: %s", name, msg.error.reason)
                continue
            try:
                report, metrics, nbytes = self._read_train_reply(msg, name)
            except PayloadError as e:
                rejected += 1
                row["fgrpo/rejected"] = 1.0
                log.warning("round %d: rejected client %s's update: %s", r, name, e)
                continue
            row.update(metrics)
            row["exchange/bytes_sent"] = nbytes
            reports.append(report)
        for name in self._sampled:
            if name not in replied:  # no reply within the round's timeout
                dropped += 1
                self._rows[name]["fgrpo/dropped"] = 1.0
                log.warning("round %d: client %s did not reply in time", r, name)
        if not reports and errors and len(errors) == len(self._sampled) and r == self.first_round:
            # Every client failed the first round of this process: a broken set-up, not churn.
            raise LaunchError(f"every client failed round {r}; the first said: {errors[0]}")
        outcome = self.aggregator.aggregate(reports)
        self.aggregator.totals["rejected_total"] += rejected
        self.aggregator.totals["dropped_total"] += dropped
        self._server_row = self._server_metrics(reports, outcome, rejected, dropped)
        for name in self.names:
            self._rows[name].setdefault("fgrpo/rejected", 0.0)
            self._rows[name].setdefault("fgrpo/dropped", 0.0)
            if name in outcome.weights:
                self._rows[name].update(
                    {
                        "fgrpo/accepted": 1.0,
                        "fgrpo/weight": outcome.weights[name],
                        "fgrpo/gain": outcome.gains[name],
                        "fgrpo/baseline_after": outcome.new_baselines[name],
                    }
                )
                if outcome.baselines[name] is not None:
                    self._rows[name]["fgrpo/baseline"] = outcome.baselines[name]
            else:
                self._rows[name]["fgrpo/accepted"] = 0.0
        theta = array_record(to_numpy(self.aggregator.params))
        summary = MetricRecord({"accepted": len(reports), "rejected": rejected, "dropped": dropped})
        return theta, summary

    def _read_train_reply(
        self, msg: Message, name: str
    ) -> tuple[ClientReport, dict[str, float], float]:
        """A client's train reply, checked; PayloadError names what is wrong."""
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
        delta = read_params(arrays, self.aggregator.params)
        perf = metrics.get(PERF_KEY)
        if isinstance(perf, bool) or not isinstance(perf, int | float):
            raise PayloadError(f"performance is {perf!r}, not a number")
        perf = float(perf)
        if perf != perf or perf in (float("inf"), float("-inf")):
            raise PayloadError(f"performance is {perf}, not finite")
        count = metrics.get(COUNT_KEY)
        if isinstance(count, bool) or not isinstance(count, int | float) or not 0 < count < 1e15:
            raise PayloadError(f"num-examples is {count!r}, not a positive count")
        row = {
            k: float(v)
            for k, v in metrics.items()
            if k not in (PERF_KEY, COUNT_KEY)
            and isinstance(v, int | float)
            and not isinstance(v, bool)
        }
        row["fgrpo/performance"] = perf
        row["train/num_examples"] = float(count)
        report = ClientReport(name=name, delta=delta, performance=perf, num_examples=int(count))
        return report, row, float(arrays.count_bytes())

    def _server_metrics(
        self, reports: list[ClientReport], outcome: RoundOutcome, rejected: int, dropped: int
    ) -> dict[str, Any]:
        row: dict[str, Any] = {
            "server/sampled": float(len(self._sampled)),
            "server/accepted": float(len(reports)),
            "server/rejected": float(rejected),
            "server/dropped": float(dropped),
            "server/rejected_total": self.aggregator.totals["rejected_total"],
            "server/dropped_total": self.aggregator.totals["dropped_total"],
            "server/update_norm": outcome.update_norm,
            "server/skipped_update": float(not reports),
        }
        for name, w in outcome.weights.items():
            row[f"agg/weight/{name}"] = w
            row[f"agg/gain/{name}"] = outcome.gains[name]
            if outcome.baselines[name] is not None:
                row[f"agg/baseline/{name}"] = outcome.baselines[name]
            row[f"agg/baseline_after/{name}"] = outcome.new_baselines[name]
        for rep in reports:
            row[f"agg/performance/{rep.name}"] = rep.performance
            row[f"agg/num_examples/{rep.name}"] = float(rep.num_examples)
        return row

    # ---- evaluation and the end of a round ----------------------------------------------

    def eval_due(self, round_: int) -> bool:
        every = self.cfg.eval.every
        return round_ == 0 or round_ == self.total or bool(every and round_ % every == 0)

    def checkpoint_due(self, round_: int) -> bool:
        every = self.cfg.checkpoint.every
        return round_ == self.total or bool(every and round_ % every == 0)

    def _evaluate_messages(self, round_: int, names: list[str]) -> list[Message]:
        theta = array_record(to_numpy(self.aggregator.params))
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

    def _finish_round(self, r: int, evals: dict[str, dict[str, float]]) -> dict[str, float]:
        """Write round r's rows (clients in config order, then the server) and checkpoint."""
        rows = self._rows if r > 0 else {n: {} for n in self.names}
        server = dict(self._server_row) if r > 0 else {}
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
        return {"round": round_, **self.aggregator.state_dict()}


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


def short(reason: str | None, limit: int = 200) -> str:
    """The last line of an error reason (Ray wraps the client's exception in tracebacks)."""
    lines = [ln.strip() for ln in str(reason or "").splitlines() if ln.strip()]
    last = lines[-1].removesuffix("'>") if lines else "no reason given"
    return last if len(last) <= limit else last[: limit - 3] + "..."


def server_dir(run_dir: Path) -> Path:
    return run_dir / "nodes" / SERVER_NAME
