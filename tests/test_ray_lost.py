"""Ray dying under a Flower run is a clear stop, not a silent one (issue 37).

Killing the raylet of a FedDPO run used to end it with exit 1 and only Ray's "Raylet is
terminated"; when the driver survived, the clients' calls failed every round and the run
"finished" with exit 0 having trained nothing after the kill. Now `ftis run` supervises the
driver process: whether Ray's core worker ends the driver (exit 1, no Python cleanup) or the
driver's watch sees the raylet die (the server then checkpoints its last round), `ftis run` exits
1 with one line naming Ray's raylet and the resume command, no Ray process is left, and the
resume finishes the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import yaml

from ftis.launch.stop import alive, descendants
from tests.test_stop_protocol import FTIS


def _raylet(launcher: int) -> int | None:
    for pid in descendants(launcher):
        try:
            if b"raylet/raylet" in open(f"/proc/{pid}/cmdline", "rb").read():
                return pid
        except OSError:
            continue
    return None


def _server_rounds(out) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return sorted({r["step"] for r in rows if r.get("node") == "server"})


@pytest.mark.chaos
@pytest.mark.chaos_case("FedDPO", "raylet killed")
def test_a_killed_raylet_stops_the_run_with_a_resume_hint(tmp_path):
    pytest.importorskip("ray")
    from tests.test_fed_dpo import fed_dpo_config

    data = fed_dpo_config(names=("a", "b"), steps=8)
    data["checkpoint"] = {"every": 1}  # Ray may end the driver before the server can save
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    with (tmp_path / "out.log").open("w") as log:
        proc = subprocess.Popen(
            [FTIS, "run", str(config), "--out", str(out)], stdout=log, stderr=subprocess.STDOUT
        )
    kids: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while max(_server_rounds(out), default=-1) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "no round 2 in time"
            time.sleep(0.2)
        raylet = _raylet(proc.pid)
        assert raylet is not None, "no raylet below the launcher"
        kids = descendants(proc.pid)
        os.kill(raylet, signal.SIGKILL)
        code = proc.wait(timeout=300)
    finally:
        for pid in [proc.pid, *kids]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    said = (tmp_path / "out.log").read_text()
    assert code == 1, said[-3000:]
    assert "Ray" in said and "raylet" in said and f"ftis run --resume {out}" in said, said[-3000:]
    time.sleep(2)
    assert not [p for p in kids if alive(p)], "Ray processes left behind"
    done = max(_server_rounds(out))
    assert done < 8
    res = subprocess.run(
        [FTIS, "run", "--resume", str(out)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert _server_rounds(out) == list(range(9))
