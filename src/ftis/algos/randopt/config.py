"""Configs of the population algorithms: `randopt` and `corp` (docs/randopt.md).

A step is one round: stage 0 scores `per_step` members of the population per step, so it takes
ceil(population / per_step) steps; CoRP adds one consolidation step. `train.steps` must equal
that count (the error says the number). Light: imports no model code.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator

from ftis.plugins import AlgorithmConfig, check_one_shared_model, check_sampler_dtype_unused


def _finite(name: str, values: list[float], *, positive: bool = False, lo: float | None = None):
    for v in values:
        if not math.isfinite(v) or (positive and v <= 0) or (lo is not None and v < lo):
            need = "> 0" if positive else (f">= {lo}" if lo is not None else "finite")
            raise ValueError(f"{name} values must be finite and {need}, got {v!r}")


class RandOptConfig(AlgorithmConfig):
    """RandOpt (arXiv 2603.12228; methods-wave2.md §4): a population of seeded Gaussian
    perturbations theta_0 + sigma_i * eps(s_i), each scored greedily on every node's private
    support set; the nodes trade only reward vectors; the answer at evaluation is the majority
    vote of the best `top_k` members (by pooled reward)."""

    kind: Literal["randopt"] = "randopt"
    population: int = Field(64, ge=1, description="N: members (seeded perturbations) in all.")
    per_step: int = Field(
        16,
        ge=1,
        description="Members scored per step; a step is one exchange round. train.steps must "
        "be ceil(population / per_step) (plus 1 for corp's consolidation).",
    )
    sigmas: list[float] = Field(
        default_factory=lambda: [0.001, 0.002, 0.005],
        min_length=1,
        description="Noise scales; each member draws one uniformly (the authors' rule).",
    )
    seed: int = Field(
        0,
        ge=0,
        description="Seed of the member seeds and sigmas, and of the nodes' support/probe "
        "draws; every node shares it.",
    )
    noise: Literal["independent", "shared"] = Field(
        "independent",
        description="'independent': one generator seeded once per member draws every tensor in "
        "turn; 'shared': reseeded with the member's seed before every tensor (the authors' "
        "code, identical noise for tensors of the same shape).",
    )
    support_size: int = Field(
        64, ge=1, description="Problems in each node's private support set (its task's train)."
    )
    node_tasks: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Per-node overrides of the run's `task` section for its private support "
        "(and probe) problems, keyed by node name, e.g. {a: {ops: {'+': 1.0}}}; unlisted nodes "
        "use the run's task. Evaluation always uses the run's task.",
    )
    top_k: int = Field(
        5, ge=1, description="K: members whose answers are majority-voted at evaluation."
    )
    batch_size: int = Field(
        256, ge=1, description="Sequences per greedy generation batch when scoring."
    )

    @field_validator("sigmas")
    @classmethod
    def _sigmas(cls, v: list[float]) -> list[float]:
        _finite("sigmas", v, positive=True)
        return v

    def stage0_steps(self) -> int:
        return math.ceil(self.population / self.per_step)

    def required_steps(self) -> int:
        """The run's train.steps for this population."""
        return self.stage0_steps()

    def node_task(self, run: Any, name: str) -> dict[str, Any]:
        """Node `name`'s support task (the run's task with its overrides), as a dict."""
        return {**run.task.model_dump(), **self.node_tasks.get(name, {})}

    def check_run(self, run: Any) -> None:
        from ftis.tasks import check_task_section

        check_sampler_dtype_unused(run, self.kind, "scores its members greedily")
        steps = self.required_steps()
        if run.train.steps != steps:
            raise ValueError(
                f"train.steps={run.train.steps} but this {self.kind} run has {steps} steps "
                f"(population {self.population} scored {self.per_step} per step"
                + (" + 1 consolidation step" if steps != self.stage0_steps() else "")
                + f"); set train.steps={steps}"
            )
        if self.top_k > self.population:
            raise ValueError(
                f"algorithm.top_k={self.top_k} exceeds the population ({self.population}); "
                "lower top_k"
            )
        names = [n.name for n in run.nodes]
        unknown = sorted(set(self.node_tasks) - set(names))
        if unknown:
            raise ValueError(
                f"algorithm.node_tasks names unknown nodes {unknown}; use node names "
                f"({', '.join(names)})"
            )
        check_one_shared_model(run, "a population perturbs one shared base model")
        if run.testing.adversary:
            raise ValueError(
                "testing.adversary corrupts rollouts, which population nodes never send; "
                "remove it (tests inject bad reward vectors through the transport)"
            )
        if run.defence.active:
            raise ValueError(
                "defence screens peers' rollouts, which population nodes never send; remove "
                "the defence section"
            )
        for name in names:
            check_task_section(self.node_task(run, name), f"algorithm.node_tasks.{name}")


class CoRPConfig(RandOptConfig):
    """CoRP (arXiv 2605.31494; methods-wave2.md §4): RandOpt's population (stage 0) folded
    into one model (stage 1): elite tail above the q-quantile, pass 1 softmax(beta * R) and a
    provisional mean, pass 2 reweighting by z-scored alignment minus z-scored dispersion, the
    merged direction mu, and theta_0 + alpha * mu with (q, beta, alpha) chosen on every node's
    private probe split (pooled). Stage 2 is future work (docs/randopt.md)."""

    kind: Literal["corp"] = "corp"  # type: ignore[assignment]
    probe_size: int = Field(
        64,
        ge=1,
        description="Problems in each node's private probe split (disjoint from its "
        "support set) on which (q, beta, alpha) is chosen.",
    )
    validation_gate: bool = Field(
        True,
        description="Apply the chosen candidate only if it beats the base model on a held-out "
        "validation split (probe_size more private problems per node, disjoint from the "
        "support and probe sets; pooled like the probe); otherwise keep the base model. False: "
        "always apply the best probe candidate.",
    )
    quantiles: list[float] = Field(
        default_factory=lambda: [0.75, 0.9],
        min_length=1,
        description="Candidate q: the elite tail is every member with reward >= the q-quantile.",
    )
    betas: list[float] = Field(
        default_factory=lambda: [10.0, 30.0],
        min_length=1,
        description="Candidate beta: inverse temperature of softmax(beta * R) (rewards as "
        "measured: mean reward per problem).",
    )
    alphas: list[float] = Field(
        default_factory=lambda: [1.0, 2.0, 4.0],
        min_length=1,
        description="Candidate alpha: step along the merged direction (theta_0 + alpha * mu).",
    )
    compatibility: float = Field(
        1.0,
        ge=0,
        allow_inf_nan=False,
        description="Weight of pass 2's compatibility score z(alignment) - z(dispersion) in "
        "softmax(beta * R + compatibility * c); 0 = pass 1 only (an ablation).",
    )
    leave_one_out: bool = Field(
        False,
        description="Pass 2 measures member i against the provisional mean without its own "
        "term (m - w1_i u_i); the spec's reading (false) uses m itself.",
    )
    report_randopt: bool = Field(
        True,
        description="At the final evaluation also log the population's RandOpt numbers "
        "(eval/randopt/vote_accuracy over top_k, eval/randopt/best_accuracy) on the first split.",
    )

    @field_validator("quantiles")
    @classmethod
    def _quantiles(cls, v: list[float]) -> list[float]:
        _finite("quantiles", v, lo=0.0)
        if any(q > 1 for q in v):
            raise ValueError(f"quantiles must lie in [0, 1], got {v}")
        return v

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: list[float]) -> list[float]:
        _finite("betas", v, lo=0.0)
        return v

    @field_validator("alphas")
    @classmethod
    def _alphas(cls, v: list[float]) -> list[float]:
        _finite("alphas", v)
        return v

    def required_steps(self) -> int:
        return self.stage0_steps() + 1

    def candidates(self) -> list[tuple[int, int, float]]:
        """The (q index, beta index, alpha) grid in the order candidates are scored; on a tie
        of pooled probe rewards the first wins (list alphas ascending to prefer small steps)."""
        return [
            (qi, bi, a)
            for qi in range(len(self.quantiles))
            for bi in range(len(self.betas))
            for a in self.alphas
        ]
