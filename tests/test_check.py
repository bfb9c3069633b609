"""`ftis check CONFIG` (issue 55): a config checked as a run would check it, one probe step per
node, and the plan printed; a reward that never fires is visible; a bad data row ends with its
file and line and exit 2; nothing is written."""

from __future__ import annotations

import os

import yaml
from typer.testing import CliRunner

from ftis.cli import app
from tests.conftest import tiny_run_config


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_check_prints_the_plan_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "zero.py").write_text("def never(prompt, completion, fields):\n    return 0.0\n")
    data = tiny_run_config(steps=4)
    data["nodes"][0]["reward"] = [
        {"function": "builtin:exact_match", "weight": 1.0},
        {"function": f"{tmp_path / 'zero.py'}:never", "weight": 0.5},
    ]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    before = sorted(os.listdir(tmp_path))
    res = CliRunner().invoke(app, ["check", "run.yaml"])
    assert res.exit_code == 0, res.output
    out = _flat(res.output)
    assert "plan: tiny" in out and "│ xs │ llama-xs │" in out
    # 4 prompts x G = 4: 16 sequences trained per step (one node)
    assert "│ 16 │" in out
    assert "never: 0 on it; non-zero on 0 of 16 probe completions never fired in the probe" in out
    assert "builtin:exact_match:" in out
    assert "for 4 steps and 3 evaluations on this machine" in out  # steps 0, 2, 4
    assert sorted(os.listdir(tmp_path)) == before  # no run directory, nothing written


def test_check_names_a_bad_row_by_file_and_line(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "say 1", "answer": "1"}\n{"prompt": "", "answer": "2"}\n')
    data = tiny_run_config(steps=2)
    data["task"] = {"kind": "prompts", "train_file": str(rows), "test_fraction": 0.5}
    data["nodes"][0]["reward"] = "builtin:exact_match"
    del data["nodes"][0]["warm_start"]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(app, ["check", str(tmp_path / "run.yaml")])
    assert res.exit_code == 2
    assert f"{rows}:2" in _flat(res.output)


def test_check_refuses_a_config_error_with_exit_2(tmp_path):
    data = tiny_run_config(steps=2)
    data["train"]["stepz"] = 3
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(app, ["check", str(tmp_path / "run.yaml")])
    assert res.exit_code == 2 and "stepz" in res.output


def test_the_estimate_counts_the_processes_that_compute_at_once():
    """The swarm simulator runs every peer in one process, one after another: its estimate is
    the whole work on one core, not the work shared by every core."""
    from ftis.check import NodePlan, Plan

    node = NodePlan(
        name="a",
        model="llama-xs",
        trainable=1,
        total=1,
        generated_per_step=1.0,
        trained_per_step=1,
        step_seconds=1.0,
        eval_seconds=0.0,
        peak_rss_mib=1.0,
    )
    four = [node] * 4
    assert Plan("x", 10, 0, four, cores=2).total_seconds == 20.0  # 40 s of work on 2 cores
    assert Plan("x", 10, 0, four, cores=2, busy=1).total_seconds == 40.0
