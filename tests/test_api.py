"""`ftis.run(config)`: the Python entry point trains from a dict, a YAML path or a RunConfig,
applies overrides, writes the report and returns the run directory; bad input is a ConfigError
naming the field."""

from __future__ import annotations

import json

import pytest
import yaml

import ftis
from ftis.config import ConfigError, RunConfig
from tests.conftest import tiny_run_config


def _data() -> dict:
    data = tiny_run_config(steps=2)
    data["eval"] = {"every": 0, "size": 8, "pass_samples": 0}
    return data


def _steps(run_dir) -> list[int]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sorted({r["step"] for r in rows})


def test_run_from_a_dict_with_overrides_returns_the_run_directory(tmp_path):
    data = _data()
    run_dir = ftis.run(data, out=tmp_path / "r", overrides=["train.steps=1"])
    assert run_dir == tmp_path / "r"
    assert _steps(run_dir) == [0, 1]
    assert (run_dir / "report.md").is_file()
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["steps"] == 1
    assert data["train"]["steps"] == 2  # the caller's dict is left as it was


def test_run_from_a_yaml_path_and_a_run_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_data()))
    from ftis.api import resolve_config

    assert resolve_config(path, ["train.steps=5"]).train.steps == 5
    cfg = RunConfig.model_validate(_data())
    assert resolve_config(cfg) is cfg
    assert resolve_config(cfg, ["train.top_k=4"]).train.top_k == 4


def test_bad_input_is_a_config_error_naming_the_field():
    bad = _data()
    bad["train"]["group_size"] = 1
    with pytest.raises(ConfigError, match="train.group_size"):
        ftis.run(bad, out="unused")
    with pytest.raises(ConfigError, match="YAML path, a dict or a RunConfig"):
        ftis.run(42)
