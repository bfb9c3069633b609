"""`run_federated`: an FGRPO run through Flower's simulation engine (Ray) on this machine.

    base model   the shared warm start, once, here (cached); clients read it from disk
    server       the global model (nodes/server/), resumed from its newest checkpoint
    simulation   flwr.simulation.run_simulation(ServerApp, ClientApp, one node per client),
                 Ray limited to `algorithm.simulation.num_cpus` CPUs, `client_cpus` per client
    rows         metrics.jsonl: one row per client per round, one `server` row per round

`ftis run` reaches this through the algorithm registry (`launcher=`), not ftis's own launcher.
A deployed run (`ftis.algos.fgrpo.deploy`) calls it too, with the SuperLink's Grid as engine.
Ctrl-C / SIGTERM: the round in flight finishes, the server checkpoints it, the remaining rounds
are skipped and KeyboardInterrupt is raised (the CLI then says how to resume).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ftis.algos.fgrpo.config import SERVER_NAME, FGRPOConfig
from ftis.algos.fgrpo.faults import FaultPlan
from ftis.config import ConfigError, RunConfig
from ftis.launch.multi import MultiResult
from ftis.train.checkpoint import CheckpointError, load_latest_checkpoint, save_checkpoint
from ftis.train.metrics import MetricLogger, truncate_rows
from ftis.train.node import Node, build_node
from ftis.train.seeds import node_seed

log = logging.getLogger(__name__)

# engine(server_app=, client_app=, num_supernodes=, backend_config=, verbose_logging=):
# flwr.simulation.run_simulation's signature.
Engine = Callable[..., None]
NOISY_LOGGERS = ("flwr", "ray")


def not_a_node(ctx: Any) -> Any:
    """The registry's per-node factory: FGRPO clients run inside Flower, not ftis's node shell."""
    raise RuntimeError(
        "algorithm fgrpo runs through Flower's simulation engine: start it with `ftis run` or "
        "ftis.launch.run_local (which call ftis.algos.fgrpo.launch.run_federated), not train_node"
    )


def base_model(cfg: RunConfig, progress: Any = None) -> Path | None:
    """The shared base model's directory (the warm start, trained once and cached), or None
    when the clients' model needs no warm start."""
    node = cfg.nodes[0]
    if node.warm_start is None:
        return None
    from ftis.warmstart import warm_start

    return warm_start(node.model, node.warm_start, cfg.task, progress=progress)


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


def _server_node(cfg: RunConfig, base_dir: Path | None) -> Node:
    """The global model: the clients' model config (on the CPU), named "server"."""
    node_cfg = cfg.nodes[0]
    model = node_cfg.model.model_copy(update={"device": "cpu"})
    if base_dir is not None:
        model = model.model_copy(update={"path": str(base_dir), "preset": None})
    node_cfg = node_cfg.model_copy(update={"name": SERVER_NAME, "model": model, "warm_start": None})
    return build_node(node_cfg, rank=len(cfg.nodes), task_cfg=cfg.task)


@contextlib.contextmanager
def _quiet(verbose: bool) -> Iterator[None]:
    """Flower logs every round at INFO and every client failure with a traceback; the server
    logs what matters (dropped and rejected clients) through ftis's logger instead."""
    if verbose:
        yield
        return
    saved = {name: logging.getLogger(name).level for name in NOISY_LOGGERS}
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


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
    `ftis.algos.fgrpo.faults`); engine replaces Flower's simulation engine (Ray) by another
    with its signature, e.g. `ftis.algos.fgrpo.inprocess.run_in_process` (tests) or a deployed
    Grid (`ftis.algos.fgrpo.deploy`); check_client_data=False skips building every client's
    data here first (deployed, the clients' data lives on their machines)."""
    import torch

    run_dir = Path(run_dir)
    # One torch thread here (warm start, server): the clients' Ray workers hold the cores, and
    # tiny models gain little from a second thread while spinning threads on a busy machine
    # cost up to 10x (measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(
            cfg,
            run_dir,
            console=console,
            resume=resume,
            faults=faults,
            engine=engine,
            check_client_data=check_client_data,
        )
    finally:
        torch.set_num_threads(threads)


def _run(
    cfg: RunConfig,
    run_dir: Path,
    *,
    console: Console | None,
    resume: bool,
    faults: FaultPlan | None,
    engine: Engine | None,
    check_client_data: bool = True,
) -> MultiResult:
    import torch

    from ftis.algos.fgrpo.aggregator import Aggregator
    from ftis.algos.fgrpo.apps import make_client_app, make_server_app
    from ftis.algos.fgrpo.client import load_params, trainable_params
    from ftis.algos.fgrpo.strategy import FGRPOStrategy, server_dir
    from ftis.train.loop import StopFlag

    algo: FGRPOConfig = cfg.algorithm  # type: ignore[assignment]
    names = [n.name for n in cfg.nodes]
    t0 = time.perf_counter()
    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
    ]
    with Progress(*columns, console=console, disable=not cfg.log.progress) as bar:
        warm = None

        def warm_progress(step: int, total: int, loss: float) -> None:
            nonlocal warm
            if warm is None:
                warm = bar.add_task("base model warm start", total=total, info="")
            bar.update(warm, completed=step, info=f"loss {loss:.3f}")

        if check_client_data:
            check_clients(cfg)
        base_dir = base_model(cfg, warm_progress)
        # Seeded here, after the warm start (which seeds torch itself only on a cache miss):
        # LoRA adapters of the initial global model are the same whether the cache was warm.
        torch.manual_seed(node_seed(cfg.train.seed, len(names)))
        server = _server_node(cfg, base_dir)
        first_round = 1
        state: dict[str, Any] = {}
        if resume:
            found = load_latest_checkpoint(server, server_dir(run_dir))
            if found is None:
                raise CheckpointError(
                    f"{server_dir(run_dir)} has no checkpoint to resume from: start the run "
                    "again with --overwrite, or set checkpoint.every to save more often"
                )
            done = int(found[1]["step"])
            state = found[1].get("algorithm", {})
            first_round = done + 1
            for name in [*names, SERVER_NAME]:
                truncate_rows(run_dir / "metrics.jsonl", name, after_step=done)
            log.info("fgrpo: resumed the server from %s (round %d)", found[0], done)
        aggregator = Aggregator(trainable_params(server.model), algo)
        aggregator.load_state_dict(state)

        def checkpoint(round_: int, algorithm_state: dict[str, Any]) -> None:
            load_params(server.model, aggregator.params)
            save_checkpoint(
                server,
                server_dir(run_dir),
                round_,
                keep=cfg.checkpoint.keep,
                algorithm_state=algorithm_state,
            )

        rounds_task = bar.add_task(
            "fgrpo rounds", total=cfg.train.steps, completed=first_round - 1, info=""
        )

        def progress(round_: int, total: int, row: dict[str, float]) -> None:
            acc = row.get("eval/accuracy")
            info = f"union acc {100 * acc:.1f}%" if acc is not None else ""
            bar.update(rounds_task, completed=round_, info=info)

        loggers = {
            n: MetricLogger(run_dir, n, tensorboard=cfg.log.tensorboard)
            for n in [*names, SERVER_NAME]
        }
        stop = StopFlag()
        strategy = FGRPOStrategy(
            cfg=cfg,
            aggregator=aggregator,
            loggers=loggers,
            checkpoint=checkpoint,
            first_round=first_round,
            resumed=resume,
            progress=progress,
            should_stop=stop,
        )
        sim = algo.simulation
        t_sim = time.perf_counter()
        remaining = cfg.train.steps - first_round + 1
        try:
            if remaining > 0 or not resume:
                _simulate(
                    cfg,
                    server_app=make_server_app(
                        strategy, rounds=remaining, timeout_s=sim.round_timeout_s
                    ),
                    client_app=make_client_app(
                        cfg,
                        run_dir,
                        base_dir=base_dir,
                        faults=faults,
                        threads=max(1, int(sim.client_cpus)) if engine is None else 0,
                    ),
                    stop=stop,
                    engine=engine,
                )
        finally:
            for lg in loggers.values():
                lg.close()
    log.info(
        "fgrpo: rounds %d-%d in %.1fs (%.1fs with set-up)",
        first_round,
        strategy.last_round,
        time.perf_counter() - t_sim,
        time.perf_counter() - t0,
    )
    if strategy.last_round < cfg.train.steps:
        raise KeyboardInterrupt  # stopped early, after the server's checkpoint
    return MultiResult(exit_codes={n: 0 for n in [*names, SERVER_NAME]})


def _simulate(
    cfg: RunConfig, *, server_app: Any, client_app: Any, stop: Any, engine: Engine | None
) -> None:
    """Flower's simulation engine (or `engine`) with Ray kept small and quiet."""
    if engine is None:
        from flwr.simulation import run_simulation as engine

    sim = cfg.algorithm.simulation  # type: ignore[attr-defined]
    backend_config = {
        "client_resources": {"num_cpus": sim.client_cpus, "num_gpus": sim.client_gpus},
        "init_args": {
            "num_cpus": sim.num_cpus,
            "include_dashboard": False,
            "logging_level": logging.INFO if sim.verbose else logging.ERROR,
            "log_to_driver": sim.verbose,
        },
    }
    if sim.client_gpus == 0:  # else Ray finds the GPUs itself
        backend_config["init_args"]["num_gpus"] = 0
    with _quiet(sim.verbose), stop.installed():
        engine(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=len(cfg.nodes),
            backend_config=backend_config,
            verbose_logging=sim.verbose,
        )
