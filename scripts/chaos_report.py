"""Run the chaos suite and write docs/RELIABILITY.md's per-mode table from its results.

    python scripts/chaos_report.py                 # run every chaos_case test, write the table
    python scripts/chaos_report.py --junit J.xml   # only render the table of an earlier run
    python scripts/chaos_report.py -k X --merge J.xml  # rerun some cases over an earlier run

Every test marked `chaos_case(mode, case)` runs (those of the default suite and those marked
`chaos`), with a junit xml. For each case tests/conftest.py records its crashes (Python
tracebacks in the logs the case left: a participant that crashed instead of stopping) and its
orphans (processes the case started, directly or not, still alive 10 s after it ended, found with
the test process as their child subreaper). The table lists, per mode, each case, whether its
assertions held, and those counts; the rows "not run" say why a case does not apply to a mode.
The table is written between the markers in docs/RELIABILITY.md; nothing in it is typed by hand
except the reasons of the "not run" rows below."""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
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


def run_suite(junit: Path, extra: list[str]) -> tuple[int, float]:
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
        f"--junitxml={junit}",
        *extra,
    ]
    print("running:", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    code = subprocess.call(cmd, cwd=ROOT)
    return code, time.monotonic() - t0


def read_cases(*junits: Path) -> list[dict]:
    """The chaos cases of the junit files; a test in several files: the last file's result."""
    found: dict[str, dict] = {}
    for junit in junits:
        for case in _read(junit):
            found[case["test"]] = case
    return list(found.values())


def _read(junit: Path) -> list[dict]:
    cases = []
    for tc in ET.parse(junit).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        if "chaos_mode" not in props:
            continue
        if tc.find("failure") is not None or tc.find("error") is not None:
            result = "failed"
        elif tc.find("skipped") is not None:
            result = "skipped"
        else:
            result = "held"
        file = tc.get("classname", "").replace(".", "/") + ".py"
        cases.append(
            {
                "mode": props["chaos_mode"],
                "case": props["chaos_case"],
                "test": f"`{tc.get('name')}` ({file.removeprefix('tests/')})",
                "result": result,
                "crashes": int(props.get("chaos_crashes", 0)),
                "orphans": int(props.get("chaos_orphans", 0)),
                "orphan_commands": props.get("chaos_orphan_commands", ""),
                "seconds": float(tc.get("time", 0.0)),
                "default": props.get("chaos_default_suite") == "1",
            }
        )
    return cases


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


def render(cases: list[dict], *, wall_s: float | None) -> str:
    by_mode: dict[str, list[dict]] = defaultdict(list)
    for c in cases:
        by_mode[c["mode"]].append(c)
    held = sum(c["result"] == "held" for c in cases)
    crashes = sum(c["crashes"] for c in cases)
    orphans = sum(c["orphans"] for c in cases)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        START,
        f"Produced by `python scripts/chaos_report.py` on commit {_commit()}, {when}"
        + (f", {wall_s / 60:.0f} minutes" if wall_s is not None else "")
        + f": **{len(cases)} cases, {held} held, {crashes} crashes, {orphans} orphans.**",
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
            lines.append(
                f"| {c['case']} | {c['result']} | {c['crashes']} | {orphan} | "
                f"{c['seconds']:.0f} | {'yes' if c['default'] else 'no (chaos)'} | {c['test']} |"
            )
        for case, why in NOT_RUN.get(mode, []):
            lines.append(f"| {case} | not run: {why} | | | | | |")
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def write_doc(table: str, doc: Path = DOC) -> None:
    text = doc.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{doc} has no {START} ... {END} markers: add them where the table goes")
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    doc.write_text(head + table + tail)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--junit", type=Path, nargs="+", help="render from these junit xml instead of running"
    )
    ap.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=[],
        help="earlier junit xml whose cases this run's results replace or complete",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "chaos" / "junit.xml")
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("pytest_args", nargs="*", help="passed on to pytest (e.g. -k hivemind)")
    args = ap.parse_args()
    wall = None
    code = 0
    if args.junit is None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        code, wall = run_suite(args.out, args.pytest_args)
        junits = [*args.merge, args.out]
    else:
        junits = [*args.merge, *args.junit]
    cases = read_cases(*junits)
    if not cases:
        raise SystemExit(f"no chaos_case results in {', '.join(map(str, junits))}")
    table = render(cases, wall_s=wall if len(junits) == 1 else None)
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
