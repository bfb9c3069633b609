"""The poisoning study's document (ftis.results.poisoning) from hand-written run directories:
honest nodes only, screens' drop rates and trust, the DoS cost columns, and the per-arm option
lookup (an arm's own baseline before its loss's; null for none)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml

from ftis.study.arms import load_arms_study, write_arms_results
from ftis.train.metrics import encode_outcomes

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs/poisoning.yaml")
P = 40  # test problems per evaluation
ALL = ["defence.plausibility=true", "defence.same_model=true", "defence.trust=true"]


def _spec(tmp_path: Path) -> dict:
    return {
        "kind": "arms",
        "name": "poison",
        "out": str(tmp_path / "out"),
        "report": str(tmp_path / "poison.md"),
        "results": "poisoning",
        "seeds": [0, 1, 2],
        "set": ["train.seed={seed}", "train.steps=2", "eval.every=2"]
        + [f"defence.{d}=false" for d in ("plausibility", "same_model", "trust")],
        "arms": {
            "honest": {"config": CONFIG, "label": "honest", "set": ["testing.adversary={}"]},
            "attack": {"config": CONFIG, "label": "attacked"},
            "attack-all": {
                "config": CONFIG,
                "label": "attacked, all",
                "set": ALL + ["defence.max_completion_tokens=40"],
            },
            "attack-raw": {"config": CONFIG, "label": "attacked, no comparison"},
        },
        "options": {
            "baseline": {"f-tis": "honest", "attack-raw": None},
            "undefended": {"f-tis": "attack", "attack-raw": None},
        },
    }


# honest nodes' final accuracy (of P problems) per arm; the attacker's is 0 and must not count
FINAL = {"honest": 30, "attack": 20, "attack-all": 28, "attack-raw": 20}


def _write(run_dir: Path, arm: str, seed: int, nodes: list[str]) -> None:
    run_dir.mkdir(parents=True)
    rows, evals = [], []
    for n in nodes:
        bad = n == "mallory" and arm != "honest"  # without an attacker mallory is honest
        for step in (0, 1, 2):
            row: dict = {"step": step, "node": n}
            if step in (0, 2):
                k = (
                    0
                    if bad
                    else (24 if step == 0 else FINAL[arm] + (seed if arm != "honest" else 0))
                )
                bits = np.zeros(P, dtype=np.uint8)
                bits[:k] = 1
                row["eval/accuracy"] = k / P
                evals.append(
                    {
                        "step": step,
                        "node": n,
                        "split": "test",
                        "n": P,
                        "correct": encode_outcomes(bits),
                    }
                )
                if arm != "honest":
                    row["attack/success"] = (
                        1.0 if bad else (0.0 if step == 0 else 0.1 * (arm == "attack"))
                    )
            if step:
                row["train/completion_tokens"] = (
                    48.0 if bad else (22.0 if arm != "attack" else 30.0)
                )
                row["train/forward_tokens"] = 3000.0
                if arm == "attack-all" and not bad:
                    row.update(
                        {
                            "defence/plausibility_dropped": 0.25,
                            "defence/same_model_dropped": 0.0,
                            "defence/quarantine_dropped": 0.0,
                            "defence/length_dropped": 0.5,
                            "defence/own_dropped": 0.0,
                            "trust/mallory": 0.2 if step == 2 else 0.9,
                        }
                    )
                    row.update({f"trust/{m}": 1.0 for m in nodes if m not in (n, "mallory")})
            rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))


def test_poisoning_document_numbers(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(_spec(tmp_path), sort_keys=False))
    study = load_arms_study(path)
    for r in study.runs:
        _write(tmp_path / "out" / r.id, r.arm, r.seed, [n.name for n in r.config.nodes])
    text = write_arms_results(study).read_text()
    # honest nodes only (the attacker's 0% is left out): 60% at step 0; attacked 50/52.5/55%
    assert (
        "| attacked | f-tis | none | 3 | 60.0 ± 0.0 | 52.5 ± 2.5 | 0.0 ± 0.0 | 10.0 ± 0.0 "
        "| 30.0 ± 0.0 | 3.0 ± 0.0 |" in text
    )
    assert "| attacked, all | f-tis | plausibility, same_model, trust, length <= 40 | 3 |" in text
    # screens: means over steps > 0 and honest nodes; trust at the final step, every honest node
    assert (
        "| attacked, all | yes | 25.0 ± 0.0 | 0.0 ± 0.0 | 0.0 ± 0.0 | 50.0 ± 0.0 | 0.0 ± 0.0 | 0.20 ± 0.00 | 1.00 ± 0.00 |"
        in text
    )
    diff = text[text.index("## Paired differences") :]
    # attacked - honest: 20 + seed vs 30 problems of 40 -> -25, -22.5, -20 points; mean -22.5
    assert "| attacked | **−22.5 [" in diff
    # all defences: 28 + seed of 40 -> -2.5 points against honest (-5, -2.5, 0: no bold), +20
    # against attacked on every seed; attack success 0 - 10 = -10 points
    assert "| attacked, all | −2.5 [" in diff
    assert "| **+20.0 [" in diff and "| **−10.0 [−10.0, −10.0]** |" in diff
    # the arm mapped to null by name gets no comparison although its loss has one
    assert "| attacked, no comparison | - | - | - |" in diff
