"""The `algorithm:` sections of DPO runs (docs/dpo.md). Pydantic only: reading a config imports
no model code and no torch.distributed.

    kind: dpo          every node runs `local_steps` DPO steps per round on its own preference
                       pairs, alone (several nodes = each agent alone, the no-communication baseline)
    kind: gossip-dpo   the same local steps, then one gossip step with the node's neighbours on a
                       graph: theta_i <- sum_j W_ij theta_j (Metropolis-Hastings weights)
    kind: fed-dpo      the same local steps on a sample of clients from a global model, averaged
                       by a server on Flower (FedDPO); `centralized: true` = the union baseline

A row's `step` is the round (`train.steps` rounds). `train.seed` orders each agent's batches;
`train.max_new_tokens` bounds the greedy answers of the task evaluation (`eval.*`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ftis.algos.federated.config import SERVER_NAME, SimulationConfig, check_federated_run
from ftis.plugins import AlgorithmConfig, check_sampler_dtype_unused

DEFAULT_CORRUPTIONS = {"own": 1.0}
PREFERENCE_FORMATS = ("ftis", "hh-rlhf", "shp")


def _check_corruptions(v: dict[str, float] | None) -> dict[str, float] | None:
    from ftis.preferences.embedded import CORRUPTIONS

    if v is None:
        return v
    unknown = sorted(set(v) - set(CORRUPTIONS))
    if unknown:
        raise ValueError(f"unknown corruption(s) {unknown}; choose from: {', '.join(CORRUPTIONS)}")
    if any(w < 0 for w in v.values()) or not any(w > 0 for w in v.values()):
        raise ValueError("corruption weights must be >= 0 with at least one > 0")
    return v


class AgentData(BaseModel):
    """One agent's own preference data (non-IID: agents differ in what they prefer)."""

    model_config = ConfigDict(extra="forbid")
    task: dict[str, Any] = Field(
        default_factory=dict,
        description="embedded: overrides of the run's `task` for this agent's prompts, e.g. "
        "{skills: {mul: 1.0}} (reasoning) or {ops: {'-': 1.0}} (arithmetic).",
    )
    corruptions: dict[str, float] | None = Field(
        None,
        description="embedded: weights of this agent's kinds of rejected response (own, "
        "answer, carry, step, truncate); null = data.corruptions.",
    )
    path: str | None = Field(
        None, description="jsonl: this agent's own file (default: a shard of data.path)."
    )
    eval_path: str | None = Field(
        None, description="jsonl: this agent's own held-out file (default: split from its data)."
    )

    _corruptions = field_validator("corruptions")(_check_corruptions)


class PreferenceDataConfig(BaseModel):
    """Where each agent's preference pairs come from (docs/dpo.md, "Data")."""

    model_config = ConfigDict(extra="forbid")
    source: Literal["embedded", "jsonl"] = Field(
        "embedded",
        description="embedded: pairs made from the run's task (a verified-correct and a "
        "verified-wrong response per prompt); jsonl: pairs read from files.",
    )
    train_pairs: int = Field(
        256,
        ge=0,
        description="Training pairs per agent (embedded: made; jsonl: at most this many, "
        "0 = all of its shard).",
    )
    eval_pairs: int = Field(64, ge=1, description="Held-out pairs per agent (preference accuracy).")
    corruptions: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_CORRUPTIONS),
        description="embedded: weights of the kinds of rejected response: own (the starting "
        "model's own wrong greedy answer), answer (one digit of the answer wrong), carry (every "
        "carry forgotten), step (one step off, the answer following it), truncate (trace cut "
        "before the answer). A kind that does not apply falls back to the next in that order.",
    )
    path: str | None = Field(
        None,
        description="jsonl: one file for every agent; its rows (after the held-out ones) are "
        "dealt round-robin to the agents.",
    )
    eval_path: str | None = Field(
        None,
        description="jsonl: the held-out file; default: the first eval_pairs rows of a seeded "
        "shuffle of path are held out.",
    )
    format: Literal["ftis", "hh-rlhf", "shp"] = Field(
        "ftis",
        description="jsonl layout: ftis (prompt/chosen/rejected), hh-rlhf (Anthropic HH-RLHF "
        "transcripts) or shp (Stanford SHP).",
    )
    seed: int = Field(0, description="Seed of the pairs made (embedded) or the shuffle (jsonl).")
    max_length: int = Field(
        64, ge=2, description="Most tokens of prompt + response; responses are cut to fit."
    )
    max_prompt_length: int = Field(
        48, ge=1, description="Most prompt tokens; longer prompts keep their last tokens."
    )
    agents: dict[str, AgentData] = Field(
        default_factory=dict,
        description="Per-agent data keyed by node name (non-IID preferences); a node not "
        "listed uses the shared settings.",
    )

    _corruptions = field_validator("corruptions")(_check_corruptions)

    @model_validator(mode="after")
    def _lengths(self) -> PreferenceDataConfig:
        if self.max_prompt_length >= self.max_length:
            raise ValueError(
                f"data.max_prompt_length ({self.max_prompt_length}) must be below "
                f"data.max_length ({self.max_length}): responses need room"
            )
        return self


class DPOConfig(AlgorithmConfig):
    """DPO with a frozen reference (the starting weights) on each agent's own preference pairs;
    `local_steps` optimizer steps per round. The optimizer is the node's `optim` (adamw, adam
    or sgd)."""

    kind: Literal["dpo"] = "dpo"
    beta: float = Field(0.1, gt=0, allow_inf_nan=False, description="DPO's KL strength.")
    local_steps: int = Field(1, ge=1, description="E: optimizer steps per round.")
    batch_size: int = Field(4, ge=1, description="Preference pairs per optimizer step.")
    include_prompt: bool = Field(
        False,
        description="Also sum the prompt tokens' log-probs (the authors' code); they are the "
        "same for chosen and rejected, so the loss barely changes.",
    )
    sft_weight: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="Adds sft_weight x the chosen responses' per-token NLL to the DPO loss (as "
        "RPO / TRL's rpo_alpha): keeps them likely, which pure DPO does not; 0 = pure DPO.",
    )
    task_eval: bool = Field(
        True,
        description="Evaluate the run's task (greedy eval/accuracy) at each evaluation; false: "
        "eval/accuracy is the preference accuracy (for data without a verifier).",
    )
    data: PreferenceDataConfig = Field(default_factory=PreferenceDataConfig)

    def check_run(self, run: Any) -> None:
        check_sampler_dtype_unused(run, self.kind, "samples its preference pairs")
        names = [n.name for n in run.nodes]
        unknown = sorted(set(self.data.agents) - set(names))
        if unknown:
            raise ValueError(
                f"algorithm.data.agents names unknown nodes {unknown}; use node names "
                f"({', '.join(names)})"
            )
        if self.data.source == "embedded":
            _check_embedded(self, run)
        else:
            _check_jsonl(self, names)


def _check_embedded(cfg: DPOConfig, run: Any) -> None:
    from pydantic import TypeAdapter, ValidationError

    from ftis.preferences.embedded import SUPPORTED_TASKS
    from ftis.tasks import TaskConfig

    if run.task.kind not in SUPPORTED_TASKS:
        raise ValueError(
            f"algorithm.data.source embedded makes pairs from the {' or '.join(SUPPORTED_TASKS)} "
            f"task, not {run.task.kind!r}; set task.kind or use data.source jsonl"
        )
    if cfg.data.train_pairs < 1:
        raise ValueError("algorithm.data.train_pairs must be >= 1 for embedded pairs")
    test_size = getattr(run.task, "test_size", None)
    if test_size is not None and cfg.data.eval_pairs > test_size:
        raise ValueError(
            f"algorithm.data.eval_pairs ({cfg.data.eval_pairs}) is more than the task's held-out "
            f"problems (task.test_size = {test_size}); raise task.test_size or lower eval_pairs"
        )
    for name, agent in cfg.data.agents.items():
        if not agent.task:
            continue
        try:
            TypeAdapter(TaskConfig).validate_python({**run.task.model_dump(), **agent.task})
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(p) for p in first["loc"][1:])
            raise ValueError(f"algorithm.data.agents.{name}.task.{loc}: {first['msg']}") from None
        if agent.path or agent.eval_path:
            raise ValueError(
                f"algorithm.data.agents.{name}: path/eval_path apply to data.source jsonl"
            )


def _check_jsonl(cfg: DPOConfig, names: list[str]) -> None:
    """Every file is read and every row checked now, so that a bad row stops `ftis run` with
    its file, line and field before any process starts."""
    from ftis.preferences.data import read_pairs

    d = cfg.data
    for name in names:
        agent = d.agents.get(name)
        if (agent is None or agent.path is None) and d.path is None:
            raise ValueError(
                f"algorithm.data.source is jsonl but node {name!r} has no file: set "
                f"algorithm.data.path (shared) or algorithm.data.agents.{name}.path"
            )
    files = {d.path, d.eval_path}
    for agent in d.agents.values():
        files |= {agent.path, agent.eval_path}
    for f in sorted(x for x in files if x is not None):
        if not Path(f).is_file():
            raise ValueError(f"preferences file {f!r} does not exist; give a JSONL file path")
        read_pairs(f, format=d.format)  # PreferenceDataError (a ValueError) names line and field


def _start_of(node: Any) -> dict[str, Any]:
    """What decides a node's starting weights (and so its DPO reference): its model's
    initialisation and its warm start."""
    return {
        "model.init_seed": node.model.init_seed,
        "warm_start": None if node.warm_start is None else node.warm_start.model_dump(),
    }


class GossipDPOConfig(DPOConfig):
    """Decentralized DPO (DecDPO, methods-wave2.md §2): each round every agent runs
    `local_steps` DPO steps, then averages its parameters with its neighbours on the graph
    `topology`, theta_i <- sum_j W_ij theta_j with Metropolis-Hastings weights, over
    point-to-point torch.distributed messages (neighbours only). A lost agent is dropped by its
    neighbours, who renormalise their weights over the remaining graph."""

    kind: Literal["gossip-dpo"] = "gossip-dpo"  # type: ignore[assignment]
    topology: Literal["path", "ring", "star", "complete", "random-regular", "edges"] = Field(
        "ring",
        description="The graph over the nodes, in config order: path, ring, star (the first "
        "node in the middle), complete, random-regular (needs degree) or edges.",
    )
    degree: int | None = Field(None, ge=1, description="random-regular: neighbours per agent.")
    edges: list[tuple[str | int, str | int]] | None = Field(
        None,
        description="topology edges: the undirected edges, as pairs of node names (or "
        "indices), e.g. [[a, b], [b, c]].",
    )
    graph_seed: int = Field(0, description="random-regular: the seed of the graph drawn.")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="torch.distributed backend of the gossip messages: auto = nccl where "
        "CUDA is available, else gloo. Only gloo survives a lost agent (docs/dpo.md).",
    )
    consensus: Literal["sketch", "exact", "off"] = Field(
        "sketch",
        description="How gossip/consensus_error_* is measured: sketch (every agent shares a "
        "count sketch of its parameters, sketch_size numbers; estimate within a few %), exact "
        "(every agent shares all its parameters with every other: small models only), off.",
    )
    sketch_size: int = Field(
        2048, ge=16, description="Numbers per count sketch (relative error about sqrt(2/k))."
    )
    different_starts: bool = Field(
        False,
        description="Allow agents that start from different weights (another model.init_seed "
        "or warm_start): each then keeps its own start as its DPO reference and gossip "
        "averages networks that were initialised apart. Off: such a config is refused.",
    )

    def check_run(self, run: Any) -> None:
        super().check_run(run)
        self.edge_indices(run)  # names resolve
        from ftis.core.graphs import build_graph

        build_graph(
            self.topology,
            len(run.nodes),
            degree=self.degree,
            seed=self.graph_seed,
            edges=self.edge_indices(run),
        )
        first = run.nodes[0].model
        for n in run.nodes[1:]:
            for field in ("preset", "path", "lora", "dtype"):
                if getattr(n.model, field) != getattr(first, field):
                    raise ValueError(
                        f"gossip-dpo averages parameters, so every node needs the same "
                        f"architecture: nodes[{n.name}].model.{field} differs from "
                        f"{run.nodes[0].name}'s"
                    )
        if not self.different_starts:
            start = _start_of(run.nodes[0])
            for n in run.nodes[1:]:
                for field, value in _start_of(n).items():
                    if value != start[field]:
                        raise ValueError(
                            f"gossip-dpo: nodes[{n.name}].{field} differs from "
                            f"{run.nodes[0].name}'s, so the agents start from different "
                            "weights: each would use its own start as its DPO reference and "
                            "gossip would average networks initialised apart. Give every node "
                            "the same model.init_seed and warm_start, or set "
                            "algorithm.different_starts: true to run it anyway"
                        )

    def edge_indices(self, run: Any) -> list[tuple[int, int]] | None:
        """`edges` with node names turned into indices (ValueError on an unknown name)."""
        if self.edges is None:
            return None
        names = [n.name for n in run.nodes]
        out = []
        for e in self.edges:
            pair = []
            for v in e:
                if isinstance(v, int) or (isinstance(v, str) and v.isdigit() and v not in names):
                    pair.append(int(v))
                elif v in names:
                    pair.append(names.index(v))
                else:
                    raise ValueError(
                        f"algorithm.edges names {v!r}, which is no node; use node names "
                        f"({', '.join(names)}) or indices"
                    )
            out.append((pair[0], pair[1]))
        return out


class FedDPOConfig(DPOConfig):
    """Federated DPO (FedDPO, methods-wave2.md §2, docs/dpo.md "FedDPO") on Flower: the run's
    nodes are the clients, each with its own preference pairs (`data`, as gossip-dpo); one
    global model on a server. Each round the server samples `clients_per_round` clients; each
    runs `local_steps` DPO steps from the global model (or, with `max_staleness` > 0, from an
    older one the server still holds) and returns its delta and its number of training pairs;
    the server averages the clients' models with `weighting`. `centralized: true` is the
    baseline: one model on the union of the clients' pairs, no Flower."""

    kind: Literal["fed-dpo"] = "fed-dpo"  # type: ignore[assignment]

    def required_packages(self) -> list[tuple[str, str]]:
        return [("flwr", "federated"), ("ray", "federated")]  # Flower's simulation engine

    clients_per_round: int = Field(
        0,
        ge=0,
        description="S: clients sampled per round (seeded by train.seed and the round); 0 = all.",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="q_max: the oldest global model a client may start from, in rounds behind "
        "the current one; the server keeps the last q_max + 1 global models. 0 = plain FedAvg.",
    )
    staleness: Literal["age", "last-participation", "random"] = Field(
        "age",
        description="How a client's delay d is decided (max_staleness > 0): age = it starts "
        "from the global model made by the last round it took part in (the initial model if "
        "none), at most max_staleness rounds old: d = min(rounds sat out, max_staleness), 0 "
        "under full participation; last-participation (the authors' code) = from the model "
        "it was sent in its last round, d = 1 + rounds sat out, refreshed to the current "
        "model when more than max_staleness; random = a seeded d in [0, max_staleness] per "
        "participation.",
    )
    weighting: Literal["uniform", "data-size"] = Field(
        "uniform",
        description="Client weights in the average: uniform (1/K, the authors' code) or "
        "data-size (n_k / sum n, n_k = the client's training pairs: FedAvg).",
    )
    server_update: Literal["average", "delta"] = Field(
        "average",
        description="average: theta <- sum_k w_k theta_k, the clients' returned models (the "
        "spec; a stale client pulls theta back towards its old model); delta: theta <- theta + "
        "sum_k w_k (theta_k - its start), delayed updates applied to the current model. The "
        "same without staleness.",
    )
    centralized: bool = Field(
        False,
        description="The centralized baseline: one model trained on the union of the clients' "
        "pairs (batch_size x clients pairs per step, local_steps steps per round, one optimizer "
        "for the run), evaluated on each client's held-out pairs; runs in this process, no "
        "Flower.",
    )
    simulation: SimulationConfig = Field(default_factory=SimulationConfig)

    def service_ranks(self, run: Any) -> list[str]:
        return [SERVER_NAME]

    def check_run(self, run: Any) -> None:
        check_sampler_dtype_unused(run, self.kind, "samples its preference pairs")
        check_federated_run(
            run,
            kind="fed-dpo",
            clients_per_round=self.clients_per_round,
            simulation=self.simulation,
        )
        super().check_run(run)
        n = len(run.nodes)
        if self.centralized and (0 < self.clients_per_round < n or self.max_staleness > 0):
            raise ValueError(
                "algorithm.centralized trains one model on the union of every client's pairs: "
                "clients_per_round and max_staleness do not apply; set clients_per_round: 0 "
                "and max_staleness: 0 (or centralized: false)"
            )
