"""log.wandb: the W&B sink runs offline by default (no traffic leaves the machine), writes its run
under RUN_DIR/wandb, logs a row's finite numbers at the row's step, and is refused with the
install line when wandb is missing. Uses the real wandb client in offline mode."""

from __future__ import annotations

import importlib.util

import pytest

from ftis.train.metrics import MetricLogger

wandb = pytest.importorskip("wandb")


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for key in ("WANDB_MODE", "WANDB_SILENT", "WANDB_ERROR_REPORTING", "WANDB_PROJECT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))  # overridden by dir=RUN_DIR
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))


def test_wandb_logs_offline_under_the_run_directory(clean_env, tmp_path):
    import os

    run_dir = tmp_path / "run"
    logger = MetricLogger(run_dir, "a", wandb=True, run_name="tiny", config={"train": {"steps": 3}})
    run = logger.sinks[1]._run
    assert os.environ["WANDB_MODE"] == "offline" and run.settings.mode == "offline"
    assert (run.name, run.group, dict(run.config)) == ("tiny/a", "tiny", {"train": {"steps": 3}})
    logger.log(0, {"loss/loss": 1.5, "flag": True, "text": "x"})
    logger.log(1, {"loss/loss": 0.5, "eval/accuracy": float("nan")})
    logger.log(2, {"loss/loss": 0.25})
    # W&B commits a step's row when the next step arrives: the summary now holds step 1's
    summary = dict(run.summary)
    assert summary["_step"] == 1 and summary["loss/loss"] == 0.5
    assert "eval/accuracy" not in summary and "text" not in summary and "flag" not in summary
    logger.close()
    runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 3  # JSONL still written


def test_a_mode_the_user_set_is_kept(clean_env, monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    logger = MetricLogger(tmp_path / "run", "a", wandb=True, run_name="tiny")
    logger.log(0, {"loss/loss": 1.0})
    logger.close()
    assert not list((tmp_path / "run" / "wandb").glob("offline-run-*"))


def test_wandb_without_the_package_fails_before_the_run(monkeypatch):
    from ftis.config import ConfigError, load_config
    from ftis.preflight import check_run

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name)
    )
    with pytest.raises(
        ConfigError, match=r"log.wandb: true needs the wandb package.*ftis\[tracking\]"
    ):
        check_run(load_config(None, ["log.wandb=true"]))
