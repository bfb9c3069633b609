"""`ftis compare` and `ftis sweep`: runs side by side, and studies over seeds."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ftis.cli.common import console, fail, print_table, setup_logging


def compare(
    run_dirs: Annotated[list[Path], typer.Argument(help="Two or more run directories.")],
    out: Annotated[Path, typer.Option("--out", help="Output PNG.")] = Path("compare.png"),
    pair: Annotated[
        list[str] | None,
        typer.Option(
            "--pair",
            help="A=B: pair node A of the first run with node B of each other run (repeatable; "
            "default: nodes of the same name).",
        ),
    ] = None,
) -> None:
    """Overlay the accuracy curves of several runs in one plot and print their summaries, then
    the first run's last evaluation minus each other run's, per node of the same name (or per
    --pair A=B) and split, paired by problem with a 95% interval (runs of the same task only)."""
    setup_logging(False)
    from ftis.report import ReportError, compare_runs, load_rows, paired_final_rows, summary_table

    pairs: dict[str, str] = {}
    for p in pair or []:
        a, eq, b = p.partition("=")
        if not eq or not a.strip() or not b.strip():
            fail(f"--pair {p!r}: write it as A=B (node A of the first run, node B of the other)")
        if a.strip() in pairs:
            fail(f"--pair: node {a.strip()!r} of the first run is paired twice")
        pairs[a.strip()] = b.strip()
    try:
        for d in run_dirs:
            header, body = summary_table(load_rows(d))
            print_table(header, body, title=str(d))
        for other in run_dirs[1:]:
            title = f"{run_dirs[0]} minus {other}, last evaluations, paired by problem"
            if pairs:
                title += (
                    " (" + ", ".join(f"node {a} against node {b}" for a, b in pairs.items()) + ")"
                )
            header, body, why = paired_final_rows(run_dirs[0], other, pairs=pairs or None)
            if body:
                print_table(header, body, title=title)
            else:
                console.print(f"{title}: none ({why})")
        compare_runs(run_dirs, out)
    except ReportError as e:
        fail(str(e))
    console.print(f"plot: {out}")


def sweep(
    study: Annotated[Path, typer.Argument(help="Study YAML, e.g. studies/paper.yaml.")],
    out: Annotated[
        Path | None, typer.Option("--out", help="Study folder (default runs/study-<name>).")
    ] = None,
    only: Annotated[
        str | None, typer.Option("--only", help="Only runs whose id matches this glob.")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List the runs; run nothing.")] = False,
    report_only: Annotated[
        bool, typer.Option("--report-only", help="Only regenerate the results document.")
    ] = False,
    report_path: Annotated[
        Path | None, typer.Option("--report", help="Results document (default: the study's).")
    ] = None,
    jobs: Annotated[
        int,
        typer.Option(
            "--jobs",
            min=1,
            help="Slots: runs at a time, each in its own process, a run taking one slot per "
            "node process (a 2-node run 2, at most all); threads = cores x its slots / (jobs x "
            "its processes) ($OMP_NUM_THREADS wins). 1: one after another, in this process.",
        ),
    ] = 1,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """Run a study (runs over seeds, resumable) and regenerate its results document.
    The file's `kind:` picks how it is read: a grid of loss methods when absent
    (studies/reasoning.yaml), `kind: arms` for arms of any algorithm (studies/population.yaml),
    or a kind a system registered (`kind: fgrpo`, studies/fgrpo.yaml)."""
    setup_logging(verbose)
    from ftis.study import StudyError
    from ftis.study.engine import dry_run as plan_table
    from ftis.study.engine import estimate, load_study, run_study, write_results

    try:
        st = load_study(study)
    except StudyError as e:
        fail(str(e))
    if dry_run:
        header, rows = plan_table(st, out_dir=out, only=only)
        print_table(header, rows, title=f"study {st.spec.name}")
        console.print(estimate(st, out_dir=out, only=only))
        return
    failed = {}
    if not report_only:
        failed = run_study(st, out_dir=out, only=only, console=console, jobs=jobs).failed
    ran_failed = f"{len(failed)} run(s) failed: {', '.join(sorted(failed))}"
    try:
        written = write_results(st, out_dir=out, report_path=report_path)
    except StudyError as e:
        fail(f"{ran_failed}; {e}" if failed else str(e), code=1 if failed else 2)
    console.print(f"results: {written}")
    if failed:
        fail(ran_failed, code=1)
