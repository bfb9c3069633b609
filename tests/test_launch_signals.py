"""`ftis run` stopped by a signal to its own process only (`kill`, `docker stop`, a job
scheduler): every node checkpoints and exits, and no node process outlives the launcher. Left
alone, orphaned nodes would lose the store and train on, each by itself, to the last step."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ftis.cli import app
from tests.conftest import tiny_run_config

FTIS = str(Path(sys.executable).with_name("ftis"))
NODES = ("a", "b")
STEPS = 1000  # far more than the nodes run in these tests: a node that goes on is still running


def _config(tmp_path: Path, steps: int = STEPS, **exchange) -> Path:
    data = tiny_run_config(steps=steps)
    data["exchange"] = exchange
    data["nodes"] = [
        {"name": n, "model": {"preset": "llama-xs"}, "warm_start": None} for n in NODES
    ]
    data["eval"]["every"] = 0
    # random-init nodes get no training signal: without this they would stop by themselves
    # after 20 signal-less steps, which on a slow machine can come before the test's signal
    data["train"]["max_steps_without_signal"] = 0
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _alive(pid: int) -> bool:
    """Running (not a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "--ppid", str(pid), "-o", "pid="], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _checkpoint_step(out: Path, node: str) -> int:
    return int((out / "nodes" / node / "latest").read_text().strip().removeprefix("step-"))


def _wait_for_rl_steps(parent: subprocess.Popen, out: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for n in NODES:
            try:
                states.append(json.loads((out / ".status" / f"{n}.json").read_text()))
            except (OSError, json.JSONDecodeError):
                states.append({})
        if all(s.get("event") == "step" and s.get("step", 0) >= 1 for s in states):
            return
        assert parent.poll() is None, parent.communicate()[0]
        time.sleep(0.1)
    pytest.fail("the nodes did not reach an RL step in time")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_alone_checkpoints_every_node(tmp_path, sig):
    out = tmp_path / "run"
    parent = subprocess.Popen(
        [FTIS, "run", str(_config(tmp_path)), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    workers: list[int] = []
    try:
        _wait_for_rl_steps(parent, out)
        workers = _children(parent.pid)
        assert len(workers) == len(NODES)
        os.kill(parent.pid, sig)  # the launcher only, not its process group
        output, _ = parent.communicate(timeout=60)
        assert parent.returncode == 130, output
        assert "interrupted; the nodes wrote checkpoints" in output
        assert not [p for p in workers if _alive(p)]
        for n in NODES:
            assert 1 <= _checkpoint_step(out, n) < STEPS, n
    finally:
        for pid in [parent.pid, *workers]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        parent.wait()


@pytest.mark.chaos_case("F-TIS", "SIGKILL the launcher")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_nodes_stop_when_the_launcher_is_killed(tmp_path):
    """SIGKILL cannot be forwarded: the nodes learn of it from the kernel (SIGTERM) and exit.
    (on_store_lost=continue: that the nodes stop is not their own doing, on losing the store.)"""
    out = tmp_path / "run"
    parent = subprocess.Popen(
        [FTIS, "run", str(_config(tmp_path, on_store_lost="continue")), "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    workers: list[int] = []
    try:
        _wait_for_rl_steps(parent, out)
        workers = _children(parent.pid)
        assert len(workers) == len(NODES)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in workers if _alive(p)]
        for n in NODES:
            assert 1 <= _checkpoint_step(out, n) < STEPS, n
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("where", ["file", "proc"])
def test_an_unwritable_run_directory_is_a_clean_error(tmp_path, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "run" if where == "file" else Path("/proc/ftis-run")
    res = CliRunner().invoke(app, ["run", str(_config(tmp_path, steps=1)), "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert f"cannot write the run directory {out}" in res.output
    assert "choose another --out" in res.output and "Traceback" not in res.output
