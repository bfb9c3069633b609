"""`ftis bench`: the benchmark suite of a source checkout (bench/)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from ftis.cli.common import console, fail, setup_logging


def bench(
    quick: Annotated[
        bool, typer.Option("--quick", help="A short version (under 10 minutes on 2 cores).")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the summary as one JSON object.")
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Markdown report (default docs/BENCHMARKS.md for a full run, none for --quick).",
        ),
    ] = None,
    threads: Annotated[
        int,
        typer.Option(
            "--threads",
            min=1,
            help="Torch threads per process (1 keeps ratios stable on a busy machine).",
        ),
    ] = 1,
    report_only: Annotated[
        bool,
        typer.Option(
            "--report-only",
            help="Rewrite the report from docs/results/bench.json and the separate benchmarks' "
            ".json files; measure nothing.",
        ),
    ] = False,
) -> None:
    """Benchmarks side by side (ftis vs TRL, sampler vs generate, wire cost, scaling, memory,
    realistic scale with utilisation and a profile).

    Runs from a source checkout: the suite lives in the repository's bench/ folder."""

    setup_logging(False)
    repo = Path(__file__).resolve().parents[3]
    if not (repo / "bench" / "run.py").exists():
        fail(
            "ftis bench needs a source checkout (the bench/ folder beside src/): "
            "git clone the project and pip install -e '.[dev]'"
        )
    sys.path.insert(0, str(repo))
    from bench.run import flat_summary, rewrite
    from bench.run import main as bench_main

    if out is None and not quick:
        out = repo / "docs" / "BENCHMARKS.md"
    if report_only:
        if out is None:
            fail("--report-only rewrites a report: leave out --quick, or give --out")
        try:
            rewrite(out)
        except FileNotFoundError as e:
            fail(str(e))
        console.print(f"report: {out}")
        return
    results = bench_main(quick=quick, out=out, threads=threads)
    if as_json:
        typer.echo(json.dumps(flat_summary(results)))
    else:
        for k, v in results["summary"].items():
            console.print(f"{k}: {v:.3f}")
        if out is not None:
            console.print(f"report: {out}")
