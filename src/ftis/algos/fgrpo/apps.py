"""Flower's two apps for FGRPO: the ServerApp runs `FGRPOStrategy.start`; the ClientApp runs a
client's local GRPO round (`LocalClient`) on the global parameters it is sent.

In Flower's simulation engine each client message runs in a Ray worker process; a worker may
serve several clients over the run. A worker builds each client it serves once (model,
tokenizer, task; the base model is read from the shared warm start on disk) and keeps it for
the rest of the run. Nothing of a client's state carries from one round to the next but the
global parameters the server sends, so which worker runs a round does not matter.

Deployed (`ftis.algos.fgrpo.deploy`: a SuperLink and one SuperNode per data owner) the same two
apps run: the ServerApp in the SuperLink's `flwr-serverapp` process, the ClientApp in a
`flwr-clientapp` process per message on the data owner's machine, its client named by the
SuperNode's node config (`client`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from ftis.algos.fgrpo.client import LocalClient
from ftis.algos.fgrpo.faults import FaultPlan, InjectedDropout, corrupt
from ftis.algos.fgrpo.identity import client_rank, identify_reply, reply
from ftis.algos.fgrpo.records import (
    ARRAYS,
    CONFIG,
    COUNT_KEY,
    METRICS,
    PERF_KEY,
    ROUND_KEY,
    array_record,
    metric_record,
    read_params,
    to_numpy,
)
from ftis.algos.fgrpo.strategy import FGRPOStrategy
from ftis.config import RunConfig

log = logging.getLogger(__name__)

# The clients this worker process has built: (run dir, name) -> client.
_CLIENTS: dict[tuple[str, str], LocalClient] = {}


def make_client_app(
    cfg: RunConfig,
    run_dir: Path,
    *,
    base_dir: Path | Callable[[], Path | None] | None = None,
    faults: FaultPlan | None = None,
    threads: int = 0,
) -> ClientApp:
    """The ClientApp of run `cfg`. base_dir: the shared warm-started base model (None: each
    client builds its model from its config), or a function that returns it, called when the
    process builds its first client (a deployed node warm-starts only when it has work). faults:
    test-only fault injection. threads:
    torch threads of a worker process (0 = leave them alone, e.g. when clients run in this
    process)."""
    app = ClientApp()
    # A worker keeps the clients it built for the rest of the run; a resumed run in the same
    # process (the in-process engine) may have another config, so the key includes it.
    run_key = f"{run_dir}:{hash(cfg.model_dump_json())}"
    plan = faults or FaultPlan()

    def client_for(context: Context) -> LocalClient:
        rank = client_rank(cfg, context)
        key = (run_key, cfg.nodes[rank].name)
        if key not in _CLIENTS:
            if threads:
                torch.set_num_threads(threads)
            base = base_dir() if callable(base_dir) else base_dir
            _CLIENTS[key] = LocalClient(cfg, rank, base_dir=base)
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
        r = int(msg.content[CONFIG][ROUND_KEY])
        check_alive(client.name, r)
        params = read_params(msg.content[ARRAYS], _reference(client))
        result = client.train_round(params, r)
        arrays = to_numpy(result.delta)
        metrics: dict[str, Any] = {
            **result.metrics,
            PERF_KEY: result.performance,
            COUNT_KEY: result.num_examples,
        }
        kind = plan.kind(client.name, r)
        if kind is not None:
            corrupt(kind, arrays, metrics)
        # The client's local model after every round it takes part in (the server's
        # checkpoint, on checkpoint.every, is what a resume continues from).
        client.save(run_dir, r, {"performance": result.performance})
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


def _reference(client: LocalClient) -> dict[str, torch.Tensor]:
    return {n: p for n, p in client.node.model.named_parameters() if p.requires_grad}


def make_server_app(strategy: FGRPOStrategy, *, rounds: int, timeout_s: float) -> ServerApp:
    """The ServerApp: Flower's round loop (`Strategy.start`) with the FGRPO strategy."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        initial = array_record(to_numpy(strategy.aggregator.params))
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds, timeout=timeout_s)

    return app
