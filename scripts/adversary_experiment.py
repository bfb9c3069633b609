"""How much harm an adversarial peer does: the embedded default (small + large), with `large`
sending dishonest batches (nodes[1].adversary), under F-TIS and under NoIS; the honest node
`small` is measured. Writes runs/adversary/summary.json and prints a Markdown table.

    python scripts/adversary_experiment.py [--steps 40] [--seeds 0 1] [--out runs/adversary]
        [--scheme vertical|horizontal]

Takes about 25 s per run on 2 CPU cores (16 runs with two seeds).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import yaml

from ftis.config import load_config
from ftis.launch import run_local
from ftis.train.metrics import read_metrics

ADVERSARIES = ("none", "zero-logprobs", "random-tokens", "duplicate")
METHODS = ("f-tis", "nois")


def one_run(out: Path, *, adversary: str, method: str, seed: int, steps: int, scheme: str) -> dict:
    run_dir = out / f"{adversary}-{method}-s{seed}"
    overrides = [
        f"sharing.scheme={scheme}",
        f"train.steps={steps}",
        f"train.seed={seed}",
        "log.progress=false",
        f"nodes.0.loss.method={method}",
        f"nodes.1.loss.method={method}",
        f"name={run_dir.name}",
    ]
    if adversary != "none":
        overrides.append(f"testing.adversary.large={adversary}")
    summary_file = run_dir / "summary.json"
    if summary_file.exists():
        return json.loads(summary_file.read_text())
    cfg = load_config(None, overrides)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    run_local(cfg, run_dir)
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["node"] == "small"]
    evals = [r for r in rows if "eval/accuracy" in r]
    trained = [r for r in rows if r["step"] > 0]

    def mean(key):
        vals = [r[key] for r in trained if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    summary = {
        "adversary": adversary,
        "method": method,
        "seed": seed,
        "acc_start": evals[0]["eval/accuracy"],
        "acc_end": evals[-1]["eval/accuracy"],
        "acc_mean_after_start": sum(r["eval/accuracy"] for r in evals[1:]) / len(evals[1:]),
        "reward_peers": mean("reward/peers"),
        "filtered_frac": mean("loss/filtered_frac"),
        "is_weight_mean": mean("loss/is_weight_mean"),
        "skipped_updates": trained[-1].get("train/skipped_updates_total"),
    }
    summary_file.write_text(json.dumps(summary, indent=1))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out", type=Path, default=Path("runs/adversary"))
    ap.add_argument("--scheme", default="vertical", choices=["vertical", "horizontal"])
    args = ap.parse_args()
    results = []
    for seed in args.seeds:
        for method in METHODS:
            for adversary in ADVERSARIES:
                s = one_run(
                    args.out,
                    adversary=adversary,
                    method=method,
                    seed=seed,
                    steps=args.steps,
                    scheme=args.scheme,
                )
                print(json.dumps(s), flush=True)
                results.append(s)
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    print(
        "\n| adversary | method | small acc start -> end (mean over seeds) | change vs honest peer |"
    )
    print("|---|---|---|---|")
    for method in METHODS:
        base = [r["acc_end"] for r in results if r["method"] == method and r["adversary"] == "none"]
        b = sum(base) / len(base)
        for adversary in ADVERSARIES:
            rs = [r for r in results if r["method"] == method and r["adversary"] == adversary]
            start = sum(r["acc_start"] for r in rs) / len(rs)
            end = sum(r["acc_end"] for r in rs) / len(rs)
            print(
                f"| {adversary} | {method} | {100 * start:.1f}% -> {100 * end:.1f}% | "
                f"{100 * (end - b):+.1f} pts |"
            )


if __name__ == "__main__":
    main()
