"""The `algorithm:` section of an FGRPO run (kind: fgrpo). Pydantic only: reading a config
imports no model code and no Flower.

The run's `nodes` are the clients (data owners); `train.steps` is the number of federated
rounds, so a row's `step` is its round; `train.prompts_per_step`, `group_size`,
`max_new_tokens`, `temperature`, `update_epochs`, `mini_batches` shape each local GRPO step.
Each client's own data is the run's `task` with the overrides in `clients.<name>.task`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ftis.algos.federated.config import SERVER_NAME, SimulationConfig, check_federated_run
from ftis.plugins import AlgorithmConfig

__all__ = ["SERVER_NAME", "ClientSpec", "FGRPOConfig", "SimulationConfig"]


class ClientSpec(BaseModel):
    """One client's data: its task mix and reward scale."""

    model_config = ConfigDict(extra="forbid")
    task: dict[str, Any] = Field(
        default_factory=dict,
        description="Overrides of the run's `task` section for this client's data, e.g. "
        "{ops: {'*': 1.0}} (arithmetic) or {skills: {mul: 1.0}} (reasoning).",
    )
    reward_scale: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="Multiplies this client's verifier rewards (training and performance "
        "signal; not eval/accuracy): 10 makes a 0/10 reward.",
    )
    prompts_per_step: int | None = Field(
        None,
        ge=1,
        description="Prompts per local step for this client (its data size per round, which "
        "FedAvg weights by); null = train.prompts_per_step.",
    )


class FGRPOConfig(AlgorithmConfig):
    """Federated GRPO (methods-wave2.md §1, docs/fgrpo.md): each sampled client runs
    `local_steps` GRPO steps from the global model on its own task and sends its parameter
    delta, a performance signal and its sample count; the server weights the deltas (by default
    by relative performance gain against each client's score before its local training) and applies them with
    `server_lr`. Runs through Flower's simulation engine."""

    kind: Literal["fgrpo"] = "fgrpo"

    def required_packages(self) -> list[tuple[str, str]]:
        return [("flwr", "federated"), ("ray", "federated")]  # Flower's simulation engine

    local_steps: int = Field(4, ge=1, description="E: local GRPO steps per client per round.")
    clients_per_round: int = Field(
        0,
        ge=0,
        description="Clients sampled per round (seeded by train.seed and the round); 0 = all.",
    )
    aggregation: Literal["relative-gain", "fedavg", "uniform", "reward"] = Field(
        "relative-gain",
        description="Client weights: relative-gain (FGRPO), fedavg (sample counts), uniform, "
        "or reward (proportional to the performance signal; not scale-invariant).",
    )
    server_lr: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="eta_s: theta += eta_s * sum_k w_k delta_k."
    )
    temperature: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="tau of softmax(g / tau) (relative-gain)."
    )
    floor: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Uniform share mixed into the relative-gain weights: "
        "w = (1 - floor) * softmax(g / tau) + floor / K.",
    )
    gain: Literal["floored", "relative", "log-ratio"] = Field(
        "floored",
        description="floored: (P - B) / max(|B|, gain_floor) (bounded near B = 0; "
        "docs/math.md §9.4); relative: (P - B) / max(|B|, 1e-8) (the contract's formula); "
        "log-ratio: log(P / B).",
    )
    gain_floor: float = Field(
        0.1,
        gt=0,
        allow_inf_nan=False,
        description="delta of the floored gain, in the units of the performance signal: a "
        "baseline below it divides by it (0.1 = a tenth of a 0/1 reward).",
    )
    no_gain: Literal["fedavg", "skip", "weights"] = Field(
        "fedavg",
        description="When no accepted client's gain is > 0: fedavg = data-size weights, "
        "skip = leave the global model unchanged this round, weights = the gain weights "
        "anyway (the step at full size).",
    )
    gain_clip: float | None = Field(
        None,
        gt=0,
        description="Clip gains to [-gain_clip, gain_clip] before weighting (a relative gain "
        "against a baseline near 0 is huge); null = no clipping (the spec's formula).",
    )
    weighting: Literal["softmax", "clipped-positive"] = Field(
        "softmax",
        description="softmax(g / tau), or proportional to max(g, 0) (uniform when none is "
        "positive); floor applies to both.",
    )
    size_mix: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Mix relative-gain weights with data-size weights: "
        "(1 - size_mix) * w_gain + size_mix * n_k / sum n.",
    )
    baseline: Literal["pre-round", "ema", "mean", "best"] = Field(
        "pre-round",
        description="Each client's baseline B_k: pre-round = its score of the global model it "
        "was sent, before its local training in the same round (isolates its own update); or "
        "its own past scores: EMA, running mean, or best so far.",
    )
    baseline_momentum: float = Field(
        0.9, ge=0, le=1, description="gamma of the EMA baseline: B <- gamma B + (1 - gamma) P."
    )
    performance: Literal["eval", "train"] = Field(
        "eval",
        description="The performance signal P_k: 'eval' = mean (scaled) verifier reward of "
        "greedy answers on the client's held-out local batch after local training; 'train' = "
        "mean training reward of its last local step. With baseline pre-round the same "
        "signal is measured before local training too: the held-out score of the global model, "
        "or the first local step's mean reward (sampled before any update).",
    )
    performance_size: int = Field(
        64, ge=1, description="Problems in each client's held-out local batch (performance)."
    )
    clients: dict[str, ClientSpec] = Field(
        default_factory=dict,
        description="Per-client data (task overrides, reward scale), keyed by node name; a "
        "node not listed trains on the run's task with reward scale 1.",
    )
    simulation: SimulationConfig = Field(default_factory=SimulationConfig)

    @field_validator("gain_clip")
    @classmethod
    def _finite_clip(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("gain_clip must be a finite number or null")
        return v

    @property
    def pre_round(self) -> bool:
        """Whether each client measures its performance before local training too (the
        baseline of the relative-gain rule, docs/math.md §9.4)."""
        return self.aggregation == "relative-gain" and self.baseline == "pre-round"

    def service_ranks(self, run: Any) -> list[str]:
        return [SERVER_NAME]

    def client_spec(self, name: str) -> ClientSpec:
        return self.clients.get(name) or ClientSpec()

    def client_task(self, run: Any, name: str) -> dict[str, Any]:
        """Client `name`'s task config (the run's task with its overrides), as a dict."""
        return {**run.task.model_dump(), **self.client_spec(name).task}

    def check_run(self, run: Any) -> None:
        from ftis.tasks import check_task_section

        names = [n.name for n in run.nodes]
        check_federated_run(
            run,
            kind="fgrpo",
            clients_per_round=self.clients_per_round,
            simulation=self.simulation,
        )
        unknown = sorted(set(self.clients) - set(names))
        if unknown:
            raise ValueError(
                f"algorithm.clients names unknown nodes {unknown}; use node names "
                f"({', '.join(names)})"
            )
        for name in names:
            check_task_section(self.client_task(run, name), f"algorithm.clients.{name}.task")
