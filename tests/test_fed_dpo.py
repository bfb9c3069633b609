"""FedDPO (docs/dpo.md, "FedDPO"): the server's aggregation and staleness buffer by hand (pure
torch), client sampling and reply rejection on crafted Flower messages, and whole runs through
the in-process engine (the same ServerApp, strategy and ClientApp as `ftis run`, messages
delivered in this process): lost clients, exact resume, the centralized baseline. One run goes
through `ftis run` and Flower's simulation engine (Ray)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml

import ftis.algos.federated  # noqa: F401  (telemetry off before anything imports flwr)
from ftis.algos.dpo.fed_server import DPOReport, FedDPOServer
from ftis.config import ConfigError, RunConfig, load_config
from ftis.train.metrics import MetricLogger, read_metrics
from tests.test_dpo import tiny_dpo_config

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from ftis.algos.dpo.fed import make_server, run_fed_dpo
from ftis.algos.dpo.fed_strategy import FedDPOStrategy
from ftis.algos.federated.faults import FaultPlan, corrupt
from ftis.algos.federated.inprocess import run_in_process
from ftis.algos.federated.records import array_record, metric_record

VOLATILE = ("time/", "train/elapsed_seconds", "train/local_seconds", "server/round_seconds")
VOLATILE = (*VOLATILE, "memory/")


def fed_dpo_config(names=("a", "b", "c"), steps: int = 2, **algorithm) -> dict:
    """A FedDPO run that finishes in seconds: llama-xs, 2-digit reasoning pairs, tiny data."""
    data = tiny_dpo_config(steps=steps, kind="fed-dpo", **algorithm)
    data["algorithm"]["data"].update(train_pairs=8, eval_pairs=4)
    data["algorithm"]["data"]["corruptions"] = {"answer": 1.0, "carry": 1.0}  # no greedy pass
    data["eval"] = {"every": 0, "size": 4, "pass_samples": 0}
    data["train"]["max_new_tokens"] = 16
    data["nodes"] = [{**data["nodes"][0], "name": n} for n in names]
    return data


def _params(value: float = 0.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 3), value), "b": torch.full((3,), value)}


def _report(name: str, value: float, n: int = 8, start: int = 0) -> DPOReport:
    return DPOReport(name, _params(value), n, start)


# ---- aggregation and the staleness buffer, by hand ------------------------------------------


def test_uniform_and_data_size_weights_by_hand() -> None:
    """theta = 0; a returns delta 1 (8 pairs), b delta 4 (24 pairs). Uniform: (1 + 4) / 2 = 2.5;
    data-size: (8 * 1 + 24 * 4) / 32 = 3.25. Reports arrive in any order."""
    uni = FedDPOServer(_params(0.0), weighting="uniform")
    out = uni.aggregate([_report("b", 4.0, 24), _report("a", 1.0, 8)])
    assert out.weights == {"a": 0.5, "b": 0.5}
    assert torch.equal(uni.params["w"], torch.full((2, 3), 2.5)) and uni.version == 1
    size = FedDPOServer(_params(0.0), weighting="data-size")
    out = size.aggregate([_report("a", 1.0, 8), _report("b", 4.0, 24)])
    assert out.weights == {"a": 0.25, "b": 0.75}
    assert torch.equal(size.params["b"], torch.full((3,), 3.25))
    assert out.update_norm == pytest.approx(3.25 * 9**0.5)
    # no accepted report: theta stays, the version moves on
    assert not size.aggregate([]).weights and size.version == 2
    assert torch.equal(size.params["b"], torch.full((3,), 3.25))


def test_stale_updates_average_models_or_apply_deltas() -> None:
    """q_max 1. Round 1 from theta^0 = 0: a returns +2 -> theta^1 = 2. Round 2: a is current
    (delta +1 from theta^1), b is one round stale (delta +1 from theta^0 = 0). average:
    ((2 + 1) + (0 + 1)) / 2 = 2; delta: 2 + (1 + 1) / 2 = 3."""
    for update, want in (("average", 2.0), ("delta", 3.0)):
        s = FedDPOServer(_params(0.0), max_staleness=1, server_update=update)
        s.aggregate([_report("a", 2.0, start=0)])
        s.aggregate([_report("a", 1.0, start=1), _report("b", 1.0, start=0)])
        assert torch.equal(s.params["w"], torch.full((2, 3), want)), update


def test_age_delays_by_hand() -> None:
    """q_max 2, rule age (the default). A client starts from the model made by its last round
    (theta^0 if none), at most q_max old: a in every round -> 0 every round; b only in rounds 1
    and 4 -> sat out 2 rounds -> 2; c first in round 3 -> theta^0, two rounds old -> 2. With q_max
    1 the same plan caps b and c at 1 (never reset to 0)."""
    plan = {1: ["a", "b"], 2: ["a"], 3: ["a", "c"], 4: ["a", "b"]}
    for q, want in ((2, {"b4": 2, "c3": 2}), (1, {"b4": 1, "c3": 1})):
        s = FedDPOServer(_params(), max_staleness=q)
        got = {}
        for r, names in plan.items():
            for name, a in s.assign(r, names).items():
                got[(name, r)] = a.staleness
                assert a.version == r - 1 - a.staleness
            s.aggregate([])
        assert got == {
            ("a", 1): 0,
            ("b", 1): 0,
            ("a", 2): 0,
            ("a", 3): 0,
            ("c", 3): want["c3"],
            ("a", 4): 0,
            ("b", 4): want["b4"],
        }


def _plus_one_run(q_max: int, rule: str, plan: dict[int, list[str]]) -> float:
    """Every sampled client returns +1 from the model it was sent; average update."""
    s = FedDPOServer(_params(0.0), max_staleness=q_max, staleness=rule)
    for r, names in plan.items():
        starts = s.assign(r, names)
        s.aggregate([_report(n, 1.0, start=a.version) for n, a in starts.items()])
    return float(s.params["w"][0, 0])


def test_age_rule_progresses_every_round_and_q_max_matters() -> None:
    """Full participation, 8 rounds of +1: the age rule serves the latest model -> 8.0 for
    every q_max; the authors' rule serves every client the model two versions back from round
    2 on -> two chains (1, 1, 2, 2, 3, 3, 4, 4) -> 4.0, the same for q_max 1, 2 and 5.
    Partial participation (a every round, b in rounds 1 and 4), +1 each, average update: a's
    chain is 1, 2, 3, then in round 4 a makes 3 + 1 = 4 and b, two rounds away, starts from
    theta^(3 - min(2, q)): q 1 -> theta^2 = 2 -> 3, mean 3.5; q 2 (or 5) -> theta^1 = 1 -> 2,
    mean 3.0."""
    full = {r: ["a", "b"] for r in range(1, 9)}
    for q in (1, 2, 5):
        assert _plus_one_run(q, "age", full) == 8.0
        assert _plus_one_run(q, "last-participation", full) == 4.0
    partial = {1: ["a", "b"], 2: ["a"], 3: ["a"], 4: ["a", "b"]}
    assert _plus_one_run(1, "age", partial) == 3.5
    assert _plus_one_run(2, "age", partial) == 3.0
    assert _plus_one_run(5, "age", partial) == 3.0
    with pytest.raises(ValueError, match="staleness rule"):
        FedDPOServer(_params(), staleness="oldest")  # type: ignore[arg-type]


def test_last_participation_delays_by_hand() -> None:
    """q_max 2, rule last-participation (the authors' code). A client starts from the global
    model current at its last round (theta^0 if none): a in every round -> delay 0, then 1 from
    round 2 on; b only in rounds 1 and 4 -> delay 3 > q_max in round 4: refreshed (0); c first in
    round 3 -> 2."""
    s = FedDPOServer(_params(), max_staleness=2, staleness="last-participation")
    plan = {1: ["a", "b"], 2: ["a"], 3: ["a", "c"], 4: ["a", "b"]}
    got = {}
    for r, names in plan.items():
        for name, a in s.assign(r, names).items():
            got[(name, r)] = a.staleness
            assert a.version == r - 1 - a.staleness
        s.aggregate([])
    assert got == {
        ("a", 1): 0,
        ("b", 1): 0,
        ("a", 2): 1,
        ("a", 3): 1,
        ("c", 3): 2,
        ("a", 4): 1,
        ("b", 4): 0,
    }


@pytest.mark.parametrize("rule", ["age", "last-participation", "random"])
@pytest.mark.parametrize("q_max", [1, 3])
def test_the_buffer_never_serves_a_model_older_than_q_max(rule: str, q_max: int) -> None:
    """40 rounds of random partial participation: every delay is what the rule says, computed
    here from the participation history alone (age: min(rounds sat out, q_max); the authors':
    1 + rounds sat out, 0 past q_max; random: within [0, min(q_max, r - 1)]); the model served is
    the global model of that version (each version's theta is its round number here), the buffer
    never holds more than q_max + 1 models, and an older version cannot be served at all."""
    rng = random.Random(0)
    names = [f"c{i}" for i in range(5)]
    s = FedDPOServer(_params(), max_staleness=q_max, staleness=rule, seed=3)
    last_round: dict[str, int] = {}  # the last round each client took part in (0: never)
    delays = []
    for r in range(1, 41):
        sampled = rng.sample(names, rng.randint(1, 5))
        for name, a in s.assign(r, sampled).items():
            away = r - 1 - last_round.get(name, 0)  # rounds sat out (never: since round 0)
            if rule == "age":
                assert a.staleness == min(away, q_max)
            elif rule == "last-participation":
                seen = last_round[name] - 1 if name in last_round else 0
                d = (r - 1) - seen
                assert a.staleness == (d if d <= q_max else 0)
            else:
                assert 0 <= a.staleness <= min(q_max, r - 1)
            assert a.version == r - 1 - a.staleness
            assert float(s.model(a.version)["w"][0, 0]) == a.version
            delays.append(a.staleness)
            last_round[name] = r
        s.aggregate([])
        s.params = {k: torch.full_like(v, float(s.version)) for k, v in s.params.items()}
        s.history[s.version] = s.params
        assert len(s.history) <= q_max + 1
        assert min(s.history) >= s.version - q_max
    assert max(delays) == q_max  # the bound is reached, never passed
    with pytest.raises(ValueError, match="not in the buffer"):
        s.model(s.version - q_max - 1)


def test_q_max_zero_is_plain_fedavg() -> None:
    """With q_max 0 every client starts from the current model, and theta^r is the weighted
    mean of the clients' returned models (FedAvg), round after round."""
    g = torch.Generator().manual_seed(0)
    s = FedDPOServer(_params(0.5), max_staleness=0, weighting="data-size")
    theta = _params(0.5)
    for r in range(1, 6):
        assigned = s.assign(r, ["a", "b", "c"])
        assert {a.staleness for a in assigned.values()} == {0}
        models, sizes, reports = [], [], []
        for i, name in enumerate(("a", "b", "c")):
            start = s.model(assigned[name].version)
            assert all(torch.equal(start[k], theta[k]) for k in theta)
            local = {k: v + torch.randn(v.shape, generator=g) for k, v in start.items()}
            models.append(local)
            sizes.append(4 * (i + 1))
            delta = {k: local[k] - start[k] for k in local}
            reports.append(DPOReport(name, delta, sizes[-1], assigned[name].version))
        s.aggregate(reports)
        theta = {k: sum(n * m[k] for n, m in zip(sizes, models)) / sum(sizes) for k in theta}
        assert all(torch.allclose(s.params[k], theta[k], atol=1e-6) for k in theta)
        theta = s.params


def test_server_state_round_trips() -> None:
    s = FedDPOServer(_params(0.0), max_staleness=2, staleness="random", seed=1)
    for r in range(1, 5):
        s.assign(r, ["a", "b"])
        s.aggregate([_report("a", float(r), start=r - 1)])
    s.lost.add("b")
    t = FedDPOServer(s.params, max_staleness=2, staleness="random", seed=1)
    t.load_state_dict(s.state_dict())
    assert t.version == 4 and sorted(t.history) == [2, 3, 4] and t.lost == {"b"}
    assert all(torch.equal(t.model(v)["w"], s.model(v)["w"]) for v in (2, 3, 4))
    assert t.last_seen == s.last_seen and [t.delay(n, 5) for n in "ab"] == [
        s.delay(n, 5) for n in "ab"
    ]


# ---- config ----------------------------------------------------------------------------------


def test_the_shipped_config_reads_and_errors_name_the_field(tmp_path: Path) -> None:
    cfg = load_config("configs/fed-dpo.yaml")
    assert cfg.algorithm.kind == "fed-dpo" and len(cfg.nodes) == 4
    assert cfg.rank_names[-1] == "server"
    for change, match in (
        ({"clients_per_round": 4}, "clients_per_round=4 exceeds the 3 clients"),
        ({"centralized": True, "max_staleness": 1}, "centralized trains one model"),
        ({"staleness": "sometimes"}, "staleness"),
        ({"weighting": "reward"}, "weighting"),
    ):
        data = fed_dpo_config()
        data["algorithm"].update(change)
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(ConfigError, match=match):
            load_config(path)
    data = fed_dpo_config()
    data["nodes"][1]["optim"] = {"lr": 0.1}  # an own optimizer is fine ...
    RunConfig.model_validate(data)
    data["nodes"][1]["model"] = {"preset": "llama-s"}  # ... an own model is not
    with pytest.raises(ValueError, match="one shared model"):
        RunConfig.model_validate(data)


# ---- the strategy on crafted replies -----------------------------------------------------------

BEHAVIOURS = {
    "ok1": "ok",
    "ok2": "ok",
    "nan": "nan-delta",
    "shape": "wrong-shape",
    "name": "wrong-name",
    "int": "int-delta",
    "count": "bad-count",
    "imposter": "imposter",
    "err": "error",
    "silent": "silent",
}


def _strategy(tmp_path: Path, names: list[str], **algorithm) -> FedDPOStrategy:
    cfg = RunConfig.model_validate(fed_dpo_config(names, **algorithm))
    loggers = {n: MetricLogger(tmp_path, n) for n in [*names, "server"]}
    strategy = FedDPOStrategy(
        cfg=cfg,
        server=make_server(_params(0.0), cfg.algorithm, cfg.train.seed),
        loggers=loggers,
        checkpoint=lambda r, state: None,
    )
    strategy.node_of = {n: 100 + i for i, n in enumerate(names)}
    strategy.name_of = {v: k for k, v in strategy.node_of.items()}
    return strategy


def _reply(msg: Message, name: str, behaviour: str, value: float) -> Message | None:
    if behaviour == "silent":
        return None
    if behaviour == "error":
        return Message(Error(code=2, reason="ClientAppException: boom"), reply_to=msg)
    arrays = {k: v.numpy() for k, v in _params(value).items()}
    metrics = {"num-examples": 8, "loss/dpo": 0.5}
    if behaviour not in ("ok", "imposter"):
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


@pytest.mark.chaos_case("FedDPO", "malformed replies")
def test_bad_replies_are_rejected_and_counted(tmp_path: Path) -> None:
    """Of ten clients two send good deltas (1 and 3): theta becomes exactly their mean, 2.
    NaN, wrongly shaped, wrongly named and integer arrays, a negative pair count and a reply
    claiming another client's name are rejected (6); an error reply and a missing one are
    dropouts (2), and those two clients count as lost."""
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 0, 1
    names = list(BEHAVIOURS)
    strategy = _strategy(tmp_path, names)
    msgs = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid=None))
    assert len(msgs) == len(names)
    assert all(m.content["config"]["staleness"] == 0 for m in msgs)
    replies = []
    for msg in msgs:
        name = strategy.name_of[msg.metadata.dst_node_id]
        reply = _reply(msg, name, BEHAVIOURS[name], 3.0 if name == "ok2" else 1.0)
        if reply is not None:
            replies.append(reply)
    theta, summary = strategy.aggregate_train(1, replies)
    assert summary == MetricRecord({"accepted": 2, "rejected": 6, "dropped": 2})
    assert torch.equal(strategy.server.params["w"], torch.full((2, 3), 2.0))
    assert set(theta.keys()) == {"w", "b"}
    strategy.aggregate_evaluate(1, [])  # the end of round 1: rows are written
    for lg in strategy.loggers.values():
        lg.close()
    rows = {r["node"]: r for r in read_metrics(tmp_path / "metrics.jsonl")}
    server = rows["server"]
    assert (server["fed/participants"], server["fed/rejected"], server["fed/dropped"]) == (2, 6, 2)
    assert server["fed/rejected_total"] == 6 and server["fed/lost_clients"] == 2
    assert server["fed/staleness_mean"] == 0 and server["fed/weight/ok1"] == 0.5
    for name, behaviour in BEHAVIOURS.items():
        row = rows[name]
        assert row["fed/participated"] == 1.0 and row["fed/staleness"] == 0.0
        assert row["fed/accepted"] == (behaviour == "ok")
        assert row["fed/dropped"] == (behaviour in ("error", "silent"))
        assert row["fed/rejected"] == (behaviour not in ("ok", "error", "silent"))
    assert rows["ok1"]["loss/dpo"] == 0.5 and rows["ok1"]["train/num_pairs"] == 8


def test_client_sampling_is_seeded_and_takes_s_clients(tmp_path: Path) -> None:
    names = [f"c{i}" for i in range(6)]
    strategy = _strategy(tmp_path, names, clients_per_round=2)
    rounds = [strategy.sample_clients(r) for r in range(1, 11)]
    assert all(len(s) == 2 and len(set(s)) == 2 for s in rounds)
    assert len({tuple(s) for s in rounds}) > 1  # not the same pair every round
    again = _strategy(tmp_path / "again", names, clients_per_round=2)
    assert rounds == [again.sample_clients(r) for r in range(1, 11)]  # seeded by (seed, round)
    every = _strategy(tmp_path / "all", names)
    assert every.sample_clients(1) == names  # 0 = all


@pytest.mark.parametrize(
    ("rule", "delay", "final"),
    [("last-participation", 1, 1.0), ("age", 0, 2.0)],
)
def test_stale_clients_are_sent_old_models(tmp_path: Path, rule: str, delay: int, final) -> None:
    """q_max 1, full participation. The authors' rule: round 2's clients start from theta^0
    (one round old) -> round 1: 0 + 1 = 1, round 2: the average of theta^0 + 1, twice = 1. The
    age rule: from theta^1 (delay 0) -> 2. The message carries that model and its delay."""
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 0, 1
    strategy = _strategy(tmp_path, ["a", "b"], max_staleness=1, staleness=rule)
    for r in (1, 2):
        msgs = list(strategy.configure_train(r, ArrayRecord(), ConfigRecord(), grid=None))
        replies = [_reply(m, strategy.name_of[m.metadata.dst_node_id], "ok", 1.0) for m in msgs]
        if r == 2:
            for m in msgs:
                assert m.content["config"]["staleness"] == delay
                assert m.content["config"]["start-version"] == 1 - delay
                assert float(m.content["arrays"]["w"].numpy().max()) == 1.0 - delay
        strategy.aggregate_train(r, replies)
        strategy.aggregate_evaluate(r, [])
    assert torch.equal(strategy.server.params["w"], torch.full((2, 3), final))


# ---- whole runs, in process --------------------------------------------------------------------


def _stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def _server_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    latest = (run_dir / "nodes" / "server" / "latest").read_text().strip()
    return load_file(str(run_dir / "nodes" / "server" / latest / "model" / "model.safetensors"))


@pytest.mark.chaos_case("FedDPO", "lost client, NaN delta")
def test_a_run_with_a_lost_and_a_faulty_client_finishes(tmp_path: Path) -> None:
    """3 clients, 2 rounds: b's round-1 delta holds a NaN (rejected), c is gone from round 2
    (testing.crash_at_step: its train and eval messages fail). a and b finish; every row is
    written, the server's counts say what happened, the report has the DPO section."""
    from ftis.report import write_report

    data = fed_dpo_config(steps=2)
    data["testing"] = {"crash_at_step": {"c": 2}}
    data["eval"]["every"] = 1
    run_fed_dpo(
        RunConfig.model_validate(data),
        tmp_path,
        engine=run_in_process,
        faults=FaultPlan({("b", 1): "nan-delta"}),
    )
    rows = read_metrics(tmp_path / "metrics.jsonl")
    by = {(r["node"], r["step"]): r for r in rows}
    assert len(rows) == len(by) == 4 * 3
    evaluated = {k for k, r in by.items() if "eval/preference_accuracy" in r and k[0] != "server"}
    assert evaluated == {(n, s) for n in "abc" for s in (0, 1, 2)} - {("c", 2)}
    for name in "ab":  # greedy accuracy on 4 test problems, preference accuracy on 4 pairs
        assert (4 * by[(name, 2)]["eval/accuracy"]).is_integer()
        assert (4 * by[(name, 2)]["eval/preference_accuracy"]).is_integer()
    s1, s2 = by[("server", 1)], by[("server", 2)]
    assert (s1["fed/participants"], s1["fed/rejected"], s1["fed/dropped"]) == (2, 1, 0)
    assert (s2["fed/participants"], s2["fed/rejected"], s2["fed/dropped"]) == (2, 0, 1)
    assert s2["fed/lost_clients"] == 1 and s2["fed/rejected_total"] == 1
    assert by[("b", 1)]["fed/rejected"] == 1 and by[("c", 2)]["fed/dropped"] == 1
    assert by[("a", 1)]["loss/dpo"] > 0 and by[("a", 1)]["train/num_pairs"] == 8
    assert s2["eval/clients"] == 2  # the union over the clients that evaluated
    assert (tmp_path / "nodes" / "c" / "latest").read_text().strip() == "step-000001"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))  # `ftis run` writes it
    report = write_report(tmp_path).read_text()
    assert "## DPO" in report and "| a |" in report


def test_resume_reproduces_the_uninterrupted_run(tmp_path: Path) -> None:
    """Partial participation (S = 2 of 3) with stale clients (q_max 1, random delays): run A
    goes 3 rounds; run B stops after round 1 and resumes to 3. Same global weights, same rows
    (but timings), each row once: the buffer, who saw what and the counts live in the server
    checkpoint, every draw is keyed by (seed, client, round)."""
    base = fed_dpo_config(steps=3, clients_per_round=2, max_staleness=1, staleness="random")
    base["checkpoint"] = {"every": 1, "keep": 5}
    base["eval"]["every"] = 1  # run B's round 1 is its last: evaluated
    run_fed_dpo(RunConfig.model_validate(base), tmp_path / "a", engine=run_in_process)
    first = {**base, "train": {**base["train"], "steps": 1}}
    run_fed_dpo(RunConfig.model_validate(first), tmp_path / "b", engine=run_in_process)
    run_fed_dpo(RunConfig.model_validate(base), tmp_path / "b", engine=run_in_process, resume=True)
    wa, wb = _server_weights(tmp_path / "a"), _server_weights(tmp_path / "b")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    rows_a = [_stable(r) for r in read_metrics(tmp_path / "a" / "metrics.jsonl")]
    rows_b = [_stable(r) for r in read_metrics(tmp_path / "b" / "metrics.jsonl")]
    key = lambda r: (r["step"], r["node"])  # noqa: E731
    assert sorted(rows_a, key=key) == sorted(rows_b, key=key)
    assert len({key(r) for r in rows_b}) == len(rows_b) == 4 * 4
    servers = [r for r in rows_a if r["node"] == "server" and r["step"] > 0]
    assert all(r["fed/sampled"] == 2 for r in servers)
    assert any(r["fed/staleness_max"] == 1 for r in servers[1:])  # some client was stale


def test_centralized_baseline_trains_on_the_union_and_resumes(tmp_path: Path) -> None:
    """`centralized: true`: one model on the union of the three clients' 8 pairs each (24),
    batches of 3 x 4 pairs; every evaluation scores each client's own held-out pairs under its
    name. Stopped after round 1 and resumed, it matches the uninterrupted run."""
    base = fed_dpo_config(steps=2, centralized=True)
    base["checkpoint"] = {"every": 1, "keep": 5}
    base["eval"]["every"] = 1
    run_fed_dpo(RunConfig.model_validate(base), tmp_path / "a")
    rows = read_metrics(tmp_path / "a" / "metrics.jsonl")
    by = {(r["node"], r["step"]): r for r in rows}
    assert {k for k in by if k[0] != "server"} == {(n, s) for n in "abc" for s in (0, 1, 2)}
    assert all("eval/preference_accuracy" in by[(n, 2)] for n in "abc")
    assert by[("server", 1)]["train/num_pairs"] == 24 and by[("server", 1)]["loss/dpo"] > 0
    assert by[("server", 2)]["fed/centralized"] == 1
    first = {**base, "train": {**base["train"], "steps": 1}}
    run_fed_dpo(RunConfig.model_validate(first), tmp_path / "b")
    run_fed_dpo(RunConfig.model_validate(base), tmp_path / "b", resume=True)
    rows_b = read_metrics(tmp_path / "b" / "metrics.jsonl")
    key = lambda r: (r["step"], r["node"])  # noqa: E731
    assert sorted(map(_stable, rows), key=key) == sorted(map(_stable, rows_b), key=key)


# ---- through `ftis run` and Flower's simulation engine (Ray) ----------------------------------


@pytest.mark.slow
@pytest.mark.long
def test_ftis_run_through_flower_simulation(tmp_path: Path) -> None:
    """The real path: `ftis run` hands the config to FedDPO's launcher, Flower's simulation
    engine on Ray runs two clients for two rounds; the standard run directory comes out."""
    from typer.testing import CliRunner

    from ftis.cli import app

    data = fed_dpo_config(names=("a", "b"), steps=2)
    path = tmp_path / "fed.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", str(path), "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert {(r["node"], r["step"]) for r in rows} == {
        (n, s) for n in ("a", "b", "server") for s in (0, 1, 2)
    }
    assert (out / "config.yaml").is_file() and (out / "report.md").is_file()
    assert (out / "nodes" / "server" / "latest").is_file()
    assert "## DPO" in (out / "report.md").read_text()
