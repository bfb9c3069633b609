"""The sweep machinery: grid expansion, resume, results from hand-written run directories, and one
tiny real sweep through the CLI."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ftis.cli import app
from ftis.results.grid import collect, finals
from ftis.study import StudyError, load_study, plan, run_study, write_results
from ftis.study.document import READING_BEGIN, READING_END
from tests.conftest import tiny_run_config


def _pair_config() -> dict:
    cfg = tiny_run_config()
    cfg["nodes"] = [
        {**cfg["nodes"][0], "name": "a"},
        {**cfg["nodes"][0], "name": "b", "model": {"preset": "llama-xs", "init_seed": 1}},
    ]
    return cfg


def _write_study(tmp_path: Path, **extra) -> Path:
    (tmp_path / "pair.yaml").write_text(yaml.safe_dump(_pair_config()))
    study = {
        "name": "t",
        "out": str(tmp_path / "out"),
        "report": str(tmp_path / "RESULTS.md"),
        "seeds": [0, 1, 2],
        "pairings": {"pair": {"config": "pair.yaml"}},
        "methods": {
            "alone": {"loss": "vis", "alone": True, "label": "Alone"},
            "nois": {"loss": "nois", "label": "NoIS"},
            "f-tis": {"loss": "f-tis", "label": "F-TIS"},
        },
        "grid": [
            {"pairings": ["pair"], "methods": ["alone", "nois", "f-tis"]},
            {"pairings": ["pair"], "methods": ["f-tis"], "schemes": ["horizontal"]},
            {"pairings": ["pair"], "methods": ["f-tis"], "thresholds": [5, 0.5], "seeds": [0]},
        ],
        **extra,
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


class TestGrid:
    def test_count_and_ids(self, tmp_path):
        study = load_study(_write_study(tmp_path))
        ids = [r.id for r in study.runs]
        # alone: 2 nodes x 3 seeds; nois, f-tis: 3 seeds each; horizontal: 3; thresholds: 2 x 1
        assert len(ids) == 6 + 3 + 3 + 3 + 2 == len(set(ids))
        assert ids[:2] == ["pair-alone-a-s0", "pair-alone-b-s0"]
        assert {"pair-nois-s2", "pair-f-tis-h-s1", "pair-f-tis-g5-s0", "pair-f-tis-g0p5-s0"} <= set(
            ids
        )

    def test_configs_carry_the_grid_point(self, tmp_path):
        runs = {r.id: r for r in load_study(_write_study(tmp_path)).runs}
        alone = runs["pair-alone-b-s2"].config
        assert [n.name for n in alone.nodes] == ["b"] and alone.nodes[0].loss.method == "vis"
        assert alone.train.seed == 2 and alone.name == "pair-alone-b-s2"
        h = runs["pair-f-tis-h-s1"].config
        assert h.sharing.scheme == "horizontal" and {n.loss.method for n in h.nodes} == {"f-tis"}
        g = runs["pair-f-tis-g5-s0"]
        assert [n.loss.filter_threshold for n in g.config.nodes] == [5.0, 5.0]
        assert g.variant == "f-tis g=5" and runs["pair-f-tis-s0"].variant == "f-tis"
        # warm starts do not depend on the seed, so they are cached once per model
        assert runs["pair-nois-s0"].config.nodes[0].warm_start == alone.nodes[0].warm_start

    def test_only_selects_by_glob(self, tmp_path):
        study = load_study(_write_study(tmp_path))
        assert [r.id for r in study.select("*-g*")] == ["pair-f-tis-g5-s0", "pair-f-tis-g0p5-s0"]

    def test_method_set_reaches_every_node(self, tmp_path):
        methods = {
            "alone-w": {"loss": "reco", "alone": True, "set": ["loss.reco_token_ratio=false"]},
            "f-reco": {
                "loss": "f-reco",
                "set": ["loss.reco_tis=true", "optim.lr=0.003", "loss.filter_threshold=7"],
            },
            "f-tis": {"loss": "f-tis"},
        }
        grid = [
            {"pairings": ["pair"], "methods": ["alone-w", "f-reco", "f-tis"], "seeds": [0]},
            {"pairings": ["pair"], "methods": ["f-reco"], "thresholds": [5], "seeds": [0]},
        ]
        path = _write_study(tmp_path, methods=methods, grid=grid)
        runs = {r.id: r for r in load_study(path).runs}
        # ids are those of any method: `set` never enters them
        assert list(runs) == [
            "pair-alone-w-a-s0",
            "pair-alone-w-b-s0",
            "pair-f-reco-s0",
            "pair-f-tis-s0",
            "pair-f-reco-g5-s0",
        ]
        for node in ("a", "b"):
            (n,) = runs[f"pair-alone-w-{node}-s0"].config.nodes
            assert n.name == node and n.loss.method == "reco"
            assert not n.loss.reco_token_ratio and n.loss.reco_response_weights
        f = runs["pair-f-reco-s0"].config.nodes
        assert [(n.loss.method, n.loss.reco_tis, n.optim.lr) for n in f] == [
            ("f-reco", True, 0.003)
        ] * 2
        assert [n.loss.filter_threshold for n in f] == [7.0, 7.0]
        # the grid's threshold comes after the method's set
        g = runs["pair-f-reco-g5-s0"].config.nodes
        assert [n.loss.filter_threshold for n in g] == [5.0, 5.0]
        # other methods are untouched
        t = runs["pair-f-tis-s0"].config.nodes
        assert [(n.loss.reco_tis, n.optim.lr) for n in t] == [(False, 1e-4)] * 2

    @pytest.mark.parametrize(
        ("item", "message"),
        [
            ("train.steps=3", "'train' is not a node field"),
            ("nodes.0.loss.reco_tis=true", "'nodes' is not a node field"),
            ("name=x", "'name' is not a node field"),
            ("loss.method=vis", "as the method's `loss`"),
            ("loss.reco_tis", "is not KEY=VALUE"),
            ("loss..x=1", "is not KEY=VALUE"),
        ],
    )
    def test_method_set_is_validated(self, tmp_path, item, message):
        methods = {"m": {"loss": "reco", "set": [item]}}
        path = _write_study(
            tmp_path, methods=methods, grid=[{"pairings": ["pair"], "methods": ["m"]}]
        )
        with pytest.raises(StudyError, match=re.escape(message)):
            load_study(path)

    def test_method_set_values_are_checked_per_run(self, tmp_path):
        methods = {"m": {"loss": "reco", "set": ["loss.reco_w_max=-1"]}}
        path = _write_study(
            tmp_path, methods=methods, grid=[{"pairings": ["pair"], "methods": ["m"]}]
        )
        with pytest.raises(
            StudyError, match=r"run pair-m-s0: invalid config:\n  nodes.0.loss.reco_w_max"
        ):
            load_study(path)

    def test_errors_name_the_problem(self, tmp_path):
        path = _write_study(tmp_path)
        data = yaml.safe_load(path.read_text())
        data["grid"][0]["methods"].append("ppo")
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(StudyError, match="'ppo' is not defined under methods"):
            load_study(path)
        data["grid"][0]["methods"].pop()
        data["set"] = ["train.steps=-1"]
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(
            StudyError, match=r"run pair-alone-a-s0: invalid config:\n  train.steps"
        ):
            load_study(path)


def _fake_metrics(run_dir: Path, cfg, acc: dict[str, float], last_step: int | None = None) -> None:
    """metrics.jsonl rows as the loop writes them: eval at step 0 and at the end."""
    run_dir.mkdir(parents=True, exist_ok=True)
    steps = cfg.train.steps if last_step is None else last_step
    with (run_dir / "metrics.jsonl").open("w") as f:
        for node in cfg.nodes:
            for step in range(steps + 1):
                row = {"step": step, "node": node.name}
                if step == 0:
                    row.update({"eval/accuracy": 0.1, "eval/test/accuracy": 0.1, "time/setup": 1})
                    row["eval/ood/accuracy"] = 0.0
                else:
                    row["train/generated_tokens_total"] = 100.0 * step
                    row["train/elapsed_seconds"] = 1.0 + step
                    row["loss/filtered_frac"] = 0.25
                if step == cfg.train.steps:
                    a = acc[node.name]
                    row.update({"eval/accuracy": a, "eval/test/accuracy": a})
                    row["eval/ood/accuracy"] = a / 2
                f.write(json.dumps(row) + "\n")


class TestResume:
    def test_skips_done_redoes_incomplete(self, tmp_path, monkeypatch):
        study = load_study(_write_study(tmp_path))
        out = study.out_dir
        runs = {r.id: r for r in study.runs}
        done, partial = runs["pair-nois-s0"], runs["pair-nois-s1"]
        _fake_metrics(out / done.id, done.config, {"a": 0.5, "b": 0.5})
        _fake_metrics(out / partial.id, partial.config, {"a": 0.5, "b": 0.5}, last_step=2)
        (out / partial.id / "stale.txt").write_text("from the interrupted attempt")
        status = {r.id: s for r, s in plan(study)}
        assert status[done.id] == "done" and status[partial.id] == "incomplete"
        assert status["pair-nois-s2"] == "todo"

        calls = []

        def fake_run_local(cfg, run_dir, *, console=None):
            calls.append(cfg.name)
            assert not (run_dir / "stale.txt").exists()  # redone from scratch
            assert (run_dir / "config.yaml").exists() and not cfg.log.progress
            _fake_metrics(run_dir, cfg, {n.name: 0.5 for n in cfg.nodes})

        monkeypatch.setattr("ftis.launch.run_local", fake_run_local)
        outcome = run_study(study, only="pair-nois-*")
        assert outcome.skipped == [done.id]
        assert sorted(calls) == ["pair-nois-s1", "pair-nois-s2"] == sorted(outcome.executed)
        assert run_study(study, only="pair-nois-*").executed == []  # everything done now
        log = json.loads((out / "study.json").read_text())["invocations"]
        assert [i["executed"] for i in log] == [2, 0]

    def test_a_failed_run_does_not_stop_the_sweep(self, tmp_path, monkeypatch):
        study = load_study(_write_study(tmp_path))

        def fake_run_local(cfg, run_dir, *, console=None):
            if cfg.name.endswith("s1"):
                raise RuntimeError("boom")
            _fake_metrics(run_dir, cfg, {n.name: 0.5 for n in cfg.nodes})

        monkeypatch.setattr("ftis.launch.run_local", fake_run_local)
        outcome = run_study(study, only="pair-nois-*")
        assert outcome.failed == {"pair-nois-s1": "RuntimeError: boom"}
        assert outcome.executed == ["pair-nois-s0", "pair-nois-s2"]
        assert plan(study, only="pair-nois-s1")[0][1] == "incomplete"


def _cells(text: str, prefix: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(prefix))
    return [c.strip() for c in line.strip().strip("|").split("|")]


class TestResults:
    def test_tables_give_mean_and_sample_std(self, tmp_path):
        study = load_study(_write_study(tmp_path))
        out = study.out_dir
        runs = {r.id: r for r in study.runs}
        f_tis = {0: (0.50, 0.40), 1: (0.60, 0.50), 2: (0.70, 0.90)}  # seed -> (a, b)
        for seed, (a, b) in f_tis.items():
            r = runs[f"pair-f-tis-s{seed}"]
            _fake_metrics(out / r.id, r.config, {"a": a, "b": b})
            for node, v in (("a", 0.45), ("b", 0.40)):
                r = runs[f"pair-alone-{node}-s{seed}"]
                _fake_metrics(out / r.id, r.config, {node: v + 0.05 * seed})
        results, missing = collect(study, out)
        assert len(results) == 9 and len(missing) == len(study.runs) - 9
        assert finals(results, "pair", "f-tis", "b", "test") == [0.40, 0.50, 0.90]
        assert finals(results, "pair", "alone", "a", "test") == pytest.approx([0.45, 0.50, 0.55])

        report = tmp_path / "RESULTS.md"
        report.write_text(f"old\n{READING_BEGIN}\nMy reading.\n{READING_END}\n")
        write_results(study)
        text = report.read_text()
        # b under F-TIS: mean 60.0, sample std of (40, 50, 90) = 26.5 (hand: sqrt(1400/2))
        assert statistics.stdev([40, 50, 90]) == pytest.approx(26.4575, abs=1e-4)
        row = _cells(text, "| F-TIS |")
        assert row[1:] == ["60.0 ± 10.0", "60.0 ± 26.5", "30.0 ± 5.0", "30.0 ± 13.2", "3", "25.0%"]
        assert _cells(text, "| Alone |")[1:3] == ["50.0 ± 5.0", "45.0 ± 5.0"]
        # gain over alone, seeds paired: a: (5, 10, 15) pp -> +10.0 ± 5.0;
        # b: (0, 5, 40) pp -> +15.0 ± sqrt((15^2 + 10^2 + 25^2) / 2) = 21.8
        gain = next(line for line in text.splitlines() if "| F-TIS | a:" in line)
        assert "a: +10.0 ± 5.0" in gain and "b: +15.0 ± 21.8" in gain
        # equal budget: the pair's final point (step 3: 300 tokens) against Alone's eval point
        # nearest 300 tokens; Alone's fake rows have evals only at steps 0 and 3 -> step 3
        budget = _cells(text, "| pair | F-TIS | b |")
        assert budget[3:] == ["300", "60.0 ± 26.5", "300 (step 3)", "45.0 ± 5.0"]
        assert "Partial results: 9 of 17 runs complete" in text
        assert "My reading." in text and text.count(READING_BEGIN) == 1
        for png in ("curves.png", "budget-tokens.png", "budget-time.png"):
            assert (tmp_path / "results" / "results" / png).exists()
            assert f"results/results/{png}" in text

    def test_step0_per_split_passk_and_offpolicy_tables(self, tmp_path):
        study = load_study(_write_study(tmp_path))
        out = study.out_dir
        runs = {r.id: r for r in study.runs}
        for seed in (0, 1):
            r = runs[f"pair-f-tis-s{seed}"]
            _fake_metrics(out / r.id, r.config, {"a": 0.5, "b": 0.6})
            rows = [json.loads(x) for x in (out / r.id / "metrics.jsonl").read_text().splitlines()]
            last = r.config.train.steps
            for row in rows:
                a = row["node"] == "a"
                if row["step"] == 0:  # a is the adder, b the multiplier
                    row["eval/add/accuracy"], row["eval/mul/accuracy"] = (
                        (0.7, 0.2) if a else (0.1, 0.8)
                    )
                    row["eval/pass@1"], row["eval/pass@8"] = 0.3, 0.6
                elif row["step"] == last:
                    row["eval/add/accuracy"] = 0.75 + 0.1 * seed
                    row["eval/pass@1"], row["eval/pass@8"] = 0.4, 0.7 + 0.1 * seed
                    row["eval/test/distinct_answers"] = 2.0 + seed
                if row["step"] > 0:
                    row["loss/is_weight_mean"] = 1.0 + 0.1 * row["step"]
                    row["loss/is_weight_max"] = 3.0 * row["step"]
                    row["train/completion_tokens"] = 20.0 + row["step"]
            (out / r.id / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
        write_results(study)
        text = (tmp_path / "RESULTS.md").read_text()
        start = text[text.index("## At step 0") : text.index("## Final accuracy")]
        assert _cells(start, "| a |") == [
            "a",
            "10.0 ± 0.0",
            "0.0 ± 0.0",
            "70.0 ± 0.0",
            "20.0 ± 0.0",
            "30.0 ± 0.0",
            "60.0 ± 0.0",
            "-",  # distinct answers: logged at the last eval only in this fake run
            "21.0",
        ]
        assert "add: `a` +60.0; mul: `b` +60.0" in start  # the expertise gap
        skills = text[text.index("## Accuracy per eval split") : text.index("## pass@k")]
        assert _cells(skills, "| F-TIS |")[1] == "80.0 ± 7.1"  # a on add: (75, 85)
        passk = text[text.index("## pass@k") : text.index("## Off-policy")]
        assert _cells(passk, "| method |")[1:4] == [
            "a pass@1",
            "a pass@8",
            "a test/distinct_answers",
        ]
        assert _cells(passk, "| F-TIS |")[1:4] == ["40.0 ± 0.0", "75.0 ± 7.1", "2.50 ± 0.71"]
        assert (tmp_path / "results" / "results" / "passk.png").exists()
        off = text[text.index("## Off-policy") : text.index("## Gain")]
        steps = study.runs[0].config.train.steps
        is_mean = statistics.fmean(1.0 + 0.1 * s for s in range(1, steps + 1))
        tail = statistics.fmean(20.0 + s for s in range(max(1, steps - 4), steps + 1))
        assert _cells(off, "| F-TIS |")[1:5] == [
            "25.0 ± 0.0",
            f"{is_mean:.3f} ± 0.000",
            f"{3.0 * steps:.1f} ± 0.0",
            f"{tail:.2f} ± 0.00",
        ]


def test_a_study_without_alone_has_no_alone_sections(tmp_path):
    path = _write_study(tmp_path)
    spec = yaml.safe_load(path.read_text())
    del spec["methods"]["alone"]
    spec["grid"][0]["methods"] = ["nois", "f-tis"]
    path.write_text(yaml.safe_dump(spec))
    study = load_study(path)
    r = next(r for r in study.runs if r.variant == "f-tis")
    _fake_metrics(study.out_dir / r.id, r.config, {"a": 0.5, "b": 0.6})
    write_results(study)
    text = (tmp_path / "RESULTS.md").read_text()
    assert "## Final accuracy" in text and "| F-TIS |" in text
    assert "Alone" not in text and "## Equal budget" not in text
    assert not (tmp_path / "results" / "results" / "budget-tokens.png").exists()


def test_tiny_sweep_through_the_cli(tmp_path):
    """Two real one-node runs (llama-xs, 2 steps), then --report-only and a resumed no-op."""
    path = _write_study(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["grid"] = [{"pairings": ["pair"], "methods": ["alone"], "seeds": [0]}]
    data["set"] = ["train.steps=2", "nodes.0.warm_start.steps=10", "nodes.1.warm_start.steps=10"]
    path.write_text(yaml.safe_dump(data))
    runner = CliRunner()
    res = runner.invoke(app, ["sweep", str(path)])
    assert res.exit_code == 0, res.output
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| Alone |" in text and "Partial" not in text
    for rid in ("pair-alone-a-s0", "pair-alone-b-s0"):
        rows = (tmp_path / "out" / rid / "metrics.jsonl").read_text().splitlines()
        assert json.loads(rows[-1])["step"] == 2
    res = runner.invoke(app, ["sweep", str(path), "--report-only"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["sweep", str(path), "--dry-run"])
    assert res.exit_code == 0 and res.output.count("│ done") == 2
    assert "estimate: every selected run is done" in res.output


def test_interval_table_matches_a_t_interval_worked_by_hand(tmp_path):
    """The paired-difference table of hand-written runs. Node a: F-TIS ends 1, 2 and 3 points
    above Alone on seeds 0, 1, 2. The mean is +2.0, the sd 1.0, and the 95% t interval with 2
    degrees of freedom is 2 +- 4.303 x 1 / sqrt(3) = [-0.48, +4.48]: it includes zero (not bold).
    Equal tokens: the pair's node generated 150 tokens by its last step; Alone's curve is 0.1 at
    0 tokens and 0.5 at 300, so at 150 it is 0.3 and the differences are +21, +22, +23 ->
    +22.0 [+19.5, +24.5] (bold). Node b: no difference on any seed -> 0.0 [0.0, 0.0], not bold.
    One seed: no interval."""
    study = load_study(_write_study(tmp_path))
    out = study.out_dir
    runs = {r.id: r for r in study.runs}
    for seed in (0, 1, 2):
        for node, v in (("a", 0.50), ("b", 0.60)):
            r = runs[f"pair-alone-{node}-s{seed}"]
            _fake_metrics(out / r.id, r.config, {node: v})  # 100 tokens a step, 300 at the end
        r = runs[f"pair-f-tis-s{seed}"]
        _fake_metrics(out / r.id, r.config, {"a": 0.50 + 0.01 * (seed + 1), "b": 0.60})
        rows = [json.loads(x) for x in (out / r.id / "metrics.jsonl").read_text().splitlines()]
        for row in rows:
            if row["step"] > 0:
                row["train/generated_tokens_total"] = 50.0 * row["step"]
        (out / r.id / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    r = runs["pair-nois-s0"]  # one seed only
    _fake_metrics(out / r.id, r.config, {"a": 0.9, "b": 0.9})
    write_results(study)
    text = (tmp_path / "RESULTS.md").read_text()
    paired = text[text.index("## Paired differences") : text.index("## Curves")]
    assert _cells(paired, "| pair | F-TIS | a |")[3:] == [
        "+2.0 [−0.5, +4.5]",  # test, equal steps
        "**+22.0 [+19.5, +24.5]**",  # test, equal tokens
        "+1.0 [−0.2, +2.2]",  # ood (a / 2 at the end in the fake rows): +0.5, +1, +1.5
        # ood at 150 tokens: Alone's ood curve is 0 at step 0 and 0.25 at 300 tokens -> 0.125;
        # F-TIS's ood is 0.255, 0.26, 0.265 -> +13.0, +13.5, +14.0 -> 13.5 +- 4.303 x 0.5 / sqrt(3)
        "**+13.5 [+12.3, +14.7]**",
        "3",
    ]
    assert _cells(paired, "| pair | F-TIS | b |")[3] == "0.0 [0.0, 0.0]"
    assert _cells(paired, "| pair | NoIS | a |")[3:] == ["n/a (1 seed)"] * 4 + ["1"]
    # b at equal tokens: 0.6 against Alone's 0.35 (test) and 0.3 against 0.15 (ood) on every
    # seed (a zero-width interval), so with a's two equal-token cells 4 of the 8 intervals with two
    # or more seeds are bold (the NoIS cells are 1 seed)
    assert "4 of the 8 intervals exclude zero (bold): 4 better, 0 worse." in paired


def test_dry_run_estimates_the_time_left_from_the_done_runs_of_each_variant(tmp_path):
    """`ftis sweep --dry-run`'s last line: each run left at the mean seconds of the done runs of
    its variant; a variant with none done at the mean of every done run, and said so."""
    from ftis.study.engine import estimate

    study = load_study(_write_study(tmp_path))
    assert "no run is done yet" in estimate(study)
    times = {"pair-alone-a-s0": 100.0, "pair-alone-b-s0": 300.0, "pair-nois-s0": 1000.0}
    for r in study.runs:
        if r.id in times:
            _fake_metrics(study.out_dir / r.id, r.config, {"a": 0.5, "b": 0.6})
            meta = {"status": "done", "seconds": times[r.id]}
            (study.out_dir / r.id / "study-run.json").write_text(json.dumps(meta))
    left = [r for r in study.runs if r.id not in times]
    alone = sum(r.variant == "alone" for r in left)  # 4 left at (100 + 300) / 2
    nois = sum(r.variant == "nois" for r in left)  # 2 left at 1000
    other = len(left) - alone - nois  # at the mean of the three done, 1400 / 3
    total = alone * 200 + nois * 1000 + other * 1400 / 3
    line = estimate(study)
    assert f"{len(left)} run(s) to do, about {total / 3600:.1f} h" in line
    assert f"; {other} of a variant with no done run" in line
    assert estimate(study, only="pair-alone-a-s0") == "estimate: every selected run is done"
