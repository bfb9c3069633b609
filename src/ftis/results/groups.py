"""The groups study's document (studies/groups.yaml -> docs/results/groups.md): experts trained
together in groups of 2, 3 and 4, each against itself training alone, and against itself in a
smaller group.

It reads the runs as the collaboration study does (`ftis.results.collab`: every node of every
run, paired differences by seed with Student-t intervals over seeds) and adds what
groups ask:

- one set of Alone runs for every group (`options.alone_from`: the group whose Alone runs are
  every group's baseline). A node must then be the same model from the same warm start, on the
  same task, in every group: the renderer compares the configs and refuses a group that differs;
- each node's accuracy on every skill of the task against its own Alone run (`options.skills`:
  node -> the split of its own skill; the other splits are the transfer);
- more peers: a node in a larger group against the same node, method and seed in a smaller one;
- HACPO per (learner, peer) pair: the capability, weight and discrepancy it logged per peer;
- swarm arms (`options.swarm`: pairing -> its Alone method, the same swarm with
  `algorithm.max_peers_used: 0`): per peer, the rounds it was present, each method against
  that Alone arm, and each method's change over the run (last evaluation against the first).
  A peer's own skill is `options.skills` of its name or of its name without the last `-<i>`
  (`adder-2` -> `adder`);
- SAPO's own measure (`options.sapo`: swarm pairing -> its reference method, SAPO's I=8/J=0):
  per kind of peer (its name without the last `-<i>`), each method's cumulative reward (the sum
  over the rounds a peer trained of its own samples' mean reward, `reward/own`), and its
  change relative to the reference, per seed, with a t interval over seeds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ftis.results.collab import (
    CollabData,
    CollabDoc,
    NodeRun,
    _pairing_nodes,
    collab_renderer,
    difference_cell,
)
from ftis.results.collab import collect as collect
from ftis.study.stats import PairedDifference, paired_difference
from ftis.study.tables import is_bold, table

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


def check_same_nodes(study: Any, alone_from: str, skip: frozenset[str] = frozenset()) -> None:
    """Raise ValueError unless every node of every group (but the pairings in `skip`, swarms
    with an Alone arm of their own) is, in model, warm start, optimizer, reward and task, the
    node of `alone_from` whose Alone runs are its baseline."""
    configs = _node_configs(study)
    if alone_from not in configs:
        raise ValueError(
            f"options.alone_from: {alone_from!r} is not a pairing with runs; choose one of "
            f"{', '.join(sorted(configs))}"
        )
    base = configs[alone_from]
    for p, nodes in configs.items():
        if p == alone_from or p in skip:
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
    """Raise ValueError unless every key of `options.skills` names a node of the study (or, for
    a swarm's peers, a node name without its last `-<i>`), and every node's own skill is an
    evaluation split of its pairing's task."""
    configs = _node_configs(study)
    known = {n for nodes in configs.values() for n in nodes}
    for key in skills:
        if not any(skill_of({key: ""}, n) is not None for n in known):
            raise ValueError(
                f"options.skills names {key!r}, not a node of the study "
                f"({', '.join(sorted(known))})"
            )
    for p, nodes in configs.items():
        for node, (_, task) in nodes.items():
            split = skill_of(skills, node)
            splits = ["test", *(getattr(task, "ood", None) or {})]
            if split is not None and split not in splits:
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


def skill_of(skills: dict[str, str], node: str) -> str | None:
    """A node's own skill split: skills[node], else skills[node without its last -suffix]."""
    if node in skills:
        return skills[node]
    return skills.get(node.rsplit("-", 1)[0]) if "-" in node else None


def _schedule(run: NodeRun, memo: dict[Path, dict]) -> dict:
    """A swarm run's RUN_DIR/swarm-schedule.json ({} where it has none), read once per run."""
    if run.run_dir not in memo:
        try:
            memo[run.run_dir] = json.loads((run.run_dir / "swarm-schedule.json").read_text())
        except (OSError, ValueError):
            memo[run.run_dir] = {}
    return memo[run.run_dir]


def presence(
    data: CollabData, p: str, method: str, node: str, memo: dict[Path, dict]
) -> list[tuple[int, int]]:
    """(rounds node was present, the run's rounds) in each seed's run of `method`."""
    out = []
    for run in data.seeds(p, method, node).values():
        doc = _schedule(run, memo)
        try:
            out.append((int(doc["peers"][node]["present_rounds"]), int(doc["steps"])))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def change_over_run(data: CollabData, p: str, method: str, node: str, split: str):
    """node's last evaluation minus its first on split (step 0, or a late joiner's first),
    paired by seed."""
    a: dict[int, np.ndarray] = {}
    b: dict[int, np.ndarray] = {}
    for seed, run in data.seeds(p, method, node).items():
        f, start = data.final(run, split), data.first(run, split)
        if f is not None and start is not None and f[0] > start[0]:
            a[seed], b[seed] = f[1], start[1]
    return paired_difference(a, b)


def kind_of(node: str) -> str:
    """A swarm peer's kind: its name without the last `-<i>` (`llama-s-3` -> `llama-s`)."""
    head, _, tail = node.rpartition("-")
    return head if head and tail.isdigit() else node


def cumulative_reward(data: CollabData, run: NodeRun) -> float:
    """SAPO's measure for one peer's run: the sum over the rounds it trained of its own
    samples' mean reward (`reward/own`)."""
    return float(
        sum(r["reward/own"] for r in data.rows(run) if r.get("step", 0) >= 1 and "reward/own" in r)
    )


def sapo_lines(doc: CollabDoc, p: str, reference: str) -> list[str]:
    """Per kind of peer: each method's mean cumulative reward over the kind's peers and seeds,
    and its change relative to `reference` (per seed: the kind's mean over the reference's,
    minus 1), as SAPO reports it (+94% for I=4/J=4 against I=8/J=0)."""
    data, labels = doc.data, doc.labels
    peers = doc.nodes.get(p, [])
    methods = [reference, *(m for m in doc.ran(p) if m != reference)]
    kinds = sorted({kind_of(n) for n in peers})
    rows = []
    for k in kinds:
        ns = [n for n in peers if kind_of(n) == k]
        per: dict[str, dict[int, float]] = {}
        for m in methods:
            by_seed: dict[int, list[float]] = {}
            for n in ns:
                for seed, run in data.seeds(p, m, n).items():
                    by_seed.setdefault(seed, []).append(cumulative_reward(data, run))
            per[m] = {s: float(np.mean(v)) for s, v in by_seed.items() if len(v) == len(ns)}
        ref = per[reference]
        cells = [f"{np.mean(list(ref.values())):.2f}" if ref else "-"]
        for m in methods[1:]:
            common = sorted(s for s in per[m] if s in ref and ref[s] > 0)
            if not common:
                cells.append("-")
                continue
            rel = paired_difference(
                {s: per[m][s] / ref[s] - 1 for s in common}, dict.fromkeys(common, 0.0)
            )
            mean = np.mean([per[m][s] for s in common])
            cells.append(f"{mean:.2f}: {difference_cell(rel)}")
        rows.append([f"`{k}` ({len(ns)})", *cells])
    ref_label = labels.get(reference, reference)
    header = ["kind (peers)", f"{ref_label}: cumulative reward"]
    header += [f"{labels.get(m, m)}: cumulative reward, % vs {ref_label}" for m in methods[1:]]
    return [
        f"### SAPO's measure: cumulative reward against {ref_label}",
        "",
        "Per kind of peer, the sum over the rounds a peer trained of its own samples' mean "
        "reward (`reward/own`, sampled at the run's temperature), averaged over the kind's "
        "peers; then, per seed, the kind's mean relative to the reference's, in percent, with "
        "a t interval over seeds (exploratory unless a primary comparison names it). SAPO "
        "reports +94% for I=4/J=4 against I=8/J=0.",
        "",
        *table(header, rows, empty="No kind has runs of the reference."),
        "",
    ]


def swarm_lines(doc: CollabDoc, p: str, alone: str, skills: dict[str, str]) -> list[str]:
    """A swarm pairing's section: per peer the rounds present, each method against `alone` on
    the mix and the peer's own skill, each method's change over the run; HACPO's capability."""
    data, labels, split = doc.data, doc.labels, doc.opts.split
    peers = doc.nodes.get(p, [])
    sharing = [m for m in doc.ran(p) if m != alone]
    methods = [alone, *sharing]
    ps = doc.spec.pairings[p]
    L = [f"## {ps.label or p}", ""]
    if ps.description:
        L += [ps.description.strip(), ""]
    memo: dict[Path, dict] = {}
    rows = []
    for n in peers:
        present = [r for r, _ in presence(data, p, alone, n, memo)]
        own = skill_of(skills, n)
        cells = []
        for m in sharing:
            cells.append(difference_cell(data.at_equal_steps(p, n, m, alone, split)))
            if skills:
                own_d = None if own is None else data.at_equal_steps(p, n, m, alone, own)
                cells.append("-" if own_d is None else difference_cell(own_d))
        rows.append([n, "/".join(map(str, sorted(set(present)))) or "-", f"`{own or '-'}`", *cells])
    header = ["peer", "rounds present", "own skill"]
    for m in sharing:
        header.append(f"{labels.get(m, m)} vs {labels.get(alone, alone)}, `{split}`")
        if skills:
            header.append(f"{labels.get(m, m)} vs {labels.get(alone, alone)}, own skill")
    L += [
        f"### Each peer against {labels.get(alone, alone)} (the same swarm and churn, no "
        "sharing), equal steps",
        "",
        *table(header, rows, empty="No peer has runs of both."),
        "",
    ]
    rows = []
    improved = {m: [0, 0] for m in methods}  # method -> [peers present >= half that improved, of]
    for n in peers:
        cells = []
        for m in methods:
            d = change_over_run(data, p, m, n, split)
            cells.append(difference_cell(d))
            seen = presence(data, p, m, n, memo)
            if seen and all(2 * r >= total for r, total in seen):
                improved[m][1] += 1
                improved[m][0] += int(is_bold(d) and d.mean > 0)
        rows.append([n, *cells])
    L += [
        f"### Change over the run (`{split}`): last evaluation minus the first (step 0, or a "
        "late joiner's first), paired by seed",
        "",
        *table(["peer", *(labels.get(m, m) for m in methods)], rows, empty=""),
        "",
        "Peers present at least half the run whose change is an interval above zero: "
        + "; ".join(f"{labels.get(m, m)} {k} of {t}" for m, (k, t) in improved.items())
        + ".",
        "",
    ]
    sapo = dict(doc.spec.options or {}).get("sapo") or {}
    if p in sapo:
        L += sapo_lines(doc, p, sapo[p])
    for h in doc.hacpo:
        if h in methods:
            L += doc.hacpo_lines(p, h)
    return L


def _node_runs(study: Any, runs: list[NodeRun]) -> list[NodeRun]:
    """The runs' nodes, checked (options.skills, options.alone_from) and with the Alone runs of
    `alone_from` filed under every group."""
    options = dict(study.spec.options or {})
    if options.get("skills"):
        check_skills(study, dict(options["skills"]))
    alone_from = options.get("alone_from")
    if not alone_from:
        return runs
    check_same_nodes(study, alone_from, frozenset(options.get("swarm") or {}))
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
    swarms: dict[str, str] = dict(options.get("swarm") or {})
    sharing = [m for m in sharing if m not in swarms.values()]  # a swarm's Alone arm
    groups = [p for p in doc.with_results(sharing) if p not in swarms]
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
        L += doc.pairing_lines(p, ran_only=True)
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
    with_runs = doc.with_results(doc.methods)
    for p, alone in swarms.items():
        if p in with_runs:
            L += swarm_lines(doc, p, alone, skills)
    return groups, L


render = collab_renderer(_groups_body, together="the group's nodes together", node_runs=_node_runs)
