"""Lost client workers in Flower runs (issue 22, item 2). Flower 1.42's Ray backend puts the
actor of a message whose worker process died back into its pool as it is: without a restart
policy every later message routed to that dead actor fails, and its clients drop out of every
later round. ftis asks Ray to restart the worker (`max_restarts`), counts the loss
(`server/workers_lost`, the client's `<prefix>/worker_lost`) and says it in the summary; a
summary of "all clients" says how many it covers and compares the same clients before and
after."""

from __future__ import annotations

from pathlib import Path

import pytest

import ftis.algos.fgrpo  # noqa: F401  (telemetry off before anything imports flwr)

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Error, Message
from flwr.supercore.task_identity import TaskIdentity

from ftis.algos.federated.faults import FaultPlan, InjectedDropout
from ftis.algos.federated.strategy import worker_lost
from ftis.report import federated_lines, summarize, summary_table
from ftis.train.metrics import read_metrics

# The reason Flower's simulation puts in the error reply of a message whose actor died
# (vce_api.worker: str(type(ex)) + ":<'" + str(ex) + "'>").
DIED = "<class 'ray.exceptions.ActorDiedError'>:<'The actor died unexpectedly before finishing'>"
RAISED = "<class 'flwr.clientapp.ClientAppException'>:<'ActorDiedError mentioned by the client'>"


def test_worker_loss_is_told_from_a_client_failure() -> None:
    assert worker_lost(DIED)
    assert worker_lost("<class 'ray.exceptions.RayActorError'>:<'...'>")
    assert not worker_lost(RAISED)  # the client's own exception, whatever it says
    assert not worker_lost(None)


def test_kill_worker_in_the_test_process_is_a_dropout_not_a_kill() -> None:
    plan = FaultPlan({("a", 1): "kill-worker"})
    plan.before_round("a", 2)  # another round: nothing
    with pytest.raises(InjectedDropout):
        plan.before_round("a", 1)


def test_a_lost_worker_is_counted_in_the_rows(tmp_path: Path) -> None:
    """Round 1 of two clients: a's reply is good, b's says its worker died. b is dropped and
    its loss counted once, in its row and the server's."""
    from tests.test_fgrpo_flower import _reply, _strategy

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 0, 1
    strategy = _strategy(tmp_path, ["a", "b"])
    msgs = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid=None))
    replies = []
    for msg in msgs:
        name = strategy.name_of[msg.metadata.dst_node_id]
        if name == "a":
            replies.append(_reply(msg, "a", "ok", 1.0))
        else:
            replies.append(Message(Error(code=0, reason=DIED), reply_to=msg))
    _, summary = strategy.aggregate_train(1, replies)
    assert summary["dropped"] == 1 and summary["accepted"] == 1
    strategy.aggregate_evaluate(1, [])
    for lg in strategy.loggers.values():
        lg.close()
    rows = {r["node"]: r for r in read_metrics(tmp_path / "metrics.jsonl")}
    assert rows["server"]["server/workers_lost"] == 1
    assert rows["server"]["server/workers_lost_total"] == 1
    assert rows["b"]["fgrpo/worker_lost"] == 1 and rows["b"]["fgrpo/dropped"] == 1
    assert "fgrpo/worker_lost" not in rows["a"]
    assert federated_lines(list(rows.values()))[0].endswith(
        "1 client workers lost (each restarted for the next round)."
    )


def test_before_and_after_compare_the_same_clients() -> None:
    """Step 0: a 10% (16 problems), b 30% (16), c 60% (32): the server's union is
    (1.6 + 4.8 + 19.2) / 64 = 40%. At step 2 only a (20%) and c (70%) evaluated: the server's
    union over them is (3.2 + 22.4) / 48 = 53.3%. Compared on a and c alike: before
    (1.6 + 19.2) / 48 = 43.3%, after 53.3%, "2 of 3 clients"."""
    rows = [
        {"node": "a", "step": 0, "eval/test/accuracy": 0.1, "eval/size": 16},
        {"node": "b", "step": 0, "eval/test/accuracy": 0.3, "eval/size": 16},
        {"node": "c", "step": 0, "eval/test/accuracy": 0.6, "eval/size": 32},
        {"node": "server", "step": 0, "eval/test/accuracy": 0.4, "eval/clients": 3},
        {"node": "a", "step": 2, "eval/test/accuracy": 0.2, "eval/size": 16},
        {"node": "b", "step": 2},
        {"node": "c", "step": 2, "eval/test/accuracy": 0.7, "eval/size": 32},
        {"node": "server", "step": 2, "eval/test/accuracy": 25.6 / 48, "eval/clients": 2},
    ]
    server = {s["node"]: s for s in summarize(rows)}["server"]
    assert server["test_before"] == pytest.approx(20.8 / 48, abs=1e-12)
    assert server["test_after"] == pytest.approx(25.6 / 48, abs=1e-12)
    assert server["test_clients"] == (2, 3)
    _, body = summary_table(rows)
    cell = next(line for line in body if line[0] == "server")[1]
    assert cell == "43.3% -> 53.3% (the 2 of 3 clients evaluated at both)"
    # every client at both ends: the server's own figures, unchanged
    full = [r for r in rows if (r["node"], r["step"]) != ("b", 2)] + [
        {"node": "b", "step": 2, "eval/test/accuracy": 0.3, "eval/size": 16}
    ]
    server = {s["node"]: s for s in summarize(full)}["server"]
    assert server["test_before"] == 0.4 and "test_clients" not in server


# ---- through Flower's simulation engine (Ray) ----------------------------------------------


@pytest.mark.long
@pytest.mark.chaos_case("FGRPO", "kill one client worker (SIGKILL)")
def test_a_killed_client_worker_is_restarted_for_the_next_round(tmp_path: Path) -> None:
    """Two clients, two rounds, Ray's two workers: the worker running b's round 1 is killed
    (SIGKILL). b is dropped from round 1 only, the loss counted; in round 2 both clients train
    and are aggregated and both evaluate (without the restart b dropped out of every later
    round)."""
    from ftis.algos.fgrpo.launch import run_federated
    from ftis.config import RunConfig
    from tests.test_stop_protocol import _fgrpo

    cfg = RunConfig.model_validate(_fgrpo(steps=2))
    run_federated(cfg, tmp_path, faults=FaultPlan({("b", 1): "kill-worker"}))
    by = {(r["node"], r["step"]): r for r in read_metrics(tmp_path / "metrics.jsonl")}
    s1, s2 = by[("server", 1)], by[("server", 2)]
    assert (s1["server/accepted"], s1["server/dropped"], s1["server/workers_lost"]) == (1, 1, 1)
    assert (s2["server/accepted"], s2["server/dropped"], s2["server/workers_lost"]) == (2, 0, 0)
    assert s2["server/workers_lost_total"] == 1 and s2["eval/clients"] == 2
    assert by[("b", 1)]["fgrpo/worker_lost"] == 1 and by[("b", 2)]["fgrpo/accepted"] == 1
    assert "1 client workers lost" in federated_lines(list(by.values()))[0]
