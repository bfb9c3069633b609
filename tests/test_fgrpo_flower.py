"""FGRPO on Flower (docs/fgrpo.md): the strategy rejects bad client results and counts dropouts
(crafted messages, no engine), whole runs with injected faulty clients and exact resume
(in-process engine: the same ServerApp, strategy and ClientApp, messages delivered in this
process), and one run through Flower's simulation engine (Ray), as `ftis run` does it.

Skipped cleanly where flwr is not installed (the `federated` extra; `dev` pulls it in)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import ftis.algos.fgrpo  # noqa: F401  (telemetry off before anything imports flwr)

pytest.importorskip("flwr")

from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.supercore.task_identity import TaskIdentity

from ftis.algos.federated.faults import FaultPlan, corrupt
from ftis.algos.federated.inprocess import run_in_process
from ftis.algos.federated.records import array_record, metric_record
from ftis.algos.fgrpo.aggregator import Aggregator
from ftis.algos.fgrpo.launch import run_federated
from ftis.algos.fgrpo.strategy import FGRPOStrategy
from ftis.config import RunConfig
from ftis.report import write_report
from ftis.train.metrics import MetricLogger, read_metrics
from tests.test_fgrpo import fgrpo_run_config

# Row entries that differ between two runs of the same config: timings and memory.
VOLATILE = ("train/elapsed_seconds", "train/local_seconds", "server/round_seconds")
VOLATILE = (*VOLATILE, "memory/peak_rss_mb")


def test_flower_and_ray_telemetry_are_off() -> None:
    import os

    import flwr.supercore.telemetry as telemetry

    assert os.environ["FLWR_TELEMETRY_ENABLED"] == "0"
    assert os.environ["FLWR_DISABLE_UPDATE_CHECK"] == "1"
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    assert telemetry.FLWR_TELEMETRY_ENABLED == "0"


# ---- the strategy on crafted replies -------------------------------------------------------

BEHAVIOURS = {
    "ok1": "ok",
    "ok2": "ok",
    "nan": "nan-delta",
    "shape": "wrong-shape",
    "name": "wrong-name",
    "int": "int-delta",
    "perf": "nan-performance",
    "before": "no-before",
    "imposter": "imposter",
    "err": "error",
    "silent": "silent",
}


def _strategy(tmp_path: Path, names: list[str]) -> FGRPOStrategy:
    data = fgrpo_run_config()
    node = data["nodes"][0]
    data["nodes"] = [{**node, "name": n} for n in names]
    data["algorithm"]["clients"] = {}
    cfg = RunConfig.model_validate(data)
    params = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    loggers = {n: MetricLogger(tmp_path, n) for n in [*names, "server"]}
    saved = []
    strategy = FGRPOStrategy(
        cfg=cfg,
        aggregator=Aggregator(params, cfg.algorithm),
        loggers=loggers,
        checkpoint=lambda r, state: saved.append((r, state)),
    )
    strategy.node_of = {n: 100 + i for i, n in enumerate(names)}
    strategy.name_of = {v: k for k, v in strategy.node_of.items()}
    strategy.saved = saved  # type: ignore[attr-defined]
    return strategy


def _reply(
    msg: Message,
    name: str,
    behaviour: str,
    value: float,
    perf: tuple[float, float] = (0.5, 0.5),
) -> Message | None:
    """A crafted train reply: delta `value` everywhere, performance (before, after) = perf."""
    if behaviour == "silent":
        return None
    if behaviour == "error":
        return Message(Error(code=2, reason="ClientAppException: boom"), reply_to=msg)
    arrays = {
        "w": torch.full((2, 3), value).numpy(),
        "b": torch.full((3,), value).numpy(),
    }
    metrics = {
        "performance": perf[1],
        "performance-before": perf[0],
        "num-examples": 32,
        "reward/mean": 0.25,
    }
    if behaviour == "no-before":  # the pre-round baseline is missing
        del metrics["performance-before"]
    elif behaviour not in ("ok", "imposter"):
        corrupt(behaviour, arrays, metrics)
    claimed = "ok1" if behaviour == "imposter" else name
    content = RecordDict(
        {
            "arrays": array_record(arrays),
            "metrics": metric_record(metrics),
            "config": ConfigRecord({"client": claimed}),
        }
    )
    return Message(content, reply_to=msg)


def test_strategy_rejects_bad_results_and_counts_dropouts(tmp_path: Path, caplog) -> None:
    """Of eleven clients two send good deltas (1 and 3 everywhere): the server applies exactly
    their mean (both gains 0.5 -> 0.5 = 0: no positive gain, so data-size weights, equal) -> 2.
    NaN, wrongly shaped, wrongly named and integer arrays, a NaN performance, a missing
    performance before training and a reply claiming another client's name are rejected (7); an
    error reply and a missing reply are dropouts (2). Nothing else moves theta,
    the round's rows say who was what, and the server's row counts them."""
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 0, 1
    names = list(BEHAVIOURS)
    strategy = _strategy(tmp_path, names)
    msgs = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid=None))
    assert sorted(strategy.name_of[m.metadata.dst_node_id] for m in msgs) == sorted(names)
    replies = []
    for msg in msgs:
        name = strategy.name_of[msg.metadata.dst_node_id]
        value = 3.0 if name == "ok2" else 1.0
        reply = _reply(msg, name, BEHAVIOURS[name], value)
        if reply is not None:
            replies.append(reply)
    theta, summary = strategy.aggregate_train(1, replies)
    assert summary == MetricRecord({"accepted": 2, "rejected": 7, "dropped": 2})
    assert torch.equal(strategy.aggregator.params["w"], torch.full((2, 3), 2.0))
    assert torch.equal(strategy.aggregator.params["b"], torch.full((3,), 2.0))
    assert set(theta.keys()) == {"w", "b"}
    strategy.aggregate_evaluate(1, [])  # the end of round 1: rows are written
    for lg in strategy.loggers.values():
        lg.close()
    rows = {r["node"]: r for r in read_metrics(tmp_path / "metrics.jsonl")}
    server = rows["server"]
    assert (server["server/accepted"], server["server/rejected"], server["server/dropped"]) == (
        2,
        7,
        2,
    )
    assert server["agg/no_positive_gain"] == 1.0
    assert server["server/rejected_total"] == 7 and server["server/dropped_total"] == 2
    assert {k for k in server if k.startswith("agg/weight/")} == {
        "agg/weight/ok1",
        "agg/weight/ok2",
    }
    assert server["agg/weight/ok1"] == pytest.approx(0.5)
    for name, behaviour in BEHAVIOURS.items():
        row = rows[name]
        assert row["fgrpo/participated"] == 1.0
        assert row["fgrpo/accepted"] == (behaviour == "ok")
        assert row["fgrpo/dropped"] == (behaviour in ("error", "silent"))
        assert row["fgrpo/rejected"] == (behaviour not in ("ok", "error", "silent"))
    assert "performance before local training is None" in caplog.text
    assert rows["ok1"]["reward/mean"] == 0.25 and rows["ok1"]["fgrpo/weight"] == 0.5
    assert strategy.saved == []  # checkpoint.every = 0 and round 1 < train.steps


def test_the_update_uses_the_logged_weights(tmp_path: Path) -> None:
    """Two rounds of crafted replies through the strategy (default rule: pre-round baseline,
    floored gain with delta 0.1, tau 1, no floor). Round 1: a goes 0 -> 1/64 (gain (1/64)/0.1 =
    0.15625, not 1.6e6), b 0.5 -> 0.625 and c 0.4 -> 0.5 (gains 0.25): weights softmax(0.15625,
    0.25, 0.25), so a gets less than the clients that improved by 25%. Round 2: nobody improves
    -> data-size weights (all 32: 1/3 each). In both rounds theta moves by exactly the weighted
    sum of the deltas with the weights the server row logged."""
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 0, 1
    strategy = _strategy(tmp_path, ["a", "b", "c"])
    rounds = {
        1: {"a": (1.0, (0.0, 1 / 64)), "b": (3.0, (0.5, 0.625)), "c": (-2.0, (0.4, 0.5))},
        2: {"a": (2.0, (0.1, 0.1)), "b": (-1.0, (0.6, 0.5)), "c": (5.0, (0.5, 0.25))},
    }
    theta = {k: v.clone() for k, v in strategy.aggregator.params.items()}
    for r, plan in rounds.items():
        msgs = strategy.configure_train(r, ArrayRecord(), ConfigRecord(), grid=None)
        replies = []
        for msg in msgs:
            name = strategy.name_of[msg.metadata.dst_node_id]
            value, perf = plan[name]
            replies.append(_reply(msg, name, "ok", value, perf))
        strategy.aggregate_train(r, replies)
        strategy.aggregate_evaluate(r, [])
        server = next(
            row
            for row in read_metrics(tmp_path / "metrics.jsonl")
            if row["node"] == "server" and row["step"] == r
        )
        w = {n: server[f"agg/weight/{n}"] for n in plan}
        step = sum(w[n] * plan[n][0] for n in plan)
        for key, t in theta.items():
            theta[key] = t + step
            assert torch.allclose(strategy.aggregator.params[key], theta[key], atol=1e-6)
        if r == 1:
            e = {"a": math.exp(0.15625), "b": math.exp(0.25), "c": math.exp(0.25)}
            assert w == pytest.approx({n: e[n] / sum(e.values()) for n in e}, abs=1e-12)
            assert w["a"] < w["b"] and server["agg/no_positive_gain"] == 0.0
            assert server["agg/gain/a"] == pytest.approx(0.15625, abs=1e-12)
            assert server["agg/baseline/b"] == 0.5
        else:
            assert w == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}, abs=1e-12)
            assert server["agg/no_positive_gain"] == 1.0
    for lg in strategy.loggers.values():
        lg.close()


def test_client_sampling_is_seeded_and_partial(tmp_path: Path) -> None:
    names = [f"c{i}" for i in range(6)]
    strategy = _strategy(tmp_path, names)
    strategy.algo = strategy.algo.model_copy(update={"clients_per_round": 2})
    rounds = [strategy.sample_clients(r) for r in range(1, 9)]
    assert all(len(s) == 2 and len(set(s)) == 2 for s in rounds)
    assert len({tuple(s) for s in rounds}) > 1  # not the same pair every round
    assert rounds == [strategy.sample_clients(r) for r in range(1, 9)]  # seeded by (seed, round)


# ---- whole runs, in process ----------------------------------------------------------------


def _rows(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl")


def _stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("time/") and k not in VOLATILE}


def _server_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    latest = (run_dir / "nodes" / "server" / "latest").read_text().strip()
    return load_file(str(run_dir / "nodes" / "server" / latest / "model" / "model.safetensors"))


@pytest.mark.chaos_case("FGRPO", "malformed and failing client replies")
def test_in_process_run_with_faulty_clients(tmp_path: Path) -> None:
    """3 clients, 2 rounds: client b's round-1 delta holds a NaN (rejected), client c drops out
    of round 2. Every client has one row per round with eval/accuracy (eval every round), the
    server one row per round with the weights of the clients it aggregated; checkpoints and the
    report are written."""
    cfg = RunConfig.model_validate(fgrpo_run_config(steps=2))
    faults = FaultPlan({("b", 1): "nan-delta", ("c", 2): "drop"})
    run_federated(cfg, tmp_path, engine=run_in_process, faults=faults)
    rows = _rows(tmp_path)
    by = {(r["node"], r["step"]): r for r in rows}
    assert len(rows) == len(by) == 4 * 3  # (a, b, c, server) x rounds 0..2, each once
    for name in ("a", "b", "c"):
        for step in (0, 1, 2):
            row = by[(name, step)]  # greedy accuracy on eval.size = 16 problems: k / 16
            assert row["eval/size"] == 16 and (16 * row["eval/accuracy"]).is_integer()
    assert by[("server", 0)]["eval/accuracy"] == pytest.approx(
        sum(by[(n, 0)]["eval/accuracy"] for n in "abc") / 3
    )
    s1, s2 = by[("server", 1)], by[("server", 2)]
    assert (s1["server/rejected"], s1["server/dropped"]) == (1, 0)
    assert (s2["server/rejected"], s2["server/dropped"]) == (0, 1)
    assert s2["server/rejected_total"] == 1 and s2["server/dropped_total"] == 1
    assert "agg/weight/b" not in s1 and {"agg/weight/a", "agg/weight/c"} <= set(s1)
    assert "agg/weight/c" not in s2 and "agg/gain/b" in s2
    # Every accepted report carries its baseline (its score before local training) and its
    # gain is the floored relative gain of its own row's two scores (docs/math.md §9.4).
    for r, s in ((1, s1), (2, s2)):
        for name in {k.removeprefix("agg/weight/") for k in s if k.startswith("agg/weight/")}:
            row = by[(name, r)]
            before, after = row["fgrpo/performance_before"], row["fgrpo/performance"]
            assert s[f"agg/baseline/{name}"] == before
            assert s[f"agg/gain/{name}"] == pytest.approx(
                (after - before) / max(abs(before), 0.1), abs=1e-12
            )
    assert by[("b", 1)]["fgrpo/rejected"] == 1 and by[("c", 2)]["fgrpo/dropped"] == 1
    for name in ("server", "a", "b", "c"):  # a client: its local model after each round
        assert (tmp_path / "nodes" / name / "latest").is_file()
    assert (tmp_path / "nodes" / "c" / "latest").read_text().strip() == "step-000001"
    assert (tmp_path / "nodes" / "server" / "step-000002" / "model" / "config.json").is_file()
    state = torch.load(
        tmp_path / "nodes" / "server" / "step-000002" / "trainer_state.pt", weights_only=True
    )["algorithm"]
    # pre-round baselines are measured each round, not kept: only the report counts are state
    assert state["baselines"] == {} and state["round"] == 2
    assert state["counts"] == {"a": 2, "b": 1, "c": 1}
    report = write_report(tmp_path)
    assert "server" in report.read_text() and (tmp_path / "accuracy.png").is_file()


def test_resume_reproduces_the_uninterrupted_run(tmp_path: Path) -> None:
    """Run A: 3 rounds, a checkpoint every round. Run B: the same config stopped after round 1
    (train.steps 1), then resumed to 3. Same global weights, same baselines, same rows (but
    timings), each row once: baselines live in the server checkpoint, every client draw is keyed
    by (client, round), client sampling by (seed, round)."""
    base = fgrpo_run_config(steps=3, clients_per_round=2)
    base["checkpoint"] = {"every": 1, "keep": 5}
    run_federated(RunConfig.model_validate(base), tmp_path / "a", engine=run_in_process)
    first = {**base, "train": {**base["train"], "steps": 1}}
    run_federated(RunConfig.model_validate(first), tmp_path / "b", engine=run_in_process)
    run_federated(
        RunConfig.model_validate(base), tmp_path / "b", engine=run_in_process, resume=True
    )
    wa, wb = _server_weights(tmp_path / "a"), _server_weights(tmp_path / "b")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    rows_a = [_stable(r) for r in _rows(tmp_path / "a")]
    rows_b = [_stable(r) for r in _rows(tmp_path / "b")]
    key = lambda r: (r["step"], r["node"])  # noqa: E731
    assert sorted(rows_a, key=key) == sorted(rows_b, key=key)
    assert len({key(r) for r in rows_b}) == len(rows_b) == 4 * 4


# ---- through Flower's simulation engine (Ray) ----------------------------------------------


@pytest.mark.slow
def test_flower_simulation_run(tmp_path: Path) -> None:
    """The real path of `ftis run`: Flower's simulation engine on Ray (2 CPUs, 1 per client),
    3 clients, 2 rounds, client b's round-1 delta has the wrong shape (rejected) and client c
    leaves at round 2 (testing.crash_at_step: a dropout)."""
    data = fgrpo_run_config(steps=2)
    data["testing"] = {"crash_at_step": {"c": 2}}
    cfg = RunConfig.model_validate(data)
    run_federated(cfg, tmp_path, faults=FaultPlan({("b", 1): "wrong-shape"}))
    rows = _rows(tmp_path)
    by = {(r["node"], r["step"]): r for r in rows}
    assert len(rows) == len(by) == 12
    evaluated = {k for k, r in by.items() if k[0] != "server" and "eval/accuracy" in r}
    assert evaluated == {(n, s) for n in "abc" for s in (0, 1, 2)} - {("c", 2)}  # c is gone
    assert by[("server", 1)]["server/rejected"] == 1 and by[("server", 2)]["server/dropped"] == 1
    assert by[("b", 1)]["fgrpo/rejected"] == 1 and by[("c", 2)]["fgrpo/dropped"] == 1
    assert by[("a", 1)]["fgrpo/accepted"] == 1 and by[("a", 1)]["exchange/bytes_sent"] > 0
    assert (
        json.loads((tmp_path / "nodes" / "server" / "step-000002" / "meta.json").read_text())[
            "node"
        ]
        == "server"
    )
    write_report(tmp_path)


def test_run_local_hands_fgrpo_to_its_launcher(tmp_path: Path, monkeypatch) -> None:
    import ftis.algos.fgrpo.launch as launch
    from ftis.launch import run_local

    calls = []
    monkeypatch.setattr(launch, "run_federated", lambda cfg, run_dir, **kw: calls.append(kw))
    run_local(RunConfig.model_validate(fgrpo_run_config()), tmp_path)
    assert calls == [{"console": None, "resume": False}]
