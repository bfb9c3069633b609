"""The smallest shipped swarm config, run as a user runs it (`ftis run
configs/swarm-hivemind.yaml`): real peer processes on a loopback DHT, a crash that rejoins and
a late joiner. No peer may collapse (issue 53: at lr 1e-4 / 5e-5 the same swarm took llama-xs
from 34% to 3-7% test accuracy), and every peer must have trained on its peers' samples."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# a loss of more than this many points of test accuracy over the run is a collapse (one problem
# of the config's 128 is 0.8 points; its three seeds changed by -0.7 to +4.7 at lr 2e-5)
COLLAPSE_POINTS = 10.0


@pytest.mark.long
def test_the_shipped_hivemind_swarm_runs_and_no_peer_collapses(tmp_path):
    pytest.importorskip("hivemind")
    from typer.testing import CliRunner

    from ftis.cli import app
    from ftis.study.stats import read_evals
    from ftis.train.metrics import read_metrics

    out = tmp_path / "run"
    res = CliRunner().invoke(
        app, ["run", str(ROOT / "configs" / "swarm-hivemind.yaml"), "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    evals = read_evals(out)
    rows = read_metrics(out / "metrics.jsonl")
    assert sorted(evals) == ["llama-s", "llama-xs", "qwen2-s"]
    for node, splits in evals.items():
        test = splits["test"]
        first, last = 100 * test.correct[0].mean(), 100 * test.correct[-1].mean()
        assert int(test.steps[-1]) == 16, (node, test.steps)
        assert last > first - COLLAPSE_POINTS, f"{node} collapsed: {first:.1f}% -> {last:.1f}%"
        used = [r.get("swarm/peers_used", 0) for r in rows if r["node"] == node]
        assert any(u >= 1 for u in used), f"{node} never trained on a peer's samples"
