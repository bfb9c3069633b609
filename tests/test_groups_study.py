"""The groups study's document from hand-written run directories: one set of Alone runs as every
group's baseline, a node against itself in a smaller group, every skill's split, HACPO per
(learner, peer) pair; and the check that refuses a node that is not the same in every group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ftis.results.groups import check_same_nodes, check_skills
from ftis.study.engine import load_study, write_results
from ftis.train.metrics import encode_outcomes

NODES = [
    {"name": "a", "model": {"preset": "llama-xs"}, "optim": {"lr": 1e-4}},
    {"name": "b", "model": {"preset": "llama-xs"}, "optim": {"lr": 1e-4}},
    {"name": "c", "model": {"preset": "llama-xs"}, "optim": {"lr": 1e-4}},
]


def _group(n: int) -> dict:
    return {
        "name": f"g{n}",
        "task": {
            "kind": "reasoning",
            "seed": 0,
            "ood": {"x": {"skills": {"add": 1.0}}, "y": {"skills": {"mul": 1.0}}},
        },
        "nodes": NODES[:n],
        "sharing": {"scheme": "joint"},
        "train": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "eval": {"every": 2, "size": 4, "pass_samples": 0},
    }


STUDY = {
    "name": "groups-test",
    "results": "groups",
    "seeds": [0, 1],
    "pairings": {"g2": {"config": "g2.yaml"}, "g3": {"config": "g3.yaml"}},
    "methods": {
        "alone": {"loss": "vis", "alone": True, "label": "Alone"},
        "hacpo": {"loss": "hacpo", "label": "HACPO"},
    },
    "grid": [
        {"pairings": ["g3"], "methods": ["alone"], "schemes": ["joint"]},
        {"pairings": ["g2", "g3"], "methods": ["hacpo"], "schemes": ["joint"]},
    ],
    "options": {"baselines": ["alone"], "alone_from": "g3", "skills": {"a": "x", "b": "y"}},
}

SPLITS = ("test", "x", "y")


def _final(pairing: str, method: str, node: str, split: str) -> list[int]:
    """Every node alone: all wrong. With HACPO node a is all right in the group of 3 and all
    wrong in the group of 2, except on split y (b's skill), where it is right in both; b and c
    stay all wrong."""
    if method == "hacpo" and node == "a" and (pairing == "g3" or split == "y"):
        return [1, 1, 1, 1]
    return [0, 0, 0, 0]


def _write_run(run_dir: Path, pairing: str, nodes: list[str], method: str) -> None:
    run_dir.mkdir(parents=True)
    rows, evals = [], []
    for n in nodes:
        for split in SPLITS:
            for step, bits in ((0, [0, 0, 0, 0]), (2, _final(pairing, method, n, split))):
                evals.append(
                    {
                        "step": step,
                        "node": n,
                        "split": split,
                        "n": 4,
                        "correct": encode_outcomes(bits),
                    }
                )
        for step in (1, 2):
            r = {"step": step, "node": n, "train/generated_tokens_total": 50.0 * step}
            if method == "hacpo":
                r["hacpo/capability"] = 0.5
                for peer in nodes:
                    if peer != n:  # peer's capability 0.2 + 0.2 * step: mean 0.5 over steps
                        r[f"hacpo/capability/{peer}"] = 0.2 + 0.2 * step
                        r[f"hacpo/weight/{peer}"] = 0.25
                        r[f"hacpo/discrepancy/{peer}"] = 1.5
            rows.append(r)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    (run_dir / "study-run.json").write_text(json.dumps({"seconds": 1.0, "code": "abc1234"}))


def _study(tmp_path: Path, g2: dict | None = None):
    (tmp_path / "g2.yaml").write_text(yaml.safe_dump(g2 or _group(2)))
    (tmp_path / "g3.yaml").write_text(yaml.safe_dump(_group(3)))
    (tmp_path / "groups.yaml").write_text(yaml.safe_dump(STUDY))
    return load_study(tmp_path / "groups.yaml")


def _line(text: str, start: str, after: str = "") -> str:
    body = text.split(after, 1)[1] if after else text
    return next(line for line in body.splitlines() if line.startswith(start))


def test_groups_document(tmp_path):
    study = _study(tmp_path)
    # the Alone runs are made once, in the group of 3
    assert sorted(r.id for r in study.runs if r.node) == [
        f"g3-alone-{n}-j-s{s}" for n in "abc" for s in (0, 1)
    ]
    out = tmp_path / "runs"
    for run in study.runs:
        nodes = [run.node] if run.node else [n.name for n in run.config.nodes]
        _write_run(out / run.id, run.pairing, nodes, run.method)
    report = tmp_path / "groups.md"
    write_results(study, out_dir=out, report_path=report)
    text = report.read_text()
    assert "| HACPO | `hacpo` | the group's nodes together | - |" in text
    # the group of 2 reads its nodes' Alone runs from the group of 3: a is equal to alone there
    # (0 on every problem and seed: exactly 0, no verdict), +100 in the group of 3
    g2 = "## g2"
    g3 = "## g3"
    assert _line(text, "| HACPO | a |", g2) == "| HACPO | a | 0.0 [0.0, 0.0] |"
    assert (
        _line(text, "| HACPO | a |", g3) == "| HACPO | a | **+100.0 [+100.0, +100.0]** (better) |"
    )
    assert _line(text, "| HACPO | c |", g3) == "| HACPO | c | 0.0 [0.0, 0.0] |"
    # every skill: a's own skill x; y (b's skill) +100 in both groups
    every = text.split(g2, 1)[1].split(g3, 1)[0].split("### Every skill", 1)[1]
    row = _line(every, "| HACPO | a |")
    assert row == "| HACPO | a | `x` | 0.0 [0.0, 0.0] | **+100.0 [+100.0, +100.0]** (better) |"
    # HACPO per pair in the group of 3: a's peers b and c, each capability 0.50, w 0.25, omega 1.5
    pairs = text.split(g3, 1)[1].split("per (learner, peer) pair", 1)[1]
    assert "| a | b | 0.50 | 0.25 | 1.50 |" in pairs
    assert "| c | b | 0.50 | 0.25 | 1.50 |" in pairs
    # more peers: a with HACPO in the group of 3 minus in the group of 2, on the mix (test) and on
    # its own skill x; on nothing for c (only in the group of 3)
    more = text.split("## More peers", 1)[1]
    assert "| HACPO | a | `test` | **+100.0 [+100.0, +100.0]** (better) |" in more
    assert "| HACPO | a | `x` | **+100.0 [+100.0, +100.0]** (better) |" in more
    assert "| HACPO | b | `test` | 0.0 [0.0, 0.0] |" in more
    assert "| HACPO | c |" not in more
    # regenerating gives the same bytes
    write_results(study, out_dir=out, report_path=report)
    assert report.read_text() == text


def test_a_node_that_differs_between_groups_is_refused(tmp_path):
    g2 = _group(2)
    g2["nodes"] = [NODES[0], {**NODES[1], "optim": {"lr": 1e-3}}]
    study = _study(tmp_path, g2)
    with pytest.raises(
        ValueError, match="node 'b' differs from its Alone baseline in 'g3' in optim"
    ):
        check_same_nodes(study, "g3")
    with pytest.raises(ValueError, match="'g5' is not a pairing with runs"):
        check_same_nodes(study, "g5")
    check_same_nodes(_study(tmp_path), "g3")


def test_a_skill_without_its_split_is_refused(tmp_path):
    study = _study(tmp_path)
    with pytest.raises(ValueError, match="a's skill split 'z' is not an evaluation split"):
        check_skills(study, {"a": "z"})
    with pytest.raises(ValueError, match="options.skills names 'd', not a node"):
        check_skills(study, {"d": "test"})
    check_skills(study, {"a": "test", "c": "y"})


SWARM = {
    "name": "s",
    "task": _group(2)["task"],
    "nodes": [
        {"name": "a-0", "model": {"preset": "llama-xs"}},
        {"name": "b-0", "model": {"preset": "llama-xs"}},
    ],
    "train": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
    "eval": {"every": 2, "size": 4, "pass_samples": 0},
    "algorithm": {"kind": "swarm", "backend": "sim"},
}


def test_swarm_arms(tmp_path):
    """A swarm pairing against its own Alone arm (max_peers_used 0): peer a-0 (skill x by its
    name's prefix, present both rounds) all right with HACPO, all wrong alone; b-0 (present one
    round of two: half the run) all wrong either way."""
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(SWARM))
    study_spec = {
        **STUDY,
        "pairings": {**STUDY["pairings"], "s": {"config": "s.yaml", "label": "swarm"}},
        "methods": {
            **STUDY["methods"],
            "swarm-alone": {
                "loss": "vis",
                "label": "Alone in the swarm",
                "run_set": ["algorithm.max_peers_used=0"],
            },
        },
        "grid": [
            *STUDY["grid"],
            {"pairings": ["s"], "methods": ["swarm-alone", "hacpo"], "schemes": ["joint"]},
        ],
        "options": {
            **STUDY["options"],
            "swarm": {"s": "swarm-alone"},
            "sapo": {"s": "swarm-alone"},
        },
    }
    (tmp_path / "g2.yaml").write_text(yaml.safe_dump(_group(2)))
    (tmp_path / "g3.yaml").write_text(yaml.safe_dump(_group(3)))
    (tmp_path / "groups.yaml").write_text(yaml.safe_dump(study_spec))
    study = load_study(tmp_path / "groups.yaml")
    out = tmp_path / "runs"
    for run in study.runs:
        nodes = [run.node] if run.node else [n.name for n in run.config.nodes]
        _write_run(out / run.id, run.pairing, nodes, run.method)
        if run.pairing == "s":
            schedule = {
                "steps": 2,
                "peers": {"a-0": {"present_rounds": 2}, "b-0": {"present_rounds": 1}},
            }
            (out / run.id / "swarm-schedule.json").write_text(json.dumps(schedule))
            # b-0 joined late: its first evaluation is at step 1 (all wrong), not step 0
            evals = [json.loads(x) for x in (out / run.id / "evals.jsonl").read_text().splitlines()]
            for e in evals:
                if e["node"] == "b-0" and e["step"] == 0:
                    e["step"] = 1
            (out / run.id / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
            # SAPO's measure: a-0's own reward 0.5 a round with HACPO, 0.25 alone; b-0's 0.25
            rows = [
                json.loads(x) for x in (out / run.id / "metrics.jsonl").read_text().splitlines()
            ]
            for r in rows:
                r["reward/own"] = 0.5 if (r["node"], run.method) == ("a-0", "hacpo") else 0.25
            (out / run.id / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            if run.method == "hacpo":  # a-0 all right on every split
                evals = [
                    json.loads(x) for x in (out / run.id / "evals.jsonl").read_text().splitlines()
                ]
                for e in evals:
                    if e["node"] == "a-0" and e["step"] == 2:
                        e["correct"] = encode_outcomes([1, 1, 1, 1])
                (out / run.id / "evals.jsonl").write_text(
                    "".join(json.dumps(e) + "\n" for e in evals)
                )
    report = tmp_path / "groups.md"
    write_results(study, out_dir=out, report_path=report)
    text = report.read_text()
    swarm = text.split("## swarm", 1)[1]
    bold = "**+100.0 [+100.0, +100.0]** (better)"
    assert f"| a-0 | 2 | `x` | {bold} | {bold} |" in swarm
    assert "| b-0 | 1 | `y` | 0.0 [0.0, 0.0] | 0.0 [0.0, 0.0] |" in swarm
    assert f"| a-0 | 0.0 [0.0, 0.0] | {bold} |" in swarm  # change over the run
    # b-0's change is from its first evaluation (step 1): measured, not left out
    assert "| b-0 | 0.0 [0.0, 0.0] | 0.0 [0.0, 0.0] |" in swarm
    assert (
        "at least half the run whose change is an interval above zero: Alone in the swarm 0 of 2; HACPO 1 of 2."
        in swarm
    )
    sapo = swarm.split("### SAPO's measure", 1)[1]
    assert f"| `a` (1) | 0.50 | 1.00: {bold} |" in sapo  # +100%: twice the cumulative reward
    assert "| `b` (1) | 0.50 | 0.50: 0.0 [0.0, 0.0] |" in sapo
    # the swarm's methods are not rows of the groups' tables, nor the swarm a group
    assert (
        "Alone in the swarm"
        not in text.split("## swarm", 1)[0].split("## Set-up", 1)[1].split("## g2", 1)[1]
    )
    assert "| HACPO | a-0 |" not in text
