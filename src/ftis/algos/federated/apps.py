"""Flower's two apps for a federated ftis run: the ServerApp runs the strategy's `start`; the
ClientApp answers the server's identify query and runs the algorithm's client object on the
global parameters it is sent.

A client object (FGRPO's `LocalClient`, FedDPO's `DPOClient`) has:

    name, node                       its client name; its Node (model, tokenizer, optimizer)
    fit(params, round, config)       local training from `params` -> (arrays to send, reply
                                     metrics incl. num-examples, state for its checkpoint)
    evaluate(params, round)          eval/* of the model `params`
    save(run_dir, round, state)      checkpoint its local model under nodes/<name>/

In Flower's simulation engine each client message runs in a Ray worker process; a worker may
serve several clients over the run. A worker builds each client it serves once (model,
tokenizer, data; the base model is read from the shared warm start on disk) and keeps it for
the rest of the run. Nothing of a client's state carries from one round to the next but what
the server sends, so which worker runs a round does not matter.

Deployed (a SuperLink and one SuperNode per data owner) the same two apps run: the ServerApp in
the SuperLink's `flwr-serverapp` process, the ClientApp in a `flwr-clientapp` process per
message on the data owner's machine, its client named by the SuperNode's node config (`client`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from ftis.algos.federated.faults import FaultPlan, InjectedDropout, corrupt
from ftis.algos.federated.identity import client_rank, identify_reply, reply
from ftis.algos.federated.records import (
    ARRAYS,
    CONFIG,
    METRICS,
    ROUND_KEY,
    array_record,
    metric_record,
    read_params,
    to_numpy,
)
from ftis.config import RunConfig
from ftis.launch.stop import exit_with

log = logging.getLogger(__name__)


class FederatedClient(Protocol):
    name: str
    node: Any

    def fit(
        self, params: dict[str, torch.Tensor], round_: int, config: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]: ...

    def evaluate(self, params: dict[str, torch.Tensor], round_: int) -> dict[str, float]: ...

    def save(self, run_dir: Path, round_: int, state: dict[str, Any] | None = None) -> None: ...


# build_client(cfg, rank, base_dir) -> the client object of node cfg.nodes[rank]
BuildClient = Callable[[RunConfig, int, Path | None], FederatedClient]

# The clients this worker process has built: (run key, name) -> client.
_CLIENTS: dict[tuple[str, str], FederatedClient] = {}


def make_client_app(
    cfg: RunConfig,
    run_dir: Path,
    *,
    build_client: BuildClient,
    base_dir: Path | Callable[[], Path | None] | None = None,
    faults: FaultPlan | None = None,
    threads: int = 0,
) -> ClientApp:
    """The ClientApp of run `cfg`. build_client: makes the algorithm's client object. base_dir:
    the shared warm-started base model (None: each client builds its model from its config),
    or a function that returns it, called when the process builds its first client (a
    deployed node warm-starts only when it has work). faults: test-only fault injection.
    threads: torch threads of a worker process (0 = leave them alone, e.g. when clients run in
    this process)."""
    app = ClientApp()
    # A worker keeps the clients it built for the rest of the run; a resumed run in the same
    # process (the in-process engine) may have another config, so the key includes it.
    run_key = f"{run_dir}:{hash(cfg.model_dump_json())}"
    plan = faults or FaultPlan()
    launcher = os.getpid()  # where the app is made; a worker (Ray's) exits when it is gone

    def client_for(context: Context) -> FederatedClient:
        rank = client_rank(cfg, context)
        key = (run_key, cfg.nodes[rank].name)
        if key not in _CLIENTS:
            exit_with(launcher)
            if threads:
                torch.set_num_threads(threads)
            base = base_dir() if callable(base_dir) else base_dir
            _CLIENTS[key] = build_client(cfg, rank, base)
        return _CLIENTS[key]

    @app.query()
    def identify(msg: Message, context: Context) -> Message:
        return identify_reply(cfg, msg, context)

    def check_alive(name: str, r: int) -> None:
        crash_at = cfg.testing.crash_at_step.get(name)
        if crash_at is not None and r >= crash_at:
            raise InjectedDropout(f"testing.crash_at_step: client {name} is gone")

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        client = client_for(context)
        config = dict(msg.content[CONFIG])
        r = int(config[ROUND_KEY])
        check_alive(client.name, r)
        plan.before_round(client.name, r)
        params = read_params(msg.content[ARRAYS], _reference(client))
        tensors, metrics, state = client.fit(params, r, config)
        arrays = to_numpy(tensors)
        kind = plan.kind(client.name, r)
        if kind is not None:
            corrupt(kind, arrays, metrics)
        # The client's local model after every round it takes part in (the server's
        # checkpoint, on checkpoint.every, is what a resume continues from).
        client.save(run_dir, r, state)
        return reply(
            msg, client.name, **{ARRAYS: array_record(arrays), METRICS: metric_record(metrics)}
        )

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        client = client_for(context)
        r = int(msg.content[CONFIG][ROUND_KEY])
        check_alive(client.name, r)
        params = read_params(msg.content[ARRAYS], _reference(client))
        return reply(msg, client.name, **{METRICS: metric_record(client.evaluate(params, r))})

    return app


def _reference(client: FederatedClient) -> dict[str, torch.Tensor]:
    return {n: p for n, p in client.node.model.named_parameters() if p.requires_grad}


def make_server_app(strategy: Any, *, rounds: int, timeout_s: float) -> ServerApp:
    """The ServerApp: Flower's round loop (`Strategy.start`) with `strategy` (a
    `FederatedStrategy`)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        initial = array_record(to_numpy(strategy.server.params))
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds, timeout=timeout_s)

    return app
