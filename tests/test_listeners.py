"""Nothing a run opens listens beyond loopback (issue 37): the listening TCP sockets of every
process of a running `ftis run` are read from /proc while it runs, for each mode.

Before issue 37 the F-TIS store listened on every interface (torch's TCPStore server binds the
wildcard address), and so did gloo's pairs in gossip DPO. Ray 2.55's GCS, raylet and worker
gRPC servers listen on every interface with no option to bind them elsewhere: for the Flower
modes the test instead checks that those processes run in a network namespace whose only
interface is loopback (where the machine allows one: `ftis run` supervises the driver there) and
with Ray's token authentication, and `test_an_outside_ray_driver_is_refused` that a driver
without the run's token cannot connect (before, one ran code inside the run)."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ftis.launch.stop import alive, descendants
from tests.test_stop_protocol import FTIS

RAY_PROCESSES = ("gcs_server", "raylet", "ray::", "default_worker", "site-packages/ray/")
RAY_MODES = ("FedDPO", "FGRPO")


def _inodes(pid: int) -> set[int]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(int(link[8:-1]))
    except OSError:
        pass
    return out


def listening(pid: int | str = "self") -> dict[int, tuple[str, int]]:
    """socket inode -> (local address, port) of every listening TCP socket in the network
    namespace of process `pid`."""
    out = {}
    for name, v4 in (("tcp", True), ("tcp6", False)):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A":  # LISTEN
                continue
            addr, port = f[1].split(":")
            raw = bytes.fromhex(addr)
            if v4:
                ip = ipaddress.IPv4Address(raw[::-1])
            else:  # four little-endian 32-bit words
                ip = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
            out[int(f[9])] = (str(ip), int(port, 16))
    return out


def _netns(pid: int | str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return "?"


def loopback_only_netns(pid: int) -> bool:
    """Whether `pid` lives in a network namespace other than this test's whose only interface
    is loopback: nothing outside it can reach what listens there, on any address."""
    if _netns(pid) in ("?", _netns("self")):
        return False
    try:
        lines = Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
    except OSError:
        return False
    return [x.split(":")[0].strip() for x in lines] == ["lo"]


def _describe(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
    except OSError:
        return "?"


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)


def watch(proc: subprocess.Popen, timeout_s: float = 300) -> dict[tuple[int, str, int], str]:
    """Every (pid, address, port) that a process below `proc` listened on while it ran, with
    the process's command line, and for a listener beyond loopback whether it ran in a network
    namespace of loopback only and with Ray's token; sampled every 0.1 s until it exits."""
    seen: dict[tuple[int, str, int], str] = {}
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the run did not finish in time"
        for pid in {proc.pid, *descendants(proc.pid)}:
            socks = listening(pid)
            for inode in _inodes(pid) & socks.keys():
                key = (pid, *socks[inode])
                if key in seen:
                    continue
                seen[key] = _describe(pid)
                if not ipaddress.ip_address(socks[inode][0]).is_loopback:
                    env = _environ(pid)
                    seen[key] += " | netns=" + ("lo-only" if loopback_only_netns(pid) else "host")
                    seen[key] += " | RAY_AUTH_MODE=" + (
                        env.get("RAY_AUTH_MODE", "") if env else "?"
                    )
        time.sleep(0.1)
    return seen


def _ftis() -> dict:
    from tests.test_chaos import _ftis as two_nodes

    return two_nodes(3)


def _gossip() -> dict:
    from tests.test_gossip_dpo import _gossip_config

    return _gossip_config(["a", "b"], steps=3)


def _fed_dpo() -> dict:
    from tests.test_fed_dpo import fed_dpo_config

    return fed_dpo_config(names=("a", "b"), steps=2)


def _hivemind() -> dict:
    from tests.test_stop_protocol import _swarm

    return _swarm("hivemind", 3)


MODES = {
    "F-TIS": (_ftis, []),
    "gossip DPO": (_gossip, [pytest.mark.chaos]),
    "FedDPO": (_fed_dpo, [pytest.mark.chaos]),
    "swarm hivemind": (_hivemind, [pytest.mark.chaos]),
}


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(m, marks=[pytest.mark.chaos_case(m, "non-loopback listener"), *marks], id=m)
        for m, (_, marks) in MODES.items()
    ],
)
def test_a_run_listens_on_loopback_only(tmp_path, mode):
    if mode == "swarm hivemind":
        pytest.importorskip("hivemind")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(MODES[mode][0]()))
    with (tmp_path / "out.log").open("w") as log:
        proc = subprocess.Popen(
            [FTIS, "run", str(config), "--out", str(tmp_path / "run")],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        seen = watch(proc)
    finally:
        for pid in [proc.pid, *descendants(proc.pid)]:
            if alive(pid):
                os.kill(pid, 9)
        proc.wait()
    assert proc.returncode == 0, (tmp_path / "out.log").read_text()[-3000:]
    assert seen, "no listening socket seen: the watch found none of the run's processes"
    outside = {k: v for k, v in seen.items() if not ipaddress.ip_address(k[1]).is_loopback}
    if mode not in RAY_MODES:
        assert not outside, f"non-loopback listeners: {outside}"
        return
    # Ray's servers (in its own processes and the driver's core worker) cannot be bound to
    # loopback: where the machine allows it they run in a network namespace of loopback only
    # (`ftis run` supervises the driver there); everywhere they require the run's token
    from ftis.cli.supervisor import _can_isolate

    for v in outside.values():
        assert "netns=lo-only" in v or not _can_isolate(), v
        token = v.endswith("RAY_AUTH_MODE=token")
        assert token or (v.endswith("RAY_AUTH_MODE=?") and any(r in v for r in RAY_PROCESSES)), v


@pytest.mark.chaos
@pytest.mark.chaos_case("FedDPO", "outside Ray driver")
def test_an_outside_ray_driver_is_refused(tmp_path):
    """Issue 37: `ray.init(address=<gcs>)` from outside ran arbitrary code inside a FedDPO run.
    Ray as ftis starts it (the launcher's `_start_ray`) refuses a driver without the token."""
    pytest.importorskip("ray")
    code = f"""
import os, sys
sys.path[:0] = {sys.path!r}
from ftis.algos.federated.launch import _start_ray
import ray
_start_ray({{"num_cpus": 1, "num_gpus": 0, "include_dashboard": False,
            "logging_level": "ERROR", "log_to_driver": False}})
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    host = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        gcs = host.stdout.readline().strip()
        assert gcs, "Ray did not start"
        marker = tmp_path / "pwned"
        outsider = f"""
import ray
ray.init(address={gcs!r}, logging_level="ERROR")
@ray.remote
def f():
    open({str(marker)!r}, "w").write("ran inside the run")
ray.get(f.remote())
"""
        res = subprocess.run(
            [sys.executable, "-c", outsider], capture_output=True, text=True, env=env, timeout=120
        )
        assert res.returncode != 0 and not marker.exists(), res.stdout + res.stderr[-2000:]
    finally:
        host.stdin.close()
        try:
            host.wait(timeout=60)
        except subprocess.TimeoutExpired:
            host.kill()
