"""The groups study's document (studies/groups.yaml -> docs/results/groups.md): experts trained
together in groups of 2, 3 and 4, each against itself training alone, and against itself in a
smaller group.

It reads the runs as the collaboration study does (`ftis.algos.ftis.collab`: every node of every
run, paired differences by seed with bootstrap intervals over seeds and problems) and adds what
groups ask:

- one set of Alone runs for every group (`options.alone_from`: the group whose Alone runs are
  every group's baseline). A node must then be the same model from the same warm start, on the
  same task, in every group: the renderer compares the configs and refuses a group that differs;
- each node's accuracy on every skill of the task against its own Alone run (`options.skills`:
  node -> the split of its own skill; the other splits are the transfer);
- more peers: a node in a larger group against the same node, method and seed in a smaller one;
- HACPO per (learner, peer) pair: the capability, weight and discrepancy it logged per peer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ftis.algos.ftis.collab import (
    CollabData,
    CollabOptions,
    CollabResult,
    NodeRun,
    _pairing_nodes,
    accuracy_table,
    difference_cell,
    difference_table,
    hacpo_table,
    head_lines,
    plot_lines,
    runs_lines,
)
from ftis.algos.ftis.collab import collect as collect
from ftis.study.stats import PairedDifference, paired_difference
from ftis.study.tables import table

# what must be equal for one node's Alone run to be its baseline in another group
_SAME_NODE = ("model", "warm_start", "optim", "reward")


def _dump(x: Any) -> Any:
    return None if x is None else x.model_dump()


def _node_configs(study: Any) -> dict[str, dict[str, Any]]:
    """pairing -> node -> (its config, the run's task) as the study's first runs define them: a
    group's nodes from its first run of every node, an Alone node from its Alone run."""
    out: dict[str, dict[str, Any]] = {}
    for run in study.runs:
        for n in run.config.nodes:
            if run.node is None or n.name == run.node:
                out.setdefault(run.pairing, {}).setdefault(n.name, (n, run.config.task))
    return out


def check_same_nodes(study: Any, alone_from: str) -> None:
    """Raise ValueError unless every node of every group is, in model, warm start, optimizer,
    reward and task, the node of `alone_from` whose Alone runs are its baseline."""
    configs = _node_configs(study)
    if alone_from not in configs:
        raise ValueError(
            f"options.alone_from: {alone_from!r} is not a pairing with runs; choose one of "
            f"{', '.join(sorted(configs))}"
        )
    base = configs[alone_from]
    for p, nodes in configs.items():
        if p == alone_from:
            continue
        for name, (node, task) in nodes.items():
            if name not in base:
                raise ValueError(
                    f"pairing {p!r}: node {name!r} has no Alone run in {alone_from!r} "
                    f"(options.alone_from); add it to that pairing's config"
                )
            ref, ref_task = base[name]
            diff = [f for f in _SAME_NODE if _dump(getattr(node, f)) != _dump(getattr(ref, f))]
            if _dump(task) != _dump(ref_task):
                diff.append("task")
            if diff:
                raise ValueError(
                    f"pairing {p!r}: node {name!r} differs from its Alone baseline in "
                    f"{alone_from!r} in {', '.join(diff)}; a node must be the same in every "
                    f"group for its Alone runs to be its baseline there"
                )


def check_skills(study: Any, skills: dict[str, str]) -> None:
    """Raise ValueError unless every node's own skill (`options.skills`) names a node of the
    study and an evaluation split of every pairing's task that has that node."""
    configs = _node_configs(study)
    known = {n for nodes in configs.values() for n in nodes}
    for node, split in skills.items():
        if node not in known:
            raise ValueError(
                f"options.skills names {node!r}, not a node of the study "
                f"({', '.join(sorted(known))})"
            )
        for p, nodes in configs.items():
            if node not in nodes:
                continue
            task = nodes[node][1]
            splits = ["test", *(getattr(task, "ood", None) or {})]
            if split not in splits:
                raise ValueError(
                    f"options.skills: {node}'s skill split {split!r} is not an evaluation split "
                    f"of pairing {p!r}'s task ({', '.join(splits)}); add it under task.ood, "
                    f"e.g. {split}: {{skills: {{{split}: 1.0}}, size: 1024}}"
                )


def borrow_alone(
    node_runs: list[NodeRun], alone: set[str], alone_from: str, nodes: dict[str, list[str]]
) -> list[NodeRun]:
    """The node runs plus, for every group other than `alone_from`, a copy of each of its nodes'
    Alone runs (methods in `alone`) filed under that group."""
    out = list(node_runs)
    for r in node_runs:
        if r.method not in alone or r.pairing != alone_from:
            continue
        for p, names in nodes.items():
            if p != alone_from and r.node in names:
                out.append(NodeRun(p, r.method, r.node, r.seed, r.run_dir))
    return out


def across_groups(
    data: CollabData, node: str, method: str, larger: str, smaller: str, split: str
) -> PairedDifference:
    """node's accuracy in group `larger` minus in group `smaller` (same method), each at the
    larger group's last evaluated step, paired by seed."""
    a: dict[int, np.ndarray] = {}
    b: dict[int, np.ndarray] = {}
    other = data.seeds(smaller, method, node)
    for seed, run in data.seeds(larger, method, node).items():
        f = data.final(run, split)
        if f is None or seed not in other:
            continue
        o = data.at_step(other[seed], split, f[0])
        if o is not None:
            a[seed], b[seed] = f[1], o
    return paired_difference(a, b)


def skills_table(
    data: CollabData,
    pairing: str,
    nodes: list[str],
    methods: list[str],
    labels: dict[str, str],
    baseline: str,
    skills: dict[str, str],
) -> list[str]:
    """Per method and node, its own skill's split and the paired difference to `baseline` on
    every skill's split."""
    splits = list(dict.fromkeys(skills.values()))
    rows = []
    for m in methods:
        for n in nodes:
            if not data.has(pairing, m, n):
                continue
            cells = [
                difference_cell(data.at_equal_steps(pairing, n, m, baseline, s)) for s in splits
            ]
            own = f"`{skills[n]}`" if n in skills else "-"
            rows.append([labels.get(m, m), n, own, *cells])
    return table(["method", "node", "own skill", *(f"`{s}`" for s in splits)], rows, empty="")


def more_peers_table(
    data: CollabData,
    groups: list[str],
    nodes: dict[str, list[str]],
    methods: list[str],
    labels: dict[str, str],
    group_labels: dict[str, str],
    split_of: Any,
) -> list[str]:
    """Per method and node, the node in each larger group minus the same node in each smaller
    one, on `split_of(node)`."""
    pairs = [(q, p) for i, p in enumerate(groups) for q in groups[i + 1 :]]
    rows = []
    for m in methods:
        for n in dict.fromkeys(x for g in groups for x in nodes.get(g, [])):
            cells = []
            for q, p in pairs:
                if n in nodes.get(q, []) and n in nodes.get(p, []):
                    cells.append(difference_cell(across_groups(data, n, m, q, p, split_of(n))))
                else:
                    cells.append("")
            if any(c not in ("", "-") for c in cells):
                rows.append([labels.get(m, m), n, f"`{split_of(n)}`", *cells])
    return table(
        [
            "method",
            "node",
            "split",
            *(f"{group_labels.get(q, q)} - {group_labels.get(p, p)}" for q, p in pairs),
        ],
        rows,
        empty="",
    )


def pair_table(data: CollabData, pairing: str, nodes: list[str], method: str) -> list[str]:
    """HACPO per (learner, peer): the peer's capability, its weight in the learner's baseline
    and its samples' discrepancy coefficient, each the mean over steps of the mean over seeds."""
    rows = []
    for n in nodes:
        for peer in nodes:
            if peer == n:
                continue
            cells = []
            for key in ("capability", "weight", "discrepancy"):
                _, v = data.series(pairing, method, n, f"hacpo/{key}/{peer}")
                cells.append(f"{np.mean(v):.2f}" if v else "-")
            if any(c != "-" for c in cells):
                rows.append([n, peer, *cells])
    return table(
        ["learner", "peer", "peer's capability", "peer's weight w", "discrepancy omega"],
        rows,
        empty="",
    )


def render(
    study: Any,
    results: list[CollabResult],
    missing: list[str],
    out_dir: Path,
    report_path: Path,
    reading: str,
) -> str:
    """docs/results/groups.md: per group, every node against its Alone runs (on the mix and on
    every skill), then every node against itself in smaller groups, HACPO per pair, plots."""
    spec = study.spec
    opts = CollabOptions.from_spec(spec.options)
    options = dict(spec.options or {})
    alone_from = options.get("alone_from")
    skills: dict[str, str] = dict(options.get("skills") or {})
    labels = {k: m.label or k for k, m in spec.methods.items()}
    methods = list(spec.methods)
    alone = {k for k, m in spec.methods.items() if m.alone}
    sharing = [k for k in methods if k not in alone]
    hacpo = [k for k, m in spec.methods.items() if m.loss == "hacpo"]
    nodes = _pairing_nodes(study)
    node_runs = [n for r in results for n in r.nodes]
    if skills:
        check_skills(study, skills)
    if alone_from:
        check_same_nodes(study, alone_from)
        node_runs = borrow_alone(node_runs, alone, alone_from, nodes)
    data = CollabData(node_runs)
    groups = [
        p
        for p in spec.pairings
        if any(data.has(p, m, n) for m in sharing for n in nodes.get(p, []))
    ]
    L = head_lines(study, results, missing, out_dir, together="the group's nodes together")
    if alone_from:
        L += [
            f"Each node's Alone runs are made once, in `{alone_from}`, and are its baseline in "
            "every group (the renderer checks that a node's model, warm start, optimizer, reward "
            "and task are the same in every group).",
            "",
        ]
    for p in groups:
        pn = nodes.get(p, [])
        ps = spec.pairings[p]
        L += [f"## {ps.label or p}", ""]
        if ps.description:
            L += [ps.description.strip(), ""]
        L += [f"### Accuracy (`{opts.split}`)", ""]
        L += [*accuracy_table(data, p, pn, methods, labels, opts.split), ""]
        L += ["### Paired differences to training alone", ""]
        L += [*difference_table(data, p, pn, sharing, labels, opts, opts.split), ""]
        if skills:
            b = opts.baselines[0]
            t = skills_table(data, p, pn, sharing, labels, b, skills)
            if t:
                L += [
                    f"### Every skill: each node against {labels.get(b, b)}, equal steps",
                    "",
                    "Every column but a node's own skill is transfer: from the task's mix and, "
                    "where a peer has that skill, from the peer.",
                    "",
                    *t,
                    "",
                ]
        for h in hacpo:
            t = hacpo_table(data, p, pn, h)
            if t:
                L += [f"### {labels[h]}: capability, discrepancy, clipping (mean over seeds)", ""]
                L += [*t, ""]
            t = pair_table(data, p, pn, h)
            if t:
                L += [f"### {labels[h]}: per (learner, peer) pair (mean over steps and seeds)", ""]
                L += [*t, ""]
    if len(groups) > 1:
        split_labels = {p: spec.pairings[p].label or p for p in groups}
        more = [
            ("the mix", lambda n: opts.split),
            ("its own skill", lambda n: skills.get(n, opts.split)),
        ]
        body = []
        for what, split_of in more:
            t = more_peers_table(data, groups, nodes, sharing, labels, split_labels, split_of)
            if t:
                body += [f"On {what}:", "", *t, ""]
        if body:
            L += [
                "## More peers: each node against itself in a smaller group",
                "",
                "The same node, method and seed in a larger group minus in a smaller one, at "
                "equal steps (paired by seed, same problems).",
                "",
                *body,
            ]
    panels = [(p, nodes.get(p, [])) for p in groups]
    img_dir = report_path.parent / f"{spec.name}-plots"
    L += plot_lines(data, panels, methods, labels, opts.split, hacpo, img_dir, report_path)
    L += runs_lines(results, reading)
    return "\n".join(L)
