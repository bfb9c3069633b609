"""Every results document whose runs are committed regenerates byte for byte from them (issue 39,
items 2 and 6): each study file whose `out:` folder is in the repository is rendered, as
`ftis sweep studies/<name>.yaml --report-only` renders it, into a copy of its document in a
temporary folder (the copy carries the hand-written reading; plots go there too), and the text
must equal the committed document's.

Ten documents take about 35 s together and are checked in the default suite (groups.md, 135
runs, about 26 s of it, bootstraps over 16 swarm peers included); collab.md (about a minute
of bootstraps), RESULTS.md (about 20 s), RESULTS-arithmetic.md (about 15 s) and fgrpo.md are in
the long tier (`python -m pytest -m long`, which CI runs after the default suite). A study whose
runs are not committed (paper-gpu, which needs GPUs) cannot be checked this way."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _committed() -> list[Path]:
    found = []
    for path in sorted((ROOT / "studies").glob("*.yaml")):
        spec = yaml.safe_load(path.read_text())
        out, report = spec.get("out"), ROOT / spec["report"]
        if out and (ROOT / out).is_dir() and report.exists():
            found.append(path)
    return found


SLOW = {"collab", "reasoning", "fgrpo", "paper"}  # their bootstraps take most of the check's time
STUDIES = [
    pytest.param(p, id=p.stem, marks=[pytest.mark.long] if p.stem in SLOW else [])
    for p in _committed()
]


def test_the_committed_studies_are_found():
    names = {p.stem for p in _committed()}
    assert {
        "reasoning",
        "collab",
        "fgrpo",
        "dpo",
        "poisoning",
        "swarm",
        "paper",
        "wire",
        "groups",
    } <= names


@pytest.mark.parametrize("path", STUDIES)
def test_a_document_regenerates_byte_for_byte(path, tmp_path, monkeypatch):
    from ftis.study.engine import load_study, write_results

    monkeypatch.chdir(ROOT)  # documents print paths relative to the repository root
    study = load_study(path.relative_to(ROOT))
    report = ROOT / study.spec.report
    copy = tmp_path / report.parent.relative_to(ROOT) / report.name
    copy.parent.mkdir(parents=True)
    shutil.copyfile(report, copy)
    write_results(study, report_path=copy)
    assert copy.read_bytes() == report.read_bytes(), f"{report.relative_to(ROOT)} changed"
