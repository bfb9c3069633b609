"""Two hosts, for real: two network namespaces joined by a veth pair (what one machine allows
for "two machines"), one F-TIS node in each, started as torchrun would start them across
machines (`python -m ftis.launch.worker` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0
hosts the store on MASTER_ADDR). With the shared secret they collaborate; without it the join is
refused before anything is sent (issue 37: a store off loopback needs a secret).

Needs root and iproute2 (`ip netns`); skipped with the reason otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ftis.exchange.store import SECRET_ENV, new_secret
from tests.test_chaos import _ftis

HOST0, HOST1 = "10.231.7.1", "10.231.7.2"  # addresses inside this test's own namespaces


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2's `ip netns` to make two hosts")
    tag = f"{os.getpid() % 100000}"
    a, b = f"ftis-a{tag}", f"ftis-b{tag}"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot make network namespaces here: {e}")
    try:
        _ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        _ip("link", "set", f"va{tag}", "netns", a)
        _ip("link", "set", f"vb{tag}", "netns", b)
        for ns, dev, addr in ((a, f"va{tag}", HOST0), (b, f"vb{tag}", HOST1)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _worker(ns: str, rank: int, config: Path, out: Path, secret: str | None):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (SECRET_ENV, "FTIS_STORE_HOSTED", "TORCHELASTIC_USE_AGENT_STORE")
    }
    env.update(
        RANK=str(rank),
        LOCAL_RANK="0",
        WORLD_SIZE="2",
        MASTER_ADDR=HOST0,
        MASTER_PORT="29517",
        OMP_NUM_THREADS="1",
    )
    if secret is not None:
        env[SECRET_ENV] = secret
    log = (out.parent / f"{out.name}.log").open("w")
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "ftis.launch.worker", str(config)]
        + ["--out", str(out)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _config(tmp_path: Path) -> Path:
    data = _ftis(3)
    data["exchange"] = {"timeout_s": 20.0}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _finish(*procs, timeout=300) -> list[int]:
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


def test_two_hosts_with_the_secret_collaborate(two_hosts, tmp_path):
    a, b = two_hosts
    config, secret = _config(tmp_path), new_secret()
    outs = [tmp_path / "host0", tmp_path / "host1"]
    procs = [_worker(ns, r, config, outs[r], secret) for r, ns in enumerate((a, b))]
    codes = _finish(*procs)
    logs = [(tmp_path / f"host{r}.log").read_text() for r in range(2)]
    assert codes == [0, 0], "\n---\n".join(x[-3000:] for x in logs)
    for r, node in enumerate(("a", "b")):
        rows = [json.loads(x) for x in (outs[r] / "metrics.jsonl").read_text().splitlines()]
        mine = [x for x in rows if x.get("node") == node and x.get("step", 0) >= 1]
        assert mine and all(x["exchange/peers"] == 1 for x in mine), mine
        assert all(x["exchange/lost_peers"] == 0 for x in mine)


def test_a_host_without_the_secret_is_refused(two_hosts, tmp_path):
    a, b = two_hosts
    config = _config(tmp_path)
    outs = [tmp_path / "host0", tmp_path / "host1"]
    host0 = _worker(a, 0, config, outs[0], new_secret())
    joiner = _worker(b, 1, config, outs[1], None)
    (code,) = _finish(joiner, timeout=120)
    host0.kill()
    host0.wait()
    log = (tmp_path / "host1.log").read_text()
    assert code == 2, log[-3000:]
    assert "needs a shared secret" in log and SECRET_ENV in log, log[-3000:]
