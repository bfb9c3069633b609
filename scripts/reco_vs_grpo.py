"""configs/reco.yaml against its GRPO baseline at the same settings, over seeds.

    python scripts/reco_vs_grpo.py --out /tmp/reco-vs-grpo --seeds 0 1 2 3 4

For each seed s it runs (unless RUN/reco-s and RUN/grpo-s already hold a finished run)

    ftis run configs/reco.yaml --set train.seed=s --out RUN/reco-s
    ftis run configs/reco.yaml --set train.seed=s --set nodes.0.loss.method=vis --out RUN/grpo-s

(`vis` is GRPO's loss; it ignores the `reco_*` fields, so the two arms differ in ReCo alone),
then prints each seed's pass@k and greedy test accuracy at the last evaluation, and the paired
difference ReCo - GRPO with its 95% Student-t interval (`ftis.study.stats.paired_difference`:
per-seed scalars for pass@k, per-problem greedy outcomes for test accuracy). Both arms of a seed
start from the same shipped warm start and are evaluated with the same sampling seed, so their
step-0 figures are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from ftis.study.stats import paired_difference, read_evals

ARMS = {"reco": [], "grpo": ["--set", "nodes.0.loss.method=vis"]}
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "reco.yaml"


def run(arm: str, seed: int, out: Path) -> Path:
    run_dir = out / f"{arm}-{seed}"
    if not (run_dir / "report.md").exists():
        cmd = [sys.executable, "-m", "ftis.cli", "run", str(CONFIG), "--overwrite"]
        cmd += ["--set", f"train.seed={seed}", *ARMS[arm], "--out", str(run_dir)]
        print("$", " ".join(cmd[2:]), file=sys.stderr)
        subprocess.run(cmd, check=True, env=os.environ, stdout=subprocess.DEVNULL)
    return run_dir


def evaluations(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> the eval figures (keys without 'eval/') of the run's one node."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        r["step"]: {k[5:]: v for k, v in r.items() if k.startswith("eval/")}
        for r in rows
        if r.get("eval/pass@1") is not None
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    dirs = {(arm, s): run(arm, s, args.out) for s in args.seeds for arm in ARMS}
    evals = {key: evaluations(d) for key, d in dirs.items()}
    figures = {key: e[max(e)] for key, e in evals.items()}  # the last evaluation
    keys = sorted(
        (k for k in figures[("reco", args.seeds[0])] if k.startswith("pass@")),
        key=lambda k: int(k[5:]),
    )
    keys += ["test/accuracy", "test/distinct_answers"]
    print("seed | step | " + " | ".join(f"{k} reco / grpo" for k in keys))
    for s in args.seeds:
        for step in (0, max(evals["reco", s])):
            a, b = evals["reco", s][step], evals["grpo", s][step]
            print(f"{s} | {step} | " + " | ".join(f"{a[k]:.3f} / {b[k]:.3f}" for k in keys))
    print(
        f"\nReCo - GRPO at the last evaluation, {len(args.seeds)} seeds, 95% Student-t interval over seeds:"
    )
    for k in keys:
        d = paired_difference(
            {s: figures["reco", s][k] for s in args.seeds},
            {s: figures["grpo", s][k] for s in args.seeds},
        )
        scale, unit = (1.0, "answers") if k.endswith("distinct_answers") else (100.0, "points")
        print(f"{k}: {d.cells(scale=scale, digits=2 if scale == 1 else 1)} {unit} ({d.verdict()})")
    outcomes = {key: read_evals(d)["reco"]["test"] for key, d in dirs.items()}
    last = {key: int(o.steps[-1]) for key, o in outcomes.items()}
    d = paired_difference(
        {s: outcomes["reco", s].at_step(last["reco", s]) for s in args.seeds},
        {s: outcomes["grpo", s].at_step(last["grpo", s]) for s in args.seeds},
    )
    print(f"test/accuracy, per problem ({d.problems} problems): {d.cells()} points ({d.verdict()})")


if __name__ == "__main__":
    main()
