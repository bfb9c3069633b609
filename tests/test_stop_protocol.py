"""The stop protocol in every mode (ftis.launch.stop, docs/RELIABILITY.md "Stopping a run"):
`ftis run` stopped by SIGTERM or SIGINT to its own process only (`kill`, `docker stop`, a job
scheduler) checkpoints every participant's last completed step, leaves no process of the run
behind, exits 130 with the resume command, and `ftis run --resume` then finishes the run with
every row once. F-TIS's own launcher (also gossip, RandOpt, CoRP) is covered by
tests/test_launch_signals.py; this file covers the launchers of their own: Flower's simulation
(FGRPO, FedDPO) and the swarm (simulator, hivemind).

The FGRPO case runs in the default suite; the others are marked chaos
(`python -m pytest -m chaos tests/test_stop_protocol.py`; all modes' cases:
`python scripts/chaos_report.py`)."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ftis.launch.stop import alive, descendants
from tests.conftest import tiny_run_config

FTIS = str(Path(sys.executable).with_name("ftis"))


def _rows(out: Path) -> list[dict]:
    try:
        text = (out / "metrics.jsonl").read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return rows


def _steps(out: Path, node: str) -> list[int]:
    return [r["step"] for r in _rows(out) if r.get("node") == node]


def _checkpoint_step(out: Path, node: str) -> int:
    return int((out / "nodes" / node / "latest").read_text().strip().removeprefix("step-"))


def _mentions(out: Path) -> list[int]:
    """Live processes whose command line names the run directory."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(out) in cmd and alive(int(entry)):
                found.append(int(entry))
    return found


def stop_and_resume(
    tmp_path: Path, data: dict, sig: int, *, ready, children: bool = True, timeout_s: float = 600
) -> tuple[Path, str]:
    """Start `ftis run`, wait until ready(out) holds, send `sig` to the launcher alone, and
    check the protocol: exit 130 with the resume command, no process of the run left within a
    few seconds. Returns the run directory and the launcher's output; the caller checks the
    checkpoints, then calls `resume`."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    parent = subprocess.Popen(
        [FTIS, "run", str(config), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    kids: set[int] = set()
    try:
        deadline = time.monotonic() + timeout_s
        while not ready(out):
            if parent.poll() is not None:
                pytest.fail(f"the run ended before the signal:\n{parent.communicate()[0][-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail("the run did not get far enough in time")
            kids |= descendants(parent.pid)
            time.sleep(0.1)
        kids |= descendants(parent.pid)
        assert bool(kids) == children, kids  # the simulator runs its peers in process
        os.kill(parent.pid, sig)  # the launcher only, not its process group
        output, _ = parent.communicate(timeout=300)
        assert parent.returncode == 130, output[-3000:]
        assert f"ftis run --resume {out}" in output.replace("\n", ""), output[-3000:]
        deadline = time.monotonic() + 10  # every process of the run is gone within seconds
        while (left := [p for p in kids if alive(p)] + _mentions(out)) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
        assert not left, f"processes of the run outlived it: {left}"
    finally:
        for pid in [parent.pid, *kids]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        parent.wait()
    return out, output


def resume(out: Path, *overrides: str) -> str:
    sets = [a for o in overrides for a in ("--set", o)]
    res = subprocess.run(
        [FTIS, "run", "--resume", str(out), *sets], capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert not _mentions(out)
    return res.stdout


# ---- the shared pieces ------------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the child subreaper is Linux's")
def test_orphans_started_inside_are_adopted_and_ended(tmp_path):
    """A child that leaves a grandchild behind and exits (as a raylet does its workers): the
    grandchild is adopted by this process inside `reaping_orphans` and ended on the way out;
    a process started before is left alone."""
    from ftis.launch.stop import reaping_orphans

    before = subprocess.Popen(["sleep", "60"])
    try:
        pidfile = tmp_path / "orphan.pid"
        with reaping_orphans(grace_s=2.0):
            subprocess.run(["sh", "-c", f"sleep 60 & echo $! > {pidfile}"], check=True)
            orphan = int(pidfile.read_text())
            assert alive(orphan) and orphan in descendants()  # adopted, not init's
        assert not alive(orphan)
        assert alive(before.pid)
    finally:
        before.kill()
        before.wait()


def test_a_process_exits_when_its_launcher_is_gone():
    """exit_with: for processes another program starts (Ray's client workers)."""
    launcher = subprocess.Popen(["sleep", "60"])
    code = (
        "import time; from ftis.launch.stop import exit_with; "
        f"exit_with({launcher.pid}, poll_s=0.05); time.sleep(60)"
    )
    worker = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(1.0)
        assert worker.poll() is None  # the launcher lives: so does the worker
        launcher.kill()
        launcher.wait()
        assert worker.wait(timeout=20) == 130
    finally:
        for p in (launcher, worker):
            if p.poll() is None:
                p.kill()
                p.wait()


# ---- Flower's simulation (Ray): FGRPO, FedDPO ------------------------------------------------


def _fgrpo(steps: int) -> dict:
    from tests.test_fgrpo import fgrpo_run_config

    data = fgrpo_run_config(steps=steps)
    data["nodes"] = data["nodes"][:2]
    data["algorithm"]["clients"] = {
        k: v for k, v in data["algorithm"]["clients"].items() if k in ("a", "b")
    }
    return data


def _server_after(step: int):
    return lambda out: max(_steps(out, "server"), default=-1) >= step


def _check_flower_stop(out: Path, clients: list[str], steps: int) -> None:
    """The server checkpointed the last round it completed (its last row), which is before the
    end; every client has a row for every completed round."""
    done = max(_steps(out, "server"))
    assert 1 <= done < steps
    assert _checkpoint_step(out, "server") == done
    for c in clients:
        assert max(_steps(out, c)) == done


def _check_flower_resumed(out: Path, clients: list[str], steps: int) -> None:
    for n in [*clients, "server"]:
        assert sorted(_steps(out, n)) == list(range(steps + 1)), n  # each round once
    assert _checkpoint_step(out, "server") == steps


@pytest.mark.long
@pytest.mark.chaos_case("FGRPO", "SIGTERM to the launcher, resume")
@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=["SIGTERM"])
def test_fgrpo_on_flower_stops_checkpoints_and_resumes(tmp_path, sig):
    """SIGTERM used to reach Ray's own handler (sys.exit mid-round: exit 134, no checkpoint)."""
    steps = 4  # the signal lands in round 2 (rounds take seconds, Ray's start much longer)
    out, _ = stop_and_resume(tmp_path, _fgrpo(steps), sig, ready=_server_after(1))
    _check_flower_stop(out, ["a", "b"], steps)
    resume(out)
    _check_flower_resumed(out, ["a", "b"], steps)


@pytest.mark.chaos_case("FedDPO", "SIGTERM to the launcher, resume")
@pytest.mark.chaos
@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=["SIGTERM"])  # SIGINT: as FGRPO's path
def test_fed_dpo_on_flower_stops_checkpoints_and_resumes(tmp_path, sig):
    from tests.test_fed_dpo import fed_dpo_config

    steps = 4
    data = fed_dpo_config(names=("a", "b"), steps=steps)
    data["eval"]["every"] = 1
    names = [n["name"] for n in data["nodes"]]
    out, _ = stop_and_resume(tmp_path, data, sig, ready=_server_after(1))
    _check_flower_stop(out, names, steps)
    resume(out)
    _check_flower_resumed(out, names, steps)


# ---- the swarm: simulator and hivemind -------------------------------------------------------


def _swarm(backend: str, steps: int) -> dict:
    data = tiny_run_config(steps=steps)
    data["nodes"] = [{**copy.deepcopy(data["nodes"][0]), "name": n} for n in ("a", "b")]
    data["eval"] = {"every": 0, "size": 16}
    data["algorithm"] = {
        "kind": "swarm",
        "backend": backend,
        "max_peers": 8,
        "deadline_s": 60.0,
        "member_ttl_s": 60.0,
    }
    return data


def _peers_after(step: int):
    return lambda out: all(max(_steps(out, n), default=-1) >= step for n in ("a", "b"))


def _check_swarm(out: Path) -> None:
    """Each peer checkpointed the last round it completed; a resume to two rounds beyond the
    newer one finishes with each row once (the peers meet at the newest checkpoint's round, so
    a peer one round behind skips that round)."""
    done = {}
    for n in ("a", "b"):
        done[n] = max(_steps(out, n))
        assert done[n] >= 2 and _checkpoint_step(out, n) == done[n], n
    steps = max(done.values()) + 2
    resume(out, f"train.steps={steps}")
    for n in ("a", "b"):
        rows = _steps(out, n)
        assert len(rows) == len(set(rows)) and max(rows) == steps, n
        assert list(range(done[n] + 1)) == sorted(rows)[: done[n] + 1], n


@pytest.mark.chaos_case("swarm sim", "SIGTERM to the launcher, resume")
@pytest.mark.chaos
@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=["SIGTERM"])  # SIGINT worked before
def test_the_swarm_simulator_stops_checkpoints_and_resumes(tmp_path, sig):
    steps = 1000  # far more than run before the signal
    data = _swarm("sim", steps)
    out, _ = stop_and_resume(tmp_path, data, sig, ready=_peers_after(2), children=False)
    _check_swarm(out)


@pytest.mark.chaos_case("swarm hivemind", "SIGTERM to the launcher, resume")
@pytest.mark.chaos
@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=["SIGTERM"])
def test_the_hivemind_swarm_stops_checkpoints_and_resumes(tmp_path, sig):
    """SIGTERM used to kill the launcher alone (exit 143): its peers and their p2pd daemons
    trained on, orphaned."""
    pytest.importorskip("hivemind")
    steps = 1000
    data = _swarm("hivemind", steps)
    out, _ = stop_and_resume(tmp_path, data, sig, ready=_peers_after(2))
    _check_swarm(out)


# ---- the launcher's own death (SIGKILL: nothing to forward) ---------------------------------


def _killed_launcher(tmp_path: Path, data: dict, ready) -> dict[str, float]:
    """Start `ftis run`, SIGKILL it once ready(out) holds; return, for each process the
    launcher ever had below it, the seconds it outlived the launcher (by command line)."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    parent = subprocess.Popen(
        [FTIS, "run", str(config), "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    kids: set[int] = set()
    try:
        deadline = time.monotonic() + 600
        while not ready(out):
            assert parent.poll() is None and time.monotonic() < deadline
            kids |= descendants(parent.pid)
            time.sleep(0.1)
        kids |= descendants(parent.pid)
        names = {}
        for k in kids:
            try:
                names[k] = Path(f"/proc/{k}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                names[k] = "?"
        parent.kill()
        parent.wait()
        t0, gone = time.monotonic(), {}
        while len(gone) < len(kids) and time.monotonic() - t0 < 120:
            for k in kids - set(gone):
                if not alive(k):
                    gone[k] = time.monotonic() - t0
            time.sleep(0.1)
        assert len(gone) == len(kids), [names[k] for k in kids - set(gone)]
        return {f"{names[k][:60]} ({k})": s for k, s in gone.items()}
    finally:
        for pid in [parent.pid, *kids]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.chaos_case("FGRPO", "SIGKILL the launcher")
@pytest.mark.chaos
def test_flower_client_workers_exit_when_the_launcher_is_killed(tmp_path):
    """The client workers (Ray actors running ftis's ClientApp) watch the launcher and exit
    within seconds; Ray's own raylet and GCS share its fate; Ray's agents exit once they find
    the raylet gone (about a minute)."""
    outlived = _killed_launcher(tmp_path, _fgrpo(4), _server_after(1))
    workers = {k: s for k, s in outlived.items() if "ClientAppActor" in k}
    assert workers and max(workers.values()) < 10, outlived


@pytest.mark.chaos_case("swarm hivemind", "SIGKILL the launcher")
@pytest.mark.chaos
def test_hivemind_peers_stop_when_the_launcher_is_killed(tmp_path):
    """The peers get SIGTERM from the kernel (PR_SET_PDEATHSIG), checkpoint and leave; their
    p2pd daemons end with them."""
    pytest.importorskip("hivemind")
    outlived = _killed_launcher(tmp_path, _swarm("hivemind", 1000), _peers_after(2))
    assert max(outlived.values()) < 60, outlived
    for n in ("a", "b"):
        assert _checkpoint_step(tmp_path / "run", n) >= 2
