"""Comparisons named before the runs: the section every grid study's document opens with when its
study file declares `primary:` (docs/math.md §11).

    primary:
      - name: F-TIS vs Alone G=8, adder, test
        a: {method: f-tis, node: adder}
        b: {method: alone-2g, node: adder}
        split: test
      - name: F-TIS matches Alone G=8 at half the own generation, adder
        a: {method: f-tis, node: adder}
        b: {method: alone-2g, node: adder}
        equivalence: 5            # points: the claim is "A matches B" within +-5

Each comparison pairs, seed by seed, the greedy outcomes of `a.node` and `b.node` on `split`
at each run's last evaluation (evals.jsonl) and prints the t interval of the paired difference
(ftis.study.stats) at a Bonferroni-corrected level: with m primary comparisons each interval
is at 1 - 0.05/m, so that the chance of any false call among them is at most 5%. A difference
is called only where that interval excludes zero. An equivalence comparison (two one-sided
tests, each at 0.05/m) holds where the 1 - 2 x 0.05/m interval lies inside +-margin. Every
other cell of the document is exploratory.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

import numpy as np

from ftis.study.runner import run_status
from ftis.study.spec import ArmRef, PrimaryComparison, Study
from ftis.study.stats import NO_DIFFERENCE, PairedDifference, paired_difference, read_evals
from ftis.study.tables import interval_cell, printed_excludes_zero, table

ALPHA = 0.05


def arm_outcomes(
    study: Study, out_dir: Path, ref: ArmRef, split: str
) -> tuple[dict[int, np.ndarray], dict[int, int]]:
    """seed -> (P,) outcomes of `ref.node` on `split` at the run's last evaluation, and seed ->
    that step, over the complete runs of the grid point `ref` names (a run not done, or
    without that node or split in evals.jsonl, is left out). A glob pattern (`llama-s-*`, a
    kind of swarm peer) gives the mean over the nodes it matches, each at its own last
    evaluation (a peer that left for good was last evaluated when it left); the step is the
    latest of theirs."""
    outcomes: dict[int, np.ndarray] = {}
    steps: dict[int, int] = {}
    for run in study.runs_of(ref):
        run_dir = Path(out_dir) / run.id
        if run_status(run_dir, run.config) != "done" or not (run_dir / "evals.jsonl").is_file():
            continue
        evals = read_evals(run_dir)
        found = [
            evals[n][split]
            for n in sorted(evals)
            if fnmatch.fnmatchcase(n, ref.node) and split in evals[n]
        ]
        if not found:
            continue
        outcomes[run.seed] = np.mean([f.correct[-1].astype(float) for f in found], axis=0)
        steps[run.seed] = max(int(f.steps[-1]) for f in found)
    return outcomes, steps


def _verdict(d: PairedDifference) -> str:
    if d.seeds < 2 or not printed_excludes_zero(d) or not d.excludes_zero:
        return NO_DIFFERENCE
    return "A better" if d.low > 0 else "A worse"


def _equivalent(d: PairedDifference, margin: float) -> str:
    if d.seeds < 2:
        return "not shown (fewer than 2 seeds)"
    inside = -margin < 100 * d.low and 100 * d.high < margin
    return (
        f"equivalent within ±{margin:g}" if inside else f"not shown equivalent within ±{margin:g}"
    )


def evaluate(
    study: Study, out_dir: Path
) -> list[tuple[PrimaryComparison, PairedDifference, PairedDifference | None, str]]:
    """(comparison, difference at 1 - 0.05/m, equivalence interval at 1 - 0.1/m or None, a note
    on the steps compared) for every primary comparison of `study`."""
    comps = study.spec.primary
    m = len(comps)
    out = []
    for c in comps:
        a, a_steps = arm_outcomes(study, out_dir, c.a, c.split)
        b, b_steps = arm_outcomes(study, out_dir, c.b, c.split)
        steps = sorted({a_steps[s] for s in a if s in b} | {b_steps[s] for s in b if s in a})
        note = "step " + "/".join(str(s) for s in steps) if steps else "-"
        d = paired_difference(a, b, confidence=1 - ALPHA / m)
        e = paired_difference(a, b, confidence=1 - 2 * ALPHA / m) if c.equivalence else None
        out.append((c, d, e, note))
    return out


def _side(ref: ArmRef) -> str:
    extra = [x for x in (ref.pairing, ref.scheme) if x]
    if ref.threshold is not None:
        extra.append(f"g={ref.threshold:g}")
    return f"{ref.method} ({ref.node}" + (", " + ", ".join(extra) if extra else "") + ")"


def primary_lines(study: Any, out_dir: Path) -> list[str]:
    """The document's 'Primary comparisons' section (nothing when the study names none)."""
    comps = getattr(study.spec, "primary", None)
    if not comps:
        return []
    results = evaluate(study, out_dir)
    m = len(comps)
    rows = []
    for c, d, e, note in results:
        half = "-" if d.seeds < 2 else f"{100 * (d.high - d.low) / 2:.1f}"
        rows.append(
            [
                c.name,
                _side(c.a),
                _side(c.b),
                c.split,
                note,
                str(d.seeds),
                interval_cell(d) if d.seeds else "-",
                half,
                _verdict(d),
                "-" if e is None else f"{interval_cell(e)}: {_equivalent(e, c.equivalence)}",
            ]
        )
    header = [
        "comparison",
        "A",
        "B",
        "split",
        "compared at",
        "seeds",
        f"A − B [{100 * (1 - ALPHA / m):.2f}% t interval]",
        "half-width",
        "call",
        f"equivalence [{100 * (1 - 2 * ALPHA / m):.2f}% interval]",
    ]
    return [
        "## Primary comparisons",
        "",
        f"Named in the study file before its runs: {m} comparison(s). Each is the paired "
        "difference A − B (by seed) in greedy accuracy on the split, in points, at each run's "
        "last evaluation, with a Student-t interval over seeds (docs/math.md §11, calibrated "
        "in docs/results/calibration.md) at a Bonferroni-corrected level: each interval at "
        f"1 − 0.05/{m}, so the chance of any false call among the {m} is at most 5%. A "
        "difference is called only where that interval excludes zero; an equivalence claim "
        "holds only where the "
        f"1 − 0.1/{m} interval (two one-sided tests at 0.05/{m}) lies inside the margin the "
        "study file states. These are the only comparisons a reading may call; every other "
        "cell below is exploratory.",
        "",
        *table(header, rows),
        "",
    ]


def insert_primary(text: str, lines: list[str]) -> str:
    """`text` (a rendered document) with `lines` placed before its first '## ' section."""
    if not lines:
        return text
    block = "\n".join(lines) + "\n"
    head, sep, rest = text.partition("\n## ")
    if not sep:
        return text.rstrip("\n") + "\n\n" + block
    gap = "\n" if head.endswith("\n") else "\n\n"
    return head + gap + block + "## " + rest
