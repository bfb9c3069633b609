"""The swarm study's document (studies/swarm.yaml, `results: swarm`): peers that come and go,
simulated (many peers) and real (hivemind processes), against the same peers without churn.

Who should be present when is a function of the run config (ftis.algos.swarm.schedule), so the
document compares the schedule with the rows: a peer "finished" when its last row is at its
last scheduled round; "stayed" means present for at least half the rounds. Accuracy is greedy
`eval/accuracy` on the run's task: a peer's first evaluation (round 0, or where it joined)
against its last.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from ftis.models.sources import model_label
from ftis.study.arms import ArmResult
from ftis.study.pages import Page, arms_renderer, save, section
from ftis.study.spec import Study
from ftis.study.tables import DIFFERENCES_NOTE, ONE_SEED, Differences, paired_count
from ftis.study.tables import table as _table

ACC = "eval/accuracy"


def _presence(res: ArmResult) -> dict[str, list[bool]]:
    from ftis.algos.swarm.schedule import presence, resolve_churn

    cfg = res.run.config
    return presence(resolve_churn(cfg), cfg.train.steps)


def _preset(res: ArmResult, node: str) -> str:
    n = next(n for n in res.run.config.nodes if n.name == node)
    return model_label(n.model)


def _evals(res: ArmResult, node: str) -> dict[int, float]:
    return {int(r["step"]): float(r[ACC]) for r in res.node_rows(node) if ACC in r}


def _total(res: ArmResult, node: str, key: str) -> float:
    return max((float(r[key]) for r in res.node_rows(node) if key in r), default=0.0)


def _sum(res: ArmResult, key: str) -> float:
    return sum(float(r[key]) for r in res.rows if key in r)


def run_summary(res: ArmResult) -> dict[str, Any]:
    """The figures of one run: presence, completion, exchange counts, accuracy."""
    pres = _presence(res)
    steps = res.run.config.train.steps
    nodes = res.nodes
    absent = [sum(not pres[n][r] for n in nodes) / len(nodes) for r in range(steps)]
    finished = 0
    stayed_gain, improved, stayed = [], 0, 0
    for n in nodes:
        rounds = [r + 1 for r in range(steps) if pres[n][r]]
        last_row = max((int(r["step"]) for r in res.node_rows(n)), default=-1)
        finished += bool(rounds) and last_row == rounds[-1]
        ev = _evals(res, n)
        if len(rounds) * 2 >= steps and len(ev) >= 2:
            stayed += 1
            first, last = ev[min(ev)], ev[max(ev)]
            stayed_gain.append(last - first)
            improved += last > first
    received, published = _sum(res, "swarm/samples_received"), _sum(res, "swarm/samples_published")
    seen = expected = 0.0  # payloads in time, against the other peers the schedule has there
    for r in res.rows:
        step = int(r["step"])
        if "swarm/peers_seen" in r and 1 <= step <= steps:
            seen += float(r["swarm/peers_seen"])
            expected += sum(pres[n][step - 1] for n in nodes if n != r.get("node"))
    return {
        "peers": len(nodes),
        "presets": len({_preset(res, n) for n in nodes}),
        "absent_mean": statistics.fmean(absent),
        "absent_max": max(absent),
        "finished": finished,
        "expected": sum(any(pres[n]) for n in nodes),
        "received_ratio": received / published if published else None,
        "seen_ratio": seen / expected if expected else None,
        "rejected": sum(_total(res, n, "swarm/rejected_total") for n in nodes),
        "stale": sum(_total(res, n, "swarm/stale_total") for n in nodes),
        "late": sum(_total(res, n, "swarm/late_total") for n in nodes),
        "stayed": stayed,
        "improved": improved,
        "gain": statistics.fmean(stayed_gain) if stayed_gain else None,
    }


def summary_table(study: Study, results: list[ArmResult]) -> list[str]:
    rows = []
    for res in results:
        s = run_summary(res)
        arm = study.spec.arms[res.run.arm]  # type: ignore[attr-defined]
        rows.append(
            [
                f"{arm.label or res.run.arm} (seed {res.run.seed})",
                f"{s['peers']} ({s['presets']} models)",
                f"{100 * s['absent_mean']:.0f}% (max {100 * s['absent_max']:.0f}%)",
                f"{s['finished']} of {s['expected']}",
                "-" if s["received_ratio"] is None else f"{s['received_ratio']:.3f}",
                "-" if s["seen_ratio"] is None else f"{s['seen_ratio']:.3f}",
                f"{s['rejected']:.0f} / {s['stale']:.0f} / {s['late']:.0f}",
                f"{s['improved']} of {s['stayed']}",
                "-" if s["gain"] is None else f"{100 * s['gain']:+.1f}",
            ]
        )
    header = [
        "run",
        "peers",
        "absent per round (scheduled)",
        "peers that finished their schedule",
        "peer samples trained on / published by the present peers",
        "payloads in time / other peers scheduled there",
        "rejected / stale / late payloads",
        "peers (stayed >= half) that improved",
        "mean gain, those peers (pp)",
    ]
    return _table(header, rows) if rows else ["_No complete runs yet._"]


def preset_table(study: Study, results: list[ArmResult]) -> list[str]:
    """Mean first -> last accuracy per model, per run (peers that stayed at least half)."""
    rows = []
    for res in results:
        pres = _presence(res)
        steps = res.run.config.train.steps
        per: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for n in res.nodes:
            ev = _evals(res, n)
            if sum(pres[n]) * 2 >= steps and len(ev) >= 2:
                per[_preset(res, n)].append((ev[min(ev)], ev[max(ev)]))
        arm = study.spec.arms[res.run.arm]  # type: ignore[attr-defined]
        for preset, pairs in per.items():
            first = statistics.fmean(a for a, _ in pairs)
            last = statistics.fmean(b for _, b in pairs)
            rows.append(
                [
                    f"{arm.label or res.run.arm} (seed {res.run.seed})",
                    preset,
                    str(len(pairs)),
                    f"{100 * first:.1f} -> {100 * last:.1f}",
                    f"{100 * min(b - a for a, b in pairs):+.1f} .. {100 * max(b - a for a, b in pairs):+.1f}",
                ]
            )
    header = ["run", "model", "peers", "mean accuracy, first -> last eval", "range of gains (pp)"]
    return _table(header, rows) if rows else []


def _gains(res: ArmResult) -> dict[str, dict[str, float]]:
    """model -> peer -> last minus first evaluation, for the peers present at least half the
    rounds (as in the accuracy table)."""
    pres = _presence(res)
    steps = res.run.config.train.steps
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for n in res.nodes:
        ev = _evals(res, n)
        if sum(pres[n]) * 2 >= steps and len(ev) >= 2:
            out[_preset(res, n)][n] = ev[max(ev)] - ev[min(ev)]
    return out


def _no_churn_twin(study: Study, results: list[ArmResult], arm: str) -> str | None:
    """The arm with the same run config and no churn at all (nobody ever away), if any."""
    arms = study.spec.arms  # type: ignore[attr-defined]
    for key, spec in arms.items():
        if key == arm or spec.config != arms[arm].config:
            continue
        res = [r for r in results if r.run.arm == key]  # type: ignore[attr-defined]
        if res and all(all(p) for p in _presence(res[0]).values()):
            return key
    return None


def churn_table(study: Study, results: list[ArmResult]) -> list[str]:
    """Per model, a churn arm's accuracy change (a peer's last minus first evaluation) minus
    its no-churn twin's: paired by seed (each seed's mean over the model's peers; one seed
    gives no interval), and paired by peer within the seeds (the same peer, model, data and
    warm start in both runs; the interval is over peers, so it says how the result varies
    over peers of this one run, not over seeds)."""
    arms = study.spec.arms  # type: ignore[attr-defined]
    diffs = Differences()
    rows = []
    for key, arm in arms.items():
        mine = [r for r in results if r.run.arm == key]  # type: ignore[attr-defined]
        twin = _no_churn_twin(study, results, key) if mine else None
        if twin is None or all(all(p) for p in _presence(mine[0]).values()):
            continue
        theirs = {r.run.seed: _gains(r) for r in results if r.run.arm == twin}  # type: ignore[attr-defined]
        ours = {r.run.seed: _gains(r) for r in mine}
        for model in sorted({m for g in ours.values() for m in g}):
            by_seed_a = {
                s: statistics.fmean(g[model].values()) for s, g in ours.items() if g.get(model)
            }
            by_seed_b = {
                s: statistics.fmean(g[model].values()) for s, g in theirs.items() if g.get(model)
            }
            by_peer_a = {(s, n): v for s, g in ours.items() for n, v in g.get(model, {}).items()}
            by_peer_b = {(s, n): v for s, g in theirs.items() for n, v in g.get(model, {}).items()}
            where = f"{arm.label or key} − {arms[twin].label or twin}, {model}"
            rows.append(
                [
                    arm.label or key,
                    arms[twin].label or twin,
                    model,
                    diffs.cell(f"{where} (seeds)", by_seed_a, by_seed_b),
                    diffs.cell(f"{where} (peers)", by_peer_a, by_peer_b),
                    paired_count(by_seed_a, by_seed_b),
                    paired_count(by_peer_a, by_peer_b),
                ]
            )
    header = (
        "arm (A) | minus (B) | model | change in accuracy, paired by seed (pp) | "
        "paired by peer (pp) | seeds | peers"
    )
    return diffs.block(
        "A peer's accuracy change is its last evaluation minus its first (peers present at least "
        "half the rounds in both runs; a peer that left early has its last evaluation before "
        "the last round). " + DIFFERENCES_NOTE + f" With one seed, the seed column is "
        f"'{ONE_SEED}'; the peer column's interval is over the peers of that one seed, so it "
        "says how the difference varies over peers, not over seeds.",
        _table(header, rows, empty=""),
    )


def plot(study: Study, results: list[ArmResult], path: Path) -> bool:
    """Per model: mean accuracy of the peers evaluated at each regular evaluation round (a
    joiner's evaluation at its join round is left out), one line per run; last panel: peer
    samples trained on / published per round (simulated runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = sorted({_preset(r, n) for r in results for n in r.nodes})
    if not presets:
        return False
    fig, axes = plt.subplots(1, len(presets) + 1, figsize=(4.6 * (len(presets) + 1), 3.8))
    for res in results:
        arm = study.spec.arms[res.run.arm]  # type: ignore[attr-defined]
        label = f"{arm.label or res.run.arm} s{res.run.seed}"
        style = "--" if "steady" in res.run.arm or "no churn" in label else "-"
        for ax, preset in zip(axes, presets, strict=False):
            per: dict[int, list[float]] = defaultdict(list)
            every, last = res.run.config.eval.every, res.run.config.train.steps
            for n in res.nodes:
                if _preset(res, n) == preset:
                    for s, v in _evals(res, n).items():
                        if s in (0, last) or (every and s % every == 0):  # not join evals
                            per[s].append(v)
            if per:
                xs = sorted(per)
                ax.plot(
                    xs, [100 * statistics.fmean(per[x]) for x in xs], style, marker="o", label=label
                )
            ax.set_title(preset, fontsize=10)
            ax.set_xlabel("round", fontsize=8)
            ax.set_ylabel("mean greedy accuracy of the peers there (%)", fontsize=8)
            ax.grid(alpha=0.3)
        rec: dict[int, list[float]] = defaultdict(list)
        pub: dict[int, list[float]] = defaultdict(list)
        for r in res.rows:
            if "swarm/samples_published" in r and "swarm/samples_received" in r:
                rec[int(r["step"])].append(float(r["swarm/samples_received"]))
                pub[int(r["step"])].append(float(r["swarm/samples_published"]))
        xs = [x for x in sorted(rec) if sum(pub[x]) > 0]
        if xs:
            axes[-1].plot(
                xs, [sum(rec[x]) / sum(pub[x]) for x in xs], style, marker="o", label=label
            )
    axes[-1].set_title("peer samples trained on / published", fontsize=10)
    axes[-1].set_xlabel("round", fontsize=8)
    axes[-1].grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return save(fig, path)


def _body(page: Page) -> list[str]:
    study, results = page.study, page.results
    L = section(
        "Every run",
        summary_table(study, results),
        "Delivery is the share of the other peers the schedule has present in a round whose "
        "payload arrived before the deadline (a slow peer's come late by design); "
        "a peer trains on its own samples and at most `algorithm.max_peers_used` peers' batches "
        "of those (all of them when unset), which caps the samples it trains on.",
    )
    L += section("Accuracy per model", preset_table(study, results))
    L += section(
        "Churn against no churn: paired differences", churn_table(study, results), end=False
    )
    return L + page.figure("swarm.png", "accuracy per model and samples received", plot)


render = arms_renderer(
    title="F-TIS among peers that come and go",
    note="One run per arm and seed; the schedule of who is present is the config's.",
    body=_body,
)


__all__ = ["render", "run_summary"]
