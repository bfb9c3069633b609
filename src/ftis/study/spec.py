"""A study: a YAML file naming base configs ("pairings") and a grid of runs over them.

    name: paper
    set: [train.steps=40]                   # overrides for every run
    seeds: [0, 1, 2]                        # train.seed; warm starts do not depend on it
    pairings:
      size: {config: configs/size.yaml}     # relative to the study file
    methods:
      alone: {loss: vis, alone: true}       # one one-node run per node of the pairing
      f-tis: {loss: f-tis}
      reco-w: {loss: reco, set: [loss.reco_token_ratio=false]}  # node fields, every node
    grid:                                   # blocks; each is a cartesian product
      - {pairings: [size], methods: [alone, f-tis]}
      - {pairings: [size], methods: [f-tis], schemes: [horizontal]}
      - {pairings: [size], methods: [f-tis], thresholds: [5, 10]}

Every grid point becomes a `RunSpec` with a stable id (e.g. `size-f-tis-h-s1`,
`size-alone-small-s0`) and a fully validated `RunConfig`. Nothing here trains or touches disk
beyond reading the study and its base configs.
"""

from __future__ import annotations

import fnmatch
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ftis.config import (
    ConfigError,
    NodeConfig,
    RunConfig,
    check_loss_method,
    format_validation_error,
    load_config,
)
from ftis.study.registry import get_study_renderer

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_KEY = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


# the run-id tag of a non-default sharing scheme
SCHEME_TAGS = {"horizontal": "h", "joint": "j"}


M = TypeVar("M", bound=BaseModel)


class StudyError(ValueError):
    """A study file is invalid; the message says where and how to fix it."""


class StrictModel(BaseModel):
    """A study file's section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class PairingSpec(StrictModel):
    config: str = Field(description="Base run config (YAML), relative to the study file.")
    label: str | None = Field(None, description="Display name in the results; default: the key.")
    description: str = Field("", description="One line for the results document.")
    set: list[str] = Field(default_factory=list, description="Overrides for this pairing only.")


class MethodSpec(StrictModel):
    loss: str = Field(description="loss.method given to every node of the run.")
    label: str | None = Field(None, description="Display name, e.g. 'F-TIS'; default: the key.")
    alone: bool = Field(
        False, description="Train each node of the pairing alone: one one-node run per node."
    )
    set: list[str] = Field(
        default_factory=list,
        description="Overrides of node fields, KEY=VALUE with KEY relative to a node (e.g. "
        "loss.reco_token_ratio=false, optim.lr=3e-4), applied to every node of the run like "
        "`loss`: after the study's and the pairing's `set`, before the grid's threshold. The run "
        "id does not change: give such variants their own method key.",
    )
    run_set: list[str] = Field(
        default_factory=list,
        description="Overrides of run fields, KEY=VALUE (e.g. train.group_size=8 for an Alone "
        "baseline that generates what a collaborating node trains on), applied after `set`.",
    )

    @field_validator("loss")
    @classmethod
    def _known(cls, v: str) -> str:
        return check_loss_method(v)

    @field_validator("set")
    @classmethod
    def _node_keys(cls, v: list[str]) -> list[str]:
        fields = sorted(f for f in NodeConfig.model_fields if f != "name")
        for item in v:
            key = item.split("=", 1)[0].strip()
            if "=" not in item or not _KEY.fullmatch(key):
                raise ValueError(
                    f"set: {item!r} is not KEY=VALUE with a dotted node key, e.g. "
                    "loss.reco_token_ratio=false"
                )
            head = key.split(".", 1)[0]
            if head not in fields:
                raise ValueError(
                    f"set: {item!r}: {head!r} is not a node field; keys are relative to a node "
                    f"({', '.join(fields)}); study-wide settings go in the study's `set`"
                )
            if key == "loss.method":
                raise ValueError(f"set: {item!r}: give the loss method as the method's `loss`")
        return v


class GridBlock(StrictModel):
    """A cartesian product of pairings x methods x schemes x thresholds x seeds."""

    pairings: list[str] = Field(min_length=1)
    methods: list[str] = Field(min_length=1)
    schemes: list[Literal["vertical", "horizontal", "joint"]] = Field(
        default_factory=lambda: ["vertical"]
    )
    thresholds: list[float | None] = Field(
        default_factory=lambda: [None],
        description="loss.filter_threshold (g); null keeps the base config's value.",
    )
    seeds: list[int] | None = Field(None, description="Default: the study's seeds.")


class ArmRef(StrictModel):
    """One side of a primary comparison: the runs of one grid point, one node's evaluations."""

    pairing: str | None = Field(None, description="Pairing key; may be left out with one pairing.")
    method: str = Field(description="Method key.")
    node: str = Field(
        description="The node whose evaluations are compared; a glob pattern (llama-s-*) "
        "names a kind of peer, whose outcome per problem is the mean over its nodes."
    )
    scheme: Literal["vertical", "horizontal", "joint"] | None = Field(
        None, description="Sharing scheme; may be left out where the method runs under one."
    )
    threshold: float | None = Field(None, description="loss.filter_threshold of the grid point.")


class PrimaryComparison(StrictModel):
    """A comparison named before the runs (docs/math.md §11): reported first, with intervals
    corrected for the number of primary comparisons; the reading may call a result only here."""

    name: str = Field(description="How the document names it, e.g. 'F-TIS vs Alone G=8, adder'.")
    a: ArmRef
    b: ArmRef
    split: str = Field("test", description="The eval split compared, at each run's last step.")
    equivalence: float | None = Field(
        None,
        gt=0,
        description="Declare the claim 'A matches B': the margin in accuracy points; the "
        "document says whether the interval lies within +-margin.",
    )


class StudySpec(StrictModel):
    kind: Literal["grid"] = Field("grid", description="A grid study (the default kind).")
    name: str = Field(description="Study name; default output runs/study-<name>.")
    description: str = Field("", description="A paragraph for the results document.")
    out: str | None = Field(None, description="Output folder; default runs/study-<name>.")
    report: str = Field("docs/RESULTS.md", description="Results document, relative to the cwd.")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    set: list[str] = Field(default_factory=list, description="Overrides for every run.")
    pairings: dict[str, PairingSpec] = Field(min_length=1)
    methods: dict[str, MethodSpec] = Field(min_length=1)
    grid: list[GridBlock] = Field(min_length=1)
    options: dict = Field(
        default_factory=dict, description="Settings for the study's renderer (`results`)."
    )
    results: str = Field(
        "ftis",
        description="The study renderer that writes the document (ftis.study.registry); "
        "default: the F-TIS family's grid document (ftis.results.grid).",
    )
    primary: list[PrimaryComparison] = Field(
        default_factory=list,
        description="Comparisons named before the runs (ftis.study.primary): the document "
        "reports them first, Bonferroni-corrected; every other cell is exploratory.",
    )

    @model_validator(mode="after")
    def _check_refs(self) -> StudySpec:
        get_study_renderer(self.results, "grid")  # ValueError naming the registered ones
        for key in [self.name, *self.pairings, *self.methods]:
            if not _ID.fullmatch(key):
                raise ValueError(
                    f"name {key!r} must be letters, digits, '_', '-' or '.' (it names folders)"
                )
        for i, b in enumerate(self.grid):
            for p in b.pairings:
                if p not in self.pairings:
                    raise ValueError(
                        f"grid[{i}].pairings: {p!r} is not defined under pairings "
                        f"(defined: {', '.join(self.pairings)})"
                    )
            for m in b.methods:
                if m not in self.methods:
                    raise ValueError(
                        f"grid[{i}].methods: {m!r} is not defined under methods "
                        f"(defined: {', '.join(self.methods)})"
                    )
        return self


@dataclass(frozen=True)
class RunSpec:
    """One run of a study: where it sits in the grid, and its validated config."""

    id: str
    pairing: str
    method: str
    scheme: str
    threshold: float | None
    seed: int
    node: str | None  # the node trained alone, for `alone` methods
    config: RunConfig = field(compare=False, repr=False)

    @property
    def variant(self) -> str:
        """The method plus any ablation axes, e.g. 'f-tis', 'f-tis h', 'f-tis g=5' ('j': joint
        groups)."""
        parts = [self.method]
        if self.scheme != "vertical":
            parts.append(SCHEME_TAGS[self.scheme])
        if self.threshold is not None:
            parts.append(f"g={self.threshold:g}")
        return " ".join(parts)

    def meta(self) -> dict:
        return {
            "id": self.id,
            "pairing": self.pairing,
            "method": self.method,
            "scheme": self.scheme,
            "threshold": self.threshold,
            "seed": self.seed,
            "node": self.node,
            "variant": self.variant,
        }


@dataclass
class Study:
    spec: StudySpec
    path: Path
    runs: list[RunSpec]

    @property
    def out_dir(self) -> Path:
        return Path(self.spec.out) if self.spec.out else Path("runs") / f"study-{self.spec.name}"

    def runs_of(self, ref: ArmRef, where: str = "primary") -> list[RunSpec]:
        """The runs (one per seed) of the grid point `ref` names, whose evaluations of
        `ref.node` a primary comparison reads; StudyError naming what does not match."""
        pairing = ref.pairing
        if pairing is None:
            if len(self.spec.pairings) != 1:
                raise StudyError(
                    f"study {self.path}: {where}: name the pairing (one of "
                    f"{', '.join(self.spec.pairings)})"
                )
            pairing = next(iter(self.spec.pairings))
        method = self.spec.methods.get(ref.method)
        if method is None:
            raise StudyError(
                f"study {self.path}: {where}: method {ref.method!r} is not defined under methods"
            )
        found = [
            r
            for r in self.runs
            if r.pairing == pairing
            and r.method == ref.method
            and (ref.scheme is None or r.scheme == ref.scheme)
            and r.threshold == ref.threshold
            and (r.node == ref.node if method.alone else True)
        ]
        if not found:
            raise StudyError(
                f"study {self.path}: {where}: no run of the grid is pairing {pairing!r}, method "
                f"{ref.method!r}"
                + (f", scheme {ref.scheme!r}" if ref.scheme else "")
                + (f", node {ref.node!r}" if method.alone else "")
                + (f", threshold {ref.threshold:g}" if ref.threshold is not None else "")
                + ": check the names against the grid"
            )
        variants = sorted({(r.scheme, r.node) for r in found}, key=str)
        if len(variants) > 1:
            raise StudyError(
                f"study {self.path}: {where}: {len(variants)} grid points match "
                f"({', '.join(sorted({r.variant for r in found}))}): give the scheme"
            )
        nodes = [n.name for n in found[0].config.nodes]
        if not any(fnmatch.fnmatchcase(n, ref.node) for n in nodes):
            raise StudyError(
                f"study {self.path}: {where}: runs {found[0].id} have no node {ref.node!r} "
                f"(nodes: {', '.join(nodes)})"
            )
        return sorted(found, key=lambda r: r.seed)

    def select(self, pattern: str | None) -> list[RunSpec]:
        """Runs whose id matches a glob pattern (`size-*`, `*-f-tis-*`); all when None."""
        if not pattern:
            return list(self.runs)
        return [r for r in self.runs if fnmatch.fnmatchcase(r.id, pattern)]


def read_spec(path: str | Path, model: type[M]) -> M:
    """A study file read and validated as `model` (StudyError naming what is wrong)."""
    path = Path(path)
    if not path.exists():
        raise StudyError(f"study file {str(path)!r} does not exist; give a YAML path")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise StudyError(f"study file {str(path)!r} is not valid YAML: {e}") from e
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise StudyError(
            f"study {path}: " + format_validation_error(e).replace("config", "study", 1)
        ) from None


def is_study_of_kind(path: str | Path, kind: str) -> bool:
    """True when `path` is a YAML study with `kind: <kind>` (anything else: False, and the
    ordinary study reader reports what is wrong with it)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and data.get("kind") == kind


def read_study_spec(path: str | Path) -> StudySpec:
    return read_spec(path, StudySpec)


def _fmt_threshold(g: float) -> str:
    return f"{g:g}".replace(".", "p")


def run_id(
    pairing: str, method: str, scheme: str, threshold: float | None, seed: int, node: str | None
) -> str:
    parts = [pairing, method]
    if node is not None:
        parts.append(node)
    if scheme != "vertical":
        parts.append(SCHEME_TAGS[scheme])
    if threshold is not None:
        parts.append(f"g{_fmt_threshold(threshold)}")
    parts.append(f"s{seed}")
    return "-".join(parts)


def _node_overrides(
    n_nodes: int, loss: str, threshold: float | None, node_set: Sequence[str] = ()
) -> list[str]:
    out = []
    for i in range(n_nodes):
        out.append(f"nodes.{i}.loss.method={loss}")
        out += [f"nodes.{i}.{item.lstrip()}" for item in node_set]
        if threshold is not None:
            out.append(f"nodes.{i}.loss.filter_threshold={threshold}")
    return out


def _build(config_path: Path, overrides: list[str], where: str) -> RunConfig:
    try:
        return load_config(config_path, overrides)
    except ConfigError as e:
        raise StudyError(f"{where}: {e}") from None


def _alone(cfg: RunConfig, index: int, name: str, where: str) -> RunConfig:
    data = cfg.model_dump(mode="json")
    data["nodes"] = [data["nodes"][index]]
    data["name"] = name
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise StudyError(f"{where}: {format_validation_error(e)}") from None


def expand(spec: StudySpec, study_path: Path) -> list[RunSpec]:
    """Every run of the grid, in grid order, each id once (a later duplicate is dropped)."""
    base_dir = study_path.parent
    runs: dict[str, RunSpec] = {}
    for block in spec.grid:
        seeds = block.seeds if block.seeds is not None else spec.seeds
        for pairing, method, scheme, g, seed in itertools.product(
            block.pairings, block.methods, block.schemes, block.thresholds, seeds
        ):
            p, m = spec.pairings[pairing], spec.methods[method]
            cfg_path = (base_dir / p.config).resolve()
            head = _build(cfg_path, [], f"pairing {pairing!r} ({p.config})")
            overrides = [
                *spec.set,
                *p.set,
                *_node_overrides(len(head.nodes), m.loss, g, m.set),
                f"sharing.scheme={scheme}",
                f"train.seed={seed}",
                *m.run_set,
            ]
            if m.alone:
                targets = [(i, n.name) for i, n in enumerate(head.nodes)]
            else:
                targets = [(None, None)]
            for index, node in targets:
                rid = run_id(pairing, method, scheme, g, seed, node)
                if rid in runs:
                    continue
                cfg = _build(cfg_path, overrides + [f"name={rid}"], f"run {rid}")
                if index is not None:
                    cfg = _alone(cfg, index, rid, f"run {rid}")
                runs[rid] = RunSpec(
                    id=rid,
                    pairing=pairing,
                    method=method,
                    scheme=scheme,
                    threshold=g,
                    seed=seed,
                    node=node,
                    config=cfg,
                )
    return list(runs.values())


def load_study(path: str | Path) -> Study:
    """Read, validate and expand a study file."""
    path = Path(path)
    spec = read_study_spec(path)
    study = Study(spec=spec, path=path, runs=expand(spec, path))
    for i, c in enumerate(spec.primary):
        for side in ("a", "b"):
            study.runs_of(getattr(c, side), f"primary[{i}] ({c.name!r}).{side}")
    return study
