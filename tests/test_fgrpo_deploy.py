"""FGRPO deployed with Flower (docs/fgrpo.md, "Deployed"): the Flower App in deploy/fgrpo is a
valid app whose default config is the embedded federation; the deployed apps name their client
from the SuperNode's node config and run a whole federation in process (the same ServerApp and
ClientApp, the in-process Grid); and one real deployment on this machine's loopback: a
`flower-superlink`, two `flower-supernode`s and `flwr run deploy/fgrpo` as subprocesses.

Skipped cleanly where flwr is not installed (the `federated` extra; `dev` pulls it in)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import ftis.algos.fgrpo  # noqa: F401  (telemetry off before anything imports flwr)

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from ftis.algos.federated.inprocess import InProcessGrid
from ftis.algos.fgrpo.deploy import (
    DeploySettings,
    deployed_client_app,
    deployed_server_app,
)
from ftis.config import ConfigError, load_config
from ftis.train.metrics import read_metrics
from tests.test_fgrpo import fgrpo_run_config

REPO = Path(__file__).resolve().parents[1]
APP_DIR = REPO / "deploy" / "fgrpo"
BIN = Path(sys.executable).parent  # flwr's commands, installed next to this interpreter
# The whole deployment: about 3 minutes at a load of 7 on 2 cores (every message to a client
# starts a process that imports torch); past this, the test fails and prints the logs.
RUN_TIMEOUT_S = 900
# Off in every process started here (they read it when they import flwr), and nothing installed
# at run time: no traffic may leave the machine.
QUIET_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}


def tiny_deployed_config(path: Path, *, steps: int = 1) -> Path:
    """Two llama-xs clients (a: addition; b: subtraction, 0/10 rewards), one local step per
    round, tiny evaluation; written as YAML to `path`."""
    data = fgrpo_run_config(steps=steps, local_steps=1)
    data["nodes"] = data["nodes"][:2]
    data["algorithm"]["clients"] = {
        k: v for k, v in data["algorithm"]["clients"].items() if k in ("a", "b")
    }
    data["eval"]["size"] = 8
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ---- the Flower App ------------------------------------------------------------------------


def test_the_flower_app_is_valid_and_ships_the_embedded_federation() -> None:
    from flwr.cli.config_utils import load_and_validate

    config, _ = load_and_validate(APP_DIR / "pyproject.toml", check_module=False)
    app = config["tool"]["flwr"]["app"]
    assert app["components"] == {
        "serverapp": "fgrpo_app:server_app",
        "clientapp": "fgrpo_app:client_app",
    }
    # No connection settings in the app: Flower 1.42 moves `[tool.flwr.federations]` to the
    # Flower configuration file and rewrites the pyproject.toml that had them.
    assert "federations" not in config["tool"]["flwr"]
    assert not config["project"]["dependencies"]  # nothing to install at run time
    shipped = load_config(APP_DIR / app["config"]["config"])
    assert shipped == load_config(REPO / "configs" / "fgrpo.yaml")


def test_settings_read_flowers_run_config(tmp_path: Path) -> None:
    s = DeploySettings.from_run_config({"config": "mine.yaml", "out": str(tmp_path)}, APP_DIR)
    assert s.config == APP_DIR / "mine.yaml" and s.out == tmp_path
    assert (s.resume, s.overwrite) == (False, False)
    s = DeploySettings.from_run_config({"config": "/abs/x.yaml", "resume": True})
    assert s.config == Path("/abs/x.yaml") and s.resume
    assert DeploySettings.from_run_config({"overwrite": "true"}).overwrite
    with pytest.raises(ConfigError, match="unknown FGRPO run config keys"):
        DeploySettings.from_run_config({"rounds": 3})


# ---- the deployed apps, in process ---------------------------------------------------------


def _query(name_config: dict, run_config: dict) -> Message:
    app = deployed_client_app()
    context = Context(
        run_id=7, node_id=1001, node_config=name_config, state=RecordDict(), run_config=run_config
    )
    msg = Message(
        RecordDict({"config": ConfigRecord({"query": "identify"})}),
        dst_node_id=1001,
        message_type=MessageType.QUERY,
    )
    msg.metadata.__dict__["_message_id"] = "m1"
    return app(msg, context)


def test_a_supernode_is_the_client_its_node_config_names(tmp_path: Path) -> None:
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 1001
    run_config = {"config": str(tiny_deployed_config(tmp_path / "c.yaml")), "out": str(tmp_path)}
    reply = _query({"client": "b"}, run_config)
    assert not reply.has_error() and reply.content["config"]["client"] == "b"
    with pytest.raises(RuntimeError, match="names client 'zz'"):
        _query({"client": "zz"}, run_config)
    with pytest.raises(RuntimeError, match="client='NAME'"):
        _query({}, run_config)


def test_deployed_apps_run_a_federation_in_process(tmp_path: Path) -> None:
    """The deployed ServerApp and ClientApp (the in-process Grid; each node's node config
    names its client, in reverse order of the run config): the standard run directory, a row
    per client and a `server` row per round, and a new run refuses a used directory."""
    cfg_path = tiny_deployed_config(tmp_path / "tiny.yaml")
    out = tmp_path / "run"
    run_config = {"config": str(cfg_path), "out": str(out)}
    grid = InProcessGrid(deployed_client_app(), 2)
    for node_id, name in zip(grid.contexts, ("b", "a")):
        grid.contexts[node_id].node_config = {"client": name}
        grid.contexts[node_id].run_config = run_config
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 0, 1
    context = Context(
        run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config=run_config
    )
    deployed_server_app()(grid, context)
    rows = {(r["node"], r["step"]): r for r in read_metrics(out / "metrics.jsonl")}
    assert set(rows) == {(n, s) for n in ("a", "b", "server") for s in (0, 1)}
    assert rows[("a", 1)]["fgrpo/accepted"] == 1 and rows[("b", 1)]["fgrpo/accepted"] == 1
    assert rows[("server", 1)]["server/accepted"] == 2
    for name in ("a", "b"):  # each client's gain is its own floored gain (docs/math.md §9.4)
        before, after = (
            rows[(name, 1)]["fgrpo/performance_before"],
            rows[(name, 1)]["fgrpo/performance"],
        )
        assert rows[("server", 1)][f"agg/gain/{name}"] == pytest.approx(
            (after - before) / max(abs(before), 0.1), abs=1e-12
        )
    assert load_config(out / "config.yaml").algorithm.kind == "fgrpo"
    assert (out / "report.md").is_file() and (out / "nodes" / "a" / "latest").is_file()
    with pytest.raises(ConfigError, match="already exists"):
        deployed_server_app()(grid, context)


# ---- a real deployment on loopback ---------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the SuperLink exited with code {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the SuperLink did not listen on 127.0.0.1:{port} in time")


def _stop(procs: list[subprocess.Popen]) -> None:
    """Stop the processes started here and every process they started (the SuperLink's and
    SuperNodes' SuperExecs, which leave their session, and their app processes): SIGTERM,
    then SIGKILL what is left after a grace period. Only these processes, by their ids."""
    import psutil

    family: list[psutil.Process] = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            parent = psutil.Process(proc.pid)
            family += [*parent.children(recursive=True), parent]
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(family, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.skipif(
    not all((BIN / c).exists() for c in ("flwr", "flower-superlink", "flower-supernode")),
    reason="flwr's commands are not installed next to this interpreter",
)
def test_deployed_on_loopback(tmp_path: Path) -> None:
    """`flower-superlink --insecure`, one `flower-supernode --insecure --node-config
    "client='NAME'"` per client and `flwr run deploy/fgrpo CONNECTION`, all bound to
    127.0.0.1 on free ports, as the README says. 2 clients, 1 round: the run directory has
    config.yaml, every client's rows and the `server` rows of rounds 0 and 1, the server's
    checkpoint, each client's local checkpoint and the report. The processes are always stopped;
    their logs are printed when the test fails."""
    home, logs = tmp_path / "flwr-home", tmp_path / "logs"
    home.mkdir()
    logs.mkdir()
    link_port, node_ports = _free_port(), {"a": _free_port(), "b": _free_port()}
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "ftis-test"\n\n[superlink.ftis-test]\n'
        f'address = "127.0.0.1:{link_port}"\ninsecure = true\n'
    )
    cfg_path = tiny_deployed_config(tmp_path / "tiny.yaml")
    out = tmp_path / "run"
    env = {
        **os.environ,
        **QUIET_ENV,
        "FLWR_HOME": str(home),  # the connection above, and where apps are installed
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }  # FTIS_CACHE: the session's (conftest), so the warm start is shared with other tests
    link_addr = f"127.0.0.1:{link_port}"
    commands = {
        "superlink": [
            "flower-superlink",
            "--insecure",
            "--host",
            "127.0.0.1",
            "--port",
            str(link_port),
            "--disable-runtime-dependency-installation",
        ],
        **{
            f"supernode-{name}": [
                "flower-supernode",
                "--insecure",
                "--superlink",
                link_addr,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--node-config",
                f"client='{name}'",
            ]
            for name, port in node_ports.items()
        },
    }
    procs: list[subprocess.Popen] = []
    run_out = logs / "flwr-run.log"
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    try:
        for name, cmd in commands.items():
            with open(logs / f"{name}.log", "wb") as f:
                procs.append(
                    subprocess.Popen(
                        [str(BIN / cmd[0]), *cmd[1:]],
                        env=env,
                        cwd=tmp_path,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                    )
                )
        _wait_for_port(link_port, procs[0], time.monotonic() + 180)
        timings["superlink up"] = time.monotonic() - t0
        run_config = f"config='{cfg_path}' out='{out}'"
        # --stream: flwr run returns when the run has finished (the SuperLink ends the stream).
        with open(run_out, "wb") as f:
            try:
                done = subprocess.run(
                    [str(BIN / "flwr"), "run", str(APP_DIR), "ftis-test"]
                    + ["--run-config", run_config, "--stream"],
                    env=env,
                    cwd=tmp_path,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=RUN_TIMEOUT_S,
                )
            except subprocess.TimeoutExpired:
                expired = sum(
                    p.read_text(errors="replace").count("task-token authentication failed")
                    for p in logs.glob("supernode-*.log")
                )
                raise AssertionError(
                    f"the deployed run did not finish in {RUN_TIMEOUT_S}s (load average "
                    f"{os.getloadavg()}); {expired} 'task-token authentication failed' lines in "
                    "the SuperNodes' logs: app processes that missed Flower's 30 s check-in "
                    "(each message starts one; a starved machine relaunches them)"
                ) from None
        timings["run finished"] = time.monotonic() - t0
        assert done.returncode == 0
        assert "Successfully started run" in run_out.read_text(errors="replace")
        rows = {(r["node"], r["step"]): r for r in read_metrics(out / "metrics.jsonl")}
        assert set(rows) == {(n, s) for n in ("a", "b", "server") for s in (0, 1)}
        server = rows[("server", 1)]
        for name in ("a", "b"):
            row = rows[(name, 1)]
            correct = row["eval/accuracy"] * row["eval/size"]  # greedy: k of eval/size right
            assert abs(correct - round(correct)) < 1e-9 and 0 <= round(correct) <= row["eval/size"]
            assert row["fgrpo/accepted"] == 1
            # the server's gain is the client's own floored gain (docs/math.md §9.4)
            before, after = row["fgrpo/performance_before"], row["fgrpo/performance"]
            assert server[f"agg/gain/{name}"] == pytest.approx(
                (after - before) / max(abs(before), 0.1), abs=1e-12
            )
            assert row["exchange/bytes_sent"] > 0
            assert (out / "nodes" / name / "latest").is_file()
        assert rows[("server", 1)]["server/accepted"] == 2
        assert (out / "nodes" / "server" / "step-000001" / "trainer_state.pt").is_file()
        assert (out / "config.yaml").is_file() and (out / "report.md").is_file()
    except BaseException:
        for log_file in sorted(logs.glob("*.log")):
            text = log_file.read_text(errors="replace")
            print(f"==== {log_file.name} (last 8000 characters) ====\n{text[-8000:]}")
        raise
    finally:
        _stop(procs)
        timings["stopped"] = time.monotonic() - t0
        print(f"deployment timings (s): { {k: round(v, 1) for k, v in timings.items()} }")
