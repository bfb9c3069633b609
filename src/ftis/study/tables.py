"""The table layer of every results document: what a renderer's tables are made of, written once.

A renderer (each document's module in `ftis.results`) decides its rows, columns and
which cells compare two arms; this module formats them:
- numbers over seeds: `spread` ('m ± s', '-' for none), `fmt_pct` (fractions as percent);
- paired differences: `Differences` counts every interval and applies the one bold rule through
  `interval_cell`: a cell is bold only where it has an interval and the interval excludes zero,
  never without an interval (one paired seed gives no interval: ONE_SEED, not bold);
- Markdown tables (`table`), the runs table (`runs_table`), the line saying which code made the
  runs (`code_line`) and how long `ftis sweep` ran (`invocations_line`), and the block that says
  how to regenerate a document (`regenerate_lines`).
Nothing here knows an algorithm."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ftis.study.runner import STUDY_LOG
from ftis.study.stats import PairedDifference, paired_difference

# ------------------------------------------------------------------------------------ numbers


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; 0 for a single value)."""
    m = statistics.fmean(values)
    s = statistics.stdev(values) if len(values) > 1 else 0.0
    return m, s


def spread(
    values: Sequence[float],
    digits: int = 1,
    *,
    scale: float = 1.0,
    signed: bool = False,
    std_digits: int | None = None,
    notation: str = "f",
) -> str:
    """'m ± s' over `values` (mean and sample std, each times `scale`, `digits` decimals, the
    std `std_digits` if given; the mean with its sign when `signed`; `notation` "e" for
    scientific, '1.23e-04 ± 4.5e-05'); '-' for no value."""
    if not values:
        return "-"
    m, s = mean_std([scale * v for v in values] if scale != 1.0 else list(values))
    sd = digits if std_digits is None else std_digits
    return f"{m:{'+' if signed else ''}.{digits}{notation}} ± {s:.{sd}{notation}}"


def fmt_pct(values: list[float]) -> str:
    """Fractions as percent: '12.3 ± 1.4' (the mean and std of the fractions, times 100)."""
    if not values:
        return "-"
    m, s = mean_std(values)
    return f"{100 * m:.1f} ± {100 * s:.1f}"


# ------------------------------------------------------------------------------ Markdown tables


def table(header: list[str] | str, rows: list[list[str]], *, empty: str | None = None) -> list[str]:
    """A Markdown table. `header` is its cells, or its header row as Markdown writes it ('a | b
    | c'). With `empty`, that line alone where there is no row (nothing at all for `empty=""`:
    a section that has no row is left out)."""
    if not rows and empty is not None:
        return [empty] if empty else []
    if isinstance(header, str):
        header = header.split(" | ")
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def rel(path: Path) -> str:
    """A path relative to the working directory when it lies under it (for commands in docs)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------- paired differences

ONE_SEED = "n/a (1 seed)"
DIFFERENCES_NOTE = (
    "Each cell is the paired difference A − B (paired by seed: the same seed's run of each), "
    "mean over the seeds both have, with its 95% Student-t interval over the per-seed "
    "differences (a seed's problems averaged first, so it holds for the split's problems: "
    "ftis.study.stats, docs/math.md §11; its coverage on null comparisons is measured in "
    "docs/results/calibration.md), in percentage points "
    "unless the column says otherwise. **Bold**: the printed interval excludes zero; unless "
    "the document names the comparison as primary before its runs, a bold cell is exploratory "
    "(about 1 cell in 20 is bold when nothing differs); otherwise no difference is detected at "
    f"this resolution. '{ONE_SEED}': one paired seed, no interval; '-': no paired seed."
)


def has_interval(d: PairedDifference) -> bool:
    """Whether `d` carries an interval: two paired seeds or more, or one seed's per-problem
    outcomes; finite ends either way."""
    return (d.seeds >= 2 or (d.seeds == 1 and d.problems > 0)) and bool(
        math.isfinite(d.low) and math.isfinite(d.high)
    )


def printed_excludes_zero(d: PairedDifference, *, scale: float = 100.0, digits: int = 1) -> bool:
    """Whether the interval as printed (times `scale`, rounded to `digits`) excludes zero: an
    end that prints as 0.0 touches zero, whatever its unrounded value."""
    low, high = round(d.low * scale, digits), round(d.high * scale, digits)
    return bool(low > 0 or high < 0)


def is_bold(d: PairedDifference, *, scale: float = 100.0, digits: int = 1) -> bool:
    """The one bold rule of every document: an interval, and its printed ends exclude zero."""
    return (
        has_interval(d) and d.excludes_zero and printed_excludes_zero(d, scale=scale, digits=digits)
    )


def interval_cell(
    d: PairedDifference, *, scale: float = 100.0, digits: int = 1, verdict: bool = False
) -> str:
    """'+1.2 [−0.3, +2.6]' for `d` (times `scale`), in bold by `is_bold`; with `verdict`, a bold
    cell also says '(better)' or '(worse)'. Cells without a paired seed or without an interval
    are the caller's to word (`Differences.format`, collab's cells)."""
    text = d.cells(scale=scale, digits=digits)
    if not is_bold(d, scale=scale, digits=digits):
        return text
    return f"**{text}** ({d.verdict()})" if verdict else f"**{text}**"


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
        if is_bold(d, scale=scale, digits=digits):
            self.hits.append(f"{label}: {d.verdict(higher_is_better=higher_is_better)}")
        return interval_cell(d, scale=scale, digits=digits)

    def block(self, note: str, *tables: list[str]) -> list[str]:
        """The note that says how to read the cells (DIFFERENCES_NOTE and what the intervals
        average), the tables of these differences and the summary line; nothing when every
        table is empty."""
        tables = tuple(t for t in tables if t)
        if not tables:
            return []
        lines = [note, ""]
        for t in tables:
            lines += [*t, ""]
        return [*lines, self.summary(), ""]

    def summary(self) -> str:
        """One line: how many intervals exclude zero (the bold cells), in which direction, and
        how many a null effect would bold (these cells are exploratory: docs/math.md §11)."""
        if not self.count:
            return "No comparison has two paired seeds."
        null = self.count / 20
        expect = (
            f" These {self.count} cells are exploratory: were there no difference anywhere, "
            f"about {null:.1f} of them would be bold (1 in 20)."
        )
        if not self.hits:
            return f"None of the {self.count} intervals excludes zero.{expect}"
        better = sum(h.endswith(": better") for h in self.hits)
        worse = len(self.hits) - better
        return (
            f"{len(self.hits)} of the {self.count} intervals exclude zero (bold): {better} "
            f"better, {worse} worse.{expect}"
        )


# ------------------------------------------------------------------------ runs and their code

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


def invocations_line(out_dir: Path, *, codes: bool = True) -> str:
    """How long `ftis sweep` ran, over the invocations that ran something (its study log), and
    (with `codes`) on which code; '' when the log records none."""
    try:
        inv = json.loads((out_dir / STUDY_LOG).read_text())["invocations"]
    except (OSError, ValueError, KeyError):
        return ""
    ran = [i for i in inv if i.get("executed")]
    if not ran:
        return ""
    total = sum(i["seconds"] for i in ran)
    line = f"`ftis sweep` wall time over {len(ran)} invocation(s) that ran something: "
    if not codes:
        return line + f"{total / 60:.1f} min."
    names = sorted({i.get("code") or "unknown" for i in ran})
    return line + f"{total / 60:.1f} min; code: {', '.join(f'`{c}`' for c in names)}."


def runs_table(out_dir: Path, header: list[str], rows: list[list[str]]) -> list[str]:
    """'Runs in `DIR`:' and the table of every complete run."""
    return [f"Runs in `{rel(out_dir)}`:", "", *table(header, rows)]


def paired_count(a: Mapping[Any, Any], b: Mapping[Any, Any]) -> str:
    """How many keys (seeds, peers) A and B share: the pairs behind a paired difference."""
    return str(len(set(a) & set(b)))


def seconds_cell(seconds: float | None) -> str:
    """A run's wall seconds, rounded; '-' when not recorded."""
    return "-" if seconds is None else f"{seconds:.0f}"


def regenerate_lines(study_rel: str, out_dir: Path, seeds: str) -> list[str]:
    """The 'How to regenerate' section of a grid or FGRPO document: the three `ftis sweep`
    commands and where the runs are (`seeds` ends the last line)."""
    return [
        "## How to regenerate",
        "",
        "```bash",
        f"ftis sweep {study_rel}                 # run every missing run, then rewrite this file",
        f"ftis sweep {study_rel} --report-only   # rewrite this file from the existing run "
        "directories",
        f"ftis sweep {study_rel} --dry-run       # list the runs and which are done",
        "```",
        "",
        f"Run directories: `{rel(out_dir)}/<run-id>/` (ordinary `ftis run` directories; "
        "`ftis report DIR` draws one run). " + seeds,
        "",
    ]


__all__ = [
    "DIFFERENCES_NOTE",
    "ONE_SEED",
    "UNRECORDED_CODE",
    "Differences",
    "code_line",
    "fmt_pct",
    "has_interval",
    "interval_cell",
    "invocations_line",
    "is_bold",
    "mean_std",
    "paired_count",
    "printed_excludes_zero",
    "regenerate_lines",
    "rel",
    "runs_table",
    "seconds_cell",
    "spread",
    "table",
]
