"""Config pieces every federated algorithm shares (pydantic only: reading a config imports no
model code and no Flower): the server's name, Flower's simulation section, and the checks of
the run's clients (`check_federated_run`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ftis.plugins import check_one_shared_model

SERVER_NAME = "server"  # the server's rows (`node: server`) and checkpoints (nodes/server/)


class SimulationConfig(BaseModel):
    """Flower's simulation engine (Ray) on this machine."""

    model_config = ConfigDict(extra="forbid")
    num_cpus: int = Field(2, ge=1, description="CPUs Ray may use for the clients.")
    client_cpus: float = Field(
        1.0, gt=0, description="CPUs per client: num_cpus / client_cpus clients run at once."
    )
    client_gpus: float = Field(
        0.0, ge=0, description="GPU share per client (0 = clients train on the CPU)."
    )
    round_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="Seconds the server waits for a round's replies; a client that has not "
        "replied by then counts as dropped for that round.",
    )
    verbose: bool = Field(False, description="Show Flower's and Ray's own logs.")


def check_federated_run(
    run: Any, *, kind: str, clients_per_round: int, simulation: SimulationConfig
) -> None:
    """The checks of a federated run config `run` (algorithm `kind`) that every federated
    algorithm makes; raise ValueError with a fix."""
    names = [n.name for n in run.nodes]
    if SERVER_NAME in names:
        raise ValueError(
            f"a node is named {SERVER_NAME!r}, the name of the federated server's rows and "
            "checkpoints; rename it"
        )
    if clients_per_round > len(names):
        raise ValueError(
            f"algorithm.clients_per_round={clients_per_round} exceeds the "
            f"{len(names)} clients (nodes); lower it, or 0 for all"
        )
    check_one_shared_model(run, "federated clients train one shared model")
    if run.testing.adversary:
        raise ValueError(
            f"testing.adversary corrupts rollouts, which {kind} clients never send; remove it "
            "(tests inject faulty clients through ftis.algos.federated.faults)"
        )
    if run.defence.active:
        raise ValueError(
            f"defence screens peers' rollouts, which {kind} clients never send; remove the "
            "defence section"
        )
    if simulation.client_cpus > simulation.num_cpus:
        raise ValueError(
            f"algorithm.simulation.client_cpus={simulation.client_cpus} exceeds num_cpus="
            f"{simulation.num_cpus}: no client could run; lower client_cpus"
        )
