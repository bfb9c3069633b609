"""The bf16-sampler study's document (`results: sampler-dtype`, studies/bf16-sampler.yaml): does
learning hold when the sampler runs on a bf16 copy of the weights (`train.sampler_dtype`) and
the update corrects the sampler/trainer mismatch, and what does the mismatch cost without a
correction?

Per arm and node: greedy accuracy at step 0 and at the last step (evals.jsonl), the mismatch the
bf16 copy introduced (`rollout/mismatch_k3`: mean k3 between the trainer's and the sampler's
log-probs of the node's own sampled tokens, at the weights they were drawn with), the share of
sequences the F-TIS filter removed (`loss/filtered_frac`) and the mean and largest per-token IS
weight (`loss/is_weight_mean`, `loss/is_weight_max`), each a mean over the RL steps that ran
an update, then over seeds. Paired differences of final accuracy, per node, against the arm the option maps it to:

    options:
      baseline: {<arm>: <arm it is compared with>}

A difference is paired by seed, with a Student-t interval over the seeds' mean differences on
the test problems (ftis.study.stats), and is bold only where its printed interval excludes zero.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ftis.study.arms import ArmResult
from ftis.study.pages import Page, arms_renderer, section
from ftis.study.stats import read_evals
from ftis.study.tables import DIFFERENCES_NOTE, Differences, fmt_pct, spread
from ftis.study.tables import table as _table

SPLIT = "test"
STEP_MEANS = (
    ("rollout/mismatch_k3", 1e3, 3),
    ("loss/filtered_frac", 100.0, 2),
    ("loss/is_weight_mean", 1.0, 4),
    ("loss/is_weight_max", 1.0, 2),
)


def _runs(results: list[ArmResult], arm: str) -> list[ArmResult]:
    return [r for r in results if r.run.arm == arm]  # type: ignore[attr-defined]


def _nodes(res: ArmResult) -> list[str]:
    return [n.name for n in res.run.config.nodes]


def _sampler(res: ArmResult) -> str:
    return res.run.config.train.sampler_dtype


def _loss(res: ArmResult) -> str:
    return ", ".join(sorted({n.loss.method for n in res.run.config.nodes}))


def _final_step(res: ArmResult) -> int:
    return res.run.config.train.steps


def _mean_reward(res: ArmResult, node: str, step: int) -> float | None:
    """The node's mean greedy reward on the test split at `step` (`eval/accuracy`, which is the
    share solved only where the reward is 0/1: reasoning-gym gives partial credit)."""
    for r in res.node_rows(node):
        if int(r["step"]) == step and "eval/accuracy" in r:
            return float(r["eval/accuracy"])
    return None


def _solved(out_dir: Path, res: ArmResult, node: str, step: int) -> float | None:
    """The share of the test problems the node solved (greedy reward above 0, evals.jsonl) at
    `step`: what the paired differences compare."""
    try:
        split = read_evals(out_dir / res.run.id).get(node, {}).get(SPLIT)
    except FileNotFoundError:
        return None
    if split is None or step not in split.steps.tolist():
        return None
    return float(split.at_step(step).mean())


def _step_mean(res: ArmResult, node: str, key: str) -> float | None:
    """The mean of `key` over the node's RL steps that ran an update (a step without one, no
    group having a reward signal, logs its loss metrics as 0 and `train/optimizer_steps` 0:
    not a measurement)."""
    vals = [
        float(r[key])
        for r in res.node_rows(node)
        if int(r["step"]) > 0 and key in r and r.get("train/optimizer_steps", 1) > 0
    ]
    return float(np.mean(vals)) if vals else None


def _outcomes(runs: list[ArmResult], out_dir: Path, node: str) -> dict[int, np.ndarray]:
    """seed -> the node's greedy test outcomes at the run's last step."""
    out: dict[int, np.ndarray] = {}
    for r in runs:
        try:
            evals = read_evals(out_dir / r.run.id)
        except FileNotFoundError:
            continue
        if node in evals and SPLIT in evals[node]:
            out[r.run.seed] = evals[node][SPLIT].at_step(_final_step(r))
    return out


def arm_table(page: Page) -> list[str]:
    rows = []
    for arm, spec in page.study.spec.arms.items():  # type: ignore[attr-defined]
        runs = _runs(page.results, arm)
        if not runs:
            continue

        def solved(r: ArmResult, node: str, step: int) -> float | None:
            return _solved(page.out_dir, r, node, step)

        for node in _nodes(runs[0]):
            cells = []
            for key, scale, digits in STEP_MEANS:
                vals = [
                    v * scale for r in runs for v in [_step_mean(r, node, key)] if v is not None
                ]
                cells.append(spread(vals, digits) if vals else "-")
            rows.append(
                [
                    spec.label or arm,
                    Path(spec.config).stem,  # the config file the arm runs
                    f"`{node}`",
                    _sampler(runs[0]),
                    _loss(runs[0]),
                    str(len(runs)),
                    *(
                        fmt_pct([v for r in runs for v in [f(r, node, step(r))] if v is not None])
                        for f, step in (
                            (solved, lambda r: 0),
                            (solved, _final_step),
                            (_mean_reward, _final_step),
                        )
                    ),
                    *cells,
                ]
            )
    header = [
        "arm",
        "config",
        "node",
        "sampler",
        "loss",
        "seeds",
        "solved step 0 (%)",
        "solved final (%)",
        "mean reward final (%)",
        "mismatch k3 (x 1e-3)",
        "filtered (%)",
        "IS weight mean",
        "IS weight max",
    ]
    return _table(header, rows)


def difference_table(page: Page) -> tuple[list[str], str]:
    baselines: dict[str, str] = (page.study.spec.options or {}).get("baseline", {})  # type: ignore[attr-defined]
    arms = page.study.spec.arms  # type: ignore[attr-defined]
    diffs = Differences()
    rows = []
    for arm, base in baselines.items():
        runs, base_runs = _runs(page.results, arm), _runs(page.results, base)
        if not runs or not base_runs:
            continue
        a_label, b_label = arms[arm].label or arm, arms[base].label or base
        for node in _nodes(runs[0]):
            label = f"{a_label} − {b_label}, {node}"
            a = _outcomes(runs, page.out_dir, node)
            b = _outcomes(base_runs, page.out_dir, node)
            rows.append([a_label, b_label, f"`{node}`", diffs.cell(label, a, b)])
    header = ["arm (A)", "compared with (B)", "node", "final solved share: A − B (points)"]
    return _table(header, rows), diffs.summary()


ARM_NOTE = (
    "Solved: the share of the config's held-out test problems whose greedy reward is above 0 "
    "(evals.jsonl), what the paired differences compare; mean reward: the greedy reward's mean "
    "over those problems (`eval/accuracy`), the same number where the reward is 0/1 (the "
    "default config) and above it where the task gives partial credit (reasoning-gym, "
    "smollm2). Both mean ± sample std over seeds. The "
    "mismatch, filter and IS-weight columns are means over the RL steps that ran an update (then "
    "seeds) of each step's value: k3 between the trainer's (float32) and the sampler's log-probs of the node's own "
    "tokens, at the weights they were sampled with (logged only when the sampler runs on a "
    "bf16 copy); the share of sequences the F-TIS filter removed; the per-token ratio "
    "exp(trainer − sampler log-prob) over the tokens trained on (a diagnostic, logged for every "
    "loss: NoIS does not use it, TIS caps it)."
)
PER_SEED_NOTE = " A seed's difference is its mean over the test problems."


def _body(page: Page) -> list[str]:
    diff, summary = difference_table(page)
    return [
        *section("Every arm", arm_table(page), ARM_NOTE),
        *section(
            "Paired differences with intervals",
            [*diff, "", summary],
            DIFFERENCES_NOTE + PER_SEED_NOTE,
        ),
    ]


render: Any = arms_renderer(
    title="a bf16 sampler against the f32 one",
    note="Figures are per node, mean ± sample std over seeds.",
    body=_body,
)
