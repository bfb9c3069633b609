"""What every study document shares, whatever renders it: the hand-written reading kept across
regenerations, the partial-results banner, and the one writer of a document (`write_document`).
The tables, numbers, intervals and code lines every document is made of are ftis.study.tables's
(their names are kept here too). Nothing here knows an algorithm; each algorithm's tables and
plots live with it (ftis.study.registry)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ftis.study.primary import insert_primary, primary_lines
from ftis.study.spec import StudyError
from ftis.study.tables import (
    DIFFERENCES_NOTE,
    ONE_SEED,
    UNRECORDED_CODE,
    Differences,
    code_line,
    fmt_pct,
    invocations_line,
    mean_std,
    rel,
    table,
)

log = logging.getLogger(__name__)

READING_BEGIN = "<!-- BEGIN hand-written reading: kept when this file is regenerated -->"
READING_END = "<!-- END hand-written reading -->"


def partial_lines(done: int, total: int, missing: list[str], study_rel: str) -> list[str]:
    """The banner of a document whose study is not complete (none when nothing is missing)."""
    if not missing:
        return []
    return [
        f"> **Partial results: {done} of {total} runs complete.** Missing: "
        + ", ".join(f"`{m}`" for m in missing[:12])
        + (f" and {len(missing) - 12} more" if len(missing) > 12 else "")
        + f". Resume with `ftis sweep {study_rel}` (complete runs are skipped).",
        "",
    ]


def reading_lines(reading: str) -> list[str]:
    """The document's closing section: the hand-written reading between its markers."""
    return [
        "## Reading",
        "",
        READING_BEGIN,
        reading.strip() or "_Not written yet._",
        READING_END,
        "",
    ]


def existing_reading(path: Path) -> str:
    if not path.exists():
        return ""
    text = path.read_text()
    if READING_BEGIN in text and READING_END in text:
        return (
            text.split(READING_BEGIN, 1)[1]
            .split(READING_END, 1)[0]
            .strip()
            .removeprefix("_Not written yet._")
        )
    return ""


def write_document(
    study: Any, out_dir: Path | None, report_path: Path | None, *, collect, render
) -> Path:
    """Regenerate a study's document (and its plots) from its run directories: `collect(study,
    out_dir)` gives (results, missing), `render(study, results, missing, out_dir, report_path,
    reading)` the text; the hand-written reading of the existing document is carried over. The
    one writer of every kind of study (grid, FGRPO, arms). A study file's `primary:`
    comparisons open the document, before its first section (ftis.study.primary). An existing document is never
    replaced by one of no runs: finding none complete (run as printed but without the study's
    runs folder, say) raises StudyError and leaves the file as it is."""
    out_dir = Path(out_dir) if out_dir else study.out_dir
    report_path = Path(report_path) if report_path else Path(study.spec.report)
    results, missing = collect(study, out_dir)
    if not results and report_path.exists():
        raise StudyError(
            f"no complete run of study {study.spec.name!r} in {out_dir}: {report_path} left as "
            "it is (point at its runs with --out DIR or the study's `out:`; delete the document "
            "to write an empty one)"
        )
    reading = existing_reading(report_path)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    text = render(study, results, missing, out_dir, report_path, reading)
    report_path.write_text(insert_primary(text, primary_lines(study, out_dir)))
    log.info("results: %s (%d of %d runs complete)", report_path, len(results), len(study.runs))
    return report_path


__all__ = [
    "DIFFERENCES_NOTE",
    "ONE_SEED",
    "READING_BEGIN",
    "READING_END",
    "UNRECORDED_CODE",
    "Differences",
    "code_line",
    "existing_reading",
    "fmt_pct",
    "invocations_line",
    "mean_std",
    "partial_lines",
    "reading_lines",
    "rel",
    "table",
    "write_document",
]
