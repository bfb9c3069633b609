"""What every study document shares, whatever renders it: the hand-written reading kept across
regenerations, the one writer of a document (`write_document`), and small formatting helpers
(Markdown tables, mean ± std, which code made the runs, how long `ftis sweep` ran). Nothing here
knows an algorithm; each algorithm's tables and plots live with it (ftis.study.registry)."""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ftis.study.runner import STUDY_LOG
from ftis.study.spec import StudyError
from ftis.study.stats import PairedDifference, paired_difference

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


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; 0 for a single value)."""
    m = statistics.fmean(values)
    s = statistics.stdev(values) if len(values) > 1 else 0.0
    return m, s


def fmt_pct(values: list[float]) -> str:
    if not values:
        return "-"
    m, s = mean_std(values)
    return f"{100 * m:.1f} ± {100 * s:.1f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


ONE_SEED = "n/a (1 seed)"
DIFFERENCES_NOTE = (
    "Each cell is the paired difference A − B (paired by seed: the same seed's run of each), "
    "mean over the seeds both have, with its 95% percentile bootstrap interval over seeds "
    "(ftis.study.stats, 10,000 resamples, docs/math.md §11), in percentage points unless the "
    "column says otherwise. **Bold**: the interval excludes zero, the only case a reading may "
    "call A better or worse than B; otherwise no difference is detected at this resolution. "
    f"'{ONE_SEED}': one paired seed, no interval; '-': no paired seed."
)


class Differences:
    """Paired differences of one document's table: `cell` computes one (ftis.study.stats) and
    formats it; `summary` lists the comparisons whose interval excludes zero, so a reading can
    cite the code's count instead of its own."""

    def __init__(self) -> None:
        self.count = 0
        self.fewest = 0  # the fewest paired seeds behind an interval
        self.hits: list[str] = []

    def cell(
        self,
        label: str,
        a: Mapping[Any, Any],
        b: Mapping[Any, Any],
        *,
        scale: float = 100.0,
        digits: int = 1,
        higher_is_better: bool = True,
    ) -> str:
        """'+1.2 [−0.3, +2.6]' for A − B over the seeds both have (bold when the interval
        excludes zero; the comparison named `label` is then listed by `summary`); 'n/a (1
        seed)' for one paired seed; '-' for none."""
        d = paired_difference(a, b)
        return self.format(label, d, scale=scale, digits=digits, higher_is_better=higher_is_better)

    def format(
        self,
        label: str,
        d: PairedDifference,
        *,
        scale: float = 100.0,
        digits: int = 1,
        higher_is_better: bool = True,
    ) -> str:
        if d.seeds == 0:
            return "-"
        if d.seeds < 2:
            return ONE_SEED
        self.count += 1
        self.fewest = min(self.fewest, d.seeds) if self.fewest else d.seeds
        text = d.cells(scale=scale, digits=digits)
        if d.excludes_zero:
            self.hits.append(f"{label}: {d.verdict(higher_is_better=higher_is_better)}")
            return f"**{text}**"
        return text

    def summary(self) -> str:
        """One line: how many intervals exclude zero (the bold cells), in which direction."""
        if not self.count:
            return "No comparison has two paired seeds."
        if not self.hits:
            return f"None of the {self.count} intervals excludes zero."
        better = sum(h.endswith(": better") for h in self.hits)
        worse = len(self.hits) - better
        few = (
            " With 2-3 seeds a percentile bootstrap cannot reach beyond the smallest and largest "
            "per-seed difference, so its intervals are narrower than 95% coverage would need."
            if self.fewest <= 3
            else ""
        )
        return (
            f"{len(self.hits)} of the {self.count} intervals exclude zero (bold): {better} "
            f"better, {worse} worse.{few} At 95%, about 1 interval in 20 excludes zero when "
            "there is no difference at all."
        )


UNRECORDED_CODE = "unrecorded (runs made before ftis recorded its version)"


def _runs(n: int) -> str:
    return f"{n} run" if n == 1 else f"{n} runs"


def code_line(results: list[Any], arm: Callable[[Any], str] | None = None) -> str:
    """Which code made the runs (`ftis` version + git commit, recorded by `ftis sweep`). With
    `arm` (a run's arm) and runs from more than one code version, also which arms each version
    made, so that a comparison across versions is visible as one: an arm whose runs span
    versions is named under each with its share of runs."""
    counts: dict[str, int] = {}
    for r in results:
        key = r.code or UNRECORDED_CODE
        counts[key] = counts.get(key, 0) + 1
    if not counts:
        return "Code: no complete run yet."
    order = [c for c, _ in sorted(counts.items(), key=lambda kv: -kv[1])]
    parts = [f"`{c}` ({_runs(counts[c])})" for c in order]
    line = "Code the runs were made with: " + ", ".join(parts) + "."
    if arm is None or len(counts) < 2:
        return line
    per_arm: dict[str, dict[str, int]] = {}  # arm -> code -> runs, in the results' arm order
    for r in results:
        by_code = per_arm.setdefault(arm(r), {})
        key = r.code or UNRECORDED_CODE
        by_code[key] = by_code.get(key, 0) + 1
    groups = []
    for c in order:
        names = []
        for a, by_code in per_arm.items():
            if c in by_code:
                total = sum(by_code.values())
                names.append(a if by_code[c] == total else f"{a} ({by_code[c]} of {total} runs)")
        groups.append(f"`{c}`: " + ", ".join(names))
    return (
        line
        + f" The runs come from {len(counts)} code versions, so a comparison between runs made "
        "with different versions also compares the code. Arms by version: "
        + "; ".join(groups)
        + "."
    )


def rel(path: Path) -> str:
    """A path relative to the working directory when it lies under it (for commands in docs)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def invocations_line(out_dir: Path) -> str:
    try:
        inv = json.loads((out_dir / STUDY_LOG).read_text())["invocations"]
    except (OSError, ValueError, KeyError):
        return ""
    ran = [i for i in inv if i.get("executed")]
    if not ran:
        return ""
    total = sum(i["seconds"] for i in ran)
    codes = sorted({i.get("code") or "unknown" for i in ran})
    return (
        f"`ftis sweep` wall time over {len(ran)} invocation(s) that ran something: "
        f"{total / 60:.1f} min; code: {', '.join(f'`{c}`' for c in codes)}."
    )


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
    one writer of every kind of study (grid, FGRPO, arms). An existing document is never
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
    report_path.write_text(render(study, results, missing, out_dir, report_path, reading))
    log.info("results: %s (%d of %d runs complete)", report_path, len(results), len(study.runs))
    return report_path
