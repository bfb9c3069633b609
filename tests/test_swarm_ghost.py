"""Swarm members prove themselves (issue 37 item 3).

The attack: a heartbeat `["live", train.steps + 1]` under an unused peer id passed every check on
the members key; the honest peers took it for a member and waited the full `deadline_s` for it
every round, and a late joiner believed the swarm was at round steps + 1 and trained nothing.

Now a peer is a member only once it has sent a signed heartbeat (HMAC with the swarm's secret)
*and* an authenticated payload; before that it is a candidate, waited for a short grace only; a
member silent for `silent_rounds` rounds is dropped; a round claim far beyond the rounds the
members proved with their payloads is not believed; and a late joiner learns the round from
payloads. These tests run on the simulator's board and virtual clock (no model, no real time
spent waiting), one on a real hivemind DHT."""

from __future__ import annotations

import time

import pytest

from ftis.exchange.swarm import MemoryBoard, SwarmSettings, SwarmTransport, pack
from ftis.exchange.swarm_sim import Scheduler, SimBoard

KEY = bytes(range(32))
DEADLINE_S = 15.0
COMPUTE_S = 1.0  # virtual seconds a peer spends sampling and training per round
GHOST = 6  # a peer id nobody uses
K, GRACE_S = 3, 5.0  # SwarmSettings' defaults: silent_rounds, candidate_grace_s


def _settings(secret: bytes | None, **kw) -> SwarmSettings:
    base = {"deadline_s": DEADLINE_S, "member_ttl_s": 60.0, "poll_s": 0.5, **kw}
    if secret is not None:
        base["secret"] = secret
    return SwarmSettings(**base)


class _Swarm:
    """Honest peers 0..n-1 (initial peers, meeting at the start barrier) on a SimBoard, each
    training `steps` rounds of COMPUTE_S virtual seconds; per peer and round: (virtual seconds
    the exchange took, RoundInfo)."""

    def __init__(
        self, n: int, *, steps: int, secret: bytes | None, silent_after: dict | None = None, **kw
    ) -> None:
        self.sched = Scheduler()
        self.board = SimBoard(self.sched)
        self.steps, self.secret, self.kw = steps, secret, kw
        self.start = frozenset(range(n))
        self.rounds: dict[int, list] = {}
        self.transports: dict[int, SwarmTransport] = {}
        self.now_round = 0  # the newest round any honest peer entered
        self.joined: dict[int, int] = {}  # late joiner -> its join step
        for p in range(n):
            self._spawn(p, start_peers=self.start, stop_after=(silent_after or {}).get(p))

    def transport(self, p: int, **kw) -> SwarmTransport:
        t = SwarmTransport(
            self.board.view(),
            peer_id=p,
            max_peers=8,
            settings=_settings(self.secret, max_round=self.steps, **{**self.kw, **kw}),
            clock=self.sched.clock,
        )
        self.transports[p] = t
        return t

    def _spawn(self, p: int, *, start_peers=frozenset(), at: float = 0.0, stop_after=None):
        def body():
            if at:
                self.sched.clock.sleep(at)
            t = self.transport(p, start_peers=start_peers)
            step = t.join_step(0)
            self.joined[p] = (step, self.now_round)  # and the swarm's round then
            t.ready()
            out = self.rounds.setdefault(p, [])
            for r in range(step + 1, self.steps + 1):
                self.now_round = max(self.now_round, r)
                if stop_after is not None and r > stop_after:
                    return self._silent(t, r)
                t0 = self.sched.t
                t.exchange(r, bytes([p, r % 256]), max_bytes=100)
                out.append((r, self.sched.t - t0, t.last))
                self.sched.clock.sleep(COMPUTE_S)
            t.close()

        self.sched.spawn(f"p{p}", p, body)

    def late_joiner(self, p: int, at: float) -> None:
        self._spawn(p, at=at)

    def _silent(self, t: SwarmTransport, r: int) -> None:
        """A member whose payloads stop: it keeps its heartbeat (claiming the swarm's round)
        and publishes nothing more."""
        while self.now_round < self.steps:
            t._heartbeat("live", max(r, self.now_round))
            self.sched.clock.sleep(COMPUTE_S)

    def run(self) -> None:
        w0 = time.perf_counter()
        self.sched.run()
        assert time.perf_counter() - w0 < 60  # virtual waiting costs no real time
        assert [t.error for t in self.sched.tasks if t.error is not None] == []


def _forged_round_ghost(swarm: _Swarm, at: float) -> None:
    """The attacker's record: `["live", steps + 1]` under an unused id, once, far expiry."""

    def body():
        swarm.sched.clock.sleep(at)
        swarm.board.publish(
            "swarm:members", GHOST, ["live", swarm.steps + 1], swarm.board.now() + 10**6
        )

    swarm.sched.spawn("ghost", GHOST, body)


@pytest.mark.chaos_case("swarm sim", "ghost peer")
@pytest.mark.parametrize("secret", [KEY, None], ids=["signed", "unsigned"])
def test_a_ghost_with_a_forged_round_neither_delays_the_swarm_nor_misleads_a_joiner(secret):
    """The attacker's record appears after round 3. The honest peers' rounds complete without
    waiting (no deadline hit), the record is counted as rejected, and a peer joining later
    starts at the swarm's round, not at steps + 1. Without a secret (a swarm run by hand
    without one) the payload rule and the round check still hold."""
    steps = 20
    swarm = _Swarm(3, steps=steps, secret=secret)
    _forged_round_ghost(swarm, at=3 * COMPUTE_S + 0.25)
    swarm.late_joiner(3, at=8 * COMPUTE_S + 0.25)
    swarm.run()
    for p in range(3):
        rounds = swarm.rounds[p]
        assert [r for r, _, _ in rounds] == list(range(1, steps + 1))
        assert max(dt for _, dt, _ in rounds) < DEADLINE_S / 2, [dt for _, dt, _ in rounds]
        assert not any(info.timed_out for _, _, info in rounds)
        assert all(GHOST not in info.peers for _, _, info in rounds)
        # never waited for as a member or a candidate: the others only
        assert max(info.members + info.candidates for _, _, info in rounds) <= 3
        assert swarm.transports[p].rejected_records >= 1  # the ghost's record, counted
        assert sum(info.rejected for _, _, info in rounds) >= 1
    # the whole run: 20 rounds of 1 s, not 20 x 15 s of waiting for the ghost
    assert swarm.sched.t < steps * COMPUTE_S + DEADLINE_S
    # the late joiner joined at the swarm's round (about 7 at 8.25 s) and trained from there
    join, swarm_round = swarm.joined[3]
    assert swarm_round >= 5 and swarm_round - 1 <= join <= swarm_round, (join, swarm_round)
    assert [r for r, _, _ in swarm.rounds[3]] == list(range(join + 1, steps + 1))


@pytest.mark.parametrize("secret", [KEY, None], ids=["signed", "unsigned"])
def test_a_ghost_that_knows_the_key_but_sends_no_payload_is_dropped_after_k_rounds(secret):
    """A heartbeat correctly signed (an insider, or a peer that never gets to publish) claiming
    the swarm's round: a candidate, waited for a short grace at most, dropped after
    `silent_rounds` rounds without a payload; no round waits the deadline for it."""
    steps = 12
    swarm = _Swarm(2, steps=steps, secret=secret)  # the defaults: K rounds, GRACE_S

    def ghost():
        swarm.sched.clock.sleep(0.25)
        t = swarm.transport(GHOST)
        while swarm.now_round < steps:
            t._heartbeat("live", max(1, swarm.now_round))  # "I am in your round"
            swarm.sched.clock.sleep(0.5)

    swarm.sched.spawn("ghost", GHOST, ghost)
    swarm.run()
    for p in range(2):
        rounds = swarm.rounds[p]
        waits = [dt for _, dt, _ in rounds]
        assert max(waits) <= GRACE_S + 0.5, waits  # a candidate: the grace, never the deadline
        assert all(dt < 0.6 for dt in waits[K + 1 :]), waits  # then not waited for at all
        assert not any(info.timed_out for _, _, info in rounds), waits
        assert sum(info.dropped for _, _, info in rounds) == 1
        assert swarm.transports[p].dropped_silent == 1
        # waited for (as a candidate) in k rounds at most, then not at all
        assert sum(info.candidates for _, _, info in rounds) <= K
        assert all(info.candidates == 0 for _, _, info in rounds[K + 1 :])
        assert all(info.members == 1 for _, _, info in rounds[1:])  # the honest other
    assert (SwarmSettings().silent_rounds, SwarmSettings().candidate_grace_s) == (K, GRACE_S)


@pytest.mark.parametrize("secret", [KEY, None], ids=["signed", "unsigned"])
def test_a_member_whose_payloads_stop_is_dropped_after_k_rounds(secret):
    """Peer 2 trades rounds 1-3, then keeps its heartbeat but publishes nothing: the others wait
    for it (a proven member: up to the deadline) in k rounds, then drop it and go on at
    full speed. `dropped_silent` counts it once."""
    steps = 12
    swarm = _Swarm(3, steps=steps, secret=secret, silent_after={2: 3})
    swarm.run()
    for p in range(2):
        rounds = swarm.rounds[p]
        timed_out = [r for r, _, info in rounds if info.timed_out]
        assert timed_out == [4, 5, 6], timed_out  # K rounds waited to the deadline
        assert all(dt < 1.0 for r, dt, _ in rounds if r > 6), rounds
        assert swarm.transports[p].dropped_silent == 1
        assert [info.dropped for _, _, info in rounds][5] == 1  # at the end of round 6
        assert all(info.members == 1 for r, _, info in rounds if r > 6)
    assert swarm.sched.t < steps * COMPUTE_S + (K + 1) * DEADLINE_S


def test_signed_records_bind_peer_round_and_expiry():
    """A signed heartbeat replayed under another peer id, a signed payload replayed under
    another round's key, and records signed with another key are all refused and counted."""
    board = MemoryBoard()
    s = _settings(KEY, deadline_s=0.3, poll_s=0.02)
    a = SwarmTransport(board.view(), peer_id=0, max_peers=8, settings=s)
    b = SwarmTransport(board.view(), peer_id=1, max_peers=8, settings=s)
    wrong = SwarmTransport(
        board.view(), peer_id=2, max_peers=8, settings=_settings(b"x" * 32, poll_s=0.02)
    )
    b.ready()
    wrong.ready()  # signed with another key: not a member, counted
    beat = board.read("swarm:members")[1]
    board.publish("swarm:members", 3, beat, board.now() + 60)  # b's beat under id 3
    assert set(a.members()) == {1}
    assert a.rejected_records == 2
    # b's payload of round 1 replayed under round 2's key: not b's round-2 payload
    b.exchange(1, b"b1", max_bytes=10)
    rec = board.read("swarm:round:1")[1]
    board.publish("swarm:round:2", 1, rec, board.now() + 60)
    board.publish("swarm:round:2", 4, pack(2, 4, b"unsigned"), board.now() + 60)
    assert a.exchange(2, b"a2", max_bytes=10) == {}
    assert a.last.forged == 2
    assert a.exchange(1, b"a1", max_bytes=10) == {1: b"b1"}


def test_a_left_record_from_the_launcher_is_signed():
    from ftis.exchange.swarm import announce_left

    board = MemoryBoard()
    a = SwarmTransport(board.view(), peer_id=0, max_peers=8, settings=_settings(KEY))
    b = SwarmTransport(board.view(), peer_id=1, max_peers=8, settings=_settings(KEY))
    b.ready()
    c = SwarmTransport(board.view(), peer_id=2, max_peers=8, settings=_settings(KEY))
    c.ready()
    assert set(a.members()) == {1, 2}
    announce_left(board, "swarm", 1, ttl_s=60, secret=KEY)  # the launcher, for a dead b
    announce_left(board, "swarm", 3, ttl_s=60, secret=b"x" * 32)  # not the run's key
    assert set(a.members()) == {2} and a.rejected_records == 1
    # (a record of the wrong key under c's id would hide c's heartbeat as an expiry would:
    # a board keeps one record per subkey; the DHT keeps the one that expires last)


def test_the_swarm_secret_comes_from_the_environment_or_the_configs_file(tmp_path, monkeypatch):
    from ftis.algos.swarm.config import SWARM_SECRET_ENV, SwarmConfig

    monkeypatch.delenv(SWARM_SECRET_ENV, raising=False)
    assert SwarmConfig().shared_secret() is None
    f = tmp_path / "swarm.key"
    f.write_text("ab" * 32 + "\n")
    assert SwarmConfig(secret_file=str(f)).shared_secret() == bytes([0xAB]) * 32
    monkeypatch.setenv(SWARM_SECRET_ENV, "cd" * 32)  # the launcher's, or one exported by hand
    assert SwarmConfig(secret_file=str(f)).shared_secret() == bytes([0xCD]) * 32
    monkeypatch.setenv(SWARM_SECRET_ENV, "not hex")
    with pytest.raises(ValueError, match="hex"):
        SwarmConfig().shared_secret()


def test_a_ghost_on_a_real_dht_is_rejected_and_not_waited_for():
    """The same rules over hivemind: an unsigned ghost heartbeat and an unsigned payload
    record under a member's id; the two signed peers trade at once."""
    pytest.importorskip("hivemind")
    from ftis.exchange.dht import DHTBoard
    from tests.test_swarm import _in_threads

    first = DHTBoard(max_value_bytes=200_000, max_peers=8)
    try:
        second = DHTBoard(first.maddrs(), max_value_bytes=200_000, max_peers=8)
        try:
            s = _settings(KEY, deadline_s=20.0, poll_s=0.05, max_round=10)
            ta = SwarmTransport(first, peer_id=0, max_peers=8, settings=s)
            tb = SwarmTransport(second, peer_id=1, max_peers=8, settings=s)
            ta.ready(), tb.ready()
            first.publish("swarm:members", GHOST, ["live", 11], first.now() + 600)
            first.publish("swarm:members", 5, b"FTS1" + b"\0" * 60, first.now() + 600)
            second.publish("swarm:round:1", 2, pack(1, 2, b"ghost"), second.now() + 600)
            t0 = time.perf_counter()
            got = _in_threads(
                {
                    0: lambda: ta.exchange(1, b"a", max_bytes=10),
                    1: lambda: tb.exchange(1, b"b", max_bytes=10),
                }
            )
            assert time.perf_counter() - t0 < 10.0
            assert got == {0: {1: b"b"}, 1: {0: b"a"}}
            for t in (ta, tb):
                assert not t.last.timed_out and t.last.forged == 1 and t.last.rejected == 2
                assert t.last.members + t.last.candidates == 1
        finally:
            second.close()
    finally:
        first.close()


def test_a_peer_without_the_swarms_secret_refuses_to_start(tmp_path, monkeypatch):
    """A hivemind peer needs the swarm's secret (its records would all be refused); `ftis run`
    joining a swarm started elsewhere (initial_peers) cannot draw one of its own."""
    from ftis.algos.swarm.config import SWARM_SECRET_ENV
    from ftis.algos.swarm.launch import run_swarm
    from ftis.algos.swarm.peer import build_transport
    from ftis.config import ConfigError, RunConfig
    from tests.conftest import tiny_run_config

    monkeypatch.delenv(SWARM_SECRET_ENV, raising=False)
    d = tiny_run_config()
    d["nodes"] = [{**d["nodes"][0], "name": n} for n in ("a", "b")]
    d["algorithm"] = {"kind": "swarm", "backend": "hivemind", "max_peers": 8}
    cfg = RunConfig.model_validate(d)
    with pytest.raises(ConfigError, match=SWARM_SECRET_ENV):
        build_transport(cfg, 0, [], lambda: False)
    d["algorithm"]["initial_peers"] = ["/ip4/127.0.0.1/tcp/1/p2p/QmNothing"]
    with pytest.raises(ConfigError, match="secret_file"):
        run_swarm(RunConfig.model_validate(d), tmp_path)
