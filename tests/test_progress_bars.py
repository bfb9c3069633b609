"""The launcher's progress bars: named by the algorithm, their total follows the nodes' status
(train.steps raised at resume), and a previous launch's status files are cleared first."""

from __future__ import annotations

import json
from types import SimpleNamespace

from rich.progress import Progress

from ftis.launch import ProgressBar
from ftis.launch.multi import _update_bars, clear_status


def _status(run_dir, node, **state):
    (run_dir / ".status").mkdir(exist_ok=True)
    (run_dir / ".status" / f"{node}.json").write_text(json.dumps(state))


def test_multi_bars_follow_the_total_and_are_named_by_the_algorithm(tmp_path):
    # the two fields the bars read, as a randopt run has them
    cfg = SimpleNamespace(
        nodes=[SimpleNamespace(name="a")], algorithm=SimpleNamespace(kind="randopt")
    )
    node = "a"
    progress, bars = Progress(disable=True), {}
    _status(tmp_path, node, event="step", step=6, total=6)
    _update_bars(progress, bars, cfg, tmp_path)
    _status(tmp_path, node, event="step", step=7, total=9)
    _update_bars(progress, bars, cfg, tmp_path)
    (task,) = progress.tasks
    assert task.description == f"{node} randopt"
    assert (task.completed, task.total) == (7, 9)


def test_a_previous_launchs_status_files_are_cleared(tmp_path):
    _status(tmp_path, "a", event="step", step=6, total=6)
    (tmp_path / ".status" / "notes.txt").write_text("kept")
    clear_status(tmp_path)
    assert sorted(p.name for p in (tmp_path / ".status").iterdir()) == ["notes.txt"]
    clear_status(tmp_path / "missing")  # no .status folder: nothing to do


def test_single_node_bar_is_named_by_the_algorithm_and_follows_the_total():
    progress = Progress(disable=True)
    bar = ProgressBar(progress, "xs", "dpo")
    bar("step", step=6, total=6, metrics={})
    bar("step", step=7, total=9, metrics={"reward/mean": 0.5})
    (task,) = progress.tasks
    assert task.description == "xs dpo" and (task.completed, task.total) == (7, 9)


def test_tables_off_a_terminal_keep_long_names_on_one_line(capsys, monkeypatch):
    from ftis.cli.common import print_table as _print_table

    monkeypatch.delenv("COLUMNS", raising=False)
    names = [f"a-rather-long-node-name-number-{i}-with-its-model-llama-m" for i in range(3)]
    header = ["node", "accuracy at step 0", "accuracy at the end", "change", "reward", "steps"]
    _print_table(header, [[n, "12.5%", "40.0%", "+27.5", "0.41", "60"] for n in names], "t")
    lines = capsys.readouterr().out.splitlines()
    for n in names:  # each name whole, on the one line that holds its row
        (line,) = [x for x in lines if n in x]
        assert "40.0%" in line and "…" not in line
