"""Arms studies (ftis.study.arms) and the population study's document (ftis.results.population): spec
checks, run expansion, numbers from hand-written run directories, and a tiny real sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from ftis.cli import app
from ftis.results.population import interpolate
from ftis.study import StudyError, plan
from ftis.study.arms import collect, is_arms_study, load_arms_study, write_arms_results
from tests.conftest import tiny_run_config

ROOT = Path(__file__).resolve().parents[1]


def _study(tmp_path: Path, **extra) -> Path:
    spec = {
        "kind": "arms",
        "name": "pop",
        "out": str(tmp_path / "out"),
        "report": str(tmp_path / "pop.md"),
        "results": "population",
        "seeds": [0, 1],
        "set": ["train.seed={seed}"],
        "options": {"base_series": "grpo", "members": [64]},
        "arms": {
            "grpo": {
                "config": str(ROOT / "studies/population-configs/grpo.yaml"),
                "set": ["train.steps=10"],
            },
            "corp": {
                "config": str(ROOT / "configs/corp.yaml"),
                "label": "CoRP pooled",
                "series": "corp",
                "x": 64,
                "set": ["algorithm.seed={seed}", "algorithm.population=64", "train.steps=3"],
            },
            "corp-add": {
                "config": str(ROOT / "studies/population-configs/alone.yaml"),
                "label": "CoRP add alone",
                "set": ["algorithm.population=64", "train.steps=3"],
            },
            "randopt": {
                "config": str(ROOT / "studies/population-configs/randopt.yaml"),
                "label": "RandOpt pooled",
                "set": ["algorithm.population=64", "train.steps=2", "algorithm.seed={seed}"],
            },
        },
        **extra,
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _write_run(run_dir: Path, cfg, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _fake(study, tmp_path: Path) -> None:
    """GRPO: 20% at step 0, 30% at 100 tokens, 40% at 200 (seed 1: 10 points higher after 0).
    CoRP pooled: 25% after 75 tokens per party (150 in all). CoRP alone: 22% after 75.
    RandOpt pooled (32 members a step): vote 24% / best 26% after 80 tokens per party."""
    for r in study.runs:
        d = tmp_path / "out" / r.id
        up = 0.1 * r.seed
        nodes = [n.name for n in r.config.nodes]
        rows = []
        if r.arm == "grpo":
            rows = [
                {"step": 0, "node": "grpo", "eval/accuracy": 0.2},
                {
                    "step": 5,
                    "node": "grpo",
                    "eval/accuracy": 0.3 + up,
                    "train/forward_tokens_total": 100,
                },
                {
                    "step": 10,
                    "node": "grpo",
                    "eval/accuracy": 0.4 + up,
                    "train/forward_tokens_total": 200,
                },
            ]
        elif r.arm.startswith("corp"):
            final = 0.25 if r.arm == "corp" else 0.22
            for n in nodes:
                rows += [
                    {"step": 0, "node": n, "eval/accuracy": 0.2},
                    {"step": 1, "node": n, "train/forward_tokens_total": 25},
                    {"step": 2, "node": n, "train/forward_tokens_total": 50},
                    {
                        "step": 3,
                        "node": n,
                        "eval/accuracy": final,
                        "train/forward_tokens_total": 75,
                        "population/weights_sha256": "abc",
                        "corp/q": 0.75,
                        "corp/beta": 10.0,
                        "corp/alpha": 2.0,
                        "corp/elite_size": 16,
                        "corp/probe_base": 0.3,
                        "corp/probe_reward": 0.32,
                    },
                ]
        else:
            for n in nodes:
                rows += [
                    {"step": 0, "node": n, "eval/accuracy": 0.2},
                    {"step": 1, "node": n, "eval/accuracy": 0.21, "train/forward_tokens_total": 40},
                    {
                        "step": 2,
                        "node": n,
                        "eval/accuracy": 0.24,
                        "eval/randopt/best_accuracy": 0.26,
                        "train/forward_tokens_total": 80,
                    },
                ]
        _write_run(d, r.config, rows)


def test_expansion_seed_substitution_and_kind_detection(tmp_path):
    path = _study(tmp_path)
    assert is_arms_study(path) and not is_arms_study(ROOT / "studies/reasoning.yaml")
    study = load_arms_study(path)
    assert [r.id for r in study.runs] == [
        "grpo-s0", "corp-s0", "corp-add-s0", "randopt-s0",
        "grpo-s1", "corp-s1", "corp-add-s1", "randopt-s1",
    ]  # fmt: skip
    by_id = {r.id: r for r in study.runs}
    assert by_id["corp-s1"].config.algorithm.seed == 1 and by_id["corp-s1"].config.train.seed == 1
    assert by_id["corp-add-s1"].config.algorithm.seed == 0  # its set has no {seed}
    assert by_id["corp-s0"].config.algorithm.population == 64
    assert by_id["corp-s0"].meta() == {
        "id": "corp-s0",
        "arm": "corp",
        "series": "corp",
        "x": 64.0,
        "seed": 0,
    }
    assert by_id["grpo-s0"].series == "grpo" and by_id["grpo-s0"].config.name == "grpo-s0"
    assert {s for _, s in plan(study)} == {"todo"}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"results": "nope"}, "results"),
        ({"arms": {"bad name": {"config": "x.yaml"}}}, "names folders"),
        ({"arms": {"a": {"config": str(ROOT / "configs/corp.yaml"), "set": ["train.steps=x"]}}}, "run a-s0"),
        ({"kind": "grid"}, "kind"),
    ],
)  # fmt: skip
def test_bad_specs_say_what_is_wrong(tmp_path, change, message):
    path = _study(tmp_path)
    spec = {**yaml.safe_load(path.read_text()), **change}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    with pytest.raises(StudyError, match=message):
        load_arms_study(path)


def test_interpolate():
    pts = [(0.0, 0.2), (100.0, 0.3), (200.0, 0.5)]
    assert interpolate(pts, 150) == pytest.approx(0.4)
    assert interpolate(pts, 100) == pytest.approx(0.3)
    assert interpolate(pts, 250) is None and interpolate([], 1) is None


def test_population_document_numbers(tmp_path):
    study = load_arms_study(_study(tmp_path))
    _fake(study, tmp_path)
    text = write_arms_results(study).read_text()
    head, paired = text.split("## Paired differences with intervals")
    lines = {line.split(" | ")[0].lstrip("| "): line for line in head.splitlines() if "|" in line}
    # CoRP pooled: 150 tokens, 25%; GRPO at 150 tokens: 35% (seed 0), 45% (seed 1)
    corp = lines["CoRP pooled"]
    assert "| 150 | 25.0 ± 0.0 | +5.0 ± 0.0 | 40.0 ± 7.1 | -15.0 ± 7.1 | 2 |" in corp
    # RandOpt at 64 members (step 2): 160 tokens; GRPO at 160: 36% and 46%
    assert (
        "| 160 | 26.0 ± 0.0 | +6.0 ± 0.0 | 41.0 ± 7.1 | -15.0 ± 7.1 | 2 |"
        in lines["RandOpt pooled: best of 64"]
    )
    assert "| 160 | 24.0 ± 0.0 | +4.0 ± 0.0 |" in lines["RandOpt pooled: top-5 vote of 64"]
    assert "RandOpt pooled: best of 32" not in lines  # options.members
    # the alone party against the pooled run at 64 members: +3 points
    alone = lines["CoRP add alone (consolidated, 64 members)"]
    assert "| 22.0 ± 0.0 | CoRP pooled | 25.0 ± 0.0 | +3.0 ± 0.0 | 75 |" in alone
    # the same comparisons with intervals, seeds paired. CoRP pooled - GRPO at its tokens:
    # -10 (seed 0), -20 (seed 1) points: mean -15, sd 7.07, and the 95% t interval with 1 degree
    # of freedom is -15 +- 12.706 x 7.07 / sqrt(2) = [-78.5, +48.5], not bold. Against theta_0 +5
    # on both seeds: [+5, +5], bold (it excludes zero). The alone party: +3 on both seeds.
    m = "\u2212"
    assert f"| CoRP pooled | **+5.0 [+5.0, +5.0]** | {m}15.0 [{m}78.5, +48.5] | 2 |" in paired
    alone_row = (
        "| CoRP add alone (consolidated, 64 members) | CoRP pooled | **+3.0 [+3.0, +3.0]** | 2 |"
    )
    assert alone_row in paired
    assert "| corp-s0 | (0.75, 10, 2) | 16 | 30.0 -> 32.0 | yes | - |" in text
    assert (tmp_path / "results" / "pop" / "accuracy-vs-tokens.png").exists()
    # the hand-written reading survives regeneration
    report = tmp_path / "pop.md"
    report.write_text(report.read_text().replace("_Not written yet._", "My reading."))
    assert "My reading." in write_arms_results(study).read_text()


def test_corp_randopt_rows_read_the_corp_runs_own_figures_at_stage0_tokens(tmp_path):
    """options.corp_randopt_rows: the CoRP run's end-of-run RandOpt figures (its stage-0
    population by RandOpt's rules) become rows, costed at the forward tokens spent by the end of
    stage 0 (RandOpt needs no consolidation step), not at the run's last step."""
    study = load_arms_study(
        _study(tmp_path, options={"base_series": "grpo", "corp_randopt_rows": True})
    )
    _fake(study, tmp_path)
    for r in study.runs:  # the CoRP runs log the RandOpt figures with their last evaluation
        if r.arm != "corp":
            continue
        path = tmp_path / "out" / r.id / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for row in rows:
            if row["step"] == 3:
                row["eval/randopt/best_accuracy"] = 0.30
                row["eval/randopt/vote_accuracy"] = 0.27
                row.update({"corp/validation_base": 0.2, "corp/validation_reward": 0.25})
                row["corp/applied"] = 1.0
                row["population/perturbations_per_second"] = 0.0734
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = write_arms_results(study).read_text()
    head, paired = text.split("## Paired differences with intervals")
    lines = {line.split(" | ")[0].lstrip("| "): line for line in head.splitlines() if "|" in line}
    # stage 0 is 2 steps of the 3: 50 tokens per party, 100 in all; GRPO at 100 tokens: 30%, 40%
    best = lines["CoRP pooled: RandOpt best of 64"]
    assert "| 100 | 30.0 ± 0.0 | +10.0 ± 0.0 | 35.0 ± 7.1 | -5.0 ± 7.1 | 2 |" in best
    vote = lines["CoRP pooled: RandOpt top-5 vote of 64"]
    assert "| 100 | 27.0 ± 0.0 | +7.0 ± 0.0 |" in vote
    assert "| 150 | 25.0 ± 0.0 |" in lines["CoRP pooled"]  # CoRP itself: all 3 steps
    assert "| CoRP pooled: RandOpt best of 64 | **+10.0 [+10.0, +10.0]** |" in paired
    # CoRP's validation gate, where its runs have one; a rate below 1/s keeps its digits
    assert "| corp-s0 | (0.75, 10, 2) | 16 | 30.0 -> 32.0 | 20.0 -> 25.0 (applied) | yes |" in text
    assert "| 0.073 |" in text
    # off by default: the population study's document has no such rows
    study = load_arms_study(_study(tmp_path))
    assert "RandOpt best of" not in write_arms_results(study).read_text()


def test_tiny_arms_sweep_through_the_cli(tmp_path):
    """One real one-node run per seed through `ftis sweep`, then --dry-run sees it done."""
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_run_config(steps=2)))
    spec = {
        "kind": "arms",
        "name": "tiny",
        "out": str(tmp_path / "out"),
        "report": str(tmp_path / "tiny.md"),
        "results": "population",
        "seeds": [0],
        "set": ["train.seed={seed}", "nodes.0.warm_start.steps=10", "eval.pass_samples=0"],
        "options": {"base_series": "gd"},
        "arms": {"gd": {"config": "tiny.yaml"}},
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    runner = CliRunner()
    res = runner.invoke(app, ["sweep", str(path)])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "out/gd-s0/metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and rows[-1]["train/forward_tokens_total"] > 0
    meta = json.loads((tmp_path / "out/gd-s0/study-run.json").read_text())
    assert meta["arm"] == "gd" and meta["status"] == "done"
    assert meta["machine"]["cpu"] == torch.backends.cpu.get_cpu_capability()
    assert "| gd-s0 | gd | 0 |" in (tmp_path / "tiny.md").read_text()
    res = runner.invoke(app, ["sweep", str(path), "--dry-run"])
    assert res.exit_code == 0 and "done" in res.output


_TIMING = ("time/", "memory/", "train/step_seconds", "train/elapsed_seconds", "exchange/wait")


def _untimed(path: Path) -> list[dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(_TIMING)} for r in rows]


def _tiny_study(tmp_path: Path, arms: dict, *, seeds: list[int]) -> Path:
    """A population-kind arms study of 2-step llama-xs runs (tiny.yaml), written to tmp_path."""
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_run_config(steps=2)))
    spec = {
        "kind": "arms",
        "name": "tiny",
        "report": str(tmp_path / "tiny.md"),
        "results": "population",
        "seeds": seeds,
        "set": ["train.seed={seed}", "nodes.0.warm_start.steps=10", "eval.pass_samples=0"],
        "options": {"base_series": "gd"},
        "arms": arms,
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_sweep_jobs_runs_at_the_same_time_with_the_same_results(tmp_path, monkeypatch):
    """`ftis sweep --jobs 2`: two runs in processes of their own, overlapping in time, with rows
    identical to `--jobs 1`'s (timings aside), one thread per node either way."""
    import multiprocessing

    import torch

    from ftis.study import runner

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # The overlap, seen from the sweep's side: each time it reports the runs in flight, the run
    # processes alive at that moment (a spawned child takes seconds to import torch, so two
    # started together are both alive here; a sweep that ran one at a time would show one).
    alive: list[int] = []
    started = runner._Sweep.started

    def spy(self, running):
        alive.append(
            sum(p.name.startswith("ftis-sweep-") for p in multiprocessing.active_children())
        )
        return started(self, running)

    monkeypatch.setattr(runner._Sweep, "started", spy)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = _tiny_study(tmp_path, {"gd": {"config": "tiny.yaml"}}, seeds=[0, 1])
    try:
        for jobs in (2, 1):
            out = tmp_path / f"jobs{jobs}"
            res = CliRunner().invoke(
                app, ["sweep", str(path), "--out", str(out), "--jobs", str(jobs)]
            )
            assert res.exit_code == 0, res.output
            if jobs == 2:
                assert max(alive) == 2, (
                    f"the two runs' processes were never alive together: {alive}"
                )
    finally:
        torch.set_num_threads(threads)
    for seed in (0, 1):
        run = f"gd-s{seed}/metrics.jsonl"
        assert _untimed(tmp_path / "jobs2" / run) == _untimed(tmp_path / "jobs1" / run)
    meta = [json.loads((tmp_path / f"jobs2/gd-s{s}/study-run.json").read_text()) for s in (0, 1)]
    assert all(m["status"] == "done" for m in meta)
    invocation = json.loads((tmp_path / "jobs2" / "study.json").read_text())["invocations"][-1]
    assert invocation["jobs"] == 2 and invocation["executed"] == 2


def test_a_run_whose_process_dies_fails_alone_under_jobs(tmp_path, monkeypatch):
    """--jobs 2: one run's process exits hard mid-run (testing.crash_at_step); that run is
    recorded as failed with its exit code, the other completes, the sweep exits 1."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    arms = {
        "gd": {"config": "tiny.yaml"},
        "crash": {"config": "tiny.yaml", "set": ["testing.crash_at_step={xs: 1}"]},
    }
    path = _tiny_study(tmp_path, arms, seeds=[0])
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["sweep", str(path), "--out", str(out), "--jobs", "2"])
    assert res.exit_code == 1, res.output
    invocation = json.loads((out / "study.json").read_text())["invocations"][-1]
    assert invocation["failed"] == ["crash-s0"] and invocation["executed"] == 1
    assert json.loads((out / "gd-s0/study-run.json").read_text())["status"] == "done"


@pytest.mark.long
def test_sigterm_to_a_jobs_sweep_stops_every_run_at_a_checkpoint(tmp_path):
    """SIGTERM to `ftis sweep --jobs 2` alone (not its process group, as a scheduler or `kill`
    sends it): both runs in flight get it, checkpoint and stop, the sweep exits 130 with no
    process of its own left behind, and the same command then finishes both runs."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from ftis.launch.stop import _processes, alive

    path = _tiny_study(tmp_path, {"gd": {"config": "tiny.yaml"}}, seeds=[0, 1])
    spec = yaml.safe_load(path.read_text())
    spec["set"] += ["train.steps=150", "eval.every=150", "train.max_steps_without_signal=0"]
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ftis.cli", "sweep", str(path), "--out", str(out), "--jobs", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sweep = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rows = [out / f"gd-s{s}" / "metrics.jsonl" for s in (0, 1)]
    deadline = time.monotonic() + 240
    while not all(r.exists() and r.stat().st_size for r in rows):
        assert sweep.poll() is None, sweep.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the two runs never both trained a step"
        time.sleep(0.5)

    def descendants(pid: int) -> set[int]:
        procs, found, frontier = _processes(), set(), {pid}
        while frontier:
            frontier = {p for p, (_, parent) in procs.items() if parent in frontier} - found
            found |= frontier
        return found

    family = descendants(sweep.pid)
    assert family, "the runs' processes were not found"
    sweep.send_signal(signal.SIGTERM)
    _, err = sweep.communicate(timeout=180)
    assert sweep.returncode == 130, err.decode()[-2000:]
    time.sleep(1)
    assert not [p for p in family if alive(p)], "processes of the sweep outlived it"
    for s in (0, 1):
        meta = json.loads((out / f"gd-s{s}" / "study-run.json").read_text())
        assert meta["status"] != "done"
        assert list((out / f"gd-s{s}" / "nodes").glob("*/step-*")), "no checkpoint written"
    res = subprocess.run(cmd, env=env, capture_output=True, timeout=240)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    for s in (0, 1):
        assert json.loads((out / f"gd-s{s}" / "study-run.json").read_text())["status"] == "done"


def test_threads_per_node_fill_the_machine(monkeypatch):
    from ftis.study.runner import threads_per_node

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads_per_node(1, 1, cpus=8) == 8
    assert threads_per_node(2, 1, cpus=8) == 4
    assert threads_per_node(2, 2, cpus=8) == 2  # a 2-node run counts as 2
    assert threads_per_node(4, 3, cpus=2) == 1  # never below 1
    # a 2-node run holding 2 of 2 slots: the machine's cores split between its 2 processes
    assert threads_per_node(2, 2, cpus=8, slots=2) == 4
    assert threads_per_node(2, 2, cpus=2, slots=2) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_node(2, 2, cpus=8) == 3  # the caller's choice wins


def test_a_run_takes_a_slot_per_busy_process():
    """`--jobs N` is N slots: a 2-node run takes 2 (so on 2 slots it runs alone), a 4-node run
    all N, the swarm's simulator (every peer in one process) 1, hivemind peers one each."""
    import types

    from ftis.config import load_config
    from ftis.study.runner import slots_of

    def run(cfg):
        return types.SimpleNamespace(config=cfg)

    pair = load_config(None)
    assert len(pair.nodes) == 2
    assert slots_of(run(pair), 2) == 2 and slots_of(run(pair), 1) == 1
    assert slots_of(run(pair), 8) == 2
    swarm = load_config(ROOT / "configs" / "swarm.yaml")
    assert len(swarm.nodes) == 16 and slots_of(run(swarm), 2) == 1
    hive = load_config(ROOT / "configs" / "swarm-hivemind.yaml")
    assert slots_of(run(hive), 64) == len(hive.nodes) > 1


def test_dpo_document_numbers(tmp_path):
    """Hand-written rows of a gossip arm and a FedDPO arm: the tables' averages over agents."""
    spec = {
        "kind": "arms",
        "name": "dpo",
        "out": str(tmp_path / "out"),
        "report": str(tmp_path / "dpo.md"),
        "results": "dpo",
        "seeds": [0],
        "set": ["train.steps=2", "eval.every=1"],
        "arms": {
            "ring": {"config": str(ROOT / "configs/gossip-dpo.yaml"), "label": "ring"},
            "fed": {
                "config": str(ROOT / "configs/fed-dpo.yaml"),
                "label": "fed S1",
                "set": ["algorithm.clients_per_round=1"],
            },
        },
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    study = load_arms_study(path)
    for r in study.runs:
        rows = []
        for i, n in enumerate(n.name for n in r.config.nodes):
            for step in (0, 1, 2):
                row = {"step": step, "node": n, "eval/preference_accuracy": 0.1 * i + 0.3 * step}
                row["eval/dpo_loss"] = 0.7 - 0.1 * step
                if step:
                    row["loss/dpo"] = 0.6 - 0.1 * step + 0.01 * i
                    if r.arm == "ring":
                        row["gossip/consensus_error_before"] = 0.01 * step
                        row["gossip/consensus_error_after"] = 0.001 * step
                if r.arm == "ring" and step == 0:
                    row["gossip/rho_full"], row["gossip/spectral_gap_full"] = 1 / 3, 8 / 9
                rows.append(row)
        if r.arm == "fed":
            rows += [{"step": s, "node": "server", "fed/staleness_mean": 0.0} for s in (1, 2)]
        _write_run(tmp_path / "out" / r.id, r.config, rows)
    text = write_arms_results(study).read_text()
    # 4 agents at 0, 10, 20, 30% at round 0 (mean 15%), +60 points by round 2
    assert "| ring | 15.0 ± 0.0 | 75.0 ± 0.0 | 0.500 ± 0.000 |" in text
    assert (
        "| ring | 0.333 | 0.889 | 1.50e-02 ± 0.0e+00 | 1.50e-03 ± 0.0e+00 | 0.100 ± 0.000 |" in text
    )
    assert "| fed S1 | 1 of 4 | 0 | age | 0.00 ± 0.00 | 75.0 ± 0.0 |" in text
    # the paired table: the first FedDPO arm is a reference; one seed gives no interval
    assert "| ring | fed S1 | n/a (1 seed) | n/a (1 seed) | 1 |" in text
    assert (tmp_path / "results" / "dpo" / "consensus.png").exists()


def test_swarm_document_numbers(tmp_path):
    """A 4-peer run written by hand: one joins after round 2, one leaves for good after round
    2; the summary compares the rows with that schedule."""
    from ftis.results.swarm import run_summary

    nodes = [{"name": f"p{i}", "model": {"preset": "llama-xs"}} for i in range(4)]
    cfg = {
        "name": "sw",
        "task": {"kind": "arithmetic", "ops": {"+": 1.0}, "max_digits": 2},
        "nodes": nodes,
        "train": {"steps": 4},
        "algorithm": {"kind": "swarm", "churn": {"p2": {"join_at": 2}, "p3": {"leave_at": 2}}},
    }
    (tmp_path / "sw.yaml").write_text(yaml.safe_dump(cfg))
    spec = {
        "kind": "arms",
        "name": "sw",
        "out": str(tmp_path / "out"),
        "report": str(tmp_path / "sw.md"),
        "results": "swarm",
        "seeds": [0],
        "arms": {"churn": {"config": "sw.yaml", "label": "churn"}},
    }
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    study = load_arms_study(tmp_path / "study.yaml")
    present = {"p0": [1, 2, 3, 4], "p1": [1, 2, 3, 4], "p2": [3, 4], "p3": [1, 2]}
    rows = []
    for n, rounds in present.items():
        first = rounds[0] - 1
        rows.append({"step": first, "node": n, "eval/accuracy": 0.2})
        for r in rounds:
            row = {"step": r, "node": n, "swarm/samples_received": 8, "swarm/samples_published": 10}
            row.update({"swarm/peers_seen": 2, "swarm/members": 2, "swarm/late_total": 1})
            if r == rounds[-1]:
                row["eval/accuracy"] = 0.3 if n != "p1" else 0.1
            rows.append(row)
    run = study.runs[0]
    _write_run(tmp_path / "out" / run.id, run.config, rows)
    (tmp_path / "out" / run.id / "study-run.json").write_text(json.dumps({"status": "done"}))
    text = write_arms_results(study).read_text()
    (result,), missing = collect(study, tmp_path / "out")
    assert not missing
    s = run_summary(result)
    # rounds 1-2: p2 away; rounds 3-4: p3 away -> a quarter absent every round
    assert s["absent_mean"] == 0.25 and s["finished"] == 4 and s["expected"] == 4
    assert s["received_ratio"] == 0.8 and s["seen_ratio"] == 1.0 and s["late"] == 4
    # every peer stayed >= half the run; p1 got worse
    assert s["stayed"] == 4 and s["improved"] == 3
    assert (
        "| churn (seed 0) | 4 (1 models) | 25% (max 25%) | 4 of 4 | 0.800 | 1.000 | 0 / 0 / 4 | 3 of 4 |"
        in text
    )


def test_swarm_churn_table_pairs_peers_and_gives_no_interval_for_one_seed(tmp_path):
    """The churn run of test_swarm_document_numbers against the same peers without churn. Gains
    (last minus first evaluation): with churn p0 +10, p1 -10, p2 +10, p3 +10 points; without,
    +10 each. Churn minus no churn, paired by peer: 0, -20, 0, 0 -> mean -5.0, sd 10, and the 95%
    t interval over the 4 peers (3 degrees of freedom) is -5 +- 3.182 x 10 / 2 = [-20.9, +10.9].
    One seed: no interval over seeds."""
    nodes = [{"name": f"p{i}", "model": {"preset": "llama-xs"}} for i in range(4)]
    cfg = {
        "name": "sw",
        "task": {"kind": "arithmetic", "ops": {"+": 1.0}, "max_digits": 2},
        "nodes": nodes,
        "train": {"steps": 4},
        "algorithm": {"kind": "swarm", "churn": {"p2": {"join_at": 2}, "p3": {"leave_at": 2}}},
    }
    (tmp_path / "sw.yaml").write_text(yaml.safe_dump(cfg))
    spec = {
        "kind": "arms",
        "name": "sw",
        "out": str(tmp_path / "out"),
        "report": str(tmp_path / "sw.md"),
        "results": "swarm",
        "seeds": [0],
        "arms": {
            "churn": {"config": "sw.yaml", "label": "churn"},
            "steady": {"config": "sw.yaml", "label": "steady", "set": ["algorithm.churn={}"]},
        },
    }
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    study = load_arms_study(tmp_path / "study.yaml")
    churn = {"p0": [1, 2, 3, 4], "p1": [1, 2, 3, 4], "p2": [3, 4], "p3": [1, 2]}
    for run in study.runs:
        present = churn if run.arm == "churn" else {n: [1, 2, 3, 4] for n in churn}
        rows = []
        for n, rounds in present.items():
            rows.append({"step": rounds[0] - 1, "node": n, "eval/accuracy": 0.2})
            for r in rounds:
                row = {"step": r, "node": n, "swarm/peers_seen": 2}
                if r == rounds[-1]:
                    row["eval/accuracy"] = 0.1 if (n == "p1" and run.arm == "churn") else 0.3
                rows.append(row)
        _write_run(tmp_path / "out" / run.id, run.config, rows)
        (tmp_path / "out" / run.id / "study-run.json").write_text(json.dumps({"status": "done"}))
    text = write_arms_results(study).read_text()
    m = "\u2212"
    row = f"| churn | steady | llama-xs | n/a (1 seed) | {m}5.0 [{m}20.9, +10.9] | 1 | 4 |"
    assert row in text
    assert "None of the 1 intervals excludes zero." in text
