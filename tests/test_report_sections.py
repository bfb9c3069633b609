"""report.md from hand-written metrics rows (no training): each algorithm's own section (FGRPO's
weights and gains, the swarm's membership and delivery, DPO's preference accuracy, the
population's vote), and the summary's rule that no data is absent, never 0.0. Every expected
cell below is worked out by hand from the rows written in the test."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from ftis.report import summary_table, table_lines, write_report

FTIS_ONLY = ("filtered", "bytes/token", "F- filter")


def _run(tmp_path: Path, kind: str, rows: list[dict], extra: str = "") -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.yaml").write_text(f"name: t\nalgorithm:\n  kind: {kind}\n{extra}")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def _section(report: str, title: str) -> str:
    """The text of report.md's `## title` section, up to the next image-less heading/config."""
    start = report.index(f"## {title}")
    end = report.find("\n## ", start + 1)
    return report[start : end if end != -1 else len(report)]


def _no_ftis_columns(report: str) -> None:
    for word in FTIS_ONLY:
        assert word not in report, word
    # the summary holds no invented zero (a 0.0% or 0.00 that is not part of a larger number)
    assert re.search(r"(?<![\d.])0\.0+%?(?![\d])", report.split("## ")[0]) is None


# ------------------------------------------------------------------------------------ FGRPO


def _fgrpo_rows() -> list[dict]:
    rows: list[dict] = [
        {"step": 0, "node": "a", "eval/accuracy": 0.1, "eval/test/accuracy": 0.1},
        {"step": 0, "node": "b", "eval/accuracy": 0.3, "eval/test/accuracy": 0.3},
        {"step": 0, "node": "server", "eval/accuracy": 0.2, "eval/test/accuracy": 0.2},
    ]
    for step in (1, 2, 3):
        for n in ("a", "b"):
            rows.append({"step": step, "node": n, "time/update": 2.0, "fgrpo/participated": 1.0})
    server = {
        1: {
            "agg/weight/a": 0.5,
            "agg/gain/a": 0.0,
            "agg/performance/a": 0.2,
            "agg/weight/b": 0.5,
            "agg/gain/b": 0.0,
            "agg/performance/b": 0.4,
            "server/update_norm": 0.3,
            "server/rejected_total": 0.0,
            "server/dropped_total": 0.0,
            "server/skipped_update": 0.0,
        },
        2: {
            "agg/weight/a": 0.7,
            "agg/gain/a": 0.5,
            "agg/baseline/a": 0.2,
            "agg/performance/a": 0.3,
            "agg/weight/b": 0.3,
            "agg/gain/b": -0.25,
            "agg/baseline/b": 0.4,
            "agg/performance/b": 0.3,
            "server/update_norm": 0.2,
            "server/rejected_total": 0.0,
            "server/dropped_total": 0.0,
            "server/skipped_update": 0.0,
        },
        3: {  # b's reply was rejected: it has no weight this round
            "agg/weight/a": 1.0,
            "agg/gain/a": 0.2,
            "agg/baseline/a": 0.25,
            "agg/performance/a": 0.3,
            "server/update_norm": 0.1,
            "server/rejected_total": 1.0,
            "server/dropped_total": 0.0,
            "server/skipped_update": 0.0,
            "eval/accuracy": 0.4,
            "eval/test/accuracy": 0.4,
        },
    }
    rows += [{"step": s, "node": "server", **r} for s, r in server.items()]
    return rows


def test_fgrpo_section_shows_weights_and_gains(tmp_path: Path) -> None:
    run = _run(tmp_path, "fgrpo", _fgrpo_rows(), "  aggregation: relative-gain\n")
    report = write_report(run).read_text()
    sec = _section(report, "FGRPO aggregation")
    assert "3 aggregated rounds, weights by `relative-gain`" in sec
    # a: weights 0.5, 0.7, 1.0 -> mean 0.733, max 1.000; gains 0, 0.5, 0.2 -> mean +0.233
    assert "| a | 3 | 0.733 | 1.000 | +0.233 | 0.300 | 0.250 |" in sec
    # b: rounds 1-2 only: weights 0.5, 0.3 -> 0.400, max 0.500; gains 0, -0.25 -> -0.125
    assert "| b | 2 | 0.400 | 0.500 | -0.125 | 0.300 | 0.400 |" in sec
    assert "| round | a | b | update norm |" in sec
    assert "| 1 | 0.500 (+0.000) | 0.500 (+0.000) | 0.3000 |" in sec
    assert "| 2 | 0.700 (+0.500) | 0.300 (-0.250) | 0.2000 |" in sec
    assert "| 3 | 1.000 (+0.200) | - | 0.1000 |" in sec  # absent, not a weight of 0
    assert "Server: 1 replies rejected, 0 dropped, 0 rounds without an update." in sec
    # agg/no_positive_gain is not in these rows: no clause about it
    assert "no gain was positive" not in sec
    assert "![fgrpo](fgrpo.png)" in sec and (run / "fgrpo.png").is_file()
    # the summary: the server timed nothing (no node time), no F-TIS column
    assert "| node | test acc before -> after | node time (s) |" in report
    assert "| a | 10.0% -> 10.0% | 6 |" in report
    assert "| server | 20.0% -> 40.0% | - |" in report
    _no_ftis_columns(report)
    assert not (run / "training.png").exists()  # no F-TIS panel has data


# ------------------------------------------------------------------------------------ swarm


def _swarm_row(step: int, node: str, *f: float, published: float | None) -> dict:
    members, seen, used, received, rejected, stale, late, timed_out = f
    row = {
        "step": step,
        "node": node,
        "swarm/members": members,
        "swarm/peers_seen": seen,
        "swarm/peers_used": used,
        "swarm/samples_received": received,
        "swarm/rejected": rejected,
        "swarm/stale": stale,
        "swarm/late": late,
        "swarm/timed_out": timed_out,
    }
    if published is not None:
        row["swarm/samples_published"] = published
    return row


def _swarm_rows(sim: bool) -> list[dict]:
    # 4 samples per peer and round; p2 joins at round 2. Round 1: p1 missed p0's payload.
    pub = (lambda v: v) if sim else (lambda v: None)
    return [
        {"step": 0, "node": "p0", "eval/test/accuracy": 0.5},
        _swarm_row(1, "p0", 1, 1, 1, 4, 0, 0, 0, 0, published=pub(4)),
        _swarm_row(1, "p1", 1, 0, 0, 0, 0, 1, 0, 1, published=pub(4)),
        _swarm_row(2, "p0", 2, 2, 1, 4, 1, 0, 0, 0, published=pub(8)),
        _swarm_row(2, "p1", 2, 2, 2, 8, 0, 0, 1, 0, published=pub(8)),
        _swarm_row(2, "p2", 2, 2, 2, 8, 0, 0, 0, 0, published=pub(8)),
    ]


def test_swarm_section_shows_membership_and_delivery(tmp_path: Path) -> None:
    run = _run(tmp_path, "swarm", _swarm_rows(sim=True))
    report = write_report(run).read_text()
    sec = _section(report, "Swarm")
    assert "3 peers over 2 rounds." in sec
    head = (
        "| members (mean) | arrived (mean) | peers used (mean) | samples received | "
        "samples published | delivered | rejected | stale | late | timed out |"
    )
    assert f"| peer | rounds (first-last) {head}" in sec
    # p0: members (1+2)/2, arrived (1+2)/2, used (1+1)/2; 4+4 of 4+8 published = 66.7%
    assert "| p0 | 2 (1-2) | 1.5 | 1.5 | 1.0 | 8 | 12 | 66.7% | 1 | 0 | 0 | 0 |" in sec
    assert "| p1 | 2 (1-2) | 1.5 | 1.0 | 1.0 | 8 | 12 | 66.7% | 0 | 1 | 1 | 1 |" in sec
    assert "| p2 | 1 (2-2) | 2.0 | 2.0 | 2.0 | 8 | 8 | 100.0% | 0 | 0 | 0 | 0 |" in sec
    assert f"| round | peers present {head}" in sec
    # round 1: 2 peers, received 4 of 8 published; round 2: 3 peers, used 5/3, 20 of 24
    assert "| 1 | 2 | 1.0 | 0.5 | 0.5 | 4 | 8 | 50.0% | 0 | 1 | 0 | 1 |" in sec
    assert "| 2 | 3 | 2.0 | 2.0 | 1.7 | 20 | 24 | 83.3% | 1 | 0 | 1 | 0 |" in sec
    assert "Over the run: 75.0% of the published peer samples trained on; " in sec
    assert "1 rejected, 1 stale, 1 late records." in sec
    assert (run / "swarm.png").is_file()
    _no_ftis_columns(report)


def test_swarm_section_without_published_counts_drops_delivery(tmp_path: Path) -> None:
    """A real DHT cannot know what was published: those columns are absent, not 0."""
    report = write_report(_run(tmp_path, "swarm", _swarm_rows(sim=False))).read_text()
    sec = _section(report, "Swarm")
    assert "| p0 | 2 (1-2) | 1.5 | 1.5 | 1.0 | 8 | 1 | 0 | 0 | 0 |" in sec
    assert "| delivered |" not in sec and "| samples published |" not in sec
    assert "Over the run: 1 rejected, 1 stale, 1 late records." in sec


# -------------------------------------------------------------------------------------- DPO


def _dpo_rows() -> list[dict]:
    rows = [
        {
            "step": 0,
            "node": "a",
            "eval/preference_accuracy": 0.5,
            "eval/reward_accuracy": 0.0,
            "eval/dpo_loss": 0.693,
            "gossip/rho_full": 0.5,
        },
        {"step": 0, "node": "b", "eval/preference_accuracy": 0.25, "eval/dpo_loss": 0.7},
    ]
    for step in (1, 2):
        for n, loss in (("a", 0.6), ("b", 0.65)):
            rows.append(
                {
                    "step": step,
                    "node": n,
                    "loss/dpo": loss,
                    "gossip/rho": 0.5,
                    "gossip/spectral_gap": 0.75,
                    "gossip/consensus_error_before": 0.1,
                    "gossip/consensus_error_after": 0.01,
                    "exchange/bytes_sent": 100.0,
                    "time/local": 1.0,
                }
            )
    rows[-2].update(
        {"eval/preference_accuracy": 0.75, "eval/reward_accuracy": 0.6, "eval/dpo_loss": 0.5}
    )
    rows[-1].update({"eval/preference_accuracy": 0.5, "eval/dpo_loss": 0.6})  # b: no reward acc
    return rows


def test_dpo_section_shows_preference_accuracy(tmp_path: Path) -> None:
    run = _run(tmp_path, "gossip-dpo", _dpo_rows())
    report = write_report(run).read_text()
    sec = _section(report, "DPO")
    assert (
        "| agent | preference accuracy (step 0 -> end) | reward accuracy (end) | "
        "held-out DPO loss (step 0 -> end) |"
    ) in sec
    assert "| a | 50.0% -> 75.0% | 60.0% | 0.693 -> 0.500 |" in sec
    assert "| b | 25.0% -> 50.0% | - | 0.700 -> 0.600 |" in sec
    # rho 0.5: gap 1 - 0.25 = 0.75
    assert "rho = 0.5000, spectral gap 1 - rho^2 = 0.7500" in sec
    assert "![dpo](dpo.png)" in sec and (run / "dpo.png").is_file()
    assert "FedDPO" not in sec
    assert "| node | node time (s) |" in report  # no eval split, no F-TIS column
    assert not (run / "accuracy.png").exists() and "accuracy.png" not in report
    _no_ftis_columns(report)


def test_fed_dpo_server_line_leaves_out_what_was_not_logged(tmp_path: Path) -> None:
    rows = _dpo_rows() + [
        {"step": 1, "node": "server", "fed/sampled": 2.0, "fed/participants": 2.0},
        {
            "step": 2,
            "node": "server",
            "fed/sampled": 2.0,
            "fed/participants": 1.0,
            "fed/rejected_total": 1.0,
        },
    ]
    sec = _section(write_report(_run(tmp_path, "fed-dpo", rows)).read_text(), "DPO")
    # participants (2 + 1) / 2 = 1.5; no staleness, dropped or lost figure in the rows
    assert (
        "FedDPO: 2 rounds, 2.0 clients sampled and 1.5 averaged per round on average; "
        "1 replies rejected." in sec
    )
    assert "staleness" not in sec and "dropped" not in sec


# ------------------------------------------------------------------------------- population


def _population_rows() -> list[dict]:
    rows = []
    for n, rates in (("x", (2.0, 4.0)), ("y", None)):
        rows.append({"step": 0, "node": n, "eval/accuracy": 0.2, "eval/test/accuracy": 0.2})
        for step, scored, vote, best, tokens in ((1, 4, 0.3, 0.25, 1000), (2, 8, 0.35, 0.4, 2500)):
            r = {
                "step": step,
                "node": n,
                "population/scored_total": float(scored),
                "population/rejected_total": float(step - 1),
                "train/forward_tokens_total": float(tokens),
                "eval/accuracy": vote,  # randopt: the answer is the top-K vote
                "eval/test/accuracy": vote,
                "eval/randopt/best_accuracy": best,
                "eval/randopt/k": 2.0,
            }
            if rates:
                r["population/perturbations_per_second"] = rates[step - 1]
            rows.append(r)
        rows[-1]["population/ensemble_sha256"] = ("ab" if n == "x" else "cd") * 32
    return rows


def test_population_section_shows_the_vote_over_members(tmp_path: Path) -> None:
    run = _run(tmp_path, "randopt", _population_rows())
    report = write_report(run).read_text()
    sec = _section(report, "Population (RandOpt / CoRP)")
    # randopt: no CoRP choice or probe columns; y logged no rate: '-' (never 0.0)
    assert (
        "| party | eval acc step 0 -> end | RandOpt vote / best member (end) | "
        "perturbations/s | forward tokens | rejected |"
    ) in sec
    assert "| x | 20.0% -> 35.0% | 35.0% / 40.0% | 3.0 | 2,500 | 1 |" in sec
    assert "| y | 20.0% -> 35.0% | 35.0% / 40.0% | - | 2,500 | 1 |" in sec
    assert "**The parties disagree on the top-K ensemble**" in sec
    assert "| party | step | members scored | vote | best member |" in sec
    assert "| x | 1 | 4 | 30.0% | 25.0% |" in sec
    assert "| x | 2 | 8 | 35.0% | 40.0% |" in sec
    assert "![population](population.png)" in sec and (run / "population.png").is_file()
    _no_ftis_columns(report)


def test_corp_section_shows_its_choice_and_the_vote_at_the_end(tmp_path: Path) -> None:
    rows = [
        {"step": 0, "node": "x", "eval/accuracy": 0.2, "eval/test/accuracy": 0.2},
        {
            "step": 1,
            "node": "x",
            "population/scored_total": 4.0,
            "population/perturbations_per_second": 2.0,
        },
        {
            "step": 2,
            "node": "x",
            "corp/q": 0.75,
            "corp/beta": 30.0,
            "corp/alpha": 1.0,
            "corp/probe_base": 0.3,
            "corp/probe_reward": 0.35,
            "population/weights_sha256": "ef" * 32,
            "eval/accuracy": 0.25,  # the consolidated model
            "eval/test/accuracy": 0.25,
            "eval/randopt/vote_accuracy": 0.3,
            "eval/randopt/best_accuracy": 0.28,
            "eval/randopt/k": 2.0,
        },
    ]
    sec = _section(
        write_report(_run(tmp_path, "corp", rows)).read_text(), "Population (RandOpt / CoRP)"
    )
    # no forward tokens and no rejected count in the rows: those columns are absent
    assert (
        "| party | eval acc step 0 -> end | RandOpt vote / best member (end) | (q, beta, alpha) "
        "| probe base -> chosen | perturbations/s |"
    ) in sec
    assert "| x | 20.0% -> 25.0% | 30.0% / 28.0% | (0.75, 30, 1) | 30.0% -> 35.0% | 2.0 |" in sec
    assert "Every party (1) ends with the same weights: sha256 `efefefefefefefef...`." in sec
    assert "| x | 2 | 4 | 30.0% | 28.0% |" in sec  # scored by step 1, voted at step 2


# ---------------------------------------------------------------------------------- summary


def test_summary_drops_a_column_no_node_has_and_shows_dash_where_one_lacks_it() -> None:
    rows = [
        {"step": 0, "node": "a", "eval/test/accuracy": 0.5, "eval/ood/accuracy": 0.25},
        {"step": 0, "node": "b", "eval/test/accuracy": 0.5},
        {"step": 1, "node": "a", "loss/filtered_frac": 0.25, "time/update": 1.0},
        {"step": 2, "node": "a", "loss/filtered_frac": 0.75, "time/update": 2.0},
        {"step": 1, "node": "b", "time/update": 4.0},
    ]
    header, body = summary_table(rows)
    # no node has exchange/bytes_per_token: no column; b has no filtered fraction, no ood split
    assert header == [
        "node",
        "test acc before -> after",
        "ood acc before -> after",
        "filtered",
        "node time (s)",
    ]
    assert body == [
        ["a", "50.0% -> 50.0%", "25.0% -> 25.0%", "50.0%", "3"],
        ["b", "50.0% -> 50.0%", "-", "-", "4"],
    ]


def test_summary_shows_pass_at_k_in_order_of_k_and_dash_where_a_node_lacks_it(
    tmp_path: Path,
) -> None:
    # pass@16 is logged before pass@4 and only at the later steps of a: columns go by k (4 < 16,
    # not as strings), before is a node's first value of that k, after its last
    rows = [
        {"step": 0, "node": "a", "eval/test/accuracy": 0.5, "eval/pass@4": 0.5},
        {"step": 0, "node": "b", "eval/test/accuracy": 0.25},
        {"step": 5, "node": "a", "eval/pass@16": 0.75, "eval/pass@4": 0.625},
        {"step": 9, "node": "a", "eval/pass@16": 0.875, "eval/pass@4": None},
        {"step": 9, "node": "b", "eval/test/accuracy": 0.5},
    ]
    header, body = summary_table(rows)
    assert header == [
        "node",
        "test acc before -> after",
        "pass@4 before -> after",
        "pass@16 before -> after",
    ]
    assert body == [
        ["a", "50.0% -> 50.0%", "50.0% -> 62.5%", "75.0% -> 87.5%"],
        ["b", "25.0% -> 50.0%", "-", "-"],
    ]
    report = write_report(_run(tmp_path, "ftis", rows)).read_text()
    assert "| a | 50.0% -> 50.0% | 50.0% -> 62.5% | 75.0% -> 87.5% |" in report
    assert "pass@k is the unbiased estimate" in report


def test_a_federated_servers_pass_at_k_compares_the_same_clients() -> None:
    """Client b (16 problems) evaluated at step 0 only; a (16) and c (32) at both. pass@4 over
    a and c: before (16 * 0.25 + 32 * 0.75) / 48 = 28/48 = 58.3%, after (16 * 0.5 + 32 * 1.0)
    / 48 = 40/48 = 83.3% (the server's own step-0 figure, 0.5, counts b)."""
    rows = [
        {"node": "a", "step": 0, "eval/pass@4": 0.25, "eval/size": 16},
        {"node": "b", "step": 0, "eval/pass@4": 0.5, "eval/size": 16},
        {"node": "c", "step": 0, "eval/pass@4": 0.75, "eval/size": 32},
        {"node": "server", "step": 0, "eval/pass@4": 0.5, "eval/clients": 3},
        {"node": "a", "step": 2, "eval/pass@4": 0.5, "eval/size": 16},
        {"node": "c", "step": 2, "eval/pass@4": 1.0, "eval/size": 32},
        {"node": "server", "step": 2, "eval/pass@4": 40 / 48, "eval/clients": 2},
    ]
    _, body = summary_table(rows)
    cell = next(line for line in body if line[0] == "server")[1]
    assert cell == "58.3% -> 83.3% (the 2 of 3 clients evaluated at both)"


def test_summary_without_pass_at_k_has_no_pass_column_nor_note(tmp_path: Path) -> None:
    rows = [{"step": 0, "node": "a", "eval/test/accuracy": 0.5, "eval/pass@8": None}]
    header, _ = summary_table(rows)
    assert header == ["node", "test acc before -> after"]
    assert "pass@k" not in write_report(_run(tmp_path, "ftis", rows)).read_text()


def test_summary_in_report_md_has_no_column_without_data(tmp_path: Path) -> None:
    rows = [
        {"step": 0, "node": "a", "eval/test/accuracy": 0.5},
        {"step": 1, "node": "a", "exchange/bytes_per_token": 2.5},
        {"step": 1, "node": "b", "exchange/bytes_per_token": 3.5},
    ]
    report = write_report(_run(tmp_path, "ftis", rows)).read_text()
    assert "| node | test acc before -> after | bytes/token |" in report
    assert "| a | 50.0% -> 50.0% | 2.50 |" in report
    assert "| b | - | 3.50 |" in report
    assert "filtered" not in report and "node time" not in report


def test_table_lines_renders_none_as_dash_and_drops_empty_columns() -> None:
    lines = table_lines(["k", "x", "y"], [["a", None, "1"], ["b", None, None]])
    assert lines == ["| k | y |", "|---|---|", "| a | 1 |", "| b | - |"]


def test_the_shared_report_layer_imports_no_algorithm() -> None:
    """Principle 18: ftis.report finds a run's section through the registry (`ftis.plugins`)
    only, never by importing an algorithm's package (tests/test_layers.py checks every module)."""
    import ftis.report

    tree = ast.parse(Path(ftis.report.__file__).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert "ftis.plugins" in imported  # the registry
    assert [m for m in imported if m.startswith("ftis.algos")] == []


# ------------------------------------------------------------------ change over the run


def test_change_section_calls_a_node_improved_only_when_its_interval_excludes_zero(
    tmp_path: Path,
) -> None:
    from ftis.train.metrics import encode_outcomes

    n = 200
    before = [0] * n
    after_up = [1] * 60 + [0] * (n - 60)  # 30 points up, on the same problems
    after_flat = [1] * 2 + [0] * (n - 2)  # 1 point: within what 200 problems resolve
    evals = [
        {"step": s, "node": node, "split": "test", "n": n, "correct": encode_outcomes(bits)}
        for node, after in (("up", after_up), ("flat", after_flat))
        for s, bits in ((0, before), (10, after))
    ]
    run = _run(tmp_path, "ftis", [{"step": 0, "node": "up"}, {"step": 0, "node": "flat"}])
    (run / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    text = write_report(run).read_text()
    section = text[text.index("### Change over the run") :]
    rows = {line.split(" | ")[0].strip("| "): line for line in section.splitlines()}
    assert "| test | 0 -> 10 | 200 | +30.0 [" in rows["up"] and "**improved**" in rows["up"]
    # the t interval over problems: 2 of 200 differences are 1, mean 0.01, sd 0.0997, so
    # 1.0 +- 1.972 x 9.97 / sqrt(200) = [-0.39, +2.39] points: it includes zero
    assert "| +1.0 [−0.4, +2.4] |" in rows["flat"]
    assert rows["flat"].endswith("| no change detected |")


def test_change_section_is_absent_without_two_evaluations(tmp_path: Path) -> None:
    from ftis.train.metrics import encode_outcomes

    run = _run(tmp_path, "ftis", [{"step": 0, "node": "a"}])
    row = {"step": 0, "node": "a", "split": "test", "n": 8, "correct": encode_outcomes([1] * 8)}
    (run / "evals.jsonl").write_text(json.dumps(row) + "\n")
    assert "Change over the run" not in write_report(run).read_text()


# ------------------------------------------------------------------ ftis compare: paired finals


def _evals_run(path: Path, task: dict, finals: dict[str, list[int]], step: int = 40) -> Path:
    """A run directory with config.yaml's task and each node's step-0 and last evaluation."""
    import yaml

    from ftis.train.metrics import encode_outcomes

    path.mkdir()
    (path / "config.yaml").write_text(yaml.safe_dump({"name": path.name, "task": task}))
    rows = [
        {"step": s, "node": node, "split": "test", "n": len(bits), "correct": encode_outcomes(b)}
        for node, bits in finals.items()
        for s, b in ((0, [0] * len(bits)), (step, bits))
    ]
    (path / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_compare_pairs_last_evaluations_by_problem_for_nodes_of_one_name(tmp_path: Path) -> None:
    from ftis.report import paired_final_rows

    task = {"kind": "arithmetic", "seed": 0}
    n = 200
    group = _evals_run(
        tmp_path / "group", task, {"a": [1] * 80 + [0] * 120, "b": [1] * 41 + [0] * 159}
    )
    alone = _evals_run(tmp_path / "alone", task, {"a": [1] * 20 + [0] * 180}, step=30)
    _header, rows, why = paired_final_rows(group, alone)
    assert why == "" and [r[0] for r in rows] == ["a"]  # b is in one run only
    _node, split, steps, problems, cells, reading = rows[0]
    assert (split, steps, problems, reading) == ("test", "40 vs 30", str(n), "higher")
    assert cells.startswith("+30.0 [")
    # the same problems the other way round, and a difference within what 200 problems resolve
    _, rows, _ = paired_final_rows(alone, group)
    assert rows[0][4].startswith("−30.0 [") and rows[0][5] == "lower"
    close = _evals_run(tmp_path / "close", task, {"a": [1] * 79 + [0] * 121})
    assert paired_final_rows(group, close)[1][0][5] == "no difference detected"


def test_compare_pairs_nodes_of_different_names_when_told(tmp_path: Path) -> None:
    """`ftis compare --pair A=B` (issue 55): node `a` of a group against node `solo` of a run
    alone; the row names both, the title says so, and a node not in its run is a clear error."""
    import pytest
    from typer.testing import CliRunner

    from ftis.cli import app
    from ftis.report import ReportError, paired_final_rows

    task = {"kind": "arithmetic", "seed": 0}
    group = _evals_run(tmp_path / "group", task, {"a": [1] * 80 + [0] * 120})
    alone = _evals_run(tmp_path / "alone", task, {"solo": [1] * 20 + [0] * 180}, step=30)
    assert paired_final_rows(group, alone)[1] == []  # no node of one name
    _, rows, why = paired_final_rows(group, alone, pairs={"a": "solo"})
    assert why == "" and rows[0][0] == "a vs solo" and rows[0][4].startswith("+30.0 [")
    with pytest.raises(ReportError, match="has no evaluated node 'b'; its nodes: solo"):
        paired_final_rows(group, alone, pairs={"a": "b"})
    for run, node, acc in ((group, "a", 0.4), (alone, "solo", 0.1)):
        rows = [{"step": 0, "node": node, "eval/test/accuracy": 0.0}, {"step": 1, "node": node}]
        rows.append({"step": 40, "node": node, "eval/test/accuracy": acc})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = CliRunner().invoke(
        app,
        ["compare", str(group), str(alone), "--pair", "a=solo", "--out", str(tmp_path / "c.png")],
    )
    assert res.exit_code == 0, res.output
    assert "node a against node solo" in " ".join(res.output.split())
    res = CliRunner().invoke(app, ["compare", str(group), str(alone), "--pair", "a"])
    assert res.exit_code == 2 and "write it as A=B" in res.output


def test_compare_refuses_to_pair_runs_of_different_tasks(tmp_path: Path) -> None:
    from ftis.report import paired_final_rows

    a = _evals_run(tmp_path / "a", {"kind": "arithmetic", "seed": 0}, {"x": [1] * 10})
    b = _evals_run(tmp_path / "b", {"kind": "arithmetic", "seed": 1}, {"x": [0] * 10})
    _, rows, why = paired_final_rows(a, b)
    assert rows == [] and "tasks differ" in why
