"""The table layer every results document is written with (ftis.study.tables): numbers over
seeds, Markdown tables, and the one bold rule: a cell is bold only where it has an interval and
the interval excludes zero, never without an interval."""

from __future__ import annotations

import math

from ftis.study.stats import PairedDifference
from ftis.study.tables import (
    ONE_SEED,
    Differences,
    has_interval,
    interval_cell,
    is_bold,
    regenerate_lines,
    seconds_cell,
    spread,
    table,
)


def test_spread_formats_mean_and_sample_std():
    assert spread([]) == "-"
    assert spread([1.0, 3.0]) == "2.0 ± 1.4"
    assert spread([1.0, 3.0], 3) == "2.000 ± 1.414"
    assert spread([0.01, 0.03], scale=100, signed=True) == "+2.0 ± 1.4"
    assert spread([5.0]) == "5.0 ± 0.0"
    assert spread([1e-4, 3e-4], 2, std_digits=1, notation="e") == "2.00e-04 ± 1.4e-04"


def test_table_and_its_empty_line():
    assert table(["a", "b"], [["1", "2"]]) == ["| a | b |", "|---|---|", "| 1 | 2 |"]
    assert table(["a"], [], empty="_None._") == ["_None._"]
    assert table(["a"], [], empty="") == []
    assert table(["a"], []) == ["| a |", "|---|"]


def test_bold_only_where_an_interval_excludes_zero():
    excludes = PairedDifference(mean=0.05, low=0.01, high=0.09, seeds=3)
    spans = PairedDifference(mean=0.05, low=-0.01, high=0.09, seeds=3)
    one_seed = PairedDifference(mean=0.05, low=0.05, high=0.05, seeds=1)  # no interval
    one_seed_problems = PairedDifference(mean=0.05, low=0.01, high=0.09, seeds=1, problems=40)
    none = PairedDifference(mean=math.nan, low=math.nan, high=math.nan, seeds=0)
    assert is_bold(excludes) and interval_cell(excludes) == "**+5.0 [+1.0, +9.0]**"
    assert interval_cell(excludes, verdict=True) == "**+5.0 [+1.0, +9.0]** (better)"
    assert not is_bold(spans) and interval_cell(spans) == "+5.0 [−1.0, +9.0]"
    assert one_seed.excludes_zero and not has_interval(one_seed) and not is_bold(one_seed)
    assert "**" not in interval_cell(one_seed)
    assert is_bold(one_seed_problems)
    assert not has_interval(none) and not is_bold(none)


def test_differences_count_intervals_and_name_the_bold_ones():
    diffs = Differences()
    a, b = {0: 0.5, 1: 0.6, 2: 0.7}, {0: 0.4, 1: 0.5, 2: 0.6}
    assert diffs.cell("A − B", a, b).startswith("**+10.0")
    assert diffs.cell("one", {0: 0.5}, {0: 0.4}) == ONE_SEED
    assert diffs.cell("none", {0: 0.5}, {1: 0.4}) == "-"
    assert diffs.count == 1 and diffs.hits == ["A − B: better"]
    assert diffs.summary().startswith("1 of the 1 intervals exclude zero (bold): 1 better, 0 worse")


def test_run_cells_and_the_regenerate_block(tmp_path):
    assert seconds_cell(None) == "-" and seconds_cell(12.6) == "13"
    lines = regenerate_lines("studies/x.yaml", tmp_path, "Seeds: 0.")
    assert lines[0] == "## How to regenerate"
    assert any("ftis sweep studies/x.yaml --report-only" in line for line in lines)
    assert lines[-2].endswith("draws one run). Seeds: 0.")
