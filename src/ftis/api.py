"""The Python entry point: `ftis.run(config)` does what `ftis run` does, from a YAML path, a dict
or a RunConfig, and returns the run directory."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ftis.config import (
    ConfigError,
    RunConfig,
    _drop_other_kinds_fields,
    apply_overrides,
    format_validation_error,
    load_config,
)


def resolve_config(
    config: str | Path | dict[str, Any] | RunConfig | None, overrides: Sequence[str] = ()
) -> RunConfig:
    """A validated RunConfig from a YAML path (None: the embedded default), a dict shaped like
    the YAML, or a RunConfig; `overrides` are `--set` strings ("train.steps=20") applied on
    top. ConfigError naming the field and the fix otherwise."""
    if config is None or isinstance(config, str | Path):
        return load_config(config, list(overrides))
    if isinstance(config, RunConfig):
        if not overrides:
            return config
        config = config.model_dump(mode="json")
    if not isinstance(config, dict):
        raise ConfigError(
            f"config must be a YAML path, a dict or a RunConfig, got {type(config).__name__}"
        )
    data = apply_overrides(copy.deepcopy(config), list(overrides))
    _drop_other_kinds_fields(data, list(overrides))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


def run(
    config: str | Path | dict[str, Any] | RunConfig | None = None,
    out: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    resume: bool = False,
    overwrite: bool = False,
) -> Path:
    """Train as `ftis run` does (warm start, RL, checkpoints, report.md) and return the run
    directory (`out`, default runs/<name>). `resume=True` continues the run in `out` from its
    checkpoints (its config.yaml; `config` must then be None, overrides still apply).

    Errors are exceptions, not exit codes: ConfigError, RunDirError, ModelLoadError,
    CheckpointError, LaunchError and the others `ftis run` turns into one line."""
    from ftis.launch import run_local
    from ftis.preflight import check_run
    from ftis.report import write_report
    from ftis.rundir import claim

    if resume:
        if out is None or config is not None:
            raise ConfigError("resume=True takes the run directory as out= and no config")
        cfg = load_config(Path(out) / "config.yaml", list(overrides))
        run_dir = Path(out)
    else:
        cfg = resolve_config(config, overrides)
        run_dir = Path(out) if out is not None else Path("runs") / cfg.name
    check_run(cfg)
    with claim(run_dir, overwrite=overwrite, resume=resume):
        (run_dir / "config.yaml").write_text(
            yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
        )
        run_local(cfg, run_dir, resume=resume)
    write_report(run_dir)
    return run_dir
