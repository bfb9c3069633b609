"""A swarm transport: peers that come and go, no fixed world size, no barrier (rl-swarm's contract).

    publish   this peer's payload of round r under the key `<swarm>:round:<r>`, subkey = its peer
              id, with an expiry; and a heartbeat under `<swarm>:members` (its id -> [state, r])
    collect   read the round's key until every live member has published or `deadline_s` passed
    answer    whatever arrived (membership is what arrived); absent peers contribute nothing

A board holds the records: `MemoryBoard` in this process (tests), `SimBoard`
(`ftis.exchange.swarm_sim`: many peers of one process on a virtual clock), `DHTBoard`
(`ftis.exchange.dht`) on hivemind's DHT. The transport is the same over all of them; its clock
is real time, or the simulator's virtual time.

Starting together: the swarm's initial peers (`SwarmSettings.start_peers`) meet at a start
barrier in `join_step`: each announces itself live (at its next round) once its model is built,
waits until every initial peer has announced itself (or `start_timeout_s` passed), and only then
reads where the swarm stands; so a peer that is slow to start (model build, warm start, DHT
start-up under load) is waited for before round 1 instead of being taken for a late joiner.

Joining late: `join_step(done)` says where the swarm stands (the newest round a live member
announced, minus one), so that a late joiner, or a peer rejoining after a crash, trains on the
current round instead of replaying the swarm's past. Records carry a small header (magic, round,
peer id): a record for another round or from another peer than its subkey says is dropped and
counted (`stale`), never handed over as this round's. A value larger than `max_bytes` comes
back as None (the codec rejects it); boards refuse values over their own size limit outright.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ftis.exchange.transport import ExchangeAborted, TransportStats

log = logging.getLogger(__name__)

MAGIC = b"FTSW"
_HEADER = struct.Struct("<4sQI")  # magic, round, peer id
LIVE, LEFT = "live", "left"


class Board(Protocol):
    """Where swarm records live: `key -> {subkey: value}`, each value with an expiry
    (seconds since the epoch, the board's clock: `now()`)."""

    def now(self) -> float: ...

    def publish(self, key: str, subkey: int, value: Any, expires: float) -> bool: ...

    def read(self, key: str) -> dict[Any, Any]:
        """Every unexpired `subkey -> value` of `key` (empty when none)."""
        ...

    def close(self) -> None: ...


class MemoryBoard:
    """An in-process board (thread-safe): many peers of one process share it. `max_value_bytes`
    bounds a bytes value, as the DHT's record validator does."""

    def __init__(self, *, max_value_bytes: int = 16 * 2**20) -> None:
        self.max_value_bytes = max_value_bytes
        self._lock = threading.Lock()
        self._records: dict[str, dict[Any, tuple[Any, float]]] = {}

    def now(self) -> float:
        return time.time()

    def publish(self, key: str, subkey: int, value: Any, expires: float) -> bool:
        if isinstance(value, bytes | bytearray) and len(value) > self.max_value_bytes:
            return False
        with self._lock:
            self._records.setdefault(key, {})[subkey] = (value, expires)
        return True

    def read(self, key: str) -> dict[Any, Any]:
        now = self.now()
        with self._lock:
            recs = self._records.get(key, {})
            for k in [k for k, (_, exp) in recs.items() if exp <= now]:
                del recs[k]
            return {k: v for k, (v, _) in recs.items()}

    def view(self) -> MemoryBoard:
        """The same records, for another peer (a peer's `close` must not empty the board)."""
        return _MemoryView(self)  # type: ignore[return-value]

    def close(self) -> None:
        pass


class _MemoryView:
    def __init__(self, board: MemoryBoard) -> None:
        self._b = board

    def __getattr__(self, name: str) -> Any:  # the board's extras (e.g. a simulator's)
        return getattr(self._b, name)

    def now(self) -> float:
        return self._b.now()

    def publish(self, key: str, subkey: int, value: Any, expires: float) -> bool:
        return self._b.publish(key, subkey, value, expires)

    def read(self, key: str) -> dict[Any, Any]:
        return self._b.read(key)

    def close(self) -> None:
        pass


class Clock(Protocol):
    """Time as the transport sees it: real time, or a simulator's virtual time
    (`ftis.exchange.swarm_sim`), where waiting hands the turn to another simulated peer."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class RealClock:
    def monotonic(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def pack(round_: int, peer: int, payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, round_, peer) + payload


def unpack(record: Any, *, round_: int, peer: int) -> bytes | str:
    """The payload of a record that claims to be `peer`'s of `round_`, or why it is not."""
    if not isinstance(record, bytes) or len(record) < _HEADER.size:
        return "not a swarm record"
    magic, r, p = _HEADER.unpack_from(record)
    if magic != MAGIC:
        return "not a swarm record"
    if r != round_ or p != peer:
        return f"record of peer {p} round {r} under peer {peer} round {round_}"
    return record[_HEADER.size :]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _heartbeat_state(v: Any) -> tuple[str, int] | None:
    """(state, round) of a well-formed heartbeat value, else None."""
    if not (isinstance(v, list | tuple) and len(v) == 2):
        return None
    state, round_ = v
    if state not in (LIVE, LEFT) or not _is_int(round_) or round_ < 0:
        return None
    return state, round_


def announce_left(board: Board, name: str, peer: int, *, ttl_s: float) -> bool:
    """Say on `peer`'s behalf that it left swarm `name` (e.g. the launcher, when a peer's
    process died before it could say so): nobody waits for it, at the start barrier or in a
    round."""
    return board.publish(f"{name}:members", peer, [LEFT, 0], board.now() + ttl_s)


@dataclass
class SwarmSettings:
    """deadline_s: the longest a peer waits for the live members' payloads of a round.
    member_ttl_s: a heartbeat's life; a peer silent that long (crashed) is no longer waited for.
    payload_ttl_s: how long a round's payloads stay readable (late and slow peers read them).
    poll_s: how often the round's key is read while waiting.
    start_peers: the swarm's initial peer ids, when this peer is one of them and starts with
        the swarm (not a late joiner, not a rejoin): `join_step` waits at the start barrier until
        each of them has announced itself. Empty: no barrier (this peer joins late).
    start_timeout_s: the longest the start barrier waits; after it the peer starts with whoever
        came, and a peer slower than that joins late.
    publish_delay_s: a slow peer: it publishes each round's payload this long after it entered
        the round's exchange (slow hardware, simulated); beyond the others' deadline, they
        count its payloads as late when they land.
    late_window: how many past rounds are watched for payloads that arrive after this peer left
        them (counted once each as `late`).
    max_round: the run's last round (train.steps), when known: a heartbeat claiming a round
        beyond max_round + 1 is rejected (no honest peer can be there).
    max_round_skew: a heartbeat claiming a round further than this from the swarm's own round
        (this peer's round once it exchanges; before that, the lower median of the claims) is
        rejected: a forged claim cannot make a joiner skip the run or the others wait for a
        round nobody is in."""

    name: str = "swarm"
    deadline_s: float = 20.0
    member_ttl_s: float = 60.0
    payload_ttl_s: float = 300.0
    poll_s: float = 0.1
    start_peers: frozenset[int] = frozenset()
    start_timeout_s: float = 300.0
    publish_delay_s: float = 0.0
    late_window: int = 4
    max_round: int | None = None
    max_round_skew: int = 100


@dataclass
class RoundInfo:
    """What one round of this peer saw: live members it expected, peers whose payload arrived,
    records dropped as stale (another round or peer than the key says) or malformed, payloads
    of the previous round that arrived after this peer left it (late), and whether it stopped
    waiting at the deadline."""

    members: int = 0
    arrived: int = 0
    stale: int = 0
    late: int = 0
    timed_out: bool = False
    rejected: int = 0  # heartbeats refused (malformed, or a round claim out of bounds)
    peers: list[int] = field(default_factory=list)
    published: int | None = None  # peers that sent this round's payload (a simulator knows)


class SwarmTransport:
    """A `Transport` over a board. `rank` is this peer's id (0 <= id < `max_peers`, the same id
    every time it joins); `world_size` is `max_peers`, an upper bound, not a head count.

    should_stop: polled while waiting; when it returns True the round is abandoned
    (ExchangeAborted).
    clock: real time (default) or a simulator's virtual time."""

    def __init__(
        self,
        board: Board,
        *,
        peer_id: int,
        max_peers: int,
        settings: SwarmSettings | None = None,
        should_stop: Callable[[], bool] | None = None,
        clock: Clock | None = None,
    ) -> None:
        if not 0 <= peer_id < max_peers:
            raise ValueError(f"peer id {peer_id} must lie in [0, max_peers={max_peers})")
        self.board = board
        self.rank = peer_id
        self.world_size = max_peers
        self.settings = settings or SwarmSettings()
        self.should_stop = should_stop or (lambda: False)
        self.stats = TransportStats()
        self.last = RoundInfo()
        self.clock = clock or RealClock()
        self._past: dict[int, set[int]] = {}  # recent rounds -> peers received or counted late
        self._next = 0  # the round this peer announces before its first exchange
        self._closed = False
        self.barrier_waited_s: float | None = None  # how long the start barrier took (None: none)
        self.barrier_missing: list[int] = []  # initial peers the barrier gave up on
        self.rejected_records = 0  # heartbeats refused so far (see `members`)
        self._round: int | None = None  # the round of this peer's latest exchange
        self._rejected_seen: set[str] = set()  # bad records counted in the current round

    # keys
    def _round_key(self, round_: int) -> str:
        return f"{self.settings.name}:round:{round_}"

    @property
    def _members_key(self) -> str:
        return f"{self.settings.name}:members"

    # membership
    def _heartbeat(self, state: str, round_: int) -> None:
        now = self.board.now()
        self.board.publish(
            self._members_key, self.rank, [state, int(round_)], now + self.settings.member_ttl_s
        )

    def members(self) -> dict[int, int]:
        """Live peers (other than this one) -> the newest round each announced.

        Heartbeats are untrusted input: a record is used only if its subkey is a peer id in
        range and its value is `[state, round]` with state 'live' or 'left' and round an int
        >= 0 within `max_round + 1` and within `max_round_skew` of the swarm's own round;
        anything else is dropped and counted (`rejected_records`, `RoundInfo.rejected`)."""
        claims, bad = {}, set()
        for peer, v in self.board.read(self._members_key).items():
            if _is_int(peer) and peer == self.rank:
                continue
            state = _heartbeat_state(v)
            if not (_is_int(peer) and 0 <= peer < self.world_size) or state is None:
                bad.add(repr((peer, v))[:200])
            elif state[0] == LIVE:
                claims[peer] = state[1]
        limit = self.settings.max_round
        if limit is not None:
            bad |= {repr((p, r)) for p, r in claims.items() if r > limit + 1}
            claims = {p: r for p, r in claims.items() if r <= limit + 1}
        if claims:
            ranked = sorted(claims.values())
            ref = self._round if self._round is not None else ranked[(len(ranked) - 1) // 2]
            skew = self.settings.max_round_skew
            bad |= {repr((p, r)) for p, r in claims.items() if abs(r - ref) > skew}
            claims = {p: r for p, r in claims.items() if abs(r - ref) <= skew}
        new = bad - self._rejected_seen  # each bad record counted once per round, not per poll
        if new:
            self._rejected_seen |= new
            self.rejected_records += len(new)
            log.warning(
                "peer %d: rejected %d heartbeat record(s): %s", self.rank, len(new), sorted(new)
            )
        return claims

    def join_step(self, done: int) -> int:
        """The last step this peer should count as done when it (re)joins: its own `done`, or
        the swarm's current round minus one when the swarm is further along.

        An initial peer (`settings.start_peers`) first waits at the start barrier, so that the
        initial peers start round `done + 1` together (the newest checkpoint among them, when
        they all resume)."""
        if self.settings.start_peers:
            self._start_barrier(done)
        ahead = max(self.members().values(), default=0)
        step = max(done, ahead - 1)
        if step > done:
            log.info(
                "peer %d joins the swarm at round %d (its own last step: %d)",
                self.rank,
                step + 1,
                done,
            )
        self._next = step + 1
        return step

    def _start_barrier(self, done: int) -> None:
        """Announce this peer live at round `done + 1`, then wait until every initial peer has
        announced itself (live, or already left), `start_timeout_s` passed, or a stop."""
        s = self.settings
        others = {p for p in s.start_peers if p != self.rank and 0 <= p < self.world_size}
        t0 = self.clock.monotonic()
        beat = t0
        self._heartbeat(LIVE, done + 1)
        log.info("peer %d: at the start barrier, waiting for peers %s", self.rank, sorted(others))
        while True:
            came = {p for p in self.board.read(self._members_key) if p in others}
            missing = others - came
            if not missing or self.should_stop():
                break
            now = self.clock.monotonic()
            if now - t0 >= s.start_timeout_s:
                log.warning(
                    "peer %d: start barrier timed out after %.0f s without peers %s; starting "
                    "with whoever came (they join late)",
                    self.rank,
                    s.start_timeout_s,
                    sorted(missing),
                )
                break
            if now - beat >= s.member_ttl_s / 3:  # stay a member while waiting
                self._heartbeat(LIVE, done + 1)
                beat = now
            self.clock.sleep(s.poll_s)
        self.barrier_missing = sorted(missing)
        self.barrier_waited_s = self.clock.monotonic() - t0

    def ready(self) -> None:
        self._heartbeat(LIVE, self._next)

    # one round
    def exchange(self, round_: int, payload: bytes, *, max_bytes: int) -> dict[int, bytes | None]:
        s = self.settings
        t0, w0 = self.clock.monotonic(), time.perf_counter()
        self._round, self._rejected_seen = round_, set()
        self._heartbeat(LIVE, round_)
        self._publish(round_, payload)
        self.stats.bytes_sent += len(payload)
        info = RoundInfo(late=self._count_late())
        deadline = t0 + s.deadline_s
        while True:
            if self.should_stop():
                self.stats.seconds += time.perf_counter() - w0
                raise ExchangeAborted(f"stopped while waiting for round {round_}")
            records = self.board.read(self._round_key(round_))
            members = self.members()
            got = {p for p in records if p != self.rank}
            if set(members) <= got:
                break
            if self.clock.monotonic() >= deadline:
                info.timed_out = True
                break
            self.clock.sleep(s.poll_s)
        out: dict[int, bytes | None] = {}
        for peer, rec in records.items():
            if peer == self.rank:
                continue
            if not (isinstance(peer, int) and 0 <= peer < self.world_size):
                info.stale += 1
                continue
            data = unpack(rec, round_=round_, peer=peer)
            if isinstance(data, str):
                log.warning("peer %d round %d: dropped a record: %s", self.rank, round_, data)
                info.stale += 1
                continue
            self.stats.bytes_received += len(data)
            if len(data) > max_bytes:
                self.stats.oversized += 1
                out[peer] = None
            else:
                out[peer] = data
        info.members, info.arrived, info.peers = len(members), len(out), sorted(out)
        info.rejected = len(self._rejected_seen)
        sent = getattr(self.board, "sent", None)  # only a simulator's board knows
        if sent is not None:
            info.published = len(sent(self._round_key(round_)) - {self.rank})
        # This round's exchange is over: announce the next one at once, so that a peer joining
        # while this one still trains on round_ starts at round_ + 1, never at a finished round.
        self._heartbeat(LIVE, round_ + 1)
        self._past[round_] = {p for p in records if p != self.rank}
        for r in [r for r in self._past if r <= round_ - max(1, s.late_window)]:
            del self._past[r]
        self.last = info
        self.stats.seconds += time.perf_counter() - w0
        return out

    def _publish(self, round_: int, payload: bytes) -> None:
        key = self._round_key(round_)
        note = getattr(self.board, "note_sent", None)  # a simulator's board counts who took part
        if note is not None:
            note(key, self.rank)
        if self.settings.publish_delay_s > 0:  # a slow peer
            self.clock.sleep(self.settings.publish_delay_s)
        expires = self.board.now() + self.settings.payload_ttl_s
        if not self.board.publish(key, self.rank, pack(round_, self.rank, payload), expires):
            log.warning(
                "peer %d: the board refused this peer's payload of round %d", self.rank, round_
            )

    def _count_late(self) -> int:
        """Payloads of this peer's recent rounds (`late_window`) that arrived after it stopped
        waiting for them; each is counted once."""
        late = 0
        for r, seen in self._past.items():
            now = {p for p in self.board.read(self._round_key(r)) if p != self.rank}
            late += len(now - seen)
            seen |= now
        return late

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._heartbeat(LEFT, max(self._past, default=0))
        except Exception as e:  # leaving politely is best effort: the heartbeat expires anyway
            log.warning("peer %d: could not announce its leaving: %s", self.rank, e)
        self.board.close()
