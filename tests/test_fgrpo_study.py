"""The FGRPO study (ftis.algos.fgrpo.study, studies/fgrpo.yaml): its plan and derived configs, the
union task, the stability measures, the document from hand-written run directories, and one
tiny end-to-end study (in-process Flower engine, llama-xs, 2 rounds)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ftis.algos.fgrpo.study import (
    CLIENT_EVAL,
    base_model_dir,
    is_fgrpo_study,
    load_fgrpo_study,
    plan,
    union_task,
)
from ftis.cli import app
from ftis.config import load_config
from ftis.results.fgrpo import stability, write_fgrpo_results
from ftis.study import StudyError
from ftis.study.document import READING_BEGIN, READING_END
from ftis.train.metrics import read_metrics
from tests.test_fgrpo import fgrpo_run_config

REPO = Path(__file__).resolve().parents[1]


def _write_study(tmp_path: Path, *, config: dict | None = None, **extra) -> Path:
    """A study of the tests' tiny federation (clients a: +, b: - with 0/10 rewards, c: + and -;
    2 local steps, 2 rounds) with every arm kind."""
    (tmp_path / "fed.yaml").write_text(yaml.safe_dump(config or fgrpo_run_config(steps=2)))
    study = {
        "kind": "fgrpo",
        "name": "t",
        "config": "fed.yaml",
        "out": str(tmp_path / "out"),
        "report": str(tmp_path / "doc" / "fgrpo.md"),
        "seeds": [0, 1],
        "arms": {
            "rg": {"kind": "federated", "aggregation": "relative-gain", "label": "RG"},
            "avg": {"kind": "federated", "aggregation": "fedavg", "label": "FedAvg"},
            "central": {"kind": "centralized", "label": "Central"},
            "alone": {"kind": "alone", "label": "Alone"},
        },
        "stability": {"last": 2, "drop": 0.02},
        **extra,
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


# ---- the plan ------------------------------------------------------------------------------


def test_the_shipped_study_plans_21_runs_at_equal_local_steps() -> None:
    study = load_fgrpo_study(REPO / "studies" / "fgrpo.yaml")
    assert is_fgrpo_study(REPO / "studies" / "fgrpo.yaml")
    assert not is_fgrpo_study(REPO / "studies" / "paper.yaml")
    runs = {r.id: r for r in study.runs}
    assert len(runs) == len(study.runs) == 3 * (3 + 1 + 3)
    fed = runs["relative-gain-s2"].config
    E, R = fed.algorithm.local_steps, fed.train.steps
    assert fed.train.seed == 2 and fed.eval.every == 1
    assert runs["fedavg-s1"].config.algorithm.aggregation == "fedavg"
    assert runs["uniform-s0"].config.algorithm.aggregation == "uniform"
    prompts = {
        n.name: fed.algorithm.client_spec(n.name).prompts_per_step or fed.train.prompts_per_step
        for n in fed.nodes
    }
    central = runs["central-s1"].config
    assert central.algorithm.kind == "ftis" and [n.name for n in central.nodes] == ["central"]
    assert central.train.steps == E * R and central.train.seed == 1
    assert central.train.prompts_per_step == sum(prompts.values())  # the federation's samples
    assert central.eval.every == E and central.checkpoint.every == E
    for client in prompts:
        alone = runs[f"alone-{client}-s0"].config
        assert [n.name for n in alone.nodes] == [client] and alone.algorithm.kind == "ftis"
        assert alone.train.steps == E * R and alone.train.prompts_per_step == prompts[client]
        # its task is the client's, so its own eval split is the client's
        assert (
            alone.task.model_dump()
            == load_config(REPO / "configs" / "fgrpo.yaml")
            .task.model_copy(update=fed.algorithm.clients[client].task)
            .model_dump()
        )
        # the federation's base model, by path: no second warm start
        assert alone.nodes[0].warm_start is None
        assert alone.nodes[0].model.path == str(base_model_dir(fed))
        assert (
            alone.nodes[0].optim == fed.nodes[0].optim and alone.nodes[0].loss == fed.nodes[0].loss
        )


def test_union_task_mixes_op_weights_by_prompts() -> None:
    data = fgrpo_run_config()
    data["algorithm"]["clients"]["a"]["prompts_per_step"] = 8  # the others: 4
    fed = load_config_dict(data)
    # a: {+: 1} x 8, b: {-: 1} x 4, c: {+: 1/2, -: 1/2} x 4 -> + = (8 + 2) / 16, - = (4 + 2) / 16
    assert union_task(fed)["ops"] == {"+": 0.625, "-": 0.375}


def load_config_dict(data: dict):
    from ftis.config import RunConfig

    return RunConfig.model_validate(data)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["algorithm"]["clients"]["b"]["task"].update(min_digits=2), "differ in more"),
        (lambda d: d["task"].update(terms=3, ood={}), "terms=3"),
        (lambda d: d["algorithm"].update(clients_per_round=2), "clients_per_round=2"),
        (
            lambda d: [
                n.update(loss={"method": "vis", "advantage_scale": "none"}) for n in d["nodes"]
            ],
            "advantage_scale",
        ),
        (lambda d: d["nodes"][1].update(optim={"lr": 0.5}), "different optim or loss"),
    ],
)
def test_baselines_that_would_not_be_comparable_are_refused(tmp_path, change, message) -> None:
    data = fgrpo_run_config()
    change(data)
    with pytest.raises(StudyError, match=message):
        load_fgrpo_study(_write_study(tmp_path, config=data))


@pytest.mark.parametrize(
    ("arms", "message"),
    [
        ({"c": {"kind": "centralized", "aggregation": "fedavg"}}, "federated arms only"),
        ({"bad/name": {"kind": "alone"}}, "names folders"),
        ({"x": {"kind": "federated", "set": ["train.stepz=3"]}}, "stepz"),
    ],
)
def test_bad_study_files_say_what_to_fix(tmp_path, arms, message) -> None:
    with pytest.raises(StudyError, match=message):
        load_fgrpo_study(_write_study(tmp_path, arms=arms))


def test_a_study_needs_a_federation(tmp_path) -> None:
    path = _write_study(tmp_path)
    from tests.conftest import tiny_run_config

    (tmp_path / "fed.yaml").write_text(yaml.safe_dump(tiny_run_config()))
    with pytest.raises(StudyError, match="algorithm.kind: fgrpo"):
        load_fgrpo_study(path)


# ---- stability -----------------------------------------------------------------------------


def test_stability_by_hand() -> None:
    acc = {0: 0.20, 1: 0.30, 2: 0.25, 3: 0.35, 4: 0.30}
    s = stability(acc, last=3, drop=0.02)
    # tail .25 .35 .30: mean .30, population std sqrt((.05^2 + .05^2 + 0) / 3)
    assert s.last_std == pytest.approx((0.005 / 3) ** 0.5)
    assert s.drops == 2 and s.worst_drop == pytest.approx(0.05)  # 0.30 -> 0.25, 0.35 -> 0.30
    assert stability(acc, last=3, drop=0.05).drops == 0  # "more than" the threshold
    rising = stability({0: 0.1, 1: 0.2}, last=5, drop=0.0)
    assert (rising.drops, rising.worst_drop) == (0, 0.0)


# ---- the document from hand-written run directories ----------------------------------------

START = {"a": 0.25, "b": 0.50, "c": 0.75}
DELTA = {"rg": 0.10, "avg": 0.0, "central": 0.05, "alone": -0.05}
WEIGHT = {"rg": {"a": 0.2, "b": 0.3, "c": 0.5}, "avg": {c: 1 / 3 for c in "abc"}}


def _acc(arm: str, client: str, seed: int, round_: int) -> float:
    """round 0: start; round 1: start + 2 d; round 2 (final): start + d + 0.1 seed."""
    s, d = START[client], DELTA[arm]
    return [s, s + 2 * d, s + d + 0.1 * seed][round_]


def _fake_run(study, run, out: Path) -> None:
    d = out / run.id
    d.mkdir(parents=True)
    rows = []
    E = run.steps_per_round
    if run.kind == "federated":
        for r in range(3):
            for c in run.clients:
                row = {"step": r, "node": c, "eval/accuracy": _acc(run.arm, c, run.seed, r)}
                if r:
                    row["fgrpo/weight"] = WEIGHT[run.arm][c]
                    row["fgrpo/rejected"] = float(run.arm == "rg" and c == "b" and r == 1)
                rows.append(row)
            rows.append({"step": r, "node": "server"})
    elif run.kind == "alone":
        c = run.client
        for step in range(2 * E + 1):
            row = {"step": step, "node": c}
            if step % E == 0:
                row["eval/accuracy"] = _acc("alone", c, run.seed, step // E)
            else:
                row["eval/accuracy"] = 0.99  # never at a step inside a round; must be ignored
            rows.append(row)
    else:
        rows = [{"step": s, "node": "central"} for s in range(2 * E + 1)]
        ev = [
            {"step": r * E, "round": r, "node": c, "eval/accuracy": _acc("central", c, run.seed, r)}
            for r in range(3)
            for c in run.clients
        ]
        (d / CLIENT_EVAL).write_text("".join(json.dumps(x) + "\n" for x in ev))
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    (d / "study-run.json").write_text(json.dumps({"seconds": 10.0, "code": "abc123"}))


def _cells(text: str, prefix: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(prefix))
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_document_from_fake_runs(tmp_path) -> None:
    study = load_fgrpo_study(_write_study(tmp_path))
    out = tmp_path / "out"
    for run in study.runs:
        _fake_run(study, run, out)
    assert {s for _, s in plan(study)} == {"done"}
    doc = write_fgrpo_results(study)
    text = doc.read_text()
    assert "Partial" not in text
    final = text[text.index("## Final") : text.index("## Accuracy across")]
    # start: the same model everywhere; a .25, b .5, c .75, mean .5
    assert _cells(final, "| start")[1:5] == ["25.0 ± 0.0", "50.0 ± 0.0", "75.0 ± 0.0", "50.0 ± 0.0"]
    # RG final: start + .1 + .1 seed over seeds 0, 1: mean start + .15, std of (0, 10) = 7.1
    assert _cells(final, "| RG |")[1:6] == [
        "40.0 ± 7.1",
        "65.0 ± 7.1",
        "90.0 ± 7.1",
        "65.0 ± 7.1",
        "2",
    ]
    assert _cells(final, "| Alone |")[1:5] == [
        "25.0 ± 7.1",
        "50.0 ± 7.1",
        "75.0 ± 7.1",
        "50.0 ± 7.1",
    ]
    assert _cells(final, "| Central |")[1] == "35.0 ± 7.1"
    # paired by seed, the seed term 0.1 s cancels: RG - FedAvg = 0.10 - 0.0 on every client and
    # seed, RG - Alone = 0.10 + 0.05; constant differences give a zero-width interval (bold)
    paired = text[text.index("## Paired differences") : text.index("## Accuracy across")]
    assert _cells(paired, "| RG | FedAvg |")[2:] == ["**+10.0 [+10.0, +10.0]**"] * 4 + ["2"]
    assert _cells(paired, "| RG | Alone |")[2:] == ["**+15.0 [+15.0, +15.0]**"] * 4 + ["2"]
    stab = text[text.index("## Stability") : text.index("## Aggregation")]
    std_table, drops_table, worst_table = stab.split("\n\n| arm")[1:4]
    # RG, any client: rounds .. s+.2, s+.1+.1 seed. last 2: seed 0 pstd 5 pp, seed 1 0 pp
    assert _cells(std_table, "| RG |")[1] == "2.5 ± 3.5"
    # a fall of 10 pp (> 2) at seed 0, none at seed 1
    assert _cells(drops_table, "| RG |")[1] == "0.5 ± 0.7"
    assert _cells(worst_table, "| RG |")[1] == "5.0 ± 7.1"
    # FedAvg (d = 0) is flat: no drop
    assert _cells(drops_table, "| FedAvg |")[1:4] == ["0.0 ± 0.0"] * 3
    weights = text[text.index("## Aggregation") : text.index("## Runs")]
    assert _cells(weights, "| RG |")[1:5] == [
        "20.0 ± 0.0",
        "30.0 ± 0.0",
        "50.0 ± 0.0",
        "2 / 0",
    ]  # b, round 1, each seed
    assert _cells(weights, "| FedAvg |")[1] == "33.3 ± 0.0"
    assert "| Central |" not in weights
    runs = text[text.index("## Runs") :]
    assert _cells(runs, "| Alone |")[1:3] == ["6 of 6", "10"]
    assert "`abc123` (12 runs)" in runs
    assert (doc.parent / "fgrpo" / "curves.png").stat().st_size > 0
    assert (doc.parent / "fgrpo" / "final.png").stat().st_size > 0
    assert "![accuracy against round](fgrpo/curves.png)" in text

    # the hand-written reading survives a regeneration; a missing run is reported
    doc.write_text(text.replace(READING_BEGIN + "\n_Not written yet._", READING_BEGIN + "\nMine."))
    for p in (out / "alone-c-s1").iterdir():
        p.unlink()
    (out / "alone-c-s1").rmdir()
    text = write_fgrpo_results(study).read_text()
    assert "\nMine.\n" + READING_END in text
    assert "Partial results: 11 of 12 runs complete" in text and "`alone-c-s1`" in text
    final = text[text.index("## Final") : text.index("## Accuracy across")]
    assert _cells(final, "| Alone |")[3:5] == ["70.0 ± 0.0", "45.0 ± 0.0"]  # seed 0 only
    paired = text[text.index("## Paired differences") : text.index("## Accuracy across")]
    # client c alone, and so the mean over clients, now has seed 0 only: no interval
    assert _cells(paired, "| RG | Alone |")[4:] == ["n/a (1 seed)", "n/a (1 seed)", "1"]


# ---- one tiny study, end to end ------------------------------------------------------------


def test_tiny_study_end_to_end(tmp_path, monkeypatch) -> None:
    """Every arm kind for one seed, 2 rounds of the tiny federation, through `ftis sweep`. The
    federated run takes Flower's in-process engine instead of Ray (the same ServerApp,
    strategy and ClientApp), to run in seconds."""
    import ftis.algos.fgrpo.launch as launch
    from ftis.algos.federated.inprocess import run_in_process

    monkeypatch.setattr(
        launch, "run_federated", functools.partial(launch.run_federated, engine=run_in_process)
    )
    path = _write_study(tmp_path, seeds=[0])
    data = yaml.safe_load(path.read_text())
    data["arms"].pop("avg")
    path.write_text(yaml.safe_dump(data))
    runner = CliRunner()
    res = runner.invoke(app, ["sweep", str(path)])
    assert res.exit_code == 0, res.output
    study = load_fgrpo_study(path)
    out = tmp_path / "out"
    assert [s for _, s in plan(study)] == ["done"] * 5
    meta = json.loads((out / "central-s0" / "study-run.json").read_text())
    assert meta["status"] == "done" and meta["client_eval_seconds"] > 0 and "code" in meta
    # round 0 is the shared base model on each client's split: the same number in every arm
    start = {}
    for run in study.runs:
        src = CLIENT_EVAL if run.kind == "centralized" else "metrics.jsonl"
        for row in read_metrics(out / run.id / src):
            if row["step"] == 0 and row.get("node") in run.clients:
                start.setdefault(row["node"], set()).add(row["eval/accuracy"])
    assert sorted(start) == ["a", "b", "c"] and all(len(v) == 1 for v in start.values())
    text = (tmp_path / "doc" / "fgrpo.md").read_text()
    assert "Partial" not in text and "| Central |" in text and "| Alone |" in text

    # a centralized run whose client evaluation is lost is only evaluated again
    metrics = out / "central-s0" / "metrics.jsonl"
    before = metrics.stat().st_mtime_ns
    (out / "central-s0" / CLIENT_EVAL).unlink()
    assert dict((r.id, s) for r, s in plan(study))["central-s0"] == "trained"
    res = runner.invoke(app, ["sweep", str(path)])
    assert res.exit_code == 0, res.output
    assert metrics.stat().st_mtime_ns == before and (out / "central-s0" / CLIENT_EVAL).exists()
    res = runner.invoke(app, ["sweep", str(path), "--dry-run"])
    assert res.exit_code == 0 and res.output.count("│ done") == 5
