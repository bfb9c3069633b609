"""Comparisons named before the runs (ftis.study.primary): a study file's `primary:` section is
validated against its grid when the study loads, computed from the runs' evals.jsonl with a
Bonferroni-corrected t interval, and opens the document. Checked on the committed real-model
runs (docs/results/real-pilot-runs), against the same numbers computed here from evals.jsonl."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy.stats import t as student_t

from ftis.study import StudyError
from ftis.study.primary import evaluate, insert_primary, primary_lines
from ftis.study.spec import load_study
from ftis.study.stats import read_evals

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "results" / "real-pilot-runs"

PRIMARY = [
    {
        "name": "F-TIS vs Alone G=8, adder",
        "a": {"method": "f-tis", "node": "adder"},
        "b": {"method": "alone-2g", "node": "adder"},
    },
    {
        "name": "F-TIS matches Alone G=4, multiplier",
        "a": {"method": "f-tis", "node": "multiplier"},
        "b": {"method": "alone", "node": "multiplier"},
        "split": "products",
        "equivalence": 5,
    },
]


def _study(tmp_path: Path, primary) -> Path:
    spec = yaml.safe_load((ROOT / "studies" / "real-pilot.yaml").read_text())
    spec["primary"] = primary
    spec["out"] = str(RUNS)
    spec["report"] = str(tmp_path / "real.md")
    for p in spec["pairings"].values():
        p["config"] = str(ROOT / "studies" / p["config"])
    path = tmp_path / "real.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _last(run: str, node: str, split: str) -> np.ndarray:
    return read_evals(RUNS / run)[node][split].correct[-1].astype(float)


def test_primary_numbers_are_the_paired_t_at_the_corrected_level(tmp_path):
    study = load_study(_study(tmp_path, PRIMARY))
    (_, d0, e0, note0), (_, d1, e1, _) = evaluate(study, RUNS)
    # by hand: per seed, the adder's last test accuracy in the F-TIS run minus its run alone
    diffs = np.array(
        [
            _last(f"expertise-f-tis-j-s{s}", "adder", "test").mean()
            - _last(f"expertise-alone-2g-adder-j-s{s}", "adder", "test").mean()
            for s in range(3)
        ]
    )
    half = student_t.ppf(1 - 0.05 / 2 / 2, 2) * diffs.std(ddof=1) / math.sqrt(3)  # m = 2
    assert d0.seeds == 3 and d0.mean == pytest.approx(diffs.mean())
    assert (d0.low, d0.high) == pytest.approx((diffs.mean() - half, diffs.mean() + half))
    assert e0 is None and note0 == "step 20"
    # the equivalence comparison: its interval at 1 - 2 x 0.05 / 2 = 95%, on `products`
    d = [
        _last(f"expertise-f-tis-j-s{s}", "multiplier", "products").mean()
        - _last(f"expertise-alone-multiplier-j-s{s}", "multiplier", "products").mean()
        for s in range(3)
    ]
    half = student_t.ppf(0.975, 2) * np.std(d, ddof=1) / math.sqrt(3)
    assert (e1.low, e1.high) == pytest.approx((np.mean(d) - half, np.mean(d) + half))
    assert d1.high - d1.low > e1.high - e1.low  # the call's interval is the wider, 97.5%


def test_primary_section_opens_the_document(tmp_path):
    study = load_study(_study(tmp_path, PRIMARY))
    lines = primary_lines(study, RUNS)
    text = "\n".join(lines)
    assert lines[0] == "## Primary comparisons"
    assert "97.50% t interval" in text and "95.00% interval" in text
    assert "F-TIS vs Alone G=8, adder" in text and "within ±5" in text
    doc = insert_primary("# Title\n\nintro\n\n## Results\n\nbody\n", lines)
    assert doc.index("## Primary comparisons") < doc.index("## Results")
    assert doc.startswith("# Title\n\nintro\n\n## Primary comparisons\n")
    assert "\n\n## Results\n\nbody\n" in doc
    assert insert_primary("# Title\n", []) == "# Title\n"


def test_no_primary_no_section(tmp_path):
    assert primary_lines(load_study(_study(tmp_path, [])), RUNS) == []


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ({"method": "nope", "node": "adder"}, "method 'nope' is not defined"),
        ({"method": "f-tis", "node": "divider"}, "no node 'divider'"),
        ({"method": "alone", "node": "divider"}, "no run of the grid"),
        ({"method": "f-tis", "node": "adder", "scheme": "vertical"}, "no run of the grid"),
        ({"method": "f-tis", "node": "adder", "pairing": "size"}, "no run of the grid"),
    ],
)
def test_a_primary_comparison_that_names_no_run_is_a_clear_error(tmp_path, ref, message):
    bad = [{"name": "x", "a": ref, "b": {"method": "alone", "node": "adder"}}]
    with pytest.raises(StudyError, match=message):
        load_study(_study(tmp_path, bad))


def test_a_primary_comparison_with_an_unknown_key_is_refused(tmp_path):
    bad = [
        {
            "name": "x",
            "a": {"method": "f-tis", "node": "adder"},
            "b": {"method": "alone", "node": "adder"},
            "margin": 5,
        }
    ]
    with pytest.raises(StudyError, match="margin"):
        load_study(_study(tmp_path, bad))


def test_a_node_pattern_compares_the_mean_over_a_kind_of_peer(tmp_path):
    """`node: "*"` (a glob: a kind of swarm peer) pairs, seed by seed, the mean over the nodes it
    matches of their outcomes per problem; a pattern that matches no node is refused."""
    both = [
        {
            "name": "F-TIS vs HACPO, every node",
            "a": {"method": "f-tis", "node": "*"},
            "b": {"method": "hacpo", "node": "*er"},
        }
    ]
    study = load_study(_study(tmp_path, both))
    ((_, d, _, _),) = evaluate(study, RUNS)

    def mean(m: str, s: int) -> float:
        return float(
            np.mean([_last(f"expertise-{m}-j-s{s}", n, "test") for n in ("adder", "multiplier")])
        )

    diffs = [mean("f-tis", s) - mean("hacpo", s) for s in range(3)]
    assert d.seeds == 3 and d.mean == pytest.approx(np.mean(diffs))
    bad = [{"name": "x", "a": {"method": "f-tis", "node": "div*"}, "b": both[0]["b"]}]
    with pytest.raises(StudyError, match="no node 'div\\*'"):
        load_study(_study(tmp_path, bad))
