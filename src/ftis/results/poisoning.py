"""The poisoning study's document (studies/poisoning.yaml, `results: poisoning`): attack success
and the honest nodes' accuracy under a poisoning peer, per loss and defence, against the same
runs without the attacker, with paired intervals (ftis.study.stats).

An arm's *honest nodes* are the nodes that `testing.adversary` does not name. Per run:
- accuracy: the honest nodes' greedy test outcomes (evals.jsonl), averaged over the honest
  nodes problem by problem; a paired difference averages them per seed, its interval over seeds;
- attack success: `attack/success` (sampled completions containing the injection) at each
  evaluation, mean over the honest nodes;
- drops: each screen's `defence/*_dropped` (a fraction of the peers' sequences; `own_dropped`
  of the node's own), mean over the honest nodes' steps. In an arm without an attacker every
  dropped sequence was honest: that is the screen's false-drop rate.

- cost: `train/completion_tokens` (mean length of the completions a node trained on) and
  `train/forward_tokens` (tokens through the model per step), mean over honest nodes' steps:
  what a long (denial-of-service) attack inflates.

Options (the study file's `options`); a key is an arm's name or a loss method, the arm's name
first, so that arms of one loss with another baseline (another attack, two nodes) can say so;
an arm mapped to null has no such comparison:
    baseline: {<arm or loss method>: <arm>}   the arm without attacker or defence
    undefended: {<arm or loss method>: <arm>} the attacked arm without defence
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ftis.study.arms import ArmResult
from ftis.study.pages import Page, arms_renderer, section
from ftis.study.spec import Study
from ftis.study.stats import read_evals
from ftis.study.tables import DIFFERENCES_NOTE, Differences, fmt_pct, spread
from ftis.study.tables import table as _table

SUCCESS = "attack/success"
SPLIT = "test"  # the reasoning task's in-distribution split (eval/accuracy's)
LENGTH = "train/completion_tokens"
FORWARD = "train/forward_tokens"
SCREENS = ("plausibility", "same_model", "quarantine", "length", "own")


def honest_nodes(res: ArmResult) -> list[str]:
    bad = set(res.run.config.testing.adversary)
    return [n.name for n in res.run.config.nodes if n.name not in bad]


def loss_of(res: ArmResult) -> str:
    return res.run.config.nodes[0].loss.method


def defences_of(res: ArmResult) -> str:
    d = res.run.config.defence
    on = [name for name in ("plausibility", "same_model", "trust") if getattr(d, name)]
    if d.max_completion_tokens is not None:
        on.append(f"length <= {d.max_completion_tokens}")
    if d.max_peer_share < 1:
        on.append(f"share <= {d.max_peer_share:g}")
    return ", ".join(on) or "none"


def option(opts: dict[str, Any], name: str, arm: str, loss: str) -> str | None:
    """The arm `opts[name]` maps `arm` to (by its name first, then by its loss), or None."""
    table = opts.get(name) or {}
    if arm in table:
        return table[arm]
    return table.get(loss)


def attack_of(res: ArmResult) -> str:
    adv = res.run.config.testing.adversary
    if not adv:
        return "none"
    parts = []
    for node, a in adv.items():
        if isinstance(a, str):
            parts.append(f"{node}: {a}")
        else:
            parts.append(
                f"{node}: {a.kind} `{a.text}`, {a.logprobs} log-probs, share {a.group_share:g}"
            )
    return "; ".join(parts)


def _runs(results: list[ArmResult], arm: str) -> list[ArmResult]:
    return [r for r in results if r.run.arm == arm]  # type: ignore[attr-defined]


def _by_step(res: ArmResult, key: str) -> dict[int, float]:
    """step -> mean of `key` over the honest nodes' rows that have it."""
    vals: dict[int, list[float]] = {}
    nodes = set(honest_nodes(res))
    for r in res.rows:
        if r.get("node") in nodes and key in r:
            vals.setdefault(int(r["step"]), []).append(float(r[key]))
    return {s: float(np.mean(v)) for s, v in sorted(vals.items())}


def _step_mean(res: ArmResult, key: str) -> float | None:
    curve = {s: v for s, v in _by_step(res, key).items() if s > 0}
    return float(np.mean(list(curve.values()))) if curve else None


def outcomes(res: ArmResult, run_dir: Path, step: int) -> np.ndarray | None:
    """(P,) the honest nodes' greedy test outcomes at `step`, averaged over the honest nodes."""
    try:
        evals = read_evals(run_dir)
    except FileNotFoundError:
        return None
    rows = [evals[n][SPLIT].at_step(step) for n in honest_nodes(res) if n in evals]
    return np.mean(np.stack(rows), axis=0) if rows else None


def _final_step(res: ArmResult) -> int:
    return res.run.config.train.steps


def _acc(runs: list[ArmResult], step: int | None) -> list[float]:
    out = []
    for r in runs:
        curve = _by_step(r, "eval/accuracy")
        s = _final_step(r) if step is None else step
        if s in curve:
            out.append(curve[s])
    return out


def main_table(study: Study, results: list[ArmResult]) -> list[str]:
    rows = []
    steps: list[int] = sorted({s for r in results for s in _by_step(r, SUCCESS)})
    for arm, spec in study.spec.arms.items():  # type: ignore[attr-defined]
        runs = _runs(results, arm)
        if not runs:
            continue
        succ = [
            fmt_pct([c[s] for r in runs for c in [_by_step(r, SUCCESS)] if s in c]) for s in steps
        ]
        rows.append(
            [
                spec.label or arm,
                loss_of(runs[0]),
                defences_of(runs[0]),
                str(len(runs)),
                fmt_pct(_acc(runs, 0)),
                fmt_pct(_acc(runs, None)),
                *succ,
                spread([v for r in runs for v in [_step_mean(r, LENGTH)] if v is not None], 1),
                spread(
                    [v / 1000 for r in runs for v in [_step_mean(r, FORWARD)] if v is not None],
                    1,
                ),
            ]
        )
    header = [
        "arm",
        "loss",
        "defences",
        "seeds",
        "honest acc. step 0 (%)",
        "honest acc. final (%)",
        *[f"attack success step {s} (%)" for s in steps],
        "trained completion (tokens)",
        "forward tokens per step (k)",
    ]
    return _table(header, rows)


def drop_table(study: Study, results: list[ArmResult]) -> list[str]:
    rows = []
    for arm, spec in study.spec.arms.items():  # type: ignore[attr-defined]
        runs = _runs(results, arm)
        if not runs or defences_of(runs[0]) == "none":
            continue
        cells = []
        for screen in SCREENS:
            vals = [
                v
                for r in runs
                for v in [_step_mean(r, f"defence/{screen}_dropped")]
                if v is not None
            ]
            cells.append(fmt_pct(vals))
        t_bad, t_good = [], []
        for r in runs:
            bad = set(r.run.config.testing.adversary)
            good = set(honest_nodes(r))
            for row in r.rows:
                if row.get("node") not in good or int(row["step"]) != _final_step(r):
                    continue
                for k, v in row.items():
                    if k.startswith("trust/"):
                        (t_bad if k.removeprefix("trust/") in bad else t_good).append(float(v))
        rows.append(
            [
                spec.label or arm,
                "yes" if runs[0].run.config.testing.adversary else "no",
                *cells,
                spread(t_bad, 2),
                spread(t_good, 2),
            ]
        )
    header = [
        "arm",
        "attacker",
        *[f"{s} dropped (%)" for s in SCREENS],
        "final trust in the attacker",
        "final trust in honest peers",
    ]
    return _table(header, rows, empty="")


def _per_seed(runs: list[ArmResult], out_dir: Path, step_of) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for r in runs:
        o = outcomes(r, out_dir / r.run.id, step_of(r))
        if o is not None:
            out[r.run.seed] = o
    return out


def _final_success(runs: list[ArmResult]) -> dict[int, float]:
    out = {}
    for r in runs:
        c = _by_step(r, SUCCESS)
        if c:
            out[r.run.seed] = c[max(c)]
    return out


def difference_table(
    study: Study, results: list[ArmResult], out_dir: Path
) -> tuple[list[str], str]:
    opts = study.spec.options  # type: ignore[attr-defined]
    diffs = Differences()
    rows = []
    for arm, spec in study.spec.arms.items():  # type: ignore[attr-defined]
        runs = _runs(results, arm)
        if not runs or not runs[0].run.config.testing.adversary:
            continue
        loss = loss_of(runs[0])
        label = spec.label or arm
        final = _per_seed(runs, out_dir, _final_step)
        vs_honest, vs_undef, success = "-", "-", "-"
        base = option(opts, "baseline", arm, loss)
        undef = option(opts, "undefended", arm, loss)
        if base:
            b = _per_seed(_runs(results, base), out_dir, _final_step)
            vs_honest = diffs.cell(f"{label} vs no attacker (accuracy)", final, b)
        if undef and undef != arm:
            u_runs = _runs(results, undef)
            u = _per_seed(u_runs, out_dir, _final_step)
            vs_undef = diffs.cell(f"{label} vs no defence (accuracy)", final, u)
            success = diffs.cell(
                f"{label} vs no defence (attack success)",
                _final_success(runs),
                _final_success(u_runs),
                higher_is_better=False,
            )
        rows.append([label, vs_honest, vs_undef, success])
    # the defences' cost without an attacker
    for arm, spec in study.spec.arms.items():  # type: ignore[attr-defined]
        runs = _runs(results, arm)
        if not runs or runs[0].run.config.testing.adversary or defences_of(runs[0]) == "none":
            continue
        base = option(opts, "baseline", arm, loss_of(runs[0]))
        if base and base != arm:
            label = spec.label or arm
            a = _per_seed(runs, out_dir, _final_step)
            b = _per_seed(_runs(results, base), out_dir, _final_step)
            rows.append([label, diffs.cell(f"{label} vs no defence (accuracy)", a, b), "-", "-"])
    header = [
        "arm (A)",
        "honest accuracy: A − its runs without attacker or defence",
        "honest accuracy: A − its attacked runs without defence",
        "attack success: A − its attacked runs without defence",
    ]
    return _table(header, rows), diffs.summary()


EVERY_ARM_NOTE = (
    "Honest accuracy: greedy accuracy on the test split of the nodes that are not the attacker. "
    "Attack success: the share of their sampled test completions (one per problem, temperature "
    "1) that contain the injected text."
)
DROPPED_NOTE = (
    "Per step, the share of the peers' sequences each screen dropped (`own`: of the node's own "
    "sequences, dropped by the plausibility or same-model test), mean over steps, honest nodes "
    "and seeds. In an arm without attacker every dropped sequence is honest. Trust is each "
    "honest node's trust in a peer at the last step."
)
PER_SEED_NOTE = (
    " Accuracy: a seed's difference is its mean over the test problems; attack success: the "
    "final evaluation's, per seed."
)


def _body(page: Page) -> list[str]:
    diff, summary = difference_table(page.study, page.results, page.out_dir)
    return [
        *section("Every arm", main_table(page.study, page.results), EVERY_ARM_NOTE),
        *section("What the screens dropped", drop_table(page.study, page.results), DROPPED_NOTE),
        *section(
            "Paired differences with intervals",
            [*diff, "", summary],
            DIFFERENCES_NOTE + PER_SEED_NOTE,
        ),
    ]


render = arms_renderer(
    title="poisoned rollouts and the defences",
    note="Honest nodes' figures are averaged over the honest nodes, then over seeds "
    "(mean ± sample std).",
    body=_body,
)
