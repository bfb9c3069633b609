"""The bf16-sampler study's document (ftis.results.sampler_dtype) from hand-written run
directories: per-node accuracy and mismatch columns (means over RL steps, step 0 left out), the
paired differences against each arm's baseline (bold only where the interval excludes zero),
and arms without a baseline left out of the differences."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml

from ftis.study.arms import load_arms_study, write_arms_results
from ftis.train.metrics import encode_outcomes

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "src/ftis/configs/default.yaml")
P = 40
BF16 = "train.sampler_dtype=bfloat16"
NOIS = ["nodes.0.loss.method=nois", "nodes.1.loss.method=nois"]


def _spec(tmp_path: Path) -> dict:
    return {
        "kind": "arms",
        "name": "bf16",
        "out": str(tmp_path / "out"),
        "report": str(tmp_path / "bf16.md"),
        "results": "sampler-dtype",
        "seeds": [0, 1, 2],
        "set": ["train.seed={seed}", "train.steps=2", "eval.every=2"],
        "arms": {
            "f32": {"config": CONFIG, "label": "f32"},
            "bf16": {"config": CONFIG, "label": "bf16", "set": [BF16]},
            "f32-nois": {"config": CONFIG, "label": "f32 NoIS", "set": NOIS},
            "bf16-nois": {"config": CONFIG, "label": "bf16 NoIS", "set": [BF16, *NOIS]},
        },
        "options": {"baseline": {"bf16": "f32", "bf16-nois": "f32-nois"}},
    }


# final correct problems (of P) per arm and node; seeds add 0, 1, 2 to the bf16 arms
FINAL = {"f32": 30, "bf16": 29, "f32-nois": 30, "bf16-nois": 20}


def _write(run_dir: Path, arm: str, seed: int, nodes: list[str]) -> None:
    run_dir.mkdir(parents=True)
    rows, evals = [], []
    for n in nodes:
        for step in (0, 1, 2, 3):
            row: dict = {"step": step, "node": n}
            if step == 3:  # no update: loss metrics logged as 0 must not count
                row.update({"train/optimizer_steps": 0, "train/no_signal": 1.0})
                row.update({"train/skipped_update": 0, "loss/filtered_frac": 0.0})
                row.update({"loss/is_weight_mean": 0.0, "loss/is_weight_max": 0.0})
                rows.append(row)
                continue
            if step in (0, 2):
                k = 24 if step == 0 else FINAL[arm] + (seed if "bf16" in arm else 0)
                bits = np.zeros(P, dtype=np.uint8)
                bits[:k] = 1
                # partial credit: the mean reward is not the share solved
                row["eval/accuracy"] = k / P + 0.1
                evals.append(
                    {
                        "step": step,
                        "node": n,
                        "split": "test",
                        "n": P,
                        "correct": encode_outcomes(bits),
                    }
                )
            if step:
                row["loss/filtered_frac"] = 0.01 * step
                row["loss/is_weight_mean"] = 1.0
                row["loss/is_weight_max"] = 2.0 + step
                if "bf16" in arm:
                    row["rollout/mismatch_k3"] = 0.001 * step
            rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))


def test_sampler_dtype_document_numbers(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(_spec(tmp_path), sort_keys=False))
    study = load_arms_study(path)
    for r in study.runs:
        _write(tmp_path / "out" / r.id, r.arm, r.seed, [n.name for n in r.config.nodes])
    text = write_arms_results(study).read_text()
    # bf16 arm, node small: solved at step 0 60%, final (29+s)/40 -> 72.5/75/77.5, mean reward
    # 10 points above it; k3 mean 1.5e-3, filter mean 1.5%, IS weight max mean 3.5
    assert (
        "| bf16 | default | `small` | bfloat16 | f-tis | 3 | 60.0 ± 0.0 | 75.0 ± 2.5 | "
        "85.0 ± 2.5 | 1.500 ± 0.000 | 1.50 ± 0.00 | 1.0000 ± 0.0000 | 3.50 ± 0.00 |" in text
    )
    # f32 arms log no mismatch
    assert (
        "| f32 | default | `large` | float32 | f-tis | 3 | 60.0 ± 0.0 | 75.0 ± 0.0 | 85.0 ± 0.0 | - |"
        in text
    )
    assert "solved final (%) | mean reward final (%)" in text
    diff = text[text.index("## Paired differences") :]
    # bf16 - f32: -2.5, 0, +2.5 points -> no bold; bf16 NoIS - f32 NoIS: -25, -22.5, -20 -> bold
    assert "| bf16 | f32 | `small` | 0.0 [" in diff and "| bf16 | f32 | `small` | **" not in diff
    assert "| bf16 NoIS | f32 NoIS | `large` | **−22.5 [" in diff
    # only arms with a baseline have a row (2 arms x 2 nodes)
    assert diff.count("| `small` |") == 2 and diff.count("| `large` |") == 2
