"""The FedDPO server's state and one round of aggregation, without Flower (docs/dpo.md, "FedDPO").

State: the global trainable parameters theta^v after v rounds (v = `version`), a buffer of the
last q_max + 1 global models (versions v - q_max .. v: nothing older is kept, so nothing older
can be served), the version each client last saw, the running counts of rejected and dropped
replies and the clients currently lost.

Round r (theta^(r-1) current) :

    assign     each sampled client k gets a delay d_k in [0, q_max] and starts from
               theta^(r-1-d_k), which the buffer holds (`assign`, the rule below)
    aggregate  the accepted reports (delta_k = theta_k - its start, n_k pairs), in client-name
               order: weights w (uniform 1/K, or data-size n_k / sum n), then
                 average: theta^r = sum_k w_k (start_k + delta_k)      (the clients' models)
                 delta:   theta^r = theta^(r-1) + sum_k w_k delta_k    (delayed updates)
               no accepted report: theta^r = theta^(r-1). The buffer gains theta^r and drops
               theta^(r-1-q_max).

The staleness rule (`staleness`):

    age (default)       a client holds the global model made by the last round it took part
                        in (theta^0 if none): v_k. Its delay is its true age, capped:
                        d_k = min((r-1) - v_k, q_max) = min(rounds it sat out, q_max). Then
                        v_k <- r. With full participation every delay is 0 and theta advances
                        every round; with S < N a client that sat out s rounds starts s rounds
                        behind (at most q_max), so the delay only grows with s and q_max
                        decides how stale a start can be.
    last-participation  (the authors' code) a client last saw the global model current at the
                        start of its last round (sampled; theta^0 if never): v_k. Its delay is
                        d_k = (r-1) - v_k = 1 + the rounds it sat out, and when that exceeds
                        q_max it is refreshed to the current model (d_k = 0, so the delay is
                        not monotone in the rounds sat out). Then v_k <- r-1. With full
                        participation every delay is 1 from round 2 on when q_max >= 1: theta
                        splits into two interleaved chains (odd and even rounds) and q_max >= 1
                        does not matter.
    random              d_k drawn uniformly from [0, min(q_max, r-1)] by a generator keyed by
                        (seed, round, client): the same draw in a resumed run.

q_max = 0: every client starts from theta^(r-1) and both updates are plain FedAvg.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ftis.core.aggregation import (
    apply_delta,
    combine_deltas,
    delta_norm,
    fedavg_weights,
    uniform_weights,
)


@dataclass
class DPOReport:
    """One client's accepted reply of a round: its delta from the model it started from
    (version `start_version`) and its number of training pairs."""

    name: str
    delta: dict[str, torch.Tensor]
    num_pairs: int
    start_version: int


@dataclass(frozen=True)
class Assignment:
    """The model a sampled client starts a round from: global version and its delay."""

    version: int
    staleness: int


@dataclass
class Outcome:
    """What one aggregation did: each accepted client's weight, and |theta^r - theta^(r-1)|."""

    weights: dict[str, float] = field(default_factory=dict)
    update_norm: float = 0.0


class FedDPOServer:
    """The server's state; `params`: the initial global trainable parameters (CPU tensors)."""

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        *,
        max_staleness: int = 0,
        staleness: Literal["age", "last-participation", "random"] = "age",
        weighting: Literal["uniform", "data-size"] = "uniform",
        server_update: Literal["average", "delta"] = "average",
        seed: int = 0,
    ) -> None:
        if staleness not in ("age", "last-participation", "random"):
            raise ValueError(
                f"unknown staleness rule {staleness!r}; choose age, last-participation or random"
            )
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness
        self.rule = staleness
        self.weighting = weighting
        self.server_update = server_update
        self.seed = seed
        self.params: dict[str, torch.Tensor] = {k: v.detach().cpu() for k, v in params.items()}
        self.version = 0
        self.history: dict[int, dict[str, torch.Tensor]] = {0: self.params}
        self.last_seen: dict[str, int] = {}
        self.totals: dict[str, float] = {"rejected_total": 0.0, "dropped_total": 0.0}
        self.lost: set[str] = set()

    # ---- which model a client starts from ------------------------------------------------

    def delay(self, name: str, round_: int) -> int:
        """Client `name`'s delay in round `round_` (the rule in the module docstring); it does
        not record the participation (`assign` does)."""
        q, current = self.max_staleness, self.version
        if q == 0:
            return 0
        if self.rule == "random":
            rng = random.Random(f"fed-dpo-staleness:{self.seed}:{round_}:{name}")
            return rng.randint(0, min(q, current))
        d = current - self.last_seen.get(name, 0)
        if self.rule == "age":
            return min(d, q)
        return d if d <= q else 0  # last-participation: refreshed past q_max

    def assign(self, round_: int, names: list[str]) -> dict[str, Assignment]:
        """The sampled clients' starting models for round `round_` (whose current model is
        theta^(round_-1)); records their participation."""
        if round_ - 1 != self.version:
            raise ValueError(
                f"round {round_} starts from global version {round_ - 1}, but the server "
                f"holds version {self.version}"
            )
        out = {}
        for name in names:
            d = self.delay(name, round_)
            out[name] = Assignment(self.version - d, d)
            # age: the client will hold the model this round makes; last-participation: the
            # model it was sent
            self.last_seen[name] = self.version + 1 if self.rule == "age" else self.version
        return out

    def model(self, version: int) -> dict[str, torch.Tensor]:
        """Global model `version` from the buffer (ValueError when it is not held: older than
        max_staleness rounds, or not made yet)."""
        if version not in self.history:
            raise ValueError(
                f"global version {version} is not in the buffer (versions "
                f"{min(self.history)}..{max(self.history)}, max_staleness {self.max_staleness})"
            )
        return self.history[version]

    # ---- aggregation -------------------------------------------------------------------------

    def weights(self, reports: list[DPOReport]) -> torch.Tensor:
        if self.weighting == "data-size":
            return fedavg_weights([float(r.num_pairs) for r in reports])
        return uniform_weights(len(reports))

    def aggregate(self, reports: list[DPOReport]) -> Outcome:
        """theta^(v+1) from the round's accepted reports (module docstring); the version moves
        on even when there is none (theta unchanged)."""
        reports = sorted(reports, key=lambda r: r.name)
        names = [r.name for r in reports]
        if len(set(names)) != len(names):
            raise ValueError(f"two reports from one client in a round: {names}")
        out = Outcome()
        new = self.params
        if reports:
            w = self.weights(reports)
            if self.server_update == "average":
                models = [apply_delta(self.model(r.start_version), r.delta) for r in reports]
                new = combine_deltas(models, w)
            else:
                new = apply_delta(self.params, combine_deltas([r.delta for r in reports], w))
            out.weights = {n: float(w[i]) for i, n in enumerate(names)}
            out.update_norm = delta_norm({k: new[k] - self.params[k] for k in new})
        self.version += 1
        self.params = new
        self.history[self.version] = new
        for v in [v for v in self.history if v < self.version - self.max_staleness]:
            del self.history[v]
        return out

    # ---- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain data for the server checkpoint (theta itself is the checkpoint's model)."""
        return {
            "version": self.version,
            "history": {v: dict(p) for v, p in self.history.items() if v != self.version},
            "last_seen": dict(self.last_seen),
            "totals": dict(self.totals),
            "lost": sorted(self.lost),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        self.version = int(state["version"])
        self.history = {int(v): dict(p) for v, p in state.get("history", {}).items()}
        self.history[self.version] = self.params
        self.last_seen = {str(k): int(v) for k, v in state.get("last_seen", {}).items()}
        self.totals.update({k: float(v) for k, v in state.get("totals", {}).items()})
        self.lost = set(state.get("lost", []))
