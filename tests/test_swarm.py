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
        t.join(30)
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
    a, b = _transport(board, 0, deadline_s=0.5), _transport(board, 1)
    a.ready(), b.ready()
    assert a.exchange(1, b"x", max_bytes=10) == {}
    assert a.last.timed_out and a.last.members == 1
    # b publishes round 1 after a left it: counted as late at a's next round
    b.exchange(1, b"y", max_bytes=10)
    a.exchange(2, b"x", max_bytes=10)
    assert a.last.late == 1


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
    a._heartbeat("live", 7)  # a is in round 7
    assert b.join_step(0) == 6  # b's first step is 7
    assert b.join_step(9) == 9  # its own checkpoint is newer: keep it
    a.close()
    assert b.join_step(0) == 0  # nobody live: start from scratch


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


def _peer(cfg, rank, board, run_dir, *, leave_at=None, resume=False):
    from ftis.train.loop import StopFlag, train_node

    stop = StopFlag()
    t = SwarmTransport(
        board.view(),
        peer_id=rank,
        max_peers=8,
        settings=SwarmSettings(deadline_s=5.0, member_ttl_s=5.0, poll_s=0.02),
        should_stop=stop,
    )

    def progress(event, **info):
        if leave_at is not None and event == "step" and info["step"] >= leave_at:
            stop.requested = True

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

    def late_c():
        while not any(r["step"] >= 2 for r in _rows_safe(tmp_path, "a")):
            time.sleep(0.05)
        out["c"] = _peer(cfg, 2, board, tmp_path)()

    def b_leaves_and_rejoins():
        out["b1"] = _peer(cfg, 1, board, tmp_path, leave_at=2)()
        while not any(r["step"] >= 4 for r in _rows_safe(tmp_path, "a")):
            time.sleep(0.05)
        out["b2"] = _peer(cfg, 1, board, tmp_path, resume=True)()

    _in_threads(
        {
            "a": lambda: out.__setitem__("a", _peer(cfg, 0, board, tmp_path)()),
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
    assert c_steps[0] >= 2 and "eval/accuracy" in c[0] and c_steps[-1] == 6
    # b resumed from its step-2 checkpoint and skipped to the swarm's current round
    b_steps = [r["step"] for r in b]
    assert b_steps[:3] == [0, 1, 2] and b_steps[3] >= 4
    # the late joiner trained on a's samples from its first round on (a was live and waited for)
    assert all(r["swarm/peers_used"] >= 1 for r in c[1:-1])
    # and a, once c was a member, took c's samples
    assert any(r["swarm/members"] >= 1 and r["swarm/peers_used"] >= 1 for r in a if r["step"] > 2)
    assert all(
        r["exchange/rejected"] == 0 for r in a + b + c if r["step"] > 0 and "exchange/rejected" in r
    )


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
        "max_peers": 8,
        "deadline_s": 10.0,
        "member_ttl_s": 30.0,
        "churn": {"b": {"leave_at": 2, "crash": True}, "c": {"join_at": 2}},
    }
    cfg = RunConfig.model_validate(d)
    _warm(cfg)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    result = run_swarm(cfg, tmp_path)
    assert result.exit_codes == {"a": 0, "b": 0, "c": 0}
    a, b, c = (_rows(tmp_path, n) for n in "abc")
    assert [r["step"] for r in a] == list(range(13))
    assert c[-1]["step"] == 12 and "eval/accuracy" in c[0]
    if c[1]["swarm/members"] >= 1:  # a was live when c joined: c started at the swarm's round
        assert c[0]["step"] >= 2
    # (else a had finished first, as happens when c's process starts slowly: c trained from
    # scratch, on its own samples and on what the DHT still held of the swarm's rounds)
    assert any(r["swarm/peers_seen"] >= 1 for r in c[1:])
    assert max(r["step"] for r in b) < 12  # killed mid-run
    assert any(r.get("swarm/peers_used", 0) >= 1 for r in a + c)
    assert all(r["step"] > 0 or "swarm/members" not in r for r in a)
