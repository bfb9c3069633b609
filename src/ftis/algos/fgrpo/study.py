"""The FGRPO study (issue 12, part 6): aggregation rules against centralized GRPO on the union of
the clients' data and each client alone, at equal local steps, over seeds.

    kind: fgrpo                          # what makes `ftis sweep` read the file this way
    name: fgrpo
    config: ../configs/fgrpo.yaml        # the federation, relative to the study file
    report: docs/results/fgrpo.md
    seeds: [0, 1, 2]                     # train.seed of every run
    set: [eval.every=1]                  # overrides of the federation, for every arm
    arms:
      relative-gain: {kind: federated, aggregation: relative-gain}
      fedavg:        {kind: federated, aggregation: fedavg}
      central:       {kind: centralized} # one model, GRPO on the union of the clients' data
      alone:         {kind: alone}       # one single-node run per client, on its own data
    stability: {last: 5, drop: 0.02}

Every arm is an ordinary `ftis run` directory. With E local steps per round, R rounds and P_k
prompts per local step for client k, the single-node arms are derived from the federation:

    alone (client k)  R*E GRPO steps of P_k prompts on k's task: the client's own local work in
                      the federation (same optimizer steps, same number of samples)
    centralized       R*E GRPO steps of sum_k P_k prompts on the union of the clients' tasks
                      (op weights mixed in proportion to P_k): the federation's total samples in
                      as many optimizer steps as one client takes
    both              the federation's base model (its cached warm start, by path), node
                      optimizer and loss; evaluation every E*eval.every steps = every
                      eval.every rounds; a row's step / E is its round

A client's accuracy is greedy accuracy on its own task's eval split, the very split its
federated client evaluates on. An `alone` run's task is that client's task, so its own rows are
that accuracy. A centralized run's own task is the union: after training, the study evaluates
its checkpoints (one per evaluation point) on every client's split, with the federation's eval
settings, into `client-eval.jsonl` in the run directory (rows like metrics.jsonl: step, node =
client, round, eval/*), then prunes the checkpoints to `checkpoint.keep`.

Resume rule: as `ftis sweep`'s (ftis.study.runner), plus: a centralized run is done when its
client-eval.jsonl covers every evaluation point; a trained one without it is only evaluated.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator
from rich.console import Console

from ftis.config import ConfigError, RunConfig, apply_overrides, format_validation_error
from ftis.config import load_config as load_run_config
from ftis.models.sources import model_label
from ftis.study.runner import (
    RUN_META,
    SweepOutcome,
    code_version,
    execute_run,
    run_status,
    run_study,
)
from ftis.study.runner import plan as runner_plan
from ftis.study.spec import _ID, StrictModel, Study, StudyError, is_study_of_kind, read_spec

log = logging.getLogger(__name__)

KIND = "fgrpo"
CLIENT_EVAL = "client-eval.jsonl"  # a centralized run's accuracy on every client's eval split
CENTRAL_NODE = "central"  # the node name of a centralized run

ArmKind = Literal["federated", "centralized", "alone"]
Status = Literal["done", "incomplete", "todo", "trained"]  # trained: only its client eval is left


# ---------------------------------------------------------------------------------------- spec


class ArmSpec(StrictModel):
    """One arm of the comparison."""

    kind: ArmKind = Field(
        description="federated: the federation itself (Flower); centralized: one model trained "
        "with GRPO on the union of the clients' data; alone: each client trained by itself."
    )
    label: str | None = Field(None, description="Display name; default: the key.")
    aggregation: Literal["relative-gain", "fedavg", "uniform", "reward"] | None = Field(
        None, description="federated: algorithm.aggregation; null keeps the config's."
    )
    set: list[str] = Field(
        default_factory=list,
        description="Overrides of this arm's run configs (federated: the federation's; "
        "centralized, alone: the derived single-node config's).",
    )
    description: str = Field("", description="One line for the results document.")

    @model_validator(mode="after")
    def _aggregation_only_federated(self) -> ArmSpec:
        if self.aggregation is not None and self.kind != "federated":
            raise ValueError(f"aggregation applies to federated arms only, not to {self.kind}")
        return self


class StabilitySpec(StrictModel):
    """How the document measures stability across rounds (per client, run and seed)."""

    last: int = Field(
        5, ge=2, description="Std of accuracy over the last this many evaluated rounds."
    )
    drop: float = Field(
        0.02,
        ge=0,
        le=1,
        description="A drop: accuracy falls by more than this (a fraction) from one evaluated "
        "round to the next.",
    )


class FGRPOStudySpec(StrictModel):
    kind: Literal["fgrpo"] = Field(description="Marks an FGRPO study for `ftis sweep`.")
    name: str = Field(description="Study name; default output runs/study-<name>.")
    description: str = Field("", description="A paragraph for the results document.")
    config: str = Field(description="The federation's run config, relative to the study file.")
    out: str | None = Field(None, description="Output folder; default runs/study-<name>.")
    report: str = Field("docs/results/fgrpo.md", description="Results document (cwd-relative).")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    set: list[str] = Field(default_factory=list, description="Overrides of the federation.")
    arms: dict[str, ArmSpec] = Field(min_length=1)
    stability: StabilitySpec = Field(default_factory=StabilitySpec)

    @model_validator(mode="after")
    def _names(self) -> FGRPOStudySpec:
        for key in [self.name, *self.arms]:
            if not _ID.fullmatch(key):
                raise ValueError(
                    f"name {key!r} must be letters, digits, '_', '-' or '.' (it names folders)"
                )
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeat a seed")
        return self


# ---------------------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class FGRPORun:
    """One run of the study. `clients`: the clients whose accuracy it reports; a row's step
    divided by `steps_per_round` is its round; `federation`: the federated config the run's
    rounds and evaluation follow (a federated run's own; for a single-node run, the study's
    federation of the same seed, from which its budget and eval settings are derived);
    `client_tasks`: each client's task config (its eval split) in that federation."""

    id: str
    arm: str
    kind: ArmKind
    seed: int
    client: str | None  # alone: the client trained
    clients: tuple[str, ...]
    steps_per_round: int
    config: RunConfig = field(compare=False, repr=False)
    federation: RunConfig = field(compare=False, repr=False)
    client_tasks: dict[str, dict[str, Any]] = field(compare=False, repr=False)

    def meta(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "study": KIND,
            "arm": self.arm,
            "kind": self.kind,
            "seed": self.seed,
            "client": self.client,
            "steps_per_round": self.steps_per_round,
        }

    def round_of(self, step: int) -> int | None:
        """The round a row's step ends (None for a step inside a round)."""
        q, r = divmod(int(step), self.steps_per_round)
        return q if r == 0 else None

    def eval_rounds(self) -> list[int]:
        """The rounds at which this run evaluates: 0, every eval.every rounds, the last."""
        rounds, every = self.federation.train.steps, self.federation.eval.every
        out = {0, rounds}
        if every:
            out.update(range(every, rounds + 1, every))
        return sorted(out)


@dataclass
class FGRPOStudy(Study):
    """A validated study and its runs (a Study, as `ftis.study.runner` expects; its out_dir
    and select)."""

    spec: FGRPOStudySpec  # type: ignore[assignment]
    path: Path
    runs: list[FGRPORun]  # type: ignore[assignment]

    def label(self, arm: str) -> str:
        a = self.spec.arms.get(arm)
        return (a.label or arm) if a else arm

    @property
    def clients(self) -> list[str]:
        return [n.name for n in self.runs[0].federation.nodes] if self.runs else []


def is_fgrpo_study(path: str | Path) -> bool:
    """True when `path` is a YAML study with `kind: fgrpo` (anything else: False, and the
    ordinary study reader reports what is wrong with it)."""
    return is_study_of_kind(path, KIND)


def read_fgrpo_spec(path: str | Path) -> FGRPOStudySpec:
    return read_spec(path, FGRPOStudySpec)


def load_fgrpo_study(path: str | Path) -> FGRPOStudy:
    """Read, validate and expand an FGRPO study file (no training, no warm start)."""
    path = Path(path)
    spec = read_fgrpo_spec(path)
    return FGRPOStudy(spec=spec, path=path, runs=expand(spec, path))


def _federation(spec: FGRPOStudySpec, cfg_path: Path, extra: list[str], where: str) -> RunConfig:
    try:
        cfg = load_run_config(cfg_path, [*spec.set, *extra])
    except ConfigError as e:
        raise StudyError(f"{where}: {e}") from None
    if cfg.algorithm.kind != KIND:
        raise StudyError(
            f"{where}: {cfg_path} is an algorithm.kind={cfg.algorithm.kind!r} config; an FGRPO "
            "study needs a federation (algorithm.kind: fgrpo), e.g. configs/fgrpo.yaml"
        )
    return cfg


def expand(spec: FGRPOStudySpec, study_path: Path) -> list[FGRPORun]:
    """Every run, seed by seed, arms in the study's order (alone: one run per client)."""
    cfg_path = (study_path.parent / spec.config).resolve()
    runs: list[FGRPORun] = []
    for seed in spec.seeds:
        fed = _federation(spec, cfg_path, [f"train.seed={seed}"], f"config {spec.config}")
        algo = fed.algorithm
        names = [n.name for n in fed.nodes]
        tasks = {n: algo.client_task(fed, n) for n in names}  # type: ignore[attr-defined]
        for arm, a in spec.arms.items():
            if a.kind == "federated":
                rid = f"{arm}-s{seed}"
                extra = [f"train.seed={seed}", f"name={rid}"]
                if a.aggregation is not None:
                    extra.append(f"algorithm.aggregation={a.aggregation}")
                cfg = _federation(spec, cfg_path, [*extra, *a.set], f"run {rid}")
                own = {n: cfg.algorithm.client_task(cfg, n) for n in names}  # type: ignore[attr-defined]
                runs.append(
                    FGRPORun(rid, arm, "federated", seed, None, tuple(names), 1, cfg, cfg, own)
                )
            elif a.kind == "centralized":
                rid = f"{arm}-s{seed}"
                cfg = centralized_config(fed, name=rid, overrides=a.set)
                E = algo.local_steps  # type: ignore[attr-defined]
                runs.append(
                    FGRPORun(rid, arm, "centralized", seed, None, tuple(names), E, cfg, fed, tasks)
                )
            else:
                for client in names:
                    rid = f"{arm}-{client}-s{seed}"
                    cfg = alone_config(fed, client, name=rid, overrides=a.set)
                    E = algo.local_steps  # type: ignore[attr-defined]
                    runs.append(
                        FGRPORun(rid, arm, "alone", seed, client, (client,), E, cfg, fed, tasks)
                    )
    return runs


# ------------------------------------------------------------------- single-node arms' configs


def base_model_dir(fed: RunConfig) -> Path | None:
    """Where the federation's base model (its clients' shared warm start) is cached: the
    directory `ftis.algos.fgrpo.launch` trains once and loads (None: no warm start)."""
    from ftis.warmstart import cache_key, cache_root

    node = fed.nodes[0]
    if node.warm_start is None:
        return None
    key = cache_key(node.model, node.warm_start, fed.task)
    name = Path(model_label(node.model)).name
    return cache_root() / "warmstart" / f"{name}-{key}"


def ensure_base_model(fed: RunConfig) -> Path | None:
    """Train (or find in the cache) the federation's base model; returns its directory."""
    from ftis.warmstart import warm_start

    node = fed.nodes[0]
    if node.warm_start is None:
        return None
    path = warm_start(node.model, node.warm_start, fed.task)
    expected = base_model_dir(fed)
    if Path(path).resolve() != Path(expected).resolve():  # type: ignore[arg-type]
        raise StudyError(f"the base model is in {path}, not in {expected} as the plan assumed")
    return Path(path)


def union_task(fed: RunConfig) -> dict[str, Any]:
    """The union of the clients' data as one arithmetic task: the clients' tasks, which may
    differ only in their op weights, with op weights mixed in proportion to each client's prompts
    per local step. Exact for 2-term problems (one op per problem); StudyError otherwise."""
    algo = fed.algorithm
    names = [n.name for n in fed.nodes]
    tasks = {n: algo.client_task(fed, n) for n in names}  # type: ignore[attr-defined]
    first = tasks[names[0]]
    if first.get("kind") != "arithmetic":
        raise StudyError(
            f"a centralized arm needs the clients' union as one task; only arithmetic clients "
            f"(op mixes) can be merged, not {first.get('kind')!r}: drop the centralized arm"
        )
    for n in names[1:]:
        other = {k: v for k, v in tasks[n].items() if k != "ops"}
        if other != {k: v for k, v in first.items() if k != "ops"}:
            raise StudyError(
                f"clients {names[0]!r} and {n!r} differ in more than their op weights, so their "
                "union is not one arithmetic task: drop the centralized arm or give the clients "
                "the same task apart from `ops`"
            )
    if first.get("terms", 2) != 2:
        raise StudyError(
            f"task.terms={first['terms']}: with more than one op per problem the mix of the "
            "clients' op weights is not their union; use 2-term problems for a centralized arm"
        )
    prompts = {n: _prompts(fed, n) for n in names}
    total = sum(prompts.values())
    union: dict[str, float] = {}
    for n in names:
        ops = tasks[n]["ops"]
        mass = sum(ops.values())
        for op, w in ops.items():
            union[op] = union.get(op, 0.0) + prompts[n] / total * w / mass
    return {**first, "ops": {op: round(w, 12) for op, w in union.items() if w > 0}}


def _prompts(fed: RunConfig, client: str) -> int:
    spec = fed.algorithm.client_spec(client)  # type: ignore[attr-defined]
    return spec.prompts_per_step or fed.train.prompts_per_step


def _check_rewards(fed: RunConfig, where: str) -> None:
    """A single-node run scores with the verifier's own rewards. With group-std advantages
    (`loss.advantage_scale: std`) a client's reward scale cancels in every group, so its local
    training is the same; without it, it is not, and the baseline would not be comparable."""
    algo = fed.algorithm
    scaled = [
        n.name
        for n in fed.nodes
        if algo.client_spec(n.name).reward_scale != 1.0  # type: ignore[attr-defined]
    ]
    if scaled and any(n.loss.advantage_scale != "std" for n in fed.nodes):
        raise StudyError(
            f"{where}: clients {scaled} scale their rewards, which a single-node run cannot, and "
            "loss.advantage_scale is not 'std' (where the scale would cancel): use "
            "advantage_scale: std or drop the centralized and alone arms"
        )
    if algo.clients_per_round:  # type: ignore[attr-defined]
        raise StudyError(
            f"{where}: algorithm.clients_per_round={algo.clients_per_round} (partial "  # type: ignore[attr-defined]
            "participation): the single-node arms' budgets assume every client trains every "
            "round; set it to 0"
        )


def _single_node(
    fed: RunConfig,
    *,
    node_index: int,
    node_name: str,
    task: dict[str, Any],
    prompts: int,
    checkpoint_every_rounds: int,
    keep: int,
    name: str,
    overrides: list[str],
) -> RunConfig:
    E = fed.algorithm.local_steps  # type: ignore[attr-defined]
    data = fed.model_dump(mode="json")
    node = data["nodes"][node_index]
    node["name"] = node_name
    base = base_model_dir(fed)
    if base is not None:  # the federation's base model itself, not a second warm start
        node["model"] = {**node["model"], "path": str(base), "preset": None}
        node["warm_start"] = None
    data["nodes"] = [node]
    data["algorithm"] = {"kind": "ftis"}
    data["task"] = task
    data["train"] = {**data["train"], "steps": E * fed.train.steps, "prompts_per_step": prompts}
    data["eval"] = {**data["eval"], "every": E * fed.eval.every}
    data["checkpoint"] = {"every": E * checkpoint_every_rounds, "keep": keep}
    data["testing"] = {}
    data["name"] = name
    try:
        data = apply_overrides(data, overrides)
        return RunConfig.model_validate(data)
    except ConfigError as e:
        raise StudyError(f"run {name}: {e}") from None
    except ValidationError as e:
        raise StudyError(f"run {name}: {format_validation_error(e)}") from None


def alone_config(fed: RunConfig, client: str, *, name: str, overrides: list[str]) -> RunConfig:
    """Client `client` by itself: its own task, prompts per step and node config, R*E steps."""
    _check_rewards(fed, f"run {name}")
    names = [n.name for n in fed.nodes]
    return _single_node(
        fed,
        node_index=names.index(client),
        node_name=client,
        task=fed.algorithm.client_task(fed, client),  # type: ignore[attr-defined]
        prompts=_prompts(fed, client),
        checkpoint_every_rounds=fed.checkpoint.every,
        keep=fed.checkpoint.keep,
        name=name,
        overrides=overrides,
    )


def centralized_config(fed: RunConfig, *, name: str, overrides: list[str]) -> RunConfig:
    """One model on the union of the clients' data: sum_k P_k prompts per step, R*E steps; a
    checkpoint at every evaluation point (all kept, for the clients' evaluation)."""
    _check_rewards(fed, f"run {name}")
    first = fed.nodes[0]
    for n in fed.nodes[1:]:
        if n.optim != first.optim or n.loss != first.loss:
            raise StudyError(
                f"run {name}: clients {first.name!r} and {n.name!r} have different optim or "
                "loss sections; a centralized run has one: give every client the same"
            )
    every = fed.eval.every or fed.train.steps
    points = len(range(every, fed.train.steps + 1, every)) + 2  # + the last, + margin
    return _single_node(
        fed,
        node_index=0,
        node_name=CENTRAL_NODE,
        task=union_task(fed),
        prompts=sum(_prompts(fed, n.name) for n in fed.nodes),
        checkpoint_every_rounds=every,
        keep=points,
        name=name,
        overrides=overrides,
    )


# ------------------------------------------------------------------ centralized: client eval


def _eval_checkpoints(run: FGRPORun, run_dir: Path) -> dict[int, Path]:
    """step -> checkpoint directory of the run's node, for the steps it must evaluate."""
    from ftis.train.checkpoint import read_meta

    node_dir = run_dir / "nodes" / run.config.nodes[0].name
    found: dict[int, Path] = {}
    for ckpt in sorted(p for p in node_dir.glob("step-*") if p.is_dir()):
        try:
            found[int(read_meta(ckpt)["step"])] = ckpt
        except Exception:  # a damaged one: load_checkpoint would name it; here it is missing
            continue
    return found


def client_eval_complete(run: FGRPORun, run_dir: Path) -> bool:
    """The run's client-eval.jsonl has every client at every evaluated round."""
    from ftis.train.metrics import read_metrics

    path = run_dir / CLIENT_EVAL
    if not path.exists():
        return False
    have = {(r.get("round"), r.get("node")) for r in read_metrics(path)}
    return all((r, c) in have for r in run.eval_rounds() for c in run.clients)


def can_evaluate(run: FGRPORun, run_dir: Path) -> bool:
    """Every evaluation point after round 0 has its checkpoint (round 0 is the base model)."""
    found = _eval_checkpoints(run, run_dir)
    return all(r * run.steps_per_round in found for r in run.eval_rounds() if r > 0)


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """Loading a checkpoint restores its RNG states; the study's own process keeps its own."""
    import torch

    py, th = random.getstate(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py)
        torch.set_rng_state(th)


def evaluate_clients(run: FGRPORun, run_dir: Path) -> float:
    """Evaluate a centralized run on every client's eval split at every evaluated round (its
    checkpoints; round 0 = the base model), exactly as a federated client evaluates the global
    model (`LocalClient.evaluate`: the federation's eval and train settings). Writes
    client-eval.jsonl, then prunes the checkpoints to the federation's checkpoint.keep.
    Returns seconds."""
    from ftis.tasks import build_task
    from ftis.train.checkpoint import load_checkpoint
    from ftis.train.evaluate import evaluate
    from ftis.train.node import build_node
    from ftis.train.seeds import eval_seed

    t0 = time.perf_counter()
    fed, cfg = run.federation, run.config
    found = _eval_checkpoints(run, run_dir)
    tasks = {c: build_task(run.client_tasks[c]) for c in run.clients}
    rows: list[dict[str, Any]] = []
    with _rng_kept():
        node = build_node(cfg.nodes[0], rank=0, task_cfg=cfg.task)  # round 0: the base model
        for r in run.eval_rounds():
            step = r * run.steps_per_round
            if r > 0:
                if step not in found:
                    raise StudyError(
                        f"{run_dir}: no checkpoint of step {step} (round {r}) to evaluate; "
                        f"delete {run_dir} and run the study again"
                    )
                load_checkpoint(node, found[step])
            for c, task in tasks.items():
                m = evaluate(node, task, fed.eval, fed.train, seed=eval_seed(fed.train.seed, r))
                size = min(fed.eval.size, len(task.split(task.eval_splits[0])))
                rows.append({"step": step, "node": c, "round": r, **m, "eval/size": float(size)})
    tmp = run_dir / (CLIENT_EVAL + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(run_dir / CLIENT_EVAL)
    keep = fed.checkpoint.keep
    node_dir = run_dir / "nodes" / cfg.nodes[0].name
    for old in sorted(p for p in node_dir.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return time.perf_counter() - t0


# -------------------------------------------------------------------------------------- runner


def run_state(run: FGRPORun, run_dir: Path) -> Status:
    """'done', 'todo', 'incomplete' (redone from scratch) or 'trained' (a centralized run whose
    training is complete and whose client evaluation is missing: only that is done)."""
    status = run_status(run_dir, run.config)
    if status != "done" or run.kind != "centralized":
        return status
    if client_eval_complete(run, run_dir):
        return "done"
    return "trained" if can_evaluate(run, run_dir) else "incomplete"


def plan(
    study: FGRPOStudy, *, out_dir: Path | None = None, only: str | None = None
) -> list[tuple[FGRPORun, Status]]:
    """(run, status) for every selected run, without running anything (`--dry-run`)."""
    return runner_plan(study, out_dir=out_dir, only=only, status=run_state)  # type: ignore[arg-type]


def plan_table(
    study: FGRPOStudy, *, out_dir: Path | None = None, only: str | None = None
) -> tuple[list[str], list[list[str]]]:
    """The `--dry-run` table: run, arm, arm kind, seed, status."""
    rows = [
        [r.id, r.arm, r.kind, str(r.seed), s] for r, s in plan(study, out_dir=out_dir, only=only)
    ]
    return ["run", "arm", "kind", "seed", "status"], rows


def _update_meta(run_dir: Path, **values: Any) -> None:
    path = run_dir / RUN_META
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        meta = {}
    meta.update(values)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(path)


def run_one(run: FGRPORun, run_dir: Path, status: Status, *, console: Console | None) -> float:
    """Train `run` (unless only its client evaluation is missing) and, for a centralized run,
    evaluate it on every client's split. Returns seconds (training + evaluation)."""
    seconds = 0.0
    if status != "trained":
        if run.kind != "federated":
            ensure_base_model(run.federation)  # a cache hit once any federated run has run
        seconds = execute_run(run, run_dir, console=console)  # type: ignore[arg-type]
    if run.kind == "centralized":
        eval_seconds = evaluate_clients(run, run_dir)
        _update_meta(run_dir, client_eval_seconds=eval_seconds, code_eval=code_version())
        seconds += eval_seconds
    return seconds


def run_fgrpo_study(
    study: FGRPOStudy,
    *,
    out_dir: Path | None = None,
    only: str | None = None,
    console: Console | None = None,
) -> SweepOutcome:
    """Run every selected run that is not done, one after another (seed by seed, arms in the
    study's order), by the study engine's loop with this kind's hooks (`run_state`, `run_one`).
    A failing run is logged and recorded and the study goes on; Ctrl-C stops it (the
    interrupted run is redone next time)."""
    return run_study(
        study,  # type: ignore[arg-type]
        out_dir=out_dir,
        only=only,
        console=console,
        status=run_state,  # type: ignore[arg-type]
        execute=run_one,
    )
