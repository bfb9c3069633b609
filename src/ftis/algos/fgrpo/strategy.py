"""The FGRPO server as a Flower strategy: the shared federated server
(`ftis.algos.federated.strategy.FederatedStrategy`: Flower's FedAvg with seeded sampling,
per-reply validation, dropouts, evaluation rounds, rows and checkpoints) with FGRPO's replies
and aggregation (docs/fgrpo.md).

    read_train_reply   the common checks (names, shapes, dtype, finite values, positive count,
                       the sender's identity) and a finite performance signal
    aggregate          the accepted replies -> `Aggregator` (relative-gain weights, baselines);
                       the rows get each client's weight, gain and baselines
"""

from __future__ import annotations

import logging
from typing import Any

from flwr.app import Message

from ftis.algos.federated.params import PERF_BEFORE_KEY
from ftis.algos.federated.records import COUNT_KEY, PERF_KEY
from ftis.algos.federated.strategy import (  # noqa: F401  (re-exported)
    IDENTIFY,
    CheckpointFn,
    FederatedStrategy,
    ProgressFn,
    server_dir,
    short,
    union_metrics,
)
from ftis.algos.fgrpo.aggregator import Aggregator, ClientReport, RoundOutcome
from ftis.config import RunConfig
from ftis.exchange.wire import PayloadError

log = logging.getLogger(__name__)


def _finite(value: Any, what: str) -> float:
    """A reply's number, checked: PayloadError unless a finite int or float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PayloadError(f"{what} is {value!r}, not a number")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise PayloadError(f"{what} is {value}, not finite")
    return value


class FGRPOStrategy(FederatedStrategy):
    """The FGRPO server. `aggregator`: the server's state (theta, baselines, totals); the other
    arguments are `FederatedStrategy`'s."""

    prefix = "fgrpo"
    sampling_key = "fgrpo-clients"
    label = "fgrpo"

    def __init__(self, *, cfg: RunConfig, aggregator: Aggregator, **kwargs: Any) -> None:
        super().__init__(cfg=cfg, server=aggregator, **kwargs)
        self.aggregator = aggregator

    def read_train_reply(
        self, msg: Message, name: str
    ) -> tuple[ClientReport, dict[str, float], float]:
        """A client's train reply, checked; PayloadError names what is wrong."""
        delta, metrics, count, nbytes = self.check_train_reply(msg, name)
        perf = _finite(metrics.get(PERF_KEY), "performance")
        before = None
        if self.aggregator.cfg.pre_round:  # the round's baseline: required
            before = _finite(metrics.get(PERF_BEFORE_KEY), "performance before local training")
        row = {
            k: float(v)
            for k, v in metrics.items()
            if k not in (PERF_KEY, PERF_BEFORE_KEY, COUNT_KEY)
            and isinstance(v, int | float)
            and not isinstance(v, bool)
        }
        row["fgrpo/performance"] = perf
        if before is not None:
            row["fgrpo/performance_before"] = before
        row["train/num_examples"] = float(count)
        report = ClientReport(
            name=name,
            delta=delta,
            performance=perf,
            num_examples=count,
            performance_before=before,
        )
        return report, row, nbytes

    def aggregate(self, r: int, reports: list[ClientReport]) -> dict[str, Any]:
        outcome = self.aggregator.aggregate(reports)
        for name in self.names:
            if name in outcome.weights:
                self._rows[name].update(
                    {
                        "fgrpo/accepted": 1.0,
                        "fgrpo/weight": outcome.weights[name],
                        "fgrpo/gain": outcome.gains[name],
                    }
                )
                if name in outcome.new_baselines:
                    self._rows[name]["fgrpo/baseline_after"] = outcome.new_baselines[name]
                if outcome.baselines[name] is not None:
                    self._rows[name]["fgrpo/baseline"] = outcome.baselines[name]
            else:
                self._rows[name]["fgrpo/accepted"] = 0.0
        return self._server_metrics(reports, outcome)

    def _server_metrics(self, reports: list[ClientReport], outcome: RoundOutcome) -> dict[str, Any]:
        rejected, dropped = self._counts["rejected"], self._counts["dropped"]
        row: dict[str, Any] = {
            "server/sampled": float(len(self._sampled)),
            "server/accepted": float(len(reports)),
            "server/rejected": float(rejected),
            "server/dropped": float(dropped),
            "server/rejected_total": self.aggregator.totals["rejected_total"],
            "server/dropped_total": self.aggregator.totals["dropped_total"],
            "server/update_norm": outcome.update_norm,
            "server/skipped_update": float(not reports or outcome.skipped),
        }
        if reports:
            row["agg/no_positive_gain"] = float(outcome.no_positive_gain)
        for name, w in outcome.weights.items():
            row[f"agg/weight/{name}"] = w
            row[f"agg/gain/{name}"] = outcome.gains[name]
            if outcome.baselines[name] is not None:
                row[f"agg/baseline/{name}"] = outcome.baselines[name]
            if name in outcome.new_baselines:
                row[f"agg/baseline_after/{name}"] = outcome.new_baselines[name]
        for rep in reports:
            row[f"agg/performance/{rep.name}"] = rep.performance
            row[f"agg/num_examples/{rep.name}"] = float(rep.num_examples)
        return row
