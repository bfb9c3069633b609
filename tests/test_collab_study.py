"""The collaboration study's document from hand-written run directories: its paired differences
to training alone (per-problem outcomes, by seed) and HACPO's figures, worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml

from ftis.study.engine import load_study, write_results
from ftis.train.metrics import encode_outcomes

PAIRING = {
    "name": "pair",
    "task": {"kind": "arithmetic", "seed": 0},
    "nodes": [
        {"name": "a", "model": {"preset": "llama-xs"}},
        {"name": "b", "model": {"preset": "llama-xs"}},
    ],
    "sharing": {"scheme": "joint"},
    "train": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
    "eval": {"every": 2, "size": 4, "pass_samples": 0},
}

STUDY = {
    "name": "collab-test",
    "results": "collab",
    "seeds": [0, 1],
    "pairings": {"p": {"config": "pair.yaml"}},
    "methods": {
        "alone": {"loss": "vis", "alone": True, "label": "Alone"},
        "hacpo": {"loss": "hacpo", "label": "HACPO"},
    },
    "grid": [{"pairings": ["p"], "methods": ["alone", "hacpo"], "schemes": ["joint"]}],
    "options": {"baselines": ["alone"], "tokens_baseline": "alone"},
}

# Four test problems. Node a's outcomes at step 2:
#   alone s0: 1 0 0 0   hacpo s0: 1 1 0 0   d = 0 1 0 0
#   alone s1: 0 0 1 0   hacpo s1: 0 1 1 1   d = 0 1 0 1
# Per-seed means of d: 0.25 and 0.5: mean difference +37.5 points. A resample's mean is 0 when
# it draws no problem 1 (d = 1 at both seeds) and problem 3 only with both seeds s0:
# P = 1/4 (3/4)^4 + 3/4 (1/2)^4 = 0.079 + 0.047 = 12.6% > 2.5%, so the interval's low end is
# exactly 0: zero is inside, no verdict. Its high end: the 97.5% quantile, 87.5.
OUT = {
    ("alone", "a", 0): [1, 0, 0, 0],
    ("alone", "a", 1): [0, 0, 1, 0],
    ("hacpo", "a", 0): [1, 1, 0, 0],
    ("hacpo", "a", 1): [0, 1, 1, 1],
    ("alone", "b", 0): [1, 1, 1, 1],
    ("alone", "b", 1): [1, 1, 1, 1],
    ("hacpo", "b", 0): [1, 1, 1, 1],
    ("hacpo", "b", 1): [1, 1, 1, 1],
}


def _write_run(run_dir: Path, nodes: list[str], method: str, seed: int) -> None:
    run_dir.mkdir(parents=True)
    rows, evals = [], []
    for n in nodes:
        start = [0, 0, 0, 0]
        final = OUT[(method, n, seed)]
        for step, bits in ((0, start), (2, final)):
            evals.append(
                {"step": step, "node": n, "split": "test", "n": 4, "correct": encode_outcomes(bits)}
            )
        rows.append({"step": 0, "node": n, "eval/accuracy": 0.0, "eval/test/accuracy": 0.0})
        # alone generates twice the tokens a sharing node does here: equal tokens reads its
        # curve at 100 tokens, halfway from step 0 to step 2
        tokens = 200.0 if method == "alone" else 100.0
        for step in (1, 2):
            r = {"step": step, "node": n, "train/generated_tokens_total": tokens * step / 2}
            if method == "hacpo":
                r.update(
                    {
                        "hacpo/capability": 0.2 * step,
                        "hacpo/discrepancy": 1.5,
                        "hacpo/clipped_fraction": 0.25,
                        "hacpo/peer_capability": 0.5,
                    }
                )
            if step == 2:
                r.update(
                    {
                        "eval/accuracy": float(np.mean(final)),
                        "eval/test/accuracy": float(np.mean(final)),
                    }
                )
            rows.append(r)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    (run_dir / "study-run.json").write_text(json.dumps({"seconds": 1.0, "code": "abc1234"}))


def test_collab_document_pairs_by_seed_and_problem(tmp_path):
    (tmp_path / "pair.yaml").write_text(yaml.safe_dump(PAIRING))
    (tmp_path / "collab.yaml").write_text(yaml.safe_dump(STUDY))
    study = load_study(tmp_path / "collab.yaml")
    out = tmp_path / "runs"
    for run in study.runs:
        nodes = [run.node] if run.node else ["a", "b"]
        _write_run(out / run.id, nodes, run.method, run.seed)
    report = tmp_path / "collab.md"
    write_results(study, out_dir=out, report_path=report)
    text = report.read_text()
    # accuracy: alone a 25.0 ± 0.0 at both seeds; hacpo a (50 + 75)/2 = 62.5, sd 17.7
    assert "| Alone | 0.0 ± 0.0 -> 25.0 ± 0.0 (2) | 0.0 ± 0.0 -> 100.0 ± 0.0 (2) |" in text
    assert "| HACPO | 0.0 ± 0.0 -> 62.5 ± 17.7 (2) |" in text
    # node a: per-seed differences +25 and +50 at equal steps: +37.5, and the 95% t interval with
    # 1 degree of freedom is 37.5 +- 12.706 x 17.68 / sqrt(2) = [-121.3, +196.3] (not bold: two
    # seeds resolve almost nothing); node b: identical outcomes at equal steps -> exactly
    # 0 [0, 0], no verdict; at equal tokens alone is read halfway between all wrong and all right
    # (0.5 on every problem, every seed): exactly +50 [+50, +50] on both seeds, bold.
    row_a = next(line for line in text.splitlines() if line.startswith("| HACPO | a |"))
    m = "\u2212"
    assert f"| +37.5 [{m}121.3, +196.3] |" in row_a
    row_b = next(line for line in text.splitlines() if line.startswith("| HACPO | b |"))
    assert row_b == "| HACPO | b | 0.0 [0.0, 0.0] | **+50.0 [+50.0, +50.0]** (better) |"
    # equal tokens: hacpo's 100 tokens at step 2 meet alone's curve halfway between step 0 (all
    # 0) and step 2: alone's value there is half its final outcomes, so a's differences are
    # s0 0.5 - 0.125, s1 0.75 - 0.125 -> +37.5 and +62.5: +50.0 +- 12.706 x 17.68 / sqrt(2)
    assert row_a.endswith(f"| +50.0 [{m}108.8, +208.8] |")
    # HACPO's figures: capability 0.2 -> 0.4 (steps 1, 2), omega 1.5, 25% clipped
    assert "| a | 0.20 -> 0.40 | 0.50 -> 0.50 | 1.50 | 25.0% |" in text
    assert (tmp_path / "collab-test-plots" / "accuracy.png").exists()
    # regenerating gives the same bytes
    write_results(study, out_dir=out, report_path=report)
    assert report.read_text() == text


def test_a_method_keeps_its_colour_in_every_panel(tmp_path, monkeypatch):
    # pairing q ran only the second and third methods: their lines must keep the colours they
    # have in pairing p (whose panel carries the legend), not restart at the first colour
    import matplotlib.pyplot as plt

    from ftis.results import collab

    class Outcomes:
        steps = np.array([0, 2])

    class Data:
        class _cache:  # mirrors CollabData's attribute
            @staticmethod
            def outcomes(run_dir):
                return {"n": {"test": Outcomes()}}

        def seeds(self, p, m, n):
            from types import SimpleNamespace

            ran = {"p": ["m0", "m1", "m2"], "q": ["m1", "m2"]}
            return {0: SimpleNamespace(run_dir=tmp_path)} if m in ran[p] else {}

        def curve(self, run, split):
            return np.array([0.0, 10.0]), np.array([[0.0], [1.0]])

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig: figs.append(fig))
    labels = {"m0": "zero", "m1": "one", "m2": "two"}
    panels = [("p", ["n"]), ("q", ["n"])]
    assert collab.plot_curves(
        Data(), panels, ["m0", "m1", "m2"], labels, "test", tmp_path / "a.png"
    )
    ax_p, ax_q = figs[0].axes[:2]
    colour = {line.get_label(): line.get_color() for line in ax_p.get_lines()}
    assert len(set(colour.values())) == 3
    for line in ax_q.get_lines():
        assert line.get_color() == colour[line.get_label()]
    assert [t.get_text() for t in ax_p.get_legend().get_texts()] == ["zero", "one", "two"]


def test_hacpo_series_averages_only_steps_every_seed_logged(tmp_path: Path) -> None:
    """A step that one seed did not log (its run stopped early, or the row lacks the key) is
    left out of the curve: a mean over a different set of seeds there would move the curve."""
    from ftis.results.collab import CollabData, NodeRun

    runs = []
    for seed, values in {0: [1.0, 2.0, 3.0], 1: [3.0, 4.0]}.items():
        run_dir = tmp_path / f"s{seed}"
        run_dir.mkdir()
        rows = [{"node": "a", "step": step, "hacpo/capability": v} for step, v in enumerate(values)]
        rows.append({"node": "a", "step": 5, "other": 1.0})
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(NodeRun("p", "hacpo", "a", seed, run_dir))
    steps, means = CollabData(runs).series("p", "hacpo", "a", "hacpo/capability")
    assert steps == [0, 1]
    assert means == [2.0, 3.0]
