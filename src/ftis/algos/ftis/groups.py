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

from typing import Any

import numpy as np

from ftis.algos.ftis.collab import (
    CollabData,
    CollabDoc,
    NodeRun,
    _pairing_nodes,
    collab_renderer,
    difference_cell,
)
from ftis.algos.ftis.collab import collect as collect
from ftis.study.stats import PairedDifference
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
    return data.final_against(
        data.seeds(larger, method, node), data.seeds(smaller, method, node), split
    )


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


def _node_runs(study: Any, runs: list[NodeRun]) -> list[NodeRun]:
    """The runs' nodes, checked (options.skills, options.alone_from) and with the Alone runs of
    `alone_from` filed under every group."""
    options = dict(study.spec.options or {})
    if options.get("skills"):
        check_skills(study, dict(options["skills"]))
    alone_from = options.get("alone_from")
    if not alone_from:
        return runs
    check_same_nodes(study, alone_from)
    alone = {k for k, m in study.spec.methods.items() if m.alone}
    return borrow_alone(runs, alone, alone_from, _pairing_nodes(study))


def _groups_body(doc: CollabDoc) -> tuple[list[str], list[str]]:
    """docs/results/groups.md: per group, every node against its Alone runs (on the mix and on
    every skill) and HACPO per pair; then every node against itself in smaller groups."""
    spec, data, opts, labels, sharing = doc.spec, doc.data, doc.opts, doc.labels, doc.sharing
    options = dict(spec.options or {})
    alone_from = options.get("alone_from")
    skills: dict[str, str] = dict(options.get("skills") or {})
    nodes = doc.nodes
    groups = doc.with_results(sharing)
    L: list[str] = []
    if alone_from:
        L += [
            f"Each node's Alone runs are made once, in `{alone_from}`, and are its baseline in "
            "every group (the renderer checks that a node's model, warm start, optimizer, reward "
            "and task are the same in every group).",
            "",
        ]
    for p in groups:
        pn = nodes.get(p, [])
        L += doc.pairing_lines(p)
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
        for h in doc.hacpo:
            L += doc.hacpo_lines(p, h)
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
    return groups, L


render = collab_renderer(_groups_body, together="the group's nodes together", node_runs=_node_runs)
