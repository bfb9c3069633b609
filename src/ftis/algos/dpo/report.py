"""The DPO runs' section of report.md: preference accuracy per agent (step 0 -> end), the
graph's rho and spectral gap, and a plot of the DPO loss, the held-out preference accuracy and
(gossip) the consensus error before and after mixing against the round (dpo.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _series(rows: list[dict[str, Any]], node: str, key: str) -> tuple[list[int], list[float]]:
    pts = sorted(
        (r["step"], float(r[key])) for r in rows if r.get("node") == node and r.get(key) is not None
    )
    return [p[0] for p in pts], [p[1] for p in pts]


def report_section(rows: list[dict[str, Any]], run_dir: Path) -> list[str]:
    nodes = list(dict.fromkeys(r["node"] for r in rows if "node" in r))
    lines = [
        "## DPO",
        "",
        "| agent | preference accuracy (step 0 -> end) | reward accuracy (end) | DPO loss (end) |",
        "|---|---|---|---|",
    ]
    for n in nodes:
        _, acc = _series(rows, n, "eval/preference_accuracy")
        _, racc = _series(rows, n, "eval/reward_accuracy")
        _, loss = _series(rows, n, "eval/dpo_loss")
        if not acc:
            continue
        label = "server (union of the clients' pairs)" if n == "server" else n
        lines.append(
            f"| {label} | {100 * acc[0]:.1f}% -> {100 * acc[-1]:.1f}% | "
            f"{100 * racc[-1]:.1f}% | {loss[-1]:.3f} |"
        )
    lines += [
        "",
        "Preference accuracy: share of the agent's held-out pairs whose chosen response the "
        "policy gives the higher summed log-prob. Reward accuracy: share with a positive DPO "
        "margin against the frozen reference (0 at step 0 by construction).",
        "",
    ]
    lines += _federated_lines(rows)
    rho = [r["gossip/rho_full"] for r in rows if r.get("gossip/rho_full") is not None]
    if rho:
        live = [r for r in rows if r.get("gossip/rho") is not None]
        last = max(live, key=lambda r: r["step"]) if live else None
        lines += [
            f"Gossip graph: rho = {rho[0]:.4f}, spectral gap 1 - rho^2 = {1 - rho[0] ** 2:.4f}"
            + (
                f"; at the last round, over the agents still running: rho = "
                f"{last['gossip/rho']:.4f}, gap {last['gossip/spectral_gap']:.4f}"
                if last is not None
                else ""
            )
            + ".",
            "",
        ]
    if _plot(rows, nodes, Path(run_dir) / "dpo.png"):
        lines += ["![dpo](dpo.png)", ""]
    return lines


def _federated_lines(rows: list[dict[str, Any]]) -> list[str]:
    """FedDPO's server figures: participation, staleness, rejected and dropped replies."""
    server = sorted(
        (r for r in rows if r.get("node") == "server" and r.get("step", 0) > 0),
        key=lambda r: r["step"],
    )
    if any(r.get("fed/centralized") for r in server):
        return ["Centralized DPO on the union of the clients' pairs (no server rounds).", ""]
    fed = [r for r in server if r.get("fed/sampled") is not None]
    if not fed:
        return []
    mean = lambda key: sum(r.get(key, 0.0) for r in fed) / len(fed)  # noqa: E731
    last = fed[-1]
    return [
        f"FedDPO: {len(fed)} rounds, {mean('fed/sampled'):.1f} clients sampled and "
        f"{mean('fed/participants'):.1f} averaged per round on average, mean staleness "
        f"{mean('fed/staleness_mean'):.2f} rounds; {last.get('fed/rejected_total', 0):.0f} "
        f"replies rejected, {last.get('fed/dropped_total', 0):.0f} dropped, "
        f"{last.get('fed/lost_clients', 0):.0f} clients lost at the end.",
        "",
    ]


def _plot(rows: list[dict[str, Any]], nodes: list[str], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("loss/dpo", "DPO loss (training)"),
        ("eval/preference_accuracy", "held-out preference accuracy"),
    ]
    gossip = any(r.get("gossip/consensus_error_before") is not None for r in rows)
    if not any(r.get("loss/dpo") is not None for r in rows):
        return False
    fig, axes = plt.subplots(
        1, len(panels) + gossip, figsize=(4.5 * (len(panels) + gossip), 3.4), squeeze=False
    )
    for ax, (key, title) in zip(axes[0], panels):
        for n in nodes:
            x, y = _series(rows, n, key)
            if x:
                ax.plot(x, y, marker="o" if "eval" in key else None, ms=3, label=n)
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if gossip:
        ax = axes[0][-1]
        ref = nodes[0]
        for key, style in (
            ("gossip/consensus_error_before", "-"),
            ("gossip/consensus_error_after", "--"),
        ):
            x, y = _series(rows, ref, key)
            ax.plot(x, [max(v, 1e-30) for v in y], style, label=key.split("_")[-1])
        ax.set_yscale("log")
        ax.set_title(f"consensus error (as {ref} measured it)")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
