"""Swarm: the transport's contract on an in-process board, peers that leave and join late while
the others train, bad payloads rejected and counted, and a round trip over a real hivemind DHT
on loopback."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from ftis.exchange.codec import RolloutCodec
from ftis.exchange.swarm import MemoryBoard, SwarmSettings, SwarmTransport, pack
from ftis.rollout.types import RolloutBatch
from tests.conftest import tiny_run_config


def _transport(board: MemoryBoard, peer: int, **kw) -> SwarmTransport:
    settings = SwarmSettings(**{"deadline_s": 5.0, "member_ttl_s": 5.0, "poll_s": 0.02, **kw})
    return SwarmTransport(board.view(), peer_id=peer, max_peers=8, settings=settings)


def _in_threads(fns):
    out, threads = {}, []
    for k, fn in fns.items():
        threads.append(threading.Thread(target=lambda k=k, fn=fn: out.__setitem__(k, fn())))
        threads[-1].start()
    for t in threads:
        t.join(900)  # a liveness bound only: a loaded machine is slow
    return out


# ---- the transport on an in-process board ------------------------------------------------------


def test_three_peers_trade_their_payloads():
    board = MemoryBoard()
    ts = [_transport(board, p) for p in range(3)]
    for t in ts:
        t.ready()
    got = _in_threads(
        {p: (lambda p=p: ts[p].exchange(1, bytes([p]) * 10, max_bytes=100)) for p in range(3)}
    )
    for p in range(3):
        assert got[p] == {q: bytes([q]) * 10 for q in range(3) if q != p}
        assert ts[p].last.members == 2 and not ts[p].last.timed_out
        assert ts[p].stats.bytes_sent == 10 and ts[p].stats.bytes_received == 20


def test_a_peer_that_left_is_not_waited_for():
    board = MemoryBoard()
    a, b = _transport(board, 0, deadline_s=10.0), _transport(board, 1)
    a.ready(), b.ready()
    b.close()  # says goodbye
    t0 = time.perf_counter()
    assert a.exchange(1, b"x", max_bytes=10) == {}
    assert time.perf_counter() - t0 < 2.0
    assert a.last.members == 0


def test_a_crashed_peer_is_waited_for_until_its_heartbeat_expires():
    board = MemoryBoard()
    a = _transport(board, 0, deadline_s=10.0)
    b = _transport(board, 1, member_ttl_s=0.5)
    a.ready(), b.ready()  # b then vanishes without a word
    t0 = time.perf_counter()
    assert a.exchange(1, b"x", max_bytes=10) == {}
    assert 0.3 < time.perf_counter() - t0 < 3.0  # not the 10 s deadline


def test_a_slow_live_peer_is_waited_for_until_the_deadline():
    board = MemoryBoard()
    a, b = _transport(board, 0, deadline_s=0.5), _transport(board, 1, deadline_s=0.5)
    a.ready(), b.ready()
    # round 1: both publish; each is a member for the other from then on (issue 37: a peer
    # is waited for to the deadline only once a payload of it has arrived)
    _in_threads({p: (lambda t=t: t.exchange(1, b"1", max_bytes=10)) for p, t in enumerate((a, b))})
    assert a.exchange(2, b"x", max_bytes=10) == {}
    assert a.last.timed_out and a.last.members == 1
    # b publishes round 2 after a left it: counted as late at a's next round
    b.exchange(2, b"y", max_bytes=10)
    a.exchange(3, b"x", max_bytes=10)
    assert a.last.late == 1


def test_a_peer_without_a_payload_yet_is_waited_for_a_short_grace_only():
    """Issue 37: a live heartbeat alone makes a candidate, not a member: a round waits for it
    `candidate_grace_s` at most, not `deadline_s`."""
    board = MemoryBoard()
    a = _transport(board, 0, deadline_s=10.0, candidate_grace_s=0.3)
    b = _transport(board, 1)
    a.ready(), b.ready()  # b never publishes
    t0 = time.perf_counter()
    assert a.exchange(1, b"x", max_bytes=10) == {}
    assert time.perf_counter() - t0 < 3.0 and not a.last.timed_out
    assert (a.last.members, a.last.candidates) == (0, 1)


def test_records_of_another_round_or_peer_are_dropped_and_counted():
    board = MemoryBoard()
    a = _transport(board, 0, deadline_s=0.3)
    key = a._round_key(5)
    exp = board.now() + 60
    board.publish(key, 1, pack(4, 1, b"old"), exp)  # a round-4 record under round 5
    board.publish(key, 2, pack(5, 3, b"who"), exp)  # peer 3's record under peer 2
    board.publish(key, 4, b"garbage", exp)  # no header
    board.publish(key, 99, pack(5, 99, b"x"), exp)  # not a peer id (max_peers = 8)
    board.publish(key, 5, pack(5, 5, b"ok"), exp)
    assert a.exchange(5, b"mine", max_bytes=10) == {5: b"ok"}
    assert a.last.stale == 4


def test_oversized_payloads_come_back_as_none_and_the_board_bounds_values():
    board = MemoryBoard(max_value_bytes=1000)
    a, b = _transport(board, 0, deadline_s=0.3), _transport(board, 1)
    b.exchange(1, b"y" * 50, max_bytes=100)
    assert a.exchange(1, b"x", max_bytes=10) == {1: None}
    assert a.stats.oversized == 1
    assert not board.publish("k", 1, b"z" * 2000, board.now() + 10)


def test_a_late_joiner_starts_at_the_swarms_current_round():
    board = MemoryBoard()
    a, b = _transport(board, 0), _transport(board, 1)
    a.ready()
    a._heartbeat("live", 7)  # a claims round 7, and no payload proves it (issue 37)
    assert b.join_step(0) == 0
    a.exchange(6, b"a6", max_bytes=10)  # a traded round 6 and is in round 7
    assert b.join_step(0) == 6  # b's first step is 7
    assert b.join_step(9) == 9  # its own checkpoint is newer: keep it
    a.close()
    assert b.join_step(0) == 0  # nobody live: start from scratch


@pytest.mark.chaos_case("swarm hivemind", "hostile heartbeat records")
def test_hostile_heartbeats_are_rejected_and_counted_not_fatal():
    """Issue 22: `["live", "abc"]` under the members key killed every peer (int("abc")), and
    `["live", 10**12]` made a late joiner join at round 10**12 and the others wait for it. Now
    each malformed or out-of-bounds record is dropped and counted once per round."""
    board = MemoryBoard()
    a, b = _transport(board, 0, deadline_s=0.5, max_round=50), _transport(board, 1)
    a.ready()
    a.exchange(6, b"a6", max_bytes=10)  # a traded round 6, and claims round 7
    exp = board.now() + 60
    hostile = {
        2: ["live", "abc"],
        3: ["live", 10**12],
        4: ["live", -1],
        5: {"live": 1},
        6: ["live", True],
        "x": ["live", 7],
        7: b"\x00" * 3,
    }
    for peer, value in hostile.items():
        board.publish("swarm:members", peer, value, exp)
    # b (no max_round): 10**12 is too far from the swarm's round (7, the lower median)
    assert b.members() == {0: 7} and b.rejected_records == len(hostile)
    assert b.join_step(0) == 6  # joins at round 7, not 10**12
    assert b.rejected_records == len(hostile)  # the same records are not counted twice
    b.exchange(7, b"b", max_bytes=10)
    out = a.exchange(7, b"a", max_bytes=10)
    # a did not wait for the forged peers 2-7: it got b's payload and was not timed out
    assert out == {1: b"b"} and not a.last.timed_out
    assert a.last.rejected == len(hostile) and a.rejected_records == len(hostile)
    # Once peers exchange, the rounds their payloads prove (and this peer's own) are the
    # reference: a well-formed claim more than max_round_skew (4) beyond it is refused
    # (for b: the lower median of a's round 6, proven, and its own 7)
    c = _transport(board, 3)
    c._heartbeat("live", 6 + 5)
    assert 3 not in b.members()
    c._heartbeat("live", 6 + 4)
    assert b.members()[3] == 10
    # beyond the run's last round + 1 (max_round=50): no honest peer can be there
    c._heartbeat("live", 52)
    a.settings.max_round_skew = b.settings.max_round_skew = 100
    assert 3 not in a.members() and b.members()[3] == 52


def test_the_initial_peers_wait_for_each_other_at_the_start_barrier():
    """An initial peer slow to start (model build, warm start, DHT start-up under load) is
    waited for before round 1, not taken for a late joiner."""
    board = MemoryBoard()
    a = _transport(board, 0, start_peers=frozenset({0, 1}), start_timeout_s=30.0)
    b = _transport(board, 1, start_peers=frozenset({0, 1}), start_timeout_s=30.0)

    def slow_b():
        time.sleep(0.8)  # still building its model
        return b.join_step(0)

    t0 = time.perf_counter()
    got = _in_threads({"a": lambda: a.join_step(0), "b": slow_b})
    assert got == {"a": 0, "b": 0}  # both start at round 1
    assert time.perf_counter() - t0 >= 0.7 and a.barrier_waited_s >= 0.7
    assert a.barrier_missing == [] and b.barrier_missing == []
    # while a waited it was a member at round 1 already, so b's round 1 waits for a
    assert b.members() == {0: 1}


def test_the_start_barrier_times_out_and_the_slow_peer_joins_late():
    board = MemoryBoard()
    a = _transport(board, 0, start_peers=frozenset({0, 1}), start_timeout_s=0.3)
    assert a.join_step(0) == 0
    assert a.barrier_missing == [1] and 0.25 < a.barrier_waited_s < 2.0
    a.ready()
    for r in range(1, 6):  # a trained alone up to round 5, and is in round 6
        a.exchange(r, b"a", max_bytes=10)
    b = _transport(board, 1, start_peers=frozenset({0, 1}), start_timeout_s=30.0)
    assert b.join_step(0) == 5  # a came: no wait; the swarm is ahead, b starts at round 6
    assert b.barrier_waited_s < 1.0


def test_the_start_barrier_stops_waiting_for_a_peer_announced_gone():
    from ftis.exchange.swarm import announce_left

    board = MemoryBoard()
    a = _transport(board, 0, start_peers=frozenset({0, 1}), start_timeout_s=60.0)
    # the launcher saw peer 1's process die during its start-up and said so for it
    threading.Timer(0.3, lambda: announce_left(board, "swarm", 1, ttl_s=60)).start()
    t0 = time.perf_counter()
    assert a.join_step(0) == 0
    assert 0.2 < time.perf_counter() - t0 < 5.0 and a.barrier_missing == []


def test_a_peer_started_ahead_of_its_join_round_waits_silent_until_the_swarm_is_there():
    """A late joiner is started early (a process's start-up takes several rounds of a small
    model) and waits, without a heartbeat, until the swarm finished its join round."""
    board = MemoryBoard()
    a = _transport(board, 0)
    a.ready()
    a.exchange(1, b"a", max_bytes=10)
    late = _transport(board, 1, join_round=3, start_timeout_s=60.0)
    got = {}
    waiter = threading.Thread(target=lambda: got.__setitem__("step", late.join_step(0)))
    waiter.start()
    time.sleep(0.4)
    assert waiter.is_alive()  # the swarm is in round 1: still waiting
    assert a.members() == {}  # silent: nobody waits for it
    a.exchange(2, b"a", max_bytes=10)
    a.exchange(3, b"a", max_bytes=10)
    assert waiter.is_alive()  # round 3 under way: not yet
    a._heartbeat("live", 4)  # a finished round 3 and is in round 4
    waiter.join(30)
    assert got == {"step": 3}  # it trains from round 4, as the schedule says
    assert late.join_waited_s >= 0.4


def test_a_join_wait_ends_when_everyone_left_or_nobody_came():
    board = MemoryBoard()
    a = _transport(board, 0)
    a.ready()
    a.close()  # the swarm finished before the joiner's round
    late = _transport(board, 1, join_round=5, start_timeout_s=60.0)
    t0 = time.perf_counter()
    assert late.join_step(0) == 0 and time.perf_counter() - t0 < 5.0
    lonely = _transport(MemoryBoard(), 1, join_round=5, start_timeout_s=0.3)
    assert lonely.join_step(0) == 0 and 0.25 < lonely.join_waited_s < 5.0


def test_resumed_initial_peers_start_together_at_the_newest_checkpoint():
    board = MemoryBoard()
    a = _transport(board, 0, start_peers=frozenset({0, 1}))
    b = _transport(board, 1, start_peers=frozenset({0, 1}))
    got = _in_threads({"a": lambda: a.join_step(8), "b": lambda: b.join_step(6)})
    assert got == {"a": 8, "b": 8}


def test_the_start_barrier_stops_waiting_on_a_stop():
    board = MemoryBoard()
    stop = {"now": False}
    a = SwarmTransport(
        board.view(),
        peer_id=0,
        max_peers=8,
        settings=SwarmSettings(poll_s=0.02, start_peers=frozenset({0, 1}), start_timeout_s=60),
        should_stop=lambda: stop["now"],
    )
    threading.Timer(0.2, lambda: stop.__setitem__("now", True)).start()
    t0 = time.perf_counter()
    assert a.join_step(0) == 0
    assert time.perf_counter() - t0 < 5.0


# ---- peers that train: leave, join late, bad payloads ------------------------------------------


def _swarm_cfg(steps: int, names: list[str], **algo):
    from ftis.config import RunConfig

    d = tiny_run_config(steps=steps)
    node = d["nodes"][0]
    d["nodes"] = [{**node, "name": n} for n in names]
    d["eval"] = {"every": 0, "size": 16}
    d["algorithm"] = {
        "kind": "swarm",
        "max_peers": 8,
        "deadline_s": 5.0,
        "member_ttl_s": 5.0,
        **algo,
    }
    return RunConfig.model_validate(d)


@pytest.fixture
def _serial_builds(monkeypatch):
    # Peers run as threads here (as processes under `ftis run`); transformers builds models
    # under a process-global init context, so builds must not overlap.
    import ftis.train.loop as loop

    lock, build = threading.Lock(), loop.build_node

    def locked(*a, **kw):
        with lock:
            return build(*a, **kw)

    monkeypatch.setattr(loop, "build_node", locked)


def _warm(cfg) -> None:
    from ftis.warmstart import warm_start

    n = cfg.nodes[0]
    warm_start(n.model, n.warm_start, cfg.task)  # once, before the threads share the cache


def _rows(run_dir: Path, node: str) -> list[dict]:
    from ftis.train.metrics import read_metrics

    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["node"] == node]


def _peer(
    cfg, rank, board, run_dir, *, leave_at=None, resume=False, start_peers=(), after_step=None
):
    """A peer in a thread. Deadlines are generous: peers leave politely here (nobody waits for
    a goodbye), so they only matter when the machine is loaded and a step is slow.
    after_step(step): called after each step's row (a test holds a peer there)."""
    from ftis.train.loop import StopFlag, train_node

    stop = StopFlag()
    t = SwarmTransport(
        board.view(),
        peer_id=rank,
        max_peers=8,
        settings=SwarmSettings(
            deadline_s=60.0,
            member_ttl_s=120.0,
            poll_s=0.02,
            start_peers=frozenset(start_peers),
            start_timeout_s=300.0,
        ),
        should_stop=stop,
    )

    def progress(event, **info):
        if leave_at is not None and event == "step" and info["step"] >= leave_at:
            stop.requested = True
        if after_step is not None and event == "step":
            after_step(info["step"])

    return lambda: train_node(
        cfg, rank=rank, run_dir=run_dir, transport=t, progress=progress, stop=stop, resume=resume
    )


@pytest.mark.slow
def test_a_peer_leaves_one_joins_late_and_rejoins_the_others_keep_training(
    tmp_path, _serial_builds
):
    cfg = _swarm_cfg(6, ["a", "b", "c"])
    _warm(cfg)
    board = MemoryBoard()
    out = {}

    def a_holds(step):
        # a waits after round 2 until c has joined and after round 4 until b has rejoined,
        # however slowly their threads build (a loaded machine), so the joins happen mid-run
        if step == 2:
            _wait_live(board, 2)
        if step == 4:
            _wait_live(board, 1)

    def late_c():
        while not any(r["step"] >= 2 for r in _rows_safe(tmp_path, "a")):
            time.sleep(0.05)
        out["c"] = _peer(cfg, 2, board, tmp_path)()

    def b_leaves_and_rejoins():
        out["b1"] = _peer(cfg, 1, board, tmp_path, leave_at=2, start_peers={0, 1})()
        while not any(r["step"] >= 4 for r in _rows_safe(tmp_path, "a")):
            time.sleep(0.05)
        out["b2"] = _peer(cfg, 1, board, tmp_path, resume=True)()

    _in_threads(
        {
            "a": lambda: out.__setitem__(
                "a", _peer(cfg, 0, board, tmp_path, start_peers={0, 1}, after_step=a_holds)()
            ),
            "b": b_leaves_and_rejoins,
            "c": late_c,
        }
    )
    assert out["a"].last_step == 6 and not out["a"].interrupted
    assert out["b1"].interrupted and out["b1"].last_step == 2
    assert out["b2"].last_step == 6 and out["c"].last_step == 6
    a, b, c = (_rows(tmp_path, n) for n in "abc")
    assert [r["step"] for r in a] == list(range(7))
    # c joined at the swarm's round (>= 2), evaluated before training there, trained to the end
    c_steps = [r["step"] for r in c]
    assert c_steps == [2, 3, 4, 5, 6] and "eval/accuracy" in c[0]
    # b resumed from its step-2 checkpoint and skipped to the swarm's current round (5)
    b_steps = [r["step"] for r in b]
    assert b_steps[:3] == [0, 1, 2] and b_steps[3] >= 5 and b_steps[-1] == 6
    # the late joiner trained on a's samples from its first round on (a was live and waited for)
    assert all(r["swarm/peers_used"] >= 1 for r in c[1:-1])
    # and a, once c was a member, took c's samples
    assert any(r["swarm/members"] >= 1 and r["swarm/peers_used"] >= 1 for r in a if r["step"] > 2)
    assert all(
        r["exchange/rejected"] == 0 for r in a + b + c if r["step"] > 0 and "exchange/rejected" in r
    )


def _wait_live(board: MemoryBoard, peer: int, timeout_s: float = 600.0) -> None:
    from ftis.exchange.store import Signer
    from ftis.exchange.swarm import open_heartbeat

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        v = board.read("swarm:members").get(peer)
        beat = open_heartbeat(Signer(None), "swarm:members", peer, v, board.now())
        if isinstance(beat, tuple) and beat[0] == "live":
            return
        time.sleep(0.02)
    raise AssertionError(f"peer {peer} never became live")


def _rows_safe(run_dir: Path, node: str) -> list[dict]:
    try:
        return _rows(run_dir, node)
    except (OSError, ValueError):
        return []


def _batch(prompts: list[int], generator: int) -> RolloutBatch:
    n, t = len(prompts), 3
    return RolloutBatch(
        prompt_index=torch.tensor(prompts, dtype=torch.long),
        generator=torch.full((n,), generator, dtype=torch.long),
        completion_ids=torch.full((n, t), 5, dtype=torch.long),
        lengths=torch.full((n,), t, dtype=torch.long),
        sampler_logprobs=torch.full((n, t), -1.0),
    )


@pytest.mark.chaos_case("swarm sim", "malformed, stale and out-of-round payloads")
@pytest.mark.slow
def test_malformed_stale_and_out_of_round_payloads_are_rejected_and_counted(
    tmp_path, _serial_builds
):
    cfg = _swarm_cfg(3, ["a", "bad"])
    _warm(cfg)
    board = MemoryBoard()
    bad = _transport(board, 1, deadline_s=5.0)
    codec = RolloutCodec(vocab_size=16, max_tokens=4)

    def adversary():
        while 0 not in bad.members():  # a has joined (its model is built)
            time.sleep(0.02)
        bad.ready()
        bad.exchange(1, b"\x00garbage", max_bytes=10**6)  # fails to decode
        bad.exchange(2, codec.encode(_batch([10**6, 10**6], 1)), max_bytes=10**6)  # no such prompt
        # round 3: a well-formed record of round 2 under round 3's key (stale)
        board.publish(bad._round_key(3), 1, pack(2, 1, b"old"), board.now() + 60)
        bad._heartbeat("live", 3)

    out = _in_threads({"a": _peer(cfg, 0, board, tmp_path), "bad": adversary})
    assert out["a"].last_step == 3
    rows = {r["step"]: r for r in _rows(tmp_path, "a")}
    assert rows[1]["exchange/rejected"] == 1 and rows[2]["exchange/rejected"] == 1
    assert rows[3]["swarm/stale"] == 1 and rows[3]["swarm/peers_seen"] == 0
    assert rows[3]["swarm/rejected_total"] == 2
    assert all(rows[s]["swarm/peers_used"] == 0 for s in (1, 2, 3))


# ---- a real hivemind DHT on loopback -----------------------------------------------------------


def test_rollouts_round_trip_over_a_real_dht_on_loopback():
    pytest.importorskip("hivemind")
    from ftis.exchange.dht import DHTBoard

    first = DHTBoard(max_value_bytes=200_000, max_peers=8)
    try:
        maddrs = first.maddrs()
        assert maddrs and all(m.startswith("/ip4/127.0.0.1/") for m in maddrs)
        second = DHTBoard(maddrs, max_value_bytes=200_000, max_peers=8)
        try:
            codec = RolloutCodec(vocab_size=16, max_tokens=4)
            s = SwarmSettings(deadline_s=10.0, member_ttl_s=30.0, poll_s=0.05)
            ta = SwarmTransport(first, peer_id=0, max_peers=8, settings=s)
            tb = SwarmTransport(second, peer_id=1, max_peers=8, settings=s)
            ta.ready(), tb.ready()
            sent = {0: _batch([1, 1, 2], 0), 1: _batch([3], 1)}
            got = _in_threads(
                {
                    0: lambda: ta.exchange(1, codec.encode(sent[0]), max_bytes=codec.max_payload),
                    1: lambda: tb.exchange(1, codec.encode(sent[1]), max_bytes=codec.max_payload),
                }
            )
            back = codec.decode(got[0][1], peer=1)
            assert torch.equal(back.prompt_index, sent[1].prompt_index)
            assert torch.equal(back.completion_ids, sent[1].completion_ids)
            assert torch.equal(codec.decode(got[1][0], peer=0).prompt_index, sent[0].prompt_index)
            # the validator on the other node refuses records over the size limit
            assert not second.publish("big", 1, b"z" * 300_000, second.now() + 30)
        finally:
            second.close()
    finally:
        first.close()


@pytest.mark.chaos_case("swarm hivemind", "kill one peer, one joins late")
@pytest.mark.slow
def test_real_hivemind_peers_one_killed_one_added_the_others_finish(tmp_path):
    """`ftis run`'s swarm launcher: three peer processes on a loopback DHT; b is killed after
    round 2 (no goodbye), c joins at round 2 (at the swarm's round, not from scratch); a and c
    finish every round."""
    pytest.importorskip("hivemind")
    import yaml

    from ftis.algos.swarm.launch import run_swarm
    from ftis.config import RunConfig

    d = tiny_run_config(steps=12)
    node = d["nodes"][0]
    d["nodes"] = [{**node, "name": n} for n in ("a", "b", "c")]
    d["eval"] = {"every": 6, "size": 16}
    d["checkpoint"] = {"every": 4}
    d["algorithm"] = {
        "kind": "swarm",
        "backend": "hivemind",
        "max_peers": 8,
        "deadline_s": 20.0,  # generous: the test checks liveness, and the machine may be loaded
        "member_ttl_s": 30.0,  # how long the others wait for the killed b at most
        "churn": {"b": {"leave_at": 2, "crash": True}, "c": {"join_at": 2}},
    }
    cfg = RunConfig.model_validate(d)
    _warm(cfg)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    result = run_swarm(cfg, tmp_path)
    assert result.exit_codes == {"a": 0, "b": 0, "c": 0}
    a, b, c = (_rows(tmp_path, n) for n in "abc")
    # the initial peers met at the start barrier: both evaluated at step 0 and trained from round
    # 1, however slow either was to start (model build, DHT start-up, a loaded machine)
    assert [r["step"] for r in a] == list(range(13))
    assert [r["step"] for r in b][:3] == [0, 1, 2]
    assert c[-1]["step"] == 12 and "eval/accuracy" in c[0]
    if c[1]["swarm/members"] >= 1:  # a was live when c joined: c started at the swarm's round
        assert c[0]["step"] >= 2
    # (else a had finished first, as happens when c's process starts slowly: c trained from
    # scratch, on its own samples and on what the DHT still held of the swarm's rounds)
    assert any(r["swarm/peers_seen"] >= 1 for r in c[1:])
    assert max(r["step"] for r in b) < 12  # killed mid-run
    assert any(r.get("swarm/peers_used", 0) >= 1 for r in a + c)
    assert all(r["step"] > 0 or "swarm/members" not in r for r in a)


# ---- the in-process simulator: churn schedule, virtual time, many peers ------------------------


def test_the_churn_schedule_says_who_is_present_when():
    from ftis.algos.swarm.config import ChurnConfig
    from ftis.algos.swarm.schedule import presence

    churn = {
        "always": ChurnConfig(),
        "late": ChurnConfig(join_at=2),
        "leaves": ChurnConfig(leave_at=3),
        "crash": ChurnConfig(leave_at=2, crash=True, rejoin_at=4),
    }
    got = {n: [r for r, p in enumerate(v, start=1) if p] for n, v in presence(churn, 6).items()}
    assert got == {
        "always": [1, 2, 3, 4, 5, 6],
        "late": [3, 4, 5, 6],
        "leaves": [1, 2, 3],
        "crash": [1, 2, 5, 6],
    }


def test_the_random_churn_keeps_a_quarter_of_64_peers_away_at_every_round():
    from ftis.algos.swarm.config import ChurnConfig, RandomChurn
    from ftis.algos.swarm.schedule import generate_churn, presence

    names = [f"p{i}" for i in range(64)]
    spec = RandomChurn(absent_fraction=0.25, seed=3, slow_fraction=0.1)
    churn = generate_churn(names[1:], total=64, steps=16, spec=spec, deadline_s=10.0)
    churn = {n: churn.get(n, ChurnConfig()) for n in names}
    present = presence(churn, 16)
    assert [sum(not present[n][r] for n in names) for r in range(16)] == [16] * 16
    assert all(sum(v) >= 8 for v in present.values())  # everyone stays at least half the run
    kinds = {
        "late": any(c.join_at > 0 for c in churn.values()),
        "crash+rejoin": any(c.crash and c.rejoin_at for c in churn.values()),
        "leave": any(c.leave_at and not c.rejoin_at for c in churn.values()),
        "slow": sum(c.slow_s > 0 for c in churn.values()) == 6,  # 10% of the 63 generated
    }
    assert all(kinds.values()), kinds
    assert churn["p0"] == ChurnConfig()  # an explicit entry is left alone
    again = generate_churn(names[1:], total=64, steps=16, spec=spec, deadline_s=10.0)
    assert {n: churn[n] for n in again} == again  # a function of the seed


def test_random_churn_reads_from_the_churn_section_and_names_bad_fields():
    d = tiny_run_config(steps=8)
    d["nodes"] = [{**d["nodes"][0], "name": n} for n in ("a", "b", "c", "d")]
    d["algorithm"] = {"kind": "swarm", "churn": {"random": {"absent_fraction": 0.25}}}
    from ftis.config import RunConfig

    cfg = RunConfig.model_validate(d)
    assert cfg.algorithm.random_churn.absent_fraction == 0.25 and cfg.algorithm.churn == {}
    assert RunConfig.model_validate(cfg.model_dump(mode="json")) == cfg  # config.yaml round trip
    d["algorithm"]["churn"] = {"b": {"leave_at": 8}}
    with pytest.raises(ValueError, match=r"churn.b.leave_at=8 is not before the last round"):
        RunConfig.model_validate(d)


@pytest.mark.chaos_case("swarm sim", "a slow peer past the deadline")
def test_simulated_peers_a_slow_one_is_late_and_counted_virtual_time_costs_nothing():
    from ftis.exchange.swarm_sim import Scheduler, SimBoard

    sched = Scheduler()
    board = SimBoard(sched)
    settings = {"deadline_s": 10.0, "member_ttl_s": 60.0, "poll_s": 0.5}
    start = frozenset({0, 1, 2})
    ts = [
        SwarmTransport(
            board.view(),
            peer_id=p,
            max_peers=8,
            settings=SwarmSettings(
                **settings, start_peers=start, publish_delay_s=12.0 if p == 2 else 0.0
            ),
            clock=sched.clock,
        )
        for p in range(3)
    ]
    infos: dict[int, list] = {p: [] for p in range(3)}

    def peer(p):
        t = ts[p]
        t.join_step(0)
        t.ready()
        for r in range(1, 7):
            t1 = sched.t
            got = t.exchange(r, bytes([p, r]), max_bytes=10)
            last = t.last
            infos[p].append((sorted(got), last.late, last.timed_out, last.published, sched.t - t1))
            sched.clock.sleep(5.0)  # sampling and training: 5 virtual seconds a round
        t.close()

    for p in range(3):
        sched.spawn(f"p{p}", p, lambda p=p: peer(p))
    t0 = time.perf_counter()
    sched.run()
    assert time.perf_counter() - t0 < 5.0  # tens of virtual seconds of waiting
    assert sched.t > 60.0
    assert all(task.error is None for task in sched.tasks)
    # peer 0 never gets the slow peer's payloads in time (they land 12 s after it enters a
    # round). Rounds 1 and 2: no payload of it has arrived yet, so it is a candidate and peer
    # 0 waits `candidate_grace_s` (5 s) for it, not the deadline (issue 37); its round-1
    # payload lands at 12 s, is counted late at round 3 and makes it a member: from then on
    # peer 0 waits for it until the deadline (10 s) and counts each payload late. Peer 2 took
    # part in round 1 (published: 2) and lags behind from then on.
    assert [i[0] for i in infos[0]] == [[1]] * 6
    assert [i[2] for i in infos[0]] == [False, False, True, True, True, True]
    assert [round(i[4]) for i in infos[0]] == [5, 5, 10, 10, 10, 10]
    assert [i[1] for i in infos[0]] == [0, 0, 1, 1, 1, 1]
    assert [i[3] for i in infos[0]] == [2, 1, 1, 1, 1, 1]
    # the slow peer itself gets everyone's in time
    assert [i[0] for i in infos[2]] == [[0, 1]] * 6


@pytest.mark.chaos_case("swarm sim", "crashed peer rejoins from its checkpoint")
@pytest.mark.slow
def test_the_simulator_runs_a_swarm_with_churn_and_a_crashed_peer_rejoins_from_its_checkpoint(
    tmp_path,
):
    import json

    from ftis.algos.swarm.launch import run_swarm
    from ftis.config import RunConfig

    d = tiny_run_config(steps=6)
    d["nodes"] = [{**d["nodes"][0], "name": n} for n in ("a", "b", "c", "d")]
    d["nodes"][3]["model"] = {"preset": "qwen2-s"}  # another model in the mix
    d["eval"] = {"every": 3, "size": 16}
    d["checkpoint"] = {"every": 2}
    d["algorithm"] = {
        "kind": "swarm",
        "max_peers": 8,
        "deadline_s": 10.0,
        "member_ttl_s": 30.0,
        "churn": {
            "b": {"leave_at": 3, "crash": True, "rejoin_at": 4},
            "c": {"join_at": 2},
            "d": {"slow_s": 15.0},
        },
    }
    cfg = RunConfig.model_validate(d)
    t0 = time.perf_counter()
    result = run_swarm(cfg, tmp_path)
    wall = time.perf_counter() - t0
    assert result.exit_codes == {"a": 0, "b": 0, "c": 0, "d": 0}
    a, b, c, dd = (_rows(tmp_path, n) for n in "abcd")
    assert [r["step"] for r in a] == list(range(7))
    assert [r["step"] for r in dd] == list(range(7))
    # c joined once the swarm reached round 2: evaluated there, trained from round 3
    assert [r["step"] for r in c] == [2, 3, 4, 5, 6] and "eval/accuracy" in c[0]
    # b crashed after round 3 (its last checkpoint: step 2), rejoined once the swarm reached
    # round 4 from that checkpoint, and trained from the swarm's round on
    assert [r["step"] for r in b] == [0, 1, 2, 3, 5, 6]
    assert sorted(p.name for p in (tmp_path / "nodes" / "b").glob("step-*"))[-1] == "step-000006"
    # the slow peer's payloads missed the deadline and were counted late; nobody crashed
    assert any(r.get("swarm/late", 0) >= 1 for r in a)
    assert all(r["swarm/published"] >= r["swarm/peers_seen"] for r in a[1:])
    assert all(r["swarm/rejected"] == 0 for r in a[1:] + b[1:] + c[1:] + dd[1:])
    sched = json.loads((tmp_path / "swarm-schedule.json").read_text())
    assert sched["absent_per_round"] == [1, 1, 0, 1, 0, 0]
    assert wall < 120


def test_the_shipped_swarm_configs():
    from ftis.algos.swarm.schedule import presence, resolve_churn
    from ftis.config import load_config

    root = Path(__file__).resolve().parents[1] / "configs"
    sim = load_config(root / "swarm.yaml")
    assert sim.algorithm.backend == "sim" and len(sim.nodes) >= 16
    assert len({n.model.preset for n in sim.nodes}) >= 3
    present = presence(resolve_churn(sim), sim.train.steps)
    away = [sum(not v[r] for v in present.values()) for r in range(sim.train.steps)]
    assert away == [len(sim.nodes) // 4] * sim.train.steps
    assert load_config(root / "swarm-hivemind.yaml").algorithm.backend == "hivemind"


@pytest.mark.chaos_case("swarm hivemind", "an outsider squats a peer's subkeys")
def test_an_outsider_cannot_occupy_a_peers_subkey_on_the_dht():
    """Issue 57: an outsider joins the DHT from a peer's address and publishes junk under peer
    0's subkey with a later expiry. Without ownership the DHT keeps the later record and refuses
    peer 0's own; with the swarm secret every record carries an HMAC tag that honest nodes check
    on store and on read, so peer 1 still reads peer 0's record."""
    pytest.importorskip("hivemind")
    from ftis.exchange.dht import DHTBoard

    secret = b"s" * 32
    first = DHTBoard(max_value_bytes=200_000, max_peers=8, secret=secret)
    boards = [first]
    try:
        maddrs = first.maddrs()
        second = DHTBoard(maddrs, max_value_bytes=200_000, max_peers=8, secret=secret)
        squatter = DHTBoard(maddrs, max_value_bytes=200_000, max_peers=8)  # no secret
        boards += [second, squatter]
        key = "ftis-swarm:t:round:1"
        now = first.now()
        squatter.publish(key, 0, b"junk" * 10, now + 300)  # later expiry, peer 0's subkey
        # (publish's own answer is the last replica's, which may be the squatter's refusal)
        first.publish(key, 0, b"honest", now + 30)
        assert second.read(key) == {0: b"honest"}
        assert first.read(key) == {0: b"honest"}
        # and a signed record is read back stripped of its tag, by any holder of the secret
        second.publish(key, 1, b"peer one", now + 30)
        assert first.read(key) == {0: b"honest", 1: b"peer one"}
    finally:
        for b in reversed(boards):
            b.close()


@pytest.mark.slow
def test_a_sim_swarm_bridges_another_tokenizer_and_keeps_at_most_peer_groups(tmp_path):
    """A peer on another tokenizer is re-tokenized in the swarm as in F-TIS (its ids are not
    this peer's), and `peer_groups` (SAPO's J) bounds the peer groups trained on: 3 peers,
    4 prompts of G=4 a round, J=3 of the 8 peer groups that arrive."""
    from ftis.algos.swarm.launch import run_swarm
    from ftis.config import RunConfig

    d = tiny_run_config(steps=3)
    d["nodes"] = [{**d["nodes"][0], "name": n} for n in ("a", "b", "c")]
    d["nodes"][2]["model"] = {"preset": "qwen2-bpe"}  # the byte-level BPE tokenizer
    d["eval"] = {"every": 0, "size": 16}
    d["algorithm"] = {"kind": "swarm", "max_peers": 8, "peer_groups": 3}
    result = run_swarm(RunConfig.model_validate(d), tmp_path)
    assert result.exit_codes == {"a": 0, "b": 0, "c": 0}
    for name in "abc":
        rows = [r for r in _rows(tmp_path, name) if r["step"] >= 1]
        assert len(rows) == 3
        assert all(r["swarm/peer_groups_used"] == 3 for r in rows), rows
        assert all(r["swarm/samples_received"] == 3 * 4 for r in rows), rows
        # a and b re-tokenize c's samples, c theirs: the bridge ran on every peer
        assert all("bridge/samples" in r for r in rows), rows
