"""FGRPO deployed with Flower: a SuperLink (the server's machine) and one SuperNode per data
owner, started with `flwr run deploy/fgrpo CONNECTION` (docs/fgrpo.md, "Deployed").

The apps are the ones `ftis run` simulates, not a second loop: the ServerApp prepares the run
directory and calls `run_federated` with the SuperLink's Grid in place of the simulation engine
(so `FGRPOStrategy` and Flower's `Strategy.start` run the rounds); the ClientApp is
`make_client_app`'s, its client named by the SuperNode.

Flower's run config (`[tool.flwr.app.config]` of the Flower App, `flwr run --run-config`):

    config      the ftis run config (YAML, `algorithm.kind: fgrpo`). A relative path is taken
                from the Flower App's directory, whose files reach every machine in the app
                bundle (FAB); an absolute path must hold the same file on every machine.
    out         the run directory (architecture.md §6). The server writes config.yaml,
                metrics.jsonl (every client's rows and the `server` rows), nodes/server/ and the
                report; a client writes its local checkpoints under nodes/<client>/. A relative
                path is taken from the working directory of the SuperLink (server) or the
                SuperNode (client).
    resume      continue the run in `out` from the server's newest checkpoint.
    overwrite   replace a non-empty `out` (a new run refuses one otherwise).

A SuperNode's node config (`flower-supernode --node-config "client='add'"`):

    client      the client (the run config's node name) this data owner is: its data, its
                reward scale, its rows; the server keys baselines by it.
    out         where this node writes its checkpoints (default: the run config's `out`).

`server_app` and `client_app` here take relative configs from the working directory;
`deploy/fgrpo/fgrpo_app.py` builds the same apps with its own directory instead.

Flower's telemetry and update check are read when flwr is imported, in each process Flower
starts: set FLWR_TELEMETRY_ENABLED=0 and FLWR_DISABLE_UPDATE_CHECK=1 in the environment of
`flower-superlink`, `flower-supernode` and `flwr` (their app processes inherit it); importing
ftis.algos.fgrpo also switches them off in an app process.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from ftis import rundir
from ftis.algos.federated.identity import identify_reply
from ftis.config import ConfigError, RunConfig, load_config

log = logging.getLogger(__name__)

DEFAULT_CONFIG = "fgrpo.yaml"  # in the Flower App's directory
DEFAULT_OUT = "runs/fgrpo-deployed"
OUT_NODE_KEY = "out"


@dataclass(frozen=True)
class DeploySettings:
    """What the deployed apps read from Flower's run config."""

    config: Path
    out: Path
    resume: bool = False
    overwrite: bool = False

    @classmethod
    def from_run_config(
        cls, run_config: dict[str, Any], app_dir: Path | None = None
    ) -> DeploySettings:
        known = {"config", "out", "resume", "overwrite"}
        unknown = sorted(set(run_config) - known)
        if unknown:
            raise ConfigError(
                f"unknown FGRPO run config keys {unknown}; the keys are {sorted(known)}"
            )
        config = Path(str(run_config.get("config") or DEFAULT_CONFIG)).expanduser()
        if not config.is_absolute():
            config = (app_dir or Path.cwd()) / config
        out = Path(str(run_config.get("out") or DEFAULT_OUT)).expanduser()
        return cls(
            config=config.resolve(),
            out=out.resolve(),
            resume=_flag(run_config, "resume"),
            overwrite=_flag(run_config, "overwrite"),
        )


def _flag(run_config: dict[str, Any], key: str) -> bool:
    value = run_config.get(key, False)
    if isinstance(value, str):  # --run-config "resume='true'"
        value = value.strip().lower()
        if value not in ("true", "false", "1", "0", ""):
            raise ConfigError(f"run config {key}={value!r} is not true or false")
        return value in ("true", "1")
    return bool(value)


def load_run_config(path: Path) -> RunConfig:
    """The ftis run config of a deployed run (FGRPO only), progress bars off: the server's
    output goes to Flower's log stream, not a terminal."""
    cfg = load_config(path)
    if cfg.algorithm.kind != "fgrpo":
        raise ConfigError(
            f"{path}: algorithm.kind is {cfg.algorithm.kind!r}; the deployed Flower app runs "
            "fgrpo configs only"
        )
    return cfg.model_copy(update={"log": cfg.log.model_copy(update={"progress": False})})


# ---- the server ----------------------------------------------------------------------------


def prepare_run_dir(cfg: RunConfig, settings: DeploySettings) -> None:
    """As `ftis run` does: a new run gets an empty directory (or --overwrite) and its
    config.yaml; a resumed one must have been written by the same config."""
    run_dir = settings.out
    written = run_dir / "config.yaml"
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    if settings.resume:
        if not written.is_file():
            raise ConfigError(f"resume: {run_dir} is not a run directory (no config.yaml)")
        if yaml.safe_load(written.read_text()) != yaml.safe_load(text):
            raise ConfigError(
                f"resume: {written} differs from {settings.config}; resume with the config "
                "that started the run"
            )
        return
    if run_dir.exists() and any(run_dir.iterdir()):
        if not settings.overwrite:
            raise ConfigError(
                f"run directory {run_dir} already exists and is not empty; set another `out`, "
                "overwrite=true to replace it, or resume=true to continue it"
            )
        try:
            rundir.clear(run_dir)  # only a directory ftis created
        except rundir.RunDirError as e:
            raise ConfigError(str(e)) from None
    rundir.mark(run_dir)
    written.write_text(text)


def _quiet_transformers() -> None:
    """No progress bars of transformers' (loading, saving) in Flower's log stream, as in
    `ftis run`'s output."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _log_to_flower() -> None:
    """ftis's log lines on stderr, which flwr-serverapp forwards to `flwr log` / `--stream`;
    left alone where logging is set up already (a test, an embedding program)."""
    _quiet_transformers()
    logger = logging.getLogger("ftis")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s ftis: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def deployed_server_app(app_dir: Path | None = None) -> ServerApp:
    """The ServerApp of a deployed FGRPO run: relative `config` paths from `app_dir` (None:
    the working directory)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        from ftis.algos.fgrpo.launch import run_federated
        from ftis.report import write_report

        _log_to_flower()
        settings = DeploySettings.from_run_config(dict(context.run_config), app_dir)
        cfg = load_run_config(settings.config)
        prepare_run_dir(cfg, settings)
        log.info("fgrpo (deployed): config %s, run directory %s", settings.config, settings.out)

        def on_grid(*, server_app: ServerApp, **_: Any) -> None:
            server_app(grid, context)  # the clients run on the SuperNodes

        try:
            run_federated(
                cfg,
                settings.out,
                resume=settings.resume,
                engine=on_grid,
                check_client_data=False,
            )
        except KeyboardInterrupt:  # a stop: the last completed round is checkpointed
            raise RuntimeError(
                f"stopped early; continue with --run-config \"resume=true out='{settings.out}'\""
            ) from None
        report = write_report(settings.out)
        log.info("fgrpo (deployed): done; report %s", report)

    return app


# ---- a client ------------------------------------------------------------------------------

# (run id, config, out) -> the ClientApp of that run in this process
_APPS: dict[tuple[int, str, str], ClientApp] = {}


def _client_app_for(context: Context, app_dir: Path | None) -> ClientApp:
    """`make_client_app`'s ClientApp for this node's run (built once per process)."""
    settings = DeploySettings.from_run_config(dict(context.run_config), app_dir)
    out = context.node_config.get(OUT_NODE_KEY) or settings.out
    out = Path(str(out)).expanduser().resolve()
    key = (context.run_id, str(settings.config), str(out))
    if key not in _APPS:
        from ftis.algos.fgrpo.apps import make_client_app  # model code: not for the query
        from ftis.algos.fgrpo.launch import base_model

        _quiet_transformers()
        cfg = load_run_config(settings.config)
        # The client is the node config's `client`. Its base model, the warm start cached in
        # this machine's FTIS_CACHE, is built with the client (the first training or evaluation
        # message of the process).
        _APPS[key] = make_client_app(cfg, out, base_dir=lambda: base_model(cfg))
    return _APPS[key]


def deployed_client_app(app_dir: Path | None = None) -> ClientApp:
    """The ClientApp of a deployed FGRPO run on a SuperNode: `make_client_app`'s, built from
    the run config (relative `config` paths from `app_dir`; None: the working directory).
    Flower starts a process per message, so the identify query, the first message, is answered
    without importing model code (`identity.identify_reply`, which `make_client_app` uses too)."""
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        settings = DeploySettings.from_run_config(dict(context.run_config), app_dir)
        return identify_reply(load_run_config(settings.config), msg, context)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return _client_app_for(context, app_dir)(msg, context)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return _client_app_for(context, app_dir)(msg, context)

    return app


server_app = deployed_server_app()
client_app = deployed_client_app()
