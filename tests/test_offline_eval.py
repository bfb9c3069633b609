"""`ftis eval` (issue 55): a run's checkpoint, or its export, scored on the task's splits gives
the numbers the run's own evaluation logged for the same weights; bad requests are one clear
line and exit 2."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from ftis.cli import app
from ftis.config import RunConfig
from ftis.offline_eval import EvalError, evaluate_source
from ftis.train.loop import train_node
from tests.conftest import tiny_run_config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    data = tiny_run_config(steps=2)
    data["eval"]["every"] = 1  # an evaluation at every step, so every checkpoint has one
    data["checkpoint"] = {"every": 1, "keep": 3}
    cfg = RunConfig.model_validate(data)
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    train_node(cfg, rank=0, run_dir=run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, {r["step"]: r for r in rows if "eval/accuracy" in r}


@pytest.mark.parametrize("step", [1, 2])
def test_eval_of_a_checkpoint_gives_the_runs_own_numbers(run, step):
    run_dir, logged = run
    res = evaluate_source(run_dir, step=step, pass_k=[1, 2])
    assert res.step == step and res.node == "xs" and res.problems == {"test": 16, "ood": 16}
    for key in (
        "eval/accuracy",
        "eval/test/accuracy",
        "eval/ood/accuracy",
        "eval/pass@1",
        "eval/pass@2",
    ):
        assert res.metrics[key] == logged[step][key], key
    # greedy only, by default: no pass@k is computed
    plain = evaluate_source(run_dir, step=step)
    assert "eval/pass@1" not in plain.metrics
    assert plain.metrics["eval/test/accuracy"] == logged[step]["eval/test/accuracy"]


def test_eval_of_an_export_and_the_cli_json_line(run, tmp_path):
    run_dir, logged = run
    out = tmp_path / "export"
    res = CliRunner().invoke(app, ["export", str(run_dir), "xs", "--out", str(out)])
    assert res.exit_code == 0, res.output
    runner = CliRunner()
    res = runner.invoke(
        app, ["eval", str(out), "--config", str(run_dir / "config.yaml"), "--split", "ood"]
    )
    assert res.exit_code == 0, res.output
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert line["step"] is None and line["problems"] == {"ood": 16}
    assert line["eval/ood/accuracy"] == logged[2]["eval/ood/accuracy"]  # the last checkpoint's


def test_bad_requests_are_clear(run, tmp_path):
    run_dir, _ = run
    with pytest.raises(EvalError, match="has no checkpoint of step 7"):
        evaluate_source(run_dir, step=7)
    with pytest.raises(EvalError, match="the task's evaluation splits are test, ood"):
        evaluate_source(run_dir, split="nope")
    with pytest.raises(EvalError, match="no node 'zz'"):
        evaluate_source(run_dir, node="zz")
    with pytest.raises(EvalError, match="name the task with --config"):
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "config.json").write_text("{}")
        evaluate_source(tmp_path / "m")
    res = CliRunner().invoke(app, ["eval", str(tmp_path / "absent")])
    assert res.exit_code == 2 and "is not a directory" in res.output
