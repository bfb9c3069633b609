"""One definition of accuracy per report (issue 36, item 5): the summary's headline and the
paired change agree. With a partial-credit reward the rows' `eval/<split>/accuracy` is the mean
reward while evals.jsonl counts a problem solved when its reward is above 0; they disagreed in
sign (19.2% -> 20.3% headline, -5.0 points paired). Now both figures are shown, labelled, and
the paired change is the solved share's."""

from __future__ import annotations

import json
from pathlib import Path

from ftis.report import load_rows, partial_credit_splits, summary_table, write_report
from ftis.train.metrics import encode_outcomes


def _run(tmp_path: Path, evals: dict[int, list[int]], acc: dict[int, float]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.yaml").write_text("name: t\nalgorithm:\n  kind: ftis\n")
    rows = [
        {"step": s, "node": "a", "eval/accuracy": a, "eval/test/accuracy": a}
        for s, a in acc.items()
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = [
        {"step": s, "node": "a", "split": "test", "n": len(c), "correct": encode_outcomes(c)}
        for s, c in evals.items()
    ]
    (tmp_path / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return tmp_path


# 20 problems: 5 solved (reward > 0) at step 0, 4 at step 4; the mean reward rises anyway
BEFORE = [1] * 5 + [0] * 15
AFTER = [1] * 4 + [0] * 16


def test_a_partial_credit_reward_gets_two_labelled_figures_that_agree_with_the_change(tmp_path):
    run = _run(tmp_path, {0: BEFORE, 4: AFTER}, {0: 0.192, 4: 0.203})
    rows = load_rows(run)
    assert [r["eval/test/solved"] for r in rows] == [0.25, 0.2]
    assert partial_credit_splits(rows) == ["test"]
    header, body = summary_table(rows)
    assert header == [
        "node",
        "test mean reward before -> after",
        "test solved (reward > 0) before -> after",
    ]
    assert body == [["a", "0.192 -> 0.203", "25.0% -> 20.0%"]]
    report = write_report(run).read_text()
    assert "| a | 0.192 -> 0.203 | 25.0% -> 20.0% |" in report
    assert "'mean reward', the mean greedy reward" in report
    assert "solved (reward > 0): change (points) [95% interval]" in report
    change = report[report.index("### Change over the run") :]
    row = next(line for line in change.splitlines() if line.startswith("| a | test |"))
    assert "\u22125.0 [" in row  # the sign of the solved column (25.0% -> 20.0%): minus


def test_a_0_1_reward_keeps_one_acc_column(tmp_path):
    run = _run(tmp_path, {0: BEFORE, 4: [1] * 8 + [0] * 12}, {0: 0.25, 4: 0.4})
    rows = load_rows(run)
    assert partial_credit_splits(rows) == []
    header, body = summary_table(rows)
    assert header == ["node", "test acc before -> after"]
    assert body == [["a", "25.0% -> 40.0%"]]
    report = write_report(run).read_text()
    assert "'mean reward'" not in report
    assert "the summary's 'acc', or its 'solved' column" in report


def test_rows_without_evals_jsonl_are_read_as_before(tmp_path):
    run = _run(tmp_path, {}, {0: 0.5, 4: 0.75})
    (run / "evals.jsonl").unlink()
    rows = load_rows(run)
    assert not any("eval/test/solved" in r for r in rows)
    assert summary_table(rows) == (["node", "test acc before -> after"], [["a", "50.0% -> 75.0%"]])
