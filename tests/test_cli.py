import json

import pytest
import yaml
from typer.testing import CliRunner

from ftis.cli import app
from ftis.train.metrics import decode_outcomes
from tests.conftest import tiny_run_config

runner = CliRunner()


def _config(tmp_path, **train) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_run_config(**train)))
    return str(path)


def test_run_writes_the_run_directory(tmp_path):
    out = tmp_path / "run"
    res = runner.invoke(app, ["run", _config(tmp_path), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert yaml.safe_load((out / "config.yaml").read_text())["nodes"][0]["name"] == "xs"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["node"] == "xs" for r in rows)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2, 3]  # step 0, every 2, and the last step
    assert 0.0 <= evals[0]["eval/accuracy"] <= 1.0 and "eval/ood/accuracy" in evals[0]
    assert "eval/pass@2" in evals[0]
    assert all(
        k in rows[1] for k in ("reward/mean", "loss/filtered_frac", "time/sample", "time/update")
    )
    ckpt = out / "nodes" / "xs" / (out / "nodes" / "xs" / "latest").read_text().strip()
    assert (ckpt / "model" / "config.json").exists() and (ckpt / "trainer_state.pt").exists()
    report = (out / "report.md").read_text()
    assert (
        "| xs |" in report and (out / "accuracy.png").exists() and (out / "training.png").exists()
    )
    # evals.jsonl: one line per evaluation and split, whose outcomes give the row's accuracy
    lines = [json.loads(line) for line in (out / "evals.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in lines] == [
        (s, split) for s in (0, 2, 3) for split in ("test", "ood")
    ]
    by_step = {r["step"]: r for r in evals}
    for r in lines:
        assert r["node"] == "xs" and r["n"] == 16  # eval.size
        bits = decode_outcomes(r["correct"], r["n"])
        assert bits.mean() == pytest.approx(by_step[r["step"]][f"eval/{r['split']}/accuracy"])
    # samples.jsonl: the first 3 greedy completions of each split at each evaluation
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 2 * 3
    assert all(
        {"step", "node", "split", "prompt", "completion", "reward"} <= r.keys() for r in samples
    )
    assert [r["prompt"] for r in samples[:3]] != [r["prompt"] for r in samples[3:6]]  # test, ood
    assert "## Samples at the last evaluation" in report
    assert report.count("| xs | 3 |") == 6  # the last evaluation: 3 samples x 2 splits


def test_existing_run_dir_needs_overwrite(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    res = runner.invoke(app, ["run", _config(tmp_path), "--out", str(out)])
    assert res.exit_code == 2 and "--overwrite" in res.output


def test_bad_config_is_a_clean_error(tmp_path):
    res = runner.invoke(
        app,
        [
            "run",
            _config(tmp_path),
            "--set",
            "nodes.0.loss.method=ppo",
            "--out",
            str(tmp_path / "r"),
        ],
    )
    assert res.exit_code == 2
    assert "nodes.0.loss.method" in res.output and "Traceback" not in res.output


def test_missing_config_file(tmp_path):
    res = runner.invoke(app, ["run", str(tmp_path / "none.yaml")])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_missing_model_path_is_a_clean_error(tmp_path):
    res = runner.invoke(
        app,
        [
            "run",
            _config(tmp_path),
            "--set",
            "nodes.0.model={path: /no/such/model}",
            "--set",
            "nodes.0.warm_start=null",
            "--out",
            str(tmp_path / "r"),
        ],
    )
    assert res.exit_code == 2, res.output
    assert "/no/such/model" in res.output and "Traceback" not in res.output


def test_report_and_compare(tmp_path):
    out = tmp_path / "run"
    assert runner.invoke(app, ["run", _config(tmp_path, steps=1), "--out", str(out)]).exit_code == 0
    (out / "report.md").unlink()
    res = runner.invoke(app, ["report", str(out)])
    assert res.exit_code == 0 and (out / "report.md").exists()
    res = runner.invoke(app, ["compare", str(out), str(out), "--out", str(tmp_path / "c.png")])
    assert res.exit_code == 0 and (tmp_path / "c.png").exists()
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 2 and "run directory" in res.output


def test_missing_data_file_is_a_clean_error(tmp_path):
    res = runner.invoke(
        app,
        [
            "run",
            _config(tmp_path),
            "--set",
            f"task={{kind: gsm8k, train_file: {tmp_path}/none.jsonl, test_file: {tmp_path}/t.jsonl}}",
            "--set",
            "nodes.0.warm_start=null",
            "--out",
            str(tmp_path / "r"),
        ],
    )
    assert res.exit_code == 2, res.output
    assert "none.jsonl" in res.output and "train_file" in res.output
    assert "Traceback" not in res.output
