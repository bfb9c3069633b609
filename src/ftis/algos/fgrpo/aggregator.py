"""The FGRPO server's state and one round of aggregation, without Flower (docs/math.md §9).

State: the global trainable parameters theta, each client's baseline B_k (keyed by its stable
name; absent = unset) and report count, and the running counts of rejected and dropped
replies. `aggregate(reports)` turns one round's accepted reports into weights with the
configured rule (the math lives in `ftis.core.aggregation`), applies
theta <- theta + eta_s * sum_k w_k delta_k and updates the baselines of the clients that
reported. With the default baseline `pre-round` the baseline is not state: each report carries
it (the client's score of the global model before its local training, docs/math.md §9.4). Reports are taken in client-name order, whatever order they arrived in, so a round's
floating-point sums (and a resumed run) are reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ftis.algos.fgrpo.config import FGRPOConfig
from ftis.core.aggregation import (
    apply_delta,
    clipped_positive_weights,
    combine_deltas,
    delta_norm,
    fedavg_weights,
    floored_gains,
    gain_weights,
    log_ratio_gains,
    mix_weights,
    no_gain_weights,
    performance_weights,
    relative_gains,
    uniform_weights,
    update_baselines,
)

GAINS: dict[str, Callable[..., torch.Tensor]] = {
    "floored": lambda perf, base, cfg: floored_gains(perf, base, floor=cfg.gain_floor),
    "relative": lambda perf, base, cfg: relative_gains(perf, base),
    "log-ratio": lambda perf, base, cfg: log_ratio_gains(perf, base),
}


@dataclass
class ClientReport:
    """One client's accepted reply of a round."""

    name: str
    delta: dict[str, torch.Tensor]
    performance: float
    num_examples: int
    performance_before: float | None = None  # the pre-round baseline (None: not measured)


@dataclass
class RoundOutcome:
    """What one aggregation did, per client name: weight, gain, the baseline the gain was
    measured against (None = unset) and the baseline after the round (history baselines
    only); whether no gain was positive and whether the step was skipped (`no_gain: skip`)."""

    weights: dict[str, float] = field(default_factory=dict)
    gains: dict[str, float] = field(default_factory=dict)
    baselines: dict[str, float | None] = field(default_factory=dict)
    new_baselines: dict[str, float] = field(default_factory=dict)
    update_norm: float = 0.0
    no_positive_gain: bool = False
    skipped: bool = False


def client_weights(
    cfg: FGRPOConfig, *, perf: torch.Tensor, gains: torch.Tensor, num_examples: torch.Tensor
) -> torch.Tensor:
    """(K,) weights of the round's K accepted clients under `cfg.aggregation`."""
    k = perf.numel()
    if cfg.aggregation == "fedavg":
        return fedavg_weights(num_examples)
    if cfg.aggregation == "uniform":
        return uniform_weights(k)
    if cfg.aggregation == "reward":
        return performance_weights(perf)
    g = gains if cfg.gain_clip is None else gains.clamp(-cfg.gain_clip, cfg.gain_clip)
    if cfg.weighting == "softmax":
        w = gain_weights(g, temperature=cfg.temperature, floor=cfg.floor)
    else:
        w = clipped_positive_weights(g, floor=cfg.floor)
    if cfg.size_mix > 0:
        w = mix_weights(w, fedavg_weights(num_examples), cfg.size_mix)
    return no_gain_weights(gains, w, num_examples, rule=cfg.no_gain)


class Aggregator:
    """The server's state. `params`: the initial global trainable parameters (CPU tensors)."""

    def __init__(self, params: Mapping[str, torch.Tensor], cfg: FGRPOConfig) -> None:
        self.cfg = cfg
        self.params: dict[str, torch.Tensor] = {k: v.detach().cpu() for k, v in params.items()}
        self.baselines: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.totals: dict[str, float] = {"rejected_total": 0.0, "dropped_total": 0.0}

    def baseline_of(self, name: str) -> float | None:
        return self.baselines.get(name)

    def aggregate(self, reports: list[ClientReport]) -> RoundOutcome:
        """Weight the reports, update theta and the reporters' baselines; no-op when empty."""
        if not reports:
            return RoundOutcome()
        reports = sorted(reports, key=lambda r: r.name)
        names = [r.name for r in reports]
        if len(set(names)) != len(names):
            raise ValueError(f"two reports from one client in a round: {names}")
        perf = torch.tensor([r.performance for r in reports], dtype=torch.float64)
        nan = float("nan")
        pre_round = self.cfg.pre_round
        if pre_round:
            missing = [r.name for r in reports if r.performance_before is None]
            if missing:
                raise ValueError(
                    f"baseline 'pre-round' needs each report's performance before local "
                    f"training; {missing} sent none"
                )
            base = torch.tensor([r.performance_before for r in reports], dtype=torch.float64)
        elif self.cfg.baseline == "pre-round":  # another rule: no baselines, gains 0
            base = torch.full((len(names),), nan, dtype=torch.float64)
        else:
            base = torch.tensor([self.baselines.get(n, nan) for n in names], dtype=torch.float64)
        n_ex = torch.tensor([float(r.num_examples) for r in reports], dtype=torch.float64)
        gains = GAINS[self.cfg.gain](perf, base, self.cfg)
        w = client_weights(self.cfg, perf=perf, gains=gains, num_examples=n_ex)
        skipped = not bool(w.abs().sum() > 0)
        step = combine_deltas([r.delta for r in reports], w)
        if not skipped:
            self.params = apply_delta(self.params, step, self.cfg.server_lr)
        out = RoundOutcome(
            update_norm=0.0 if skipped else self.cfg.server_lr * delta_norm(step),
            no_positive_gain=self.cfg.aggregation == "relative-gain"
            and not bool((gains > 0).any()),
            skipped=skipped,
        )
        history = self.cfg.baseline != "pre-round"
        if history:
            counts = torch.tensor(
                [float(self.counts.get(n, 0)) for n in names], dtype=torch.float64
            )
            new_base = update_baselines(
                base,
                perf,
                rule=self.cfg.baseline,  # type: ignore[arg-type]
                momentum=self.cfg.baseline_momentum,
                count=counts,
            )
        for i, n in enumerate(names):
            b = float(base[i])
            out.weights[n] = float(w[i])
            out.gains[n] = float(gains[i])
            out.baselines[n] = None if math.isnan(b) else b
            if history:
                out.new_baselines[n] = float(new_base[i])
                self.baselines[n] = float(new_base[i])
            self.counts[n] = self.counts.get(n, 0) + 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain data for the server checkpoint (theta itself is the checkpoint's model)."""
        return {
            "baselines": dict(self.baselines),
            "counts": dict(self.counts),
            "totals": dict(self.totals),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.baselines = {str(k): float(v) for k, v in state.get("baselines", {}).items()}
        self.counts = {str(k): int(v) for k, v in state.get("counts", {}).items()}
        self.totals.update({k: float(v) for k, v in state.get("totals", {}).items()})
