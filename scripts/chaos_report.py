"""Run the chaos suite and write docs/RELIABILITY.md's per-mode table from its results.

    python scripts/chaos_report.py                     # run every chaos_case test, write the table
    python scripts/chaos_report.py --results R.jsonl   # only render the table of an earlier run
    python scripts/chaos_report.py --merge R.jsonl -- -k X  # rerun some cases over an earlier run

Every test marked `chaos_case(mode, case)` runs (those of the default suite and those marked
`chaos`); tests/conftest.py appends each case's result, as it ends, to a JSONL file
(runs/chaos/results.jsonl; $FTIS_CHAOS_RESULTS). For each case it records its crashes (Python
tracebacks in the logs the case left: a participant that crashed instead of stopping) and its
orphans (processes the case started, directly or not, still alive 10 s after it ended, found with
the test process as their child subreaper). The table lists, per mode, each case, whether its
assertions held, and those counts; the rows "not run" say why a case does not apply to a mode.
The table is written between the markers in docs/RELIABILITY.md; nothing in it is typed by hand
except the reasons of the "not run" rows below."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "RELIABILITY.md"
START, END = "<!-- chaos-table:start -->", "<!-- chaos-table:end -->"
MODES = (
    "F-TIS",
    "ReCo",
    "gossip DPO",
    "CoRP",
    "FGRPO",
    "FedDPO",
    "swarm sim",
    "swarm hivemind",
)
# Cases a mode does not get, and why (design facts, not results).
NOT_RUN: dict[str, list[tuple[str, str]]] = {
    "ReCo": [
        (
            "kill one (SIGKILL, hard exit), malformed payload",
            "as F-TIS: ReCo is a loss of the F-TIS node processes; the processes, the store "
            "exchange and its payload checks are the same",
        )
    ],
    "CoRP": [
        (
            "RandOpt",
            "RandOpt runs on CoRP's launcher, transport and reward-vector checks; the cases run "
            "with CoRP",
        )
    ],
    "FGRPO": [
        (
            "pause or kill the server",
            "the server runs in the launcher's process: stopping it is stopping the launcher "
            "(the SIGTERM and SIGKILL rows)",
        )
    ],
    "FedDPO": [
        (
            "SIGKILL the launcher",
            "as FGRPO: the same Flower launcher and client workers",
        ),
        (
            "kill one client worker",
            "as FGRPO's (the same worker pool); FedDPO's lost client is run in process",
        ),
    ],
    "swarm sim": [
        (
            "pause or kill a participant process; SIGKILL the launcher",
            "the simulated peers are threads of one process in virtual time: the simulator's "
            "own slow and crashed peers are run instead; a SIGKILL loses the work since the "
            "last checkpoint (checkpoint.every)",
        )
    ],
}


def run_suite(results: Path, extra: list[str]) -> tuple[int, float]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-o",
        "addopts=-p no:cacheprovider",  # the ini's addopts leave the chaos marker out
        "-m",
        "chaos_case",
        "-q",
        "-rfE",
        *extra,
    ]
    print("running:", " ".join(cmd), flush=True)
    results.unlink(missing_ok=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "FTIS_CHAOS_RESULTS": str(results)})
    try:
        code = proc.wait()
    except KeyboardInterrupt:  # Ctrl-C: pytest stops too; the table holds the cases that ended
        code = proc.wait()
        code = code if code not in (0, 1) else 2
    return code, time.monotonic() - t0


def read_cases(*files: Path) -> list[dict]:
    """The chaos cases of the results files; a test in several files: the last one's result."""
    found: dict[str, dict] = {}
    for path in files:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            file, _, name = r["test"].partition("::")
            found[r["test"]] = {
                "mode": r["chaos_mode"],
                "case": r["chaos_case"],
                "test": f"`{name}` ({file.removeprefix('tests/')})",
                "result": r["result"],
                "crashes": int(r.get("chaos_crashes", 0)),
                "orphans": int(r.get("chaos_orphans", 0)),
                "orphan_commands": r.get("chaos_orphan_commands", ""),
                "seconds": float(r.get("chaos_seconds", 0.0)),
                "tier": r.get("chaos_tier", "default"),
                "commit": r.get("commit", "?"),
            }
    return list(found.values())


def stamp(results: Path, commit: str) -> None:
    """Name the commit a fresh run's results came from in each of them, so a merged table can
    say which case ran on which commit."""
    if results.exists():
        lines = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
        results.write_text("".join(json.dumps({**r, "commit": commit}) + "\n" for r in lines))


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src", "tests"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out.stdout.strip() + (" + uncommitted changes" if dirty else "")
    except OSError:
        return "?"


def render(
    cases: list[dict], *, wall_s: float | None, complete: bool = True, selection: str = ""
) -> str:
    by_mode: dict[str, list[dict]] = defaultdict(list)
    for c in cases:
        by_mode[c["mode"]].append(c)
    held = sum(c["result"] == "held" for c in cases)
    crashes = sum(c["crashes"] for c in cases)
    orphans = sum(c["orphans"] for c in cases)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    per_commit: dict[str, int] = defaultdict(int)
    for c in cases:
        per_commit[c.get("commit", "?")] += 1
    if len(per_commit) == 1:
        on = f"on commit {next(iter(per_commit))}"
    else:  # a merged table: say which cases ran where
        on = "on commits " + ", ".join(f"{k} ({n} cases)" for k, n in per_commit.items())
    lines = [
        START,
        f"Produced by `python scripts/chaos_report.py` {on}, {when}"
        + (f", {wall_s / 60:.0f} minutes" if wall_s is not None else "")
        + f": **{len(cases)} cases, {held} held, {crashes} crashes, {orphans} orphans.**",
        "",
    ]
    if selection and len(per_commit) == 1:
        lines += [f"**A selection** of the cases (pytest arguments `{selection}`).", ""]
    elif selection:
        lines += [
            f"Merged: the latest run ran a selection (pytest arguments `{selection}`); the "
            "other cases are an earlier run's (`--merge`).",
            "",
        ]
    if not complete:
        lines += [
            "**Partial:** the run was stopped before its end; the cases below are those that "
            "ended, the others are missing from the table.",
            "",
        ]
    for mode in [*MODES, *sorted(set(by_mode) - set(MODES))]:
        rows = sorted(by_mode.get(mode, []), key=lambda c: c["case"])
        lines += [
            f"**{mode}**",
            "",
            "| case | held | crashes | orphans | seconds | in the default suite | test |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in rows:
            orphan = str(c["orphans"]) + (f" ({c['orphan_commands']})" if c["orphans"] else "")
            default = "yes" if c["tier"] == "default" else f"no ({c['tier']})"
            lines.append(
                f"| {c['case']} | {c['result']} | {c['crashes']} | {orphan} | "
                f"{c['seconds']:.0f} | {default} | {c['test']} |"
            )
        for case, why in NOT_RUN.get(mode, []):
            lines.append(f"| {case} | not run: {why} | | | | | |")
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def write_doc(table: str, doc: Path = DOC) -> None:
    try:
        text = doc.read_text()
    except OSError as e:
        raise SystemExit(f"cannot read {doc}: {e.strerror}; name the document with --doc") from e
    if START not in text or END not in text:
        raise SystemExit(f"{doc} has no {START} ... {END} markers: add them where the table goes")
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    doc.write_text(head + table + tail)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--results", type=Path, nargs="+", help="render from these results instead of running"
    )
    ap.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=[],
        help="earlier results whose cases this run's results replace or complete",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "chaos" / "results.jsonl")
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("pytest_args", nargs="*", help="passed on to pytest (e.g. -k hivemind)")
    args = ap.parse_args()
    wall = None
    code = 0
    if args.results is None and any(m.resolve() == args.out.resolve() for m in args.merge):
        raise SystemExit(
            f"--merge {args.out} is also where this run writes its results (--out), which it "
            "empties first: copy the earlier results elsewhere and merge the copy, or pass "
            "another --out"
        )
    if args.results is None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        code, wall = run_suite(args.out, args.pytest_args)
        stamp(args.out, _commit())
        files = [*args.merge, args.out]
    else:
        files = [*args.merge, *args.results]
    files = [f for f in files if f.exists()]
    cases = read_cases(*files)
    if not cases:
        raise SystemExit("no chaos_case results: nothing to write")
    table = render(
        cases,
        wall_s=wall if len(files) == 1 else None,
        complete=code in (0, 1),
        selection=" ".join(args.pytest_args) if args.results is None else "",
    )
    write_doc(table, args.doc)
    bad = [c for c in cases if c["result"] == "failed" or c["crashes"] or c["orphans"]]
    print(f"wrote the table of {len(cases)} cases to {args.doc}; {len(bad)} not held")
    for c in bad:
        print(
            f"  {c['mode']}: {c['case']}: {c['result']}, crashes {c['crashes']}, "
            f"orphans {c['orphans']} {c['orphan_commands']}"
        )
    return 1 if bad or code not in (0,) else 0


if __name__ == "__main__":
    sys.exit(main())
