"""The command a results document prints regenerates it: a study whose runs are committed
(docs/results/<name>-runs/) names that folder with `out:`, so that the printed
`ftis sweep studies/<name>.yaml --report-only` reads them instead of an empty runs/study-<name>,
and every run folder a document prints is its study's. The check reads the study files as
written and the documents' text, neither the runs nor the expanded studies, so it takes well
under a second."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
STUDIES = sorted((ROOT / "studies").glob("*.yaml"))

# where a document names its runs: the grid, FGRPO and collab headers, the arms header, and any
# `ftis sweep studies/<name>.yaml ... --out DIR` it prints
RUN_FOLDER = re.compile(
    r"Run directories: `([^`]+)/<run-id>/`|from the run directories in `([^`]+)`"
)
COMMAND_OUT = re.compile(r"ftis sweep (studies/[\w.-]+\.yaml)[^`\n]*?--out (\S+?)[`\s]")


def test_every_study_file_is_checked():
    assert len(STUDIES) >= 8 and ROOT / "studies" / "reasoning.yaml" in STUDIES


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.stem)
def test_a_document_prints_the_runs_folder_its_study_reads(path):
    spec = yaml.safe_load(path.read_text())
    name = spec["name"]
    out = spec.get("out") or f"runs/study-{name}"  # as every study kind reads it (`out_dir`)
    committed = ROOT / "docs" / "results" / f"{name}-runs"
    if committed.is_dir():
        assert out == f"docs/results/{name}-runs", f"{path.name}: name its runs with `out:`"
        runs = [d for d in committed.iterdir() if (d / "config.yaml").is_file()]
        assert runs, f"{committed} holds no run directory"
    report = ROOT / spec["report"]
    if not report.exists():
        return
    text = report.read_text()
    printed = [a or b for a, b in RUN_FOLDER.findall(text)]
    assert printed, f"{report} names no run folder"
    assert set(printed) == {out}, report
    study_rel = str(path.relative_to(ROOT))
    for named, printed_out in COMMAND_OUT.findall(text):
        if named == study_rel:
            assert printed_out == out, f"{report} prints --out {printed_out}"


DOCUMENTS = sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs" / "results").glob("*.md"))
COUNT_LINE = re.compile(r"(?:\d+|None) of the (\d+) intervals? exclude")
TYPED_COUNT = re.compile(r"(\d[\d,]*)\s+intervals\b")


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_a_reading_counts_the_intervals_its_renderer_counted(path):
    """A hand-written reading that says how many intervals its document holds ("with 55
    intervals in that section") says the number the renderer printed under the table ("31 of
    the 55 intervals exclude zero"), not one typed from memory (issue 39, item 5: population.md
    said 54)."""
    text = path.read_text()
    begin = text.find("<!-- BEGIN hand-written reading")
    counts = {int(n) for n in COUNT_LINE.findall(text)}
    if begin < 0 or len(counts) != 1:
        return
    (count,) = counts
    typed = [int(n.replace(",", "")) for n in TYPED_COUNT.findall(text[begin:])]
    assert all(n == count for n in typed), f"{path.name}: reading says {typed}, table {count}"
