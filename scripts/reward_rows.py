"""Each reward function's mean, per node, from a run's rows (RUN_DIR/metrics.jsonl).

A reward function that sets `report_mean = True` (the reasoning-gym task's
`builtin:reasoning_gym` and `builtin:reasoning_gym_format`, docs/tasks.md) has a column
`reward/<function>` in every row: its mean unweighted value over the completions scored since
the previous row. What those completions are depends on the row:

- step 0: the first evaluation's completions only (no training yet): greedy ones, and the pass@k
  samples when `eval.pass_samples` > 0;
- a training step without an evaluation: that step's sampled completions;
- a step with an evaluation (every `eval.every` steps, and the last): that step's sampled
  completions and the evaluation's together.

This prints, per node and function, the step-0 value, the means over the first and the last K
training steps that have no evaluation (sampled completions only), and the last row (mixed):

    python scripts/reward_rows.py RUN_DIR [RUN_DIR ...] [--last K]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def function_columns(rows: list[dict]) -> list[str]:
    """The `reward/<function>` columns: a reward function is named `module:function`,
    `file.py:function` or `builtin:NAME`, so its name has a ':' and no counter's does."""
    cols = {
        k
        for r in rows
        for k in r
        if k.startswith("reward/")
        and ":" in k
        and not k.startswith(("reward/errors/", "reward/first_error/"))
    }
    return sorted(cols)


def summarise(rows: list[dict], last: int) -> tuple[list[str], list[tuple[str, list[str]]]]:
    cols = function_columns(rows)
    evaluated = [r for r in rows if "eval/accuracy" in r]
    train_only = [r for r in rows if "eval/accuracy" not in r and r.get("step", 0) > 0]

    def mean(rs: list[dict], col: str) -> str:
        vals = [r[col] for r in rs if col in r]
        return f"{sum(vals) / len(vals):.3f}" if vals else "-"

    out = []
    first = rows[0]
    if first.get("step") == 0 and "eval/accuracy" in first:
        out.append(("step 0 (eval only)", [mean([first], c) for c in cols]))
    if train_only:
        head, tail = train_only[:last], train_only[-last:]
        out.append(
            (
                f"steps {head[0]['step']}-{head[-1]['step']} (sampled, mean of {len(head)})",
                [mean(head, c) for c in cols],
            )
        )
        out.append(
            (
                f"steps {tail[0]['step']}-{tail[-1]['step']} (sampled, mean of {len(tail)})",
                [mean(tail, c) for c in cols],
            )
        )
    if evaluated and evaluated[-1] is not first:
        end = evaluated[-1]
        out.append(
            (
                f"step {end['step']} (sampled + eval, mixed)",
                [mean([end], c) for c in cols],
            )
        )
    return cols, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (or metrics.jsonl files)")
    ap.add_argument("--last", type=int, default=5, help="training steps averaged at each end")
    args = ap.parse_args()
    for run in args.runs:
        path = run / "metrics.jsonl" if run.is_dir() else run
        by_node: dict[str, list[dict]] = {}
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                by_node.setdefault(str(row.get("node")), []).append(row)
        for node, rows in by_node.items():
            rows.sort(key=lambda r: r.get("step", 0))
            cols, out = summarise(rows, args.last)
            if not cols:
                print(f"{path}: node {node}: no reward/<function> rows")
                continue
            names = [c.removeprefix("reward/") for c in cols]
            print(f"{path.parent if path.name == 'metrics.jsonl' else path} - node {node}")
            print("| rows | " + " | ".join(names) + " |")
            print("|---|" + "---|" * len(names))
            for label, vals in out:
                print(f"| {label} | " + " | ".join(vals) + " |")
            print()


if __name__ == "__main__":
    main()
