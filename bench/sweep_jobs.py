"""`ftis sweep --jobs 2` against `--jobs 1`: the same runs of a study, both ways, on this machine
(issue 38, item 4).

    python -m bench.sweep_jobs                      # collab's first 20 runs -> docs/results/sweep-jobs.md
    python -m bench.sweep_jobs --runs 4 --no-write  # a shorter look, nothing written

The runs are the first `--runs` of the study in the order `ftis sweep` runs them (seed-major:
every run of seed 0 first), from scratch into two temporary folders:
- `--jobs 1` as the study file tells a user to run it: `OMP_NUM_THREADS=1 ftis sweep`, one run
  after another in one process (a 2-node run's two node processes each get one thread);
- `--jobs 2` with $OMP_NUM_THREADS unset, so each run's processes get the threads the sweep
  gives them (`threads_per_node`: cores / (jobs x nodes), at least 1).
Each side's wall-clock time covers its whole sweep. Then the two folders are compared run for
run: every evaluation record (evals.jsonl, the greedy outcome of every test problem) and every
metrics row with its timing fields left out must be equal, as sets of records (the nodes of a
2-node run append their rows in whichever order they finish a step). Warm starts come from
ftis's cache (the shipped bases), so neither side trains one; the evaluation cache is switched
off (FTIS_EVAL_CACHE=0), so every side generates its own step-0 evaluations.

The ceiling, measured in the same run (first): the study's first one-node run alone and then two
copies of it at once (each `OMP_NUM_THREADS=1 ftis sweep --only` in a process of its own): the
machine's capacity c = 2 t(alone) / t(two at once) for two one-thread runs (2.0 on two idle
cores that share nothing; less where they share caches, memory bandwidth or a physical core).
With the `--jobs 1` side's per-run times, the fastest `--jobs 2` can be is the one-slot runs'
time / c plus the two-slot runs' time (a 2-node run takes both slots): the ceiling on the
speed-up. What varies by machine: the times, c, and so the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "results" / "sweep-jobs"
# metrics fields that measure time or the machine, not the training
TIMING = ("time/", "seconds", "memory/")


def _first_runs(study, n: int):
    seeds = study.spec.seeds
    order = sorted(study.runs, key=lambda r: seeds.index(r.seed) if r.seed in seeds else 0)
    return order[:n]


def _sweep(study, out: Path, jobs: int) -> float:
    from ftis.study import engine

    t0 = time.perf_counter()
    outcome = engine.run_study(study, out_dir=out, jobs=jobs)
    seconds = time.perf_counter() - t0
    if outcome.failed:
        raise RuntimeError(f"--jobs {jobs}: runs failed: {outcome.failed}")
    return seconds


def _rows(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        out.append({k: v for k, v in row.items() if not any(t in k for t in TIMING)})
    return out


def _records(path: Path) -> list[str]:
    """A jsonl file's records (timing fields left out), as sorted canonical JSON: the same set
    whatever order a run's nodes appended them in."""
    return sorted(json.dumps(r, sort_keys=True) for r in _rows(path))


def compare(a: Path, b: Path, ids: list[str]) -> list[str]:
    """Run ids whose evaluations or metrics (timings left out) differ between the folders."""
    differ = []
    for rid in ids:
        for name in ("evals.jsonl", "metrics.jsonl"):
            if _records(a / rid / name) != _records(b / rid / name):
                differ.append(rid)
                break
    return differ


def _run_seconds(out: Path, ids: list[str]) -> dict[str, float]:
    """Each run's own seconds (its study-run.json)."""
    out_s = {}
    for rid in ids:
        try:
            out_s[rid] = float(json.loads((out / rid / "study-run.json").read_text())["seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out_s


def capacity(study_path: Path, run_id: str, tmp: Path) -> dict:
    """t(alone) and t(two at once) of one one-node run, each an `ftis sweep --only` process
    with one thread, and c = 2 t(alone) / t(two at once)."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}

    def start(out: Path):
        cmd = [sys.executable, "-m", "ftis.cli", "sweep", str(study_path), "--only", run_id]
        cmd += ["--out", str(out), "--report", str(out / "report.md")]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait(procs) -> None:
        for p in procs:
            _, err = p.communicate()
            if p.returncode != 0:
                raise RuntimeError(f"{run_id}: {err.decode()[-2000:]}")

    t0 = time.perf_counter()
    wait([start(tmp / "alone")])
    alone = time.perf_counter() - t0
    t0 = time.perf_counter()
    wait([start(tmp / "pair-a"), start(tmp / "pair-b")])
    pair = time.perf_counter() - t0
    return {"run": run_id, "alone_s": alone, "pair_s": pair, "c": 2 * alone / pair}


def measure(study_path: Path, n: int) -> dict:
    import torch

    from bench.common import environment
    from bench.scale import _load
    from ftis.study import engine

    study = engine.load_study(study_path)
    study.runs = _first_runs(study, n)
    from ftis.study.runner import slots_of

    ids = [r.id for r in study.runs]
    nodes = {r.id: len(r.config.nodes) for r in study.runs}
    slots = {r.id: slots_of(r, 2) for r in study.runs}
    single = next(r.id for r in study.runs if slots[r.id] == 1)
    env_before = os.environ.get("OMP_NUM_THREADS")
    cache_before = os.environ.get("FTIS_EVAL_CACHE")
    # Every side runs the same runs: with the evaluation cache on, whichever side ran second
    # would read the first side's step-0 evaluations instead of generating them.
    os.environ["FTIS_EVAL_CACHE"] = "0"
    with tempfile.TemporaryDirectory(prefix="ftis-sweep-jobs-") as tmp:
        tmp = Path(tmp)
        # first, so that a failure here costs minutes, not the sweeps
        cap = capacity(study_path, single, tmp / "capacity")
        load0 = _load()
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        t1 = _sweep(study, tmp / "jobs1", 1)
        load1 = _load()
        os.environ.pop("OMP_NUM_THREADS", None)
        t2 = _sweep(study, tmp / "jobs2", 2)
        load2 = _load()
        differ = compare(tmp / "jobs1", tmp / "jobs2", ids)
        per1, per2 = _run_seconds(tmp / "jobs1", ids), _run_seconds(tmp / "jobs2", ids)
    if env_before is not None:
        os.environ["OMP_NUM_THREADS"] = env_before
    if cache_before is None:
        os.environ.pop("FTIS_EVAL_CACHE", None)
    else:
        os.environ["FTIS_EVAL_CACHE"] = cache_before
    one = sum(per1.get(i, 0.0) for i in ids if slots[i] == 1)
    two = sum(per1.get(i, 0.0) for i in ids if slots[i] > 1)
    floor = one / cap["c"] + two
    return {
        "environment": environment(),
        "study": str(study_path.relative_to(ROOT) if study_path.is_absolute() else study_path),
        "runs": ids,
        "two_node_runs": sum(1 for v in nodes.values() if v > 1),
        "jobs1_s": t1,
        "jobs2_s": t2,
        "speedup": t1 / t2,
        "differ": differ,
        "load": [load0, load1, load2],
        "seconds_jobs1": per1,
        "seconds_jobs2": per2,
        "slots": slots,
        "capacity": cap,
        "floor_s": floor,
        "ceiling": t1 / floor,
    }


def markdown(r: dict) -> str:
    env = r["environment"]
    same = (
        f"identical in all {len(r['runs'])} runs"
        if not r["differ"]
        else f"DIFFERENT in {len(r['differ'])} runs: {', '.join(r['differ'])}"
    )
    return "\n".join(
        [
            "# Studies on every core: `ftis sweep --jobs 2` against `--jobs 1`",
            "",
            f"Generated by `python -m bench.sweep_jobs` at commit `{env['commit']}`; do not edit "
            f"by hand. CPU: {env['cpu_model']}, {env['cpus']} CPUs, torch {env['torch']}, "
            f"Python {env['python']}.",
            "",
            f"The first {len(r['runs'])} runs of `{r['study']}` in the order `ftis sweep` runs "
            f"them ({r['two_node_runs']} of them with two nodes), from scratch, once with "
            "`OMP_NUM_THREADS=1 ftis sweep` (one run at a time, as the study file says) and once "
            "with `ftis sweep --jobs 2` (two slots: two one-node runs at a time, a 2-node run alone; "
            "threads set by the sweep). Load average "
            f"(1 min) {r['load'][0]:.1f} before, {r['load'][1]:.1f} between, "
            f"{r['load'][2]:.1f} after.",
            "",
            "| sweep | wall time (s) |",
            "|---|---|",
            f"| `--jobs 1` | {r['jobs1_s']:.0f} |",
            f"| `--jobs 2` | {r['jobs2_s']:.0f} |",
            f"| speed-up | **{r['speedup']:.2f}x** |",
            "",
            *_ceiling_lines(r),
            f"Results, run for run (every evaluation record and every metrics row but its "
            f"timings): {same}. Target (issue 38): at least 1.6x on 2 cores, identical results.",
            "",
            "Runs: " + ", ".join(f"`{i}`" for i in r["runs"]) + ".",
            "",
        ]
    )


def _ceiling_lines(r: dict) -> list[str]:
    if "capacity" not in r:
        return []
    cap, per1, per2 = r["capacity"], r["seconds_jobs1"], r["seconds_jobs2"]
    one = [i for i in r["runs"] if r["slots"][i] == 1]
    two = [i for i in r["runs"] if r["slots"][i] > 1]
    return [
        f"The ceiling, measured in the same run: `{cap['run']}` alone took "
        f"{cap['alone_s']:.1f} s, two copies at once {cap['pair_s']:.1f} s: this machine runs two "
        f"one-thread runs at c = {cap['c']:.2f}x the speed of one. The `--jobs 1` side's "
        f"{len(one)} one-slot runs took {sum(per1.get(i, 0) for i in one):.0f} s and its "
        f"{len(two)} two-slot runs {sum(per1.get(i, 0) for i in two):.0f} s, so `--jobs 2` can "
        f"take no less than {r['floor_s']:.0f} s if its runs take as long as there: a ceiling "
        f"of **{r['ceiling']:.2f}x** here, of which it reached "
        f"{r['speedup'] / r['ceiling'] * 100:.0f}%.",
        "",
        *_own_floor_lines(r, one, two),
        "| run | slots | `--jobs 1` (s) | `--jobs 2` (s) |",
        "|---|---|---|---|",
        *(
            f"| `{i}` | {r['slots'][i]} | {per1.get(i, float('nan')):.1f} | "
            f"{per2.get(i, float('nan')):.1f} |"
            for i in r["runs"]
        ),
        "",
    ]


def _own_floor_lines(r: dict, one: list[str], two: list[str]) -> list[str]:
    """The same floor from the `--jobs 2` side's own run times: how close its packing came,
    whatever made its runs faster or slower than under `--jobs 1`."""
    per1, per2, c = r["seconds_jobs1"], r["seconds_jobs2"], r["capacity"]["c"]
    one1, one2 = sum(per1.get(i, 0) for i in one), sum(per2.get(i, 0) for i in one)
    two1, two2 = sum(per1.get(i, 0) for i in two), sum(per2.get(i, 0) for i in two)
    if not (one1 and one2):
        return []
    floor2 = one2 / c + two2
    return [
        f"The `--jobs 2` side's own runs took {one2:.0f} s (one-slot) and {two2:.0f} s "
        f"(two-slot), {(one2 / one1 - 1) * 100:+.0f}% and "
        f"{((two2 / two1 - 1) * 100) if two1 else 0:+.0f}% against the same runs under `--jobs 1` "
        "(there, one after another in one long-lived process; here, each in a new process): "
        f"packed perfectly they fit in {floor2:.0f} s, and the sweep took "
        f"{r['jobs2_s'] / floor2 * 100:.0f}% of that.",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--study", type=Path, default=ROOT / "studies" / "collab.yaml")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    r = measure(args.study, args.runs)
    text = markdown(r)
    if not args.no_write:
        OUT.with_suffix(".json").write_text(json.dumps(r, indent=2) + "\n")
        OUT.with_suffix(".md").write_text(text)
    print(text)
    return 1 if r["differ"] else 0


if __name__ == "__main__":
    sys.exit(main())
