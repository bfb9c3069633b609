"""Decentralized DPO end to end: one process per agent under `ftis run`, gossip over gloo.
A killed agent does not stop the others (its neighbours drop it and renormalise), and a run
resumed from checkpoints continues exactly."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from ftis.cli import app
from tests.test_dpo import tiny_dpo_config

runner = CliRunner()
VOLATILE = ("time/", "train/step_seconds", "train/elapsed_seconds", "memory/", "gossip/seconds")


def _gossip_config(names, steps, **algorithm) -> dict:
    data = tiny_dpo_config(steps=steps, kind="gossip-dpo", **algorithm)
    data["algorithm"]["data"].update(train_pairs=8, eval_pairs=4)
    data["eval"] = {"every": 0, "size": 4, "pass_samples": 0}
    data["checkpoint"] = {"every": 1}
    data["nodes"] = [{**data["nodes"][0], "name": n} for n in names]
    return data


def _run(tmp_path, data, name="run"):
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(data))
    out = tmp_path / name
    return runner.invoke(app, ["run", str(cfg), "--out", str(out)]), out


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _logs(out) -> str:
    return "\n".join(
        f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((out / "logs").glob("*.log"))
    )


@pytest.mark.chaos_case("gossip DPO", "kill one (hard exit, no goodbye), resume")
@pytest.mark.slow
def test_a_killed_agent_is_dropped_and_the_others_finish(tmp_path):
    """Three agents on a triangle; c dies hard at the start of round 2. a and b drop it,
    renormalise their weights over the remaining graph (one neighbour each: W = 1/2), finish
    and write the report; the run exits 1 naming c. `--resume` then runs c alone to the end."""
    data = _gossip_config(["a", "b", "c"], steps=3, topology="complete")
    data["testing"] = {"crash_at_step": {"c": 2}}
    data["exchange"] = {"timeout_s": 120}  # the lost connection, not the timeout, ends the wait
    res, out = _run(tmp_path, data)
    assert res.exit_code == 1, res.output + _logs(out)
    assert "without c" in res.output and "exit code 17" in res.output
    rows = _rows(out)
    steps = {n: [r["step"] for r in rows if r["node"] == n] for n in "abc"}
    assert steps == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3], "c": [0, 1]}
    by = {(r["node"], r["step"]): r for r in rows}
    for n in "ab":
        one = by[n, 1]
        assert one["gossip/neighbours"] == 2 and one["gossip/self_weight"] == pytest.approx(1 / 3)
        assert one["gossip/consensus_agents"] == 3 and one["gossip/rho"] == pytest.approx(0.0)
        # complete graph of 3, every degree 2: W = 1/3 everywhere, one step is exact averaging:
        # every agent holds the mean. Not bit for bit: each weighs its own parameters by
        # 1 - 2/3 (float64, one ulp above 1/3) and sums in its own order, so a few float32
        # roundings differ by one ulp (measured: 2.5e-19). Any error in the weights themselves
        # (1% off) would leave about 1e-4 of the error before; 1e-9 of it is far below that.
        before, after = one["gossip/consensus_error_before"], one["gossip/consensus_error_after"]
        assert before > 0 and after <= 1e-9 * before
        # round 2: c is dropped before the exchange (1 neighbour, W = 1/2) or during it (c's
        # 1/3 stays home: 2/3); round 3: one neighbour left, W = 1/2 over the remaining graph
        assert by[n, 2]["gossip/self_weight"] in (pytest.approx(0.5), pytest.approx(2 / 3))
        three = by[n, 3]
        assert three["gossip/neighbours"] == 1 and three["gossip/self_weight"] == pytest.approx(0.5)
        assert three["gossip/lost_total"] == 1 and three["gossip/consensus_agents"] == 2
        assert "eval/preference_accuracy" in three and "gossip/consensus_error_after" in three
        # mixing with weight 1/2 between two agents is exact averaging: consensus in one step
        assert three["gossip/consensus_error_after"] == pytest.approx(0.0, abs=1e-12)
    assert "lost peer 2" in (out / "logs" / "a.log").read_text()
    report = (out / "report.md").read_text()
    assert "| a |" in report and "spectral gap" in report

    res = runner.invoke(app, ["run", "--resume", str(out), "--set", "testing.crash_at_step={}"])
    assert res.exit_code == 0, res.output + _logs(out)
    rows = _rows(out)
    for n in "abc":
        assert [r["step"] for r in rows if r["node"] == n] == [0, 1, 2, 3], n
    for r in rows:
        if r["node"] == "c" and r["step"] >= 2:  # a and b had finished: c gossips with nobody
            assert r["gossip/neighbours"] == 0 and r["gossip/self_weight"] == 1.0


@pytest.mark.slow
@pytest.mark.long
def test_gossip_resumes_exactly_from_checkpoints(tmp_path):
    """Two agents, 3 rounds in one go, or 2 rounds and then `--resume` to 3: the same rows."""
    res, whole = _run(tmp_path, _gossip_config(["a", "b"], steps=3), "whole")
    assert res.exit_code == 0, res.output + _logs(whole)
    res, part = _run(tmp_path, _gossip_config(["a", "b"], steps=2), "part")
    assert res.exit_code == 0, res.output + _logs(part)
    res = runner.invoke(app, ["run", "--resume", str(part), "--set", "train.steps=3"])
    assert res.exit_code == 0, res.output + _logs(part)
    a, b = _rows(whole), _rows(part)
    key = lambda r: (r["node"], r["step"])  # noqa: E731
    a, b = sorted(a, key=key), sorted(b, key=key)
    assert [key(r) for r in a] == [key(r) for r in b]
    for ra, rb in zip(a, b):
        ra = {k: v for k, v in ra.items() if not k.startswith(VOLATILE)}
        rb = {k: v for k, v in rb.items() if not k.startswith(VOLATILE)}
        # the 2-round run also evaluated at its last round (2): the only extra keys
        assert ra.keys() <= rb.keys(), key(ra)
        assert all(k.startswith("eval/") for k in rb.keys() - ra.keys()), key(ra)
        extra_eval = bool(rb.keys() - ra.keys())
        for k in ra:
            if extra_eval and k in ("reward/scored", "reward/nonzero"):
                continue  # they count the completions that extra evaluation scored
            assert ra[k] == pytest.approx(rb[k], abs=1e-6), (key(ra), k)
    assert any(r.get("gossip/mixed") == 1 for r in b if r["step"] == 3)  # round 3 did gossip
