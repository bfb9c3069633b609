"""A federated run through Flower's simulation engine (Ray) on this machine, whichever the
algorithm (`run_flower`), and the pieces any server-side run shares (`server_setup`).

    base model   the shared warm start, once, here (cached); clients read it from disk
    server       the global model (nodes/server/), resumed from its newest checkpoint
    simulation   flwr.simulation.run_simulation(ServerApp, ClientApp, one node per client),
                 Ray limited to `algorithm.simulation.num_cpus` CPUs, `client_cpus` per client
    rows         metrics.jsonl: one row per client per round, one `server` row per round

`ftis run` reaches this through the algorithm registry (`launcher=`), not ftis's own launcher:
`ftis.algos.fgrpo.launch.run_federated` and `ftis.algos.dpo.fed.run_fed_dpo` call it. Ctrl-C /
SIGTERM: the round in flight finishes, the server checkpoints it, the remaining rounds are
skipped, Ray is shut down and every process it left is ended, and KeyboardInterrupt is raised
(the CLI then says how to resume): the stop protocol of ftis.launch.stop. A client worker whose
process dies is restarted for the next round (ftis.algos.federated.workers).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from ftis.algos.federated.config import SERVER_NAME
from ftis.algos.federated.faults import FaultPlan
from ftis.config import RunConfig
from ftis.launch.multi import MultiResult
from ftis.launch.progress import progress_columns
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
    """The registry's per-node factory: federated clients run inside Flower, not ftis's node
    shell."""
    raise RuntimeError(
        f"algorithm {ctx.cfg.algorithm.kind} runs through Flower's simulation engine: start it "
        "with `ftis run` or ftis.launch.run_local (which call its registered launcher), not "
        "train_node"
    )


def base_model(cfg: RunConfig, progress: Any = None) -> Path | None:
    """The shared base model's directory (the warm start, trained once and cached), or None
    when the clients' model needs no warm start."""
    node = cfg.nodes[0]
    if node.warm_start is None:
        return None
    from ftis.warmstart import warm_start

    return warm_start(node.model, node.warm_start, cfg.task, progress=progress)


def server_node(cfg: RunConfig, base_dir: Path | None) -> Node:
    """The global model: the clients' model config (on the CPU), named "server"."""
    node_cfg = cfg.nodes[0]
    from ftis.warmstart import starting_model

    model = node_cfg.model.model_copy(update={"device": "cpu"})
    model = starting_model(model, None, cfg.task, base_dir=base_dir)
    node_cfg = node_cfg.model_copy(update={"name": SERVER_NAME, "model": model, "warm_start": None})
    return build_node(node_cfg, rank=len(cfg.nodes), task_cfg=cfg.task)


def server_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "nodes" / SERVER_NAME


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """One torch thread here (warm start, server): the clients' Ray workers hold the cores, and
    tiny models gain little from a second thread while spinning threads on a busy machine cost
    up to 10x (measured)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class ServerSetup:
    """What `server_setup` prepared: the shared base model (`base_dir`, None without warm
    start), the server's Node (`server`, its weights and optimizer restored on resume), the
    first round to run, the algorithm state of the resumed checkpoint ({} for a fresh run),
    one MetricLogger per client and one for the server."""

    cfg: RunConfig
    run_dir: Path
    label: str
    bar: Progress
    base_dir: Path | None
    server: Node
    first_round: int
    state: dict[str, Any]
    loggers: dict[str, MetricLogger]
    rounds_task: Any
    info_key: str = "eval/accuracy"

    def save(self, round_: int, params: Mapping[str, Any] | None, state: dict[str, Any]) -> None:
        """Checkpoint the server (nodes/server/): `params` (the global trainable parameters;
        None: the server model as it is) as its model, `state` as the algorithm's state."""
        from ftis.algos.federated.params import load_params

        if params is not None:
            load_params(self.server.model, params)
        save_checkpoint(
            self.server,
            server_dir(self.run_dir),
            round_,
            keep=self.cfg.checkpoint.keep,
            algorithm_state=state,
        )

    def progress(self, round_: int, total: int, row: dict[str, float]) -> None:
        value = row.get(self.info_key)
        info = (
            f"union {self.info_key.split('/')[-1]} {100 * value:.1f}%" if value is not None else ""
        )
        self.bar.update(self.rounds_task, completed=round_, info=info)


@contextlib.contextmanager
def server_setup(
    cfg: RunConfig,
    run_dir: Path,
    *,
    label: str,
    console: Console | None = None,
    resume: bool = False,
    info_key: str = "eval/accuracy",
) -> Iterator[ServerSetup]:
    """Progress bar, shared warm start, the server's Node, resume (the newest server
    checkpoint; every row after it is dropped), row loggers (closed on exit)."""
    import torch

    names = [n.name for n in cfg.nodes]
    columns = progress_columns()
    with Progress(*columns, console=console, disable=not cfg.log.progress) as bar:
        warm = None

        def warm_progress(step: int, total: int, loss: float) -> None:
            nonlocal warm
            if warm is None:
                warm = bar.add_task("base model warm start", total=total, info="")
            bar.update(warm, completed=step, info=f"loss {loss:.3f}")

        base_dir = base_model(cfg, warm_progress)
        # Seeded here, after the warm start (which seeds torch itself only on a cache miss):
        # LoRA adapters of the initial global model are the same whether the cache was warm.
        torch.manual_seed(node_seed(cfg.train.seed, len(names)))
        server = server_node(cfg, base_dir)
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
            log.info("%s: resumed the server from %s (round %d)", label, found[0], done)
        rounds_task = bar.add_task(
            f"{label} rounds", total=cfg.train.steps, completed=first_round - 1, info=""
        )
        loggers = {n: MetricLogger.for_run(cfg, run_dir, n) for n in [*names, SERVER_NAME]}
        try:
            yield ServerSetup(
                cfg=cfg,
                run_dir=run_dir,
                label=label,
                bar=bar,
                base_dir=base_dir,
                server=server,
                first_round=first_round,
                state=state,
                loggers=loggers,
                rounds_task=rounds_task,
                info_key=info_key,
            )
        finally:
            for lg in loggers.values():
                lg.close()


# new_state(initial global trainable parameters) -> the server state (with load_state_dict)
NewState = Callable[[dict[str, Any]], Any]
# make_strategy(server state, loggers=, checkpoint=, first_round=, resumed=, progress=,
#               should_stop=) -> a FederatedStrategy
MakeStrategy = Callable[..., Any]


def run_flower(
    cfg: RunConfig,
    run_dir: Path,
    *,
    label: str,
    new_state: NewState,
    make_strategy: MakeStrategy,
    build_client: Callable[..., Any],
    faults: FaultPlan | None = None,
    console: Console | None = None,
    resume: bool = False,
    engine: Engine | None = None,
    info_key: str = "eval/accuracy",
) -> MultiResult:
    """Run federated config `cfg` to the end under Flower's simulation engine (or `engine`, with
    its signature: the in-process engine of tests, a deployed Grid), writing `run_dir`.
    resume: continue from the server's newest checkpoint. The server state is `new_state`'s,
    given the resumed algorithm state (`load_state_dict`); the clients are `build_client`'s
    (`ftis.algos.federated.apps.BuildClient`), with `faults` injected (tests)."""
    from ftis.algos.federated.apps import make_client_app, make_server_app
    from ftis.algos.federated.params import trainable_params
    from ftis.train.loop import StopFlag

    names = [n.name for n in cfg.nodes]
    t0 = time.perf_counter()
    from ftis.launch.stop import interrupt_on_sigterm

    with (
        interrupt_on_sigterm(),  # until the simulation's own handler: SIGTERM acts as Ctrl-C
        one_torch_thread(),
        server_setup(
            cfg, run_dir, label=label, console=console, resume=resume, info_key=info_key
        ) as setup,
    ):
        state = new_state(trainable_params(setup.server.model))
        state.load_state_dict(setup.state)

        def checkpoint(round_: int, algorithm_state: dict[str, Any]) -> None:
            setup.save(round_, state.params, algorithm_state)

        stop = StopFlag()
        strategy = make_strategy(
            state,
            loggers=setup.loggers,
            checkpoint=checkpoint,
            first_round=setup.first_round,
            resumed=resume,
            progress=setup.progress,
            should_stop=stop,
        )
        sim = cfg.algorithm.simulation  # type: ignore[attr-defined]
        t_sim = time.perf_counter()
        remaining = cfg.train.steps - setup.first_round + 1
        if remaining > 0 or not resume:
            simulate(
                cfg,
                server_app=make_server_app(
                    strategy, rounds=remaining, timeout_s=sim.round_timeout_s
                ),
                client_app=make_client_app(
                    cfg,
                    run_dir,
                    build_client=build_client,
                    base_dir=setup.base_dir,
                    faults=faults,
                    threads=max(1, int(sim.client_cpus)) if engine is None else 0,
                ),
                stop=stop,
                engine=engine,
            )
    log.info(
        "%s: rounds %d-%d in %.1fs (%.1fs with set-up)",
        label,
        setup.first_round,
        strategy.last_round,
        time.perf_counter() - t_sim,
        time.perf_counter() - t0,
    )
    if strategy.last_round < cfg.train.steps:
        raise KeyboardInterrupt  # stopped early, after the server's checkpoint
    return MultiResult(exit_codes={n: 0 for n in [*names, SERVER_NAME]})


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


def simulate(
    cfg: RunConfig, *, server_app: Any, client_app: Any, stop: Any, engine: Engine | None
) -> None:
    """Flower's simulation engine (or `engine`) with Ray kept small and quiet, under the stop
    protocol (ftis.launch.stop): Ray is started here, before Flower would, so that SIGTERM is
    handled by `stop` (as SIGINT is) and not by the handler ray.init installs (sys.exit in the
    middle of a round: no checkpoint, an abort); on the way out Ray is shut down and every
    process it left (its raylet, GCS and client workers, orphaned or not) is ended."""
    sim = cfg.algorithm.simulation  # type: ignore[attr-defined]
    config = backend_config(cfg)
    apps = dict(  # what either engine is given
        server_app=server_app,
        client_app=client_app,
        num_supernodes=len(cfg.nodes),
        backend_config=config,
        verbose_logging=sim.verbose,
    )
    if engine is not None:
        with _quiet(sim.verbose), stop.installed():
            engine(**apps)
        return
    from flwr.simulation import run_simulation

    from ftis.algos.federated.workers import restarting_workers
    from ftis.launch.stop import reaping_orphans

    watch = RayWatch(stop)
    with _quiet(sim.verbose), reaping_orphans(what="Ray"), restarting_workers():
        try:
            _start_ray(config["init_args"])
            watch.start()
            with stop.installed():
                run_simulation(**apps)
        finally:
            watch.halt()
            import ray

            if ray.is_initialized():
                ray.shutdown()
    if watch.died:
        from ftis.launch.multi import BackendLost

        raise BackendLost(
            f"{watch.died} in the middle of the run: Flower's simulation lost every client "
            "worker, so the server checkpointed its last round and stopped"
        )


class RayWatch(threading.Thread):
    """Watches the Ray processes this run started (its raylet and GCS): when one fails (exits
    with a non-zero code or on a signal), the clients' rounds can only fail from then on, so it
    asks the run to stop (`stop.requested`: the server checkpoints its last round and skips the
    rest) and records why (`died`)."""

    def __init__(self, stop: Any, poll_s: float = 0.5) -> None:
        super().__init__(name="ftis-ray-watch", daemon=True)
        self.stop, self.poll_s = stop, poll_s
        self.died: str | None = None
        self._halt = threading.Event()

    @staticmethod
    def _processes() -> list[tuple[str, Any]]:
        import ray._private.worker as worker

        node = getattr(worker, "_global_node", None)
        found = []
        for kind, infos in (getattr(node, "all_processes", None) or {}).items():
            if kind in ("raylet", "gcs_server"):
                found += [(kind, i.process) for i in infos if getattr(i, "process", None)]
        return found

    def run(self) -> None:
        procs = self._processes()
        while not self._halt.wait(self.poll_s):
            for kind, proc in procs:
                # exit code 0: Ray shutting down as asked (Flower's engine does at its end)
                if proc.poll() not in (None, 0):
                    self.died = f"Ray's {kind} (pid {proc.pid}) exited with code {proc.returncode}"
                    log.error("%s: stopping the run after its current round", self.died)
                    self.stop.requested = True
                    return

    def halt(self) -> None:
        self._halt.set()


def backend_config(cfg: RunConfig) -> dict[str, Any]:
    """Flower's Ray backend config: `client_cpus`/`client_gpus` per client worker (a Ray actor,
    restarted by Ray when its process dies: ftis.algos.federated.workers), Ray itself limited to
    `num_cpus`, no dashboard, logs at ERROR unless verbose."""
    from ftis.algos.federated.workers import MAX_WORKER_RESTARTS

    sim = cfg.algorithm.simulation  # type: ignore[attr-defined]
    config: dict[str, Any] = {
        "client_resources": {
            "num_cpus": sim.client_cpus,
            "num_gpus": sim.client_gpus,
            # passed on to the actor's options(): Ray restarts a worker whose process died
            "max_restarts": MAX_WORKER_RESTARTS,
        },
        "init_args": {
            "num_cpus": sim.num_cpus,
            "include_dashboard": False,
            "logging_level": logging.INFO if sim.verbose else logging.ERROR,
            "log_to_driver": sim.verbose,
        },
    }
    if sim.client_gpus == 0:  # else Ray finds the GPUs itself
        config["init_args"]["num_gpus"] = 0
    return config


def _start_ray(init_args: dict[str, Any]) -> None:
    """ray.init as Flower's Ray backend calls it (which then finds Ray running and leaves it):
    the workers import this process's modules through PYTHONPATH; Ray's services require the
    token `ftis.algos.federated` set at import. The SIGTERM handler that ray.init installs (sys.exit) is
    replaced by the one that was there before."""
    import os
    import signal
    import sys
    import threading

    import ray

    if ray.is_initialized():
        return
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, **init_args)
    if main and previous is not None:
        signal.signal(signal.SIGTERM, previous)
