"""`run_federated`: an FGRPO run through Flower's simulation engine (Ray) on this machine, by the
shared federated launcher (`ftis.algos.federated.launch.run_flower`: warm start, the server's
model in nodes/server/, resume, rows, the simulation) with FGRPO's server state (`Aggregator`),
strategy (`FGRPOStrategy`) and client (`LocalClient`).

`ftis run` reaches this through the algorithm registry (`launcher=`), not ftis's own launcher.
A deployed run (`ftis.algos.fgrpo.deploy`) calls it too, with the SuperLink's Grid as engine.
Ctrl-C / SIGTERM: the round in flight finishes, the server checkpoints it, the remaining rounds
are skipped and KeyboardInterrupt is raised (the CLI then says how to resume).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rich.console import Console

from ftis.algos.federated.faults import FaultPlan
from ftis.algos.federated.launch import (  # noqa: F401  (base_model, not_a_node: re-exported)
    Engine,
    base_model,
    not_a_node,
    run_flower,
)
from ftis.algos.fgrpo.config import FGRPOConfig
from ftis.config import ConfigError, RunConfig
from ftis.launch.multi import MultiResult

log = logging.getLogger(__name__)


def check_clients(cfg: RunConfig) -> None:
    """Build every client's task here, before Ray starts: a client whose data cannot serve a
    round (too small a train split for its held-out batch and a step's prompts) is a config
    error now rather than a dropout in every round."""
    from ftis.tasks import build_task

    algo: FGRPOConfig = cfg.algorithm  # type: ignore[assignment]
    for node in cfg.nodes:
        task = build_task(algo.client_task(cfg, node.name))
        size = len(task.split("train"))
        prompts = algo.client_spec(node.name).prompts_per_step or cfg.train.prompts_per_step
        if size - algo.performance_size < prompts:
            raise ConfigError(
                f"client {node.name}: its train split has {size} problems, too few for "
                f"algorithm.performance_size={algo.performance_size} held out plus {prompts} "
                "prompts per local step; lower performance_size or prompts_per_step"
            )


def run_federated(
    cfg: RunConfig,
    run_dir: Path,
    *,
    console: Console | None = None,
    resume: bool = False,
    faults: FaultPlan | None = None,
    engine: Engine | None = None,
    check_client_data: bool = True,
) -> MultiResult:
    """Run FGRPO config `cfg` to the end under Flower's simulation engine, writing the run
    directory `run_dir`. resume: continue from the server's newest checkpoint.

    Seams (never set by `ftis run`): faults injects faulty clients (tests,
    `ftis.algos.federated.faults`); engine replaces Flower's simulation engine (Ray) by another
    with its signature, e.g. `ftis.algos.federated.inprocess.run_in_process` (tests) or a
    deployed Grid (`ftis.algos.fgrpo.deploy`); check_client_data=False skips building every
    client's data here first (deployed, the clients' data lives on their machines)."""
    from ftis.algos.fgrpo.aggregator import Aggregator
    from ftis.algos.fgrpo.apps import build_client
    from ftis.algos.fgrpo.strategy import FGRPOStrategy

    algo: FGRPOConfig = cfg.algorithm  # type: ignore[assignment]
    run_dir = Path(run_dir)
    if check_client_data:
        check_clients(cfg)

    def make_strategy(aggregator: Aggregator, **kwargs: Any) -> FGRPOStrategy:
        return FGRPOStrategy(cfg=cfg, aggregator=aggregator, **kwargs)

    return run_flower(
        cfg,
        run_dir,
        label="fgrpo",
        new_state=lambda params: Aggregator(params, algo),
        make_strategy=make_strategy,
        build_client=build_client,
        faults=faults,
        console=console,
        resume=resume,
        engine=engine,
    )
