"""scripts/chaos_report.py: the per-mode table is rendered from the cases' results, and only the
part of the document between its markers is rewritten."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "chaos_report", Path(__file__).resolve().parents[1] / "scripts" / "chaos_report.py"
)
chaos_report = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(chaos_report)


def _line(test: str, mode: str, case: str, result: str = "held", **counts) -> str:
    return json.dumps(
        {
            "test": test,
            "result": result,
            "chaos_mode": mode,
            "chaos_case": case,
            "chaos_tier": "chaos",
            "chaos_orphans": 0,
            "chaos_crashes": 0,
            "chaos_seconds": 12.0,
            **counts,
        }
    )


def test_the_table_counts_what_the_cases_reported_and_a_rerun_replaces_a_case(tmp_path):
    first = tmp_path / "a.jsonl"
    first.write_text(
        "\n".join(
            [
                _line(
                    "tests/t.py::test_x[F-TIS]",
                    "F-TIS",
                    "pause",
                    "failed",
                    chaos_orphans=2,
                    chaos_orphan_commands="p2pd",
                ),
                _line("tests/t.py::test_y", "FGRPO", "kill", chaos_crashes=1),
            ]
        )
    )
    cases = chaos_report.read_cases(first)
    table = chaos_report.render(cases, wall_s=None)
    assert "**2 cases, 1 held, 1 crashes, 2 orphans.**" in table
    assert "| pause | failed | 0 | 2 (p2pd) | 12 | no (chaos) | `test_x[F-TIS]` (t.py) |" in table
    rerun = tmp_path / "b.jsonl"
    rerun.write_text(_line("tests/t.py::test_x[F-TIS]", "F-TIS", "pause"))
    table = chaos_report.render(chaos_report.read_cases(first, rerun), wall_s=None, complete=False)
    assert "**2 cases, 2 held, 1 crashes, 0 orphans.**" in table and "**Partial:**" in table


def test_only_the_marked_part_of_the_document_is_rewritten(tmp_path):
    doc = tmp_path / "R.md"
    doc.write_text(f"head\n{chaos_report.START}\nold\n{chaos_report.END}\ntail\n")
    chaos_report.write_doc(f"{chaos_report.START}\nnew\n{chaos_report.END}", doc)
    assert doc.read_text() == f"head\n{chaos_report.START}\nnew\n{chaos_report.END}\ntail\n"
    doc.write_text("no markers")
    with pytest.raises(SystemExit, match="markers"):
        chaos_report.write_doc("x", doc)


def test_merging_the_file_this_run_writes_is_refused_before_anything_runs(tmp_path, monkeypatch):
    """--merge R --out R would empty R before the run and lose the earlier cases: refused with
    the fix, and no suite is started."""
    results = tmp_path / "results.jsonl"
    results.write_text(_line("t::a", "F-TIS", "pause") + "\n")
    ran = []
    monkeypatch.setattr(chaos_report, "run_suite", lambda *a: ran.append(a) or (0, 1.0))
    monkeypatch.setattr(
        "sys.argv",
        ["chaos_report.py", "--merge", str(results), "--out", str(results)]
        + ["--doc", str(tmp_path / "RELIABILITY.md")],
    )
    with pytest.raises(SystemExit, match="copy the earlier results elsewhere"):
        chaos_report.main()
    assert ran == [] and results.read_text().count("\n") == 1


def test_a_merged_table_names_the_commit_of_each_case(tmp_path):
    """A table merged from an earlier run and a rerun of a selection names both commits with
    their case counts, rather than the rerun's commit for every case."""
    earlier = tmp_path / "a.jsonl"
    earlier.write_text(
        "\n".join(
            [
                _line("tests/t.py::test_x", "F-TIS", "pause"),
                _line("tests/t.py::test_y", "FGRPO", "kill"),
            ]
        )
    )
    chaos_report.stamp(earlier, "aaaaaaa")
    rerun = tmp_path / "b.jsonl"
    rerun.write_text(_line("tests/t.py::test_y", "FGRPO", "kill"))
    chaos_report.stamp(rerun, "bbbbbbb")
    table = chaos_report.render(
        chaos_report.read_cases(earlier, rerun), wall_s=None, selection="-k test_y"
    )
    assert "on commits aaaaaaa (1 cases), bbbbbbb (1 cases)," in table
    assert "Merged: the latest run ran a selection (pytest arguments `-k test_y`)" in table
    alone = chaos_report.render(chaos_report.read_cases(rerun), wall_s=None, selection="-k y")
    assert "on commit bbbbbbb," in alone and "**A selection**" in alone
