"""The FedDPO server as a Flower strategy: the shared federated server
(`ftis.algos.federated.strategy.FederatedStrategy`) with FedDPO's parts (docs/dpo.md, "FedDPO"):

    begin_round        the sampled clients' starting models and delays (`FedDPOServer.assign`)
    train_arrays       each client is sent its starting model from the buffer
    read_train_reply   the common checks (names, shapes, floating dtype, finite values, a
                       positive pair count, the sender's identity)
    aggregate          `FedDPOServer.aggregate`; rows: weights, delays, lost clients
"""

from __future__ import annotations

from typing import Any

from flwr.app import ArrayRecord, Message

from ftis.algos.dpo.fed_server import Assignment, DPOReport
from ftis.algos.federated.params import COUNT_KEY
from ftis.algos.federated.records import array_record, to_numpy
from ftis.algos.federated.strategy import FederatedStrategy


class FedDPOStrategy(FederatedStrategy):
    """The FedDPO server on Flower: `server` is a `FedDPOServer`; the other arguments are
    `FederatedStrategy`'s."""

    prefix = "fed"
    sampling_key = "fed-dpo-clients"
    label = "fed-dpo"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.assigned: dict[str, Assignment] = {}
        self._sent: dict[int, ArrayRecord] = {}

    def begin_round(self, r: int, sampled: list[str]) -> None:
        self.assigned = self.server.assign(r, sampled)
        self._sent = {}
        for name, a in self.assigned.items():
            self._rows[name]["fed/staleness"] = float(a.staleness)

    def train_arrays(self, name: str, r: int) -> ArrayRecord:
        v = self.assigned[name].version
        if v not in self._sent:
            self._sent[v] = array_record(to_numpy(self.server.model(v)))
        return self._sent[v]

    def train_config(self, name: str, r: int) -> dict[str, Any]:
        a = self.assigned[name]
        return {"start-version": a.version, "staleness": a.staleness}

    def read_train_reply(
        self, msg: Message, name: str
    ) -> tuple[DPOReport, dict[str, float], float]:
        delta, metrics, count, nbytes = self.check_train_reply(msg, name)
        row = {
            k: float(v)
            for k, v in metrics.items()
            if k != COUNT_KEY and isinstance(v, int | float) and not isinstance(v, bool)
        }
        row["train/num_pairs"] = float(count)
        return DPOReport(name, delta, count, self.assigned[name].version), row, nbytes

    def aggregate(self, r: int, reports: list[DPOReport]) -> dict[str, Any]:
        outcome = self.server.aggregate(reports)
        for name in self._sampled:  # lost: its last round failed (an error or no reply)
            if self._rows[name].get("fed/dropped"):
                self.server.lost.add(name)
            else:
                self.server.lost.discard(name)
        for name in self.names:
            accepted = name in outcome.weights
            self._rows[name]["fed/accepted"] = float(accepted)
            if accepted:
                self._rows[name]["fed/weight"] = outcome.weights[name]
        delays = [a.staleness for a in self.assigned.values()]
        totals = self.server.totals
        row: dict[str, Any] = {
            "fed/sampled": float(len(self._sampled)),
            "fed/participants": float(len(reports)),
            "fed/rejected": float(self._counts["rejected"]),
            "fed/rejected_total": totals["rejected_total"],
            "fed/dropped": float(self._counts["dropped"]),
            "fed/dropped_total": totals["dropped_total"],
            "fed/lost_clients": float(len(self.server.lost)),
            "fed/staleness_mean": sum(delays) / len(delays) if delays else 0.0,
            "fed/staleness_max": float(max(delays, default=0)),
            "fed/version": float(self.server.version),
            "fed/buffer": float(len(self.server.history)),
            "fed/update_norm": outcome.update_norm,
            "fed/skipped_update": float(not reports),
        }
        for name, w in outcome.weights.items():
            row[f"fed/weight/{name}"] = w
        return row
