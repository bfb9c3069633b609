"""Arms studies: a list of arms, each an ordinary `ftis run` config with overrides, run over seeds;
for comparisons whose arms are different algorithm kinds (RandOpt against CoRP against GRPO,
FedDPO against gossip DPO), which the loss-method grid of `ftis.study.spec` cannot express.

    kind: arms                           # what makes `ftis sweep` read the file this way
    name: population
    report: docs/results/population.md
    results: population                  # the study renderer that writes the document
    seeds: [0, 1, 2]
    set: [train.seed={seed}]             # overrides for every run; {seed} is the run's seed
    arms:
      corp-x1:
        config: ../configs/corp.yaml     # relative to the study file
        label: CoRP (two parties)
        series: corp                     # the curve this arm belongs to (default: its key)
        x: 1.0                           # its position on that curve (e.g. a budget multiple)
        set: [algorithm.population=128]

A run's id is `<arm>-s<seed>`; its directory is an ordinary run directory plus study-run.json.
Running, resuming (a run is done when every node logged its last step; anything else is redone
from scratch), `--only` and `--dry-run` are those of `ftis sweep` (ftis.study.runner).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from ftis.config import ConfigError, RunConfig, load_config
from ftis.study import tables
from ftis.study.document import reading_lines
from ftis.study.engine import plan_table as engine_plan_table
from ftis.study.registry import get_study_renderer
from ftis.study.runner import complete_runs
from ftis.study.spec import (
    _ID,
    RunSpec,
    StrictModel,
    Study,
    StudyError,
    is_study_of_kind,
    read_spec,
)
from ftis.study.tables import code_line, invocations_line, rel, seconds_cell, table
from ftis.train.metrics import read_metrics

KIND = "arms"


class ArmSpec(StrictModel):
    """One arm: a run config and its overrides."""

    config: str = Field(description="Run config, relative to the study file.")
    label: str | None = Field(None, description="Display name; default: the key.")
    description: str = Field("", description="One line for the results document.")
    series: str | None = Field(None, description="The curve this arm belongs to; default: key.")
    x: float | None = Field(None, description="The arm's position on its series (e.g. budget).")
    set: list[str] = Field(default_factory=list, description="Overrides; {seed} = the seed.")


class ArmsStudySpec(StrictModel):
    kind: Literal["arms"]
    name: str = Field(description="Study name; default output runs/study-<name>.")
    description: str = Field("", description="A paragraph for the results document.")
    out: str | None = Field(None, description="Output folder; default runs/study-<name>.")
    report: str = Field(description="Results document, relative to the cwd.")
    results: str = Field(
        description="The study renderer that writes the document, registered by a system "
        "(ftis.study.registry), e.g. population, dpo, swarm."
    )
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    set: list[str] = Field(default_factory=list, description="Overrides for every run.")
    arms: dict[str, ArmSpec] = Field(min_length=1)
    options: dict[str, Any] = Field(
        default_factory=dict, description="Renderer settings (see the renderer's docstring)."
    )

    @model_validator(mode="after")
    def _check(self) -> ArmsStudySpec:
        for key in [self.name, *self.arms]:
            if not _ID.fullmatch(key):
                raise ValueError(
                    f"name {key!r} must be letters, digits, '_', '-' or '.' (it names folders)"
                )
        get_study_renderer(self.results, "arms")  # ValueError naming the registered ones
        return self


@dataclass(frozen=True)
class ArmRun(RunSpec):
    """One run of an arms study (a RunSpec, so that ftis.study.runner runs it)."""

    arm: str = ""
    series: str = ""
    x: float | None = None

    @property
    def variant(self) -> str:
        return self.arm

    def meta(self) -> dict:
        return {
            "id": self.id,
            "arm": self.arm,
            "series": self.series,
            "x": self.x,
            "seed": self.seed,
        }


@dataclass
class ArmResult:
    """A complete run: its spec, its metrics rows and what `ftis sweep` recorded about it."""

    run: ArmRun
    rows: list[dict[str, Any]]
    seconds: float | None = None
    code: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def node_rows(self, node: str) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("node") == node]

    @property
    def nodes(self) -> list[str]:
        return [n.name for n in self.run.config.nodes]


def is_arms_study(path: str | Path) -> bool:
    """True when `path` is a YAML study with `kind: arms`."""
    return is_study_of_kind(path, KIND)


def load_arms_study(path: str | Path) -> Study:
    """Read, validate and expand an arms study (a Study whose runs are ArmRuns)."""
    path = Path(path)
    spec = read_spec(path, ArmsStudySpec)
    runs = []
    for seed in spec.seeds:
        for key, arm in spec.arms.items():
            rid = f"{key}-s{seed}"
            overrides = [s.replace("{seed}", str(seed)) for s in [*spec.set, *arm.set]]
            try:
                cfg = load_config((path.parent / arm.config).resolve(), [*overrides, f"name={rid}"])
            except ConfigError as e:
                raise StudyError(f"run {rid} ({arm.config}): {e}") from None
            runs.append(
                ArmRun(
                    id=rid,
                    pairing=key,
                    method=key,
                    scheme="vertical",
                    threshold=None,
                    seed=seed,
                    node=None,
                    config=cfg,
                    arm=key,
                    series=arm.series or key,
                    x=arm.x,
                )
            )
    return Study(spec=spec, path=path, runs=runs)  # type: ignore[arg-type]


def collect(study: Study, out_dir: Path) -> tuple[list[ArmResult], list[str]]:
    """The complete runs' results and the ids of the runs that are not complete."""
    done, missing = complete_runs(study, out_dir)
    results = [
        ArmResult(run, read_metrics(d / "metrics.jsonl"), meta.get("seconds"), meta.get("code"))  # type: ignore[arg-type]
        for run, d, meta in done
    ]
    return results, missing


# The `--dry-run` table: run, arm, seed, status (the engine's, an arm for its variant).
plan_table = functools.partial(engine_plan_table, variant="arm")


def write_arms_results(
    study: Study, *, out_dir: Path | None = None, report_path: Path | None = None
) -> Path:
    """Regenerate the study's document (and its plots) from its run directories, with the
    renderer its `results` names (ftis.study.engine.write_results)."""
    from ftis.study.engine import write_results

    return write_results(study, out_dir=out_dir, report_path=report_path)


def arm_config(study: Study, arm: str) -> RunConfig:
    """The config of `arm`'s first run (the same for every seed but train/algorithm seeds)."""
    return next(r.config for r in study.runs if r.pairing == arm)


def runs_table(results: list[ArmResult], out_dir: Path) -> list[str]:
    """Every complete run: arm, seed, wall seconds, code."""
    rows = [
        [
            r.run.id,
            r.run.arm,  # type: ignore[attr-defined]
            str(r.run.seed),
            seconds_cell(r.seconds),
            r.code or "-",
        ]
        for r in results
    ]
    return tables.runs_table(out_dir, ["run", "arm", "seed", "s", "code"], rows)


def document_head(
    study: Study,
    results: list[ArmResult],
    missing: list[str],
    out_dir: Path,
    *,
    title: str,
    note: str,
) -> list[str]:
    """The opening of an arms study's document: title, provenance, description, the code the
    runs were made with, sweep wall time, incomplete runs and the set-up section."""
    spec = study.spec
    L = [
        f"# {spec.name}: {title}",
        "",
        f"Generated by `ftis sweep {rel(study.path)}` from the run directories in "
        f"`{rel(out_dir)}`; do not edit by hand (except the reading, which is kept). {note}",
        "",
        spec.description.strip(),
        "",
        code_line(results, arm=lambda r: r.run.arm),
        "",
    ]
    inv = invocations_line(out_dir)
    if inv:
        L += [inv, ""]
    if missing:
        L += [f"{len(missing)} run(s) not complete: {', '.join(missing)}.", ""]
    return [*L, "## Set-up", "", *setup_lines(study), ""]


def document_tail(results: list[ArmResult], out_dir: Path, reading: str) -> list[str]:
    """The runs table and the hand-written reading (kept across regenerations)."""
    return [
        "## Runs",
        "",
        *runs_table(results, out_dir),
        "",
        *reading_lines(reading),
    ]


def image(path: Path, report: Path, alt: str) -> str:
    """A Markdown image of `path`, relative to the document `report`."""
    import os

    return f"![{alt}]({os.path.relpath(path, report.parent)})"


def setup_lines(study: Study) -> list[str]:
    """The study's arms, with their configs and overrides, for the document's set-up section."""
    spec = study.spec
    rows = []
    for key, arm in spec.arms.items():  # type: ignore[attr-defined]
        over = ", ".join(f"`{s}`" for s in arm.set) or "-"
        rows.append([key, arm.label or key, f"`{arm.config}`", over, arm.description or ""])
    common = ", ".join(f"`{s}`" for s in spec.set) or "none"
    return [
        f"Seeds: {', '.join(map(str, spec.seeds))}. Overrides of every run: {common}.",
        "",
        *table(["arm", "label", "config", "overrides", "what"], rows),
    ]


__all__ = [
    "KIND",
    "ArmResult",
    "ArmRun",
    "ArmsStudySpec",
    "arm_config",
    "collect",
    "document_head",
    "document_tail",
    "image",
    "is_arms_study",
    "load_arms_study",
    "runs_table",
    "setup_lines",
    "write_arms_results",
]
