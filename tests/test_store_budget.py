"""The exchange's store is bounded (issue 57 item 3): it lives in the launcher's process, so what
it holds is that process's growth in resident memory; past `exchange.store_budget_mb` (writes
from outside the run: the run deletes its own payloads two steps on) the nodes checkpoint, the
run stops saying why (exit 1), and `--resume` continues it."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
import yaml
from typer.testing import CliRunner

from ftis.cli import app
from ftis.exchange import store as store_mod
from ftis.launch import multi
from tests.conftest import tiny_run_config


def test_the_budget_names_the_growth_past_it():
    mib = iter([100.0, 150.0, 230.0])
    budget = multi.StoreBudget(100, read=lambda: next(mib))  # baseline 100
    assert budget.exceeded() is None  # 50 MiB grown, within 100
    assert budget.exceeded() == pytest.approx(130.0)
    assert multi.StoreBudget(100, read=lambda: None).exceeded() is None  # no /proc: no bound


@pytest.mark.skipif(multi.resident_mib() is None, reason="needs /proc/self/statm (Linux)")
def test_junk_written_into_a_hosted_store_shows_in_its_hosts_memory():
    """What the budget reads is what the store holds: 96 MiB of values written by a client
    (in 6 MiB values, below torch's per-value limit) raise the hosting process's resident
    memory past a 64 MiB budget; nothing written, nothing grows."""
    server, store, port = store_mod.host_store()
    budget = multi.StoreBudget(64)
    assert budget.exceeded() is None
    outsider = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    for i in range(16):
        outsider.set(f"junk/{i}", bytes([i]) * (6 * 2**20))
    assert budget.exceeded() is not None
    del outsider, store, server


@pytest.mark.chaos_case("F-TIS", "a local client fills the store")
@pytest.mark.skipif(multi.resident_mib() is None, reason="needs /proc/self/statm (Linux)")
def test_a_store_filled_from_outside_stops_the_run_after_checkpoints_and_it_resumes(
    tmp_path, monkeypatch
):
    data = tiny_run_config(steps=40)
    data["nodes"] = [
        {**data["nodes"][0], "name": n, "warm_start": {"steps": 30, "batch_size": 32, "lr": 3e-3}}
        for n in ("a", "b")
    ]
    data["checkpoint"] = {"every": 1}
    data["eval"]["every"] = 40
    data["exchange"] = {"store_budget_mb": 48}
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    hosted = {}
    real_host = multi.host_store

    def host_and_remember():
        server, store, port = real_host()
        hosted["port"] = port
        return server, store, port

    def flood():  # once both nodes have trained a step, as a stranger on the port would
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            rows = out / "metrics.jsonl"
            if rows.exists():
                done = {json.loads(x)["node"] for x in rows.read_text().splitlines() if x.strip()}
                steps = [json.loads(x)["step"] for x in rows.read_text().splitlines() if x.strip()]
                if done >= {"a", "b"} and max(steps, default=0) >= 2:
                    break
            time.sleep(0.1)
        junk = dist.TCPStore(
            "127.0.0.1", hosted["port"], is_master=False, timeout=timedelta(seconds=30)
        )
        for i in range(16):
            junk.set(f"junk/{i}", bytes([i]) * (6 * 2**20))

    monkeypatch.setattr(multi, "host_store", host_and_remember)
    attacker = threading.Thread(target=flood, daemon=True)
    attacker.start()
    res = CliRunner().invoke(app, ["run", str(cfg), "--out", str(out)])
    attacker.join(60)
    assert res.exit_code == 1, res.output
    assert "grew by" in res.output and "store_budget_mb (48)" in res.output
    assert f"--resume {out}" in res.output
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    last = {n: max(r["step"] for r in rows if r["node"] == n) for n in "ab"}
    assert all(2 <= s < 40 for s in last.values()), last  # stopped mid-run, after checkpoints
    monkeypatch.setattr(multi, "host_store", real_host)
    res = CliRunner().invoke(app, ["run", "--resume", str(out)])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for n in "ab":
        steps = [r["step"] for r in rows if r["node"] == n and "train/step_seconds" in r]
        assert steps == list(range(1, 41)), n  # every step trained once, before and after
