"""A swarm transport: peers that come and go, no fixed world size, no barrier (rl-swarm's contract).

    publish   this peer's payload of round r under the key `<swarm>:round:<r>`, subkey = its peer
              id, with an expiry; and a heartbeat under `<swarm>:members` (its id ->
              [state, r, expiry]); both signed with the swarm's secret
    collect   read the round's key until every live member has published or `deadline_s` passed
              (a candidate, whose payload never arrived yet: `candidate_grace_s`)
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
The initial peers' own signed claims count there without a payload (after a whole-run resume
they agree on the newest checkpoint, before anybody has published).

Members prove themselves (issue 37). Every record is signed with the swarm's shared secret
(`SwarmSettings.secret`: HMAC-SHA256 over key, subkey and value, `ftis.exchange.store.Signer`):
a heartbeat carries its state, round and expiry, a payload its header; a record that does not
verify is refused and counted (a heartbeat: `rejected`; a payload: `forged`). A peer whose
signed heartbeat says live is a *candidate* until an authenticated payload of it has arrived:
a round waits for a candidate `candidate_grace_s` at most, for a *member* (proven) up to
`deadline_s`. A peer waited for in `silent_rounds` consecutive rounds without sending a valid
payload is dropped (`dropped`, counted once) and not waited for again until a payload of it
arrives. A round claim is believed only if it is at most `max_round_skew` beyond the rounds the
members proved with their payloads (or a payload of that peer proves the claim itself), and a
round waits only for peers whose claim is at most that round. Without a secret records travel
unsigned (the payload rule, the drop and the round checks still hold).

Joining late: `join_step(done)` says where the swarm stands, from the members' payloads: a
live member's claimed round counts only when a payload of it proves the claim (its payload of
that round or the one before), and the newest such claim within `max_round_skew` of their lower
median is the swarm's round; so a late joiner, or a peer rejoining after a crash, trains on
the current round instead of replaying the swarm's past, and a forged claim cannot make it skip
the run. Records carry a small header (magic, round, peer id): a record for another round or
from another peer than its subkey says is dropped and counted (`stale`), never handed over as
this round's. A value larger than `max_bytes` comes back as None (the codec rejects it); boards
refuse values over their own size limit outright.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ftis.exchange.store import Signer
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


def _lower_median(values: list[int]) -> int:
    ranked = sorted(values)
    return ranked[(len(ranked) - 1) // 2]


def seal_heartbeat(
    signer: Signer, members_key: str, peer: int, state: str, round_: int, expires: float
) -> bytes:
    """A heartbeat value: `[state, round, expires]` (JSON), signed over the members key and the
    peer id, so that it cannot be replayed under another id or after it expired."""
    body = json.dumps([state, int(round_), float(expires)]).encode()
    return signer.seal(f"{members_key}/{peer}", body)


def open_heartbeat(
    signer: Signer, members_key: str, peer: int, value: Any, now: float
) -> tuple[str, int] | str:
    """(state, round) of a heartbeat that verifies, is well formed and has not expired; else
    why not."""
    if not isinstance(value, bytes) or len(value) > 256:
        return "not a swarm heartbeat"
    body = signer.open(f"{members_key}/{peer}", value)
    if body is None:
        return "its signature does not verify"
    try:
        v = json.loads(body)
    except ValueError:
        return "not a swarm heartbeat"
    if not (isinstance(v, list) and len(v) == 3):
        return "not a swarm heartbeat"
    state, round_, expires = v
    if state not in (LIVE, LEFT) or not _is_int(round_) or round_ < 0:
        return "malformed"
    if not isinstance(expires, int | float) or isinstance(expires, bool) or expires <= now:
        return "expired (a replayed record)"
    return state, round_


def announce_left(
    board: Board, name: str, peer: int, *, ttl_s: float, secret: bytes | None = None
) -> bool:
    """Say on `peer`'s behalf that it left swarm `name` (e.g. the launcher, when a peer's
    process died before it could say so): nobody waits for it, at the start barrier or in a
    round. `secret`: the swarm's (the record is signed with it, as the peer's own would be)."""
    expires = board.now() + ttl_s
    value = seal_heartbeat(Signer(secret), f"{name}:members", peer, LEFT, 0, expires)
    return board.publish(f"{name}:members", peer, value, expires)


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
    join_round: a late joiner or a rejoin started ahead of its time (so that its start-up is
        done when the swarm gets there): `join_step` first waits, silent (no heartbeat, so
        nobody waits for it), until a live member claims round `join_round + 1`, every peer it
        heard of has left, or `start_timeout_s` passed without a live member. 0: no wait.
    publish_delay_s: a slow peer: it publishes each round's payload this long after it entered
        the round's exchange (slow hardware, simulated); beyond the others' deadline, they
        count its payloads as late when they land.
    late_window: how many past rounds are watched for payloads that arrive after this peer left
        them (counted once each as `late`).
    max_round: the run's last round (train.steps), when known: a heartbeat claiming a round
        beyond max_round + 1 is rejected (no honest peer can be there).
    max_round_skew: a heartbeat claiming a round more than this beyond the swarm's round (the
        lower median of the rounds the members proved with their payloads, and this peer's own
        round once it exchanges; before any payload, the lower median of the claims) is
        rejected, unless a payload of that peer proves the claim: a forged claim cannot make a
        joiner skip the run or the others wait for a round nobody is in.
    silent_rounds: a peer waited for in this many consecutive rounds without a valid payload
        (a member whose payloads stopped, or a candidate that never sent one) is dropped: not
        waited for until a payload of it arrives, or it leaves and comes back.
    candidate_grace_s: the longest a round waits for a candidate (a live heartbeat, no valid
        payload yet): at most deadline_s.
    secret: the swarm's shared secret: every heartbeat and payload is signed with it
        (HMAC-SHA256) and a record that does not verify is refused. None: unsigned records."""

    name: str = "swarm"
    deadline_s: float = 20.0
    member_ttl_s: float = 60.0
    payload_ttl_s: float = 300.0
    poll_s: float = 0.1
    start_peers: frozenset[int] = frozenset()
    start_timeout_s: float = 300.0
    join_round: int = 0
    publish_delay_s: float = 0.0
    late_window: int = 4
    max_round: int | None = None
    max_round_skew: int = 4
    silent_rounds: int = 3
    candidate_grace_s: float = 5.0
    secret: bytes | None = field(default=None, repr=False)


@dataclass
class RoundInfo:
    """What one round of this peer saw: members it waited for (peers proven by a payload) and
    candidates (live, no valid payload yet), peers whose payload arrived, records dropped as
    stale (another round or peer than the key says) or malformed, payload records whose
    signature did not verify (forged), payloads of the previous rounds that arrived after this
    peer left them (late), peers dropped this round for `silent_rounds` rounds without a
    payload, and whether it stopped waiting for a member at the deadline."""

    members: int = 0
    arrived: int = 0
    stale: int = 0
    late: int = 0
    timed_out: bool = False
    rejected: int = 0  # heartbeats refused (unsigned, malformed, or a round claim out of bounds)
    peers: list[int] = field(default_factory=list)
    published: int | None = None  # peers that sent this round's payload (a simulator knows)
    candidates: int = 0
    forged: int = 0
    dropped: int = 0


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
        self.signer = Signer(self.settings.secret)
        self._past: dict[int, set[int]] = {}  # recent rounds -> peers received or counted late
        self._next = 0  # the round this peer announces before its first exchange
        self._closed = False
        self.barrier_waited_s: float | None = None  # how long the start barrier took (None: none)
        self.barrier_missing: list[int] = []  # initial peers the barrier gave up on
        self.join_waited_s: float | None = None  # how long it waited for its join round
        self.rejected_records = 0  # heartbeats refused so far (see `members`)
        self.forged_records = 0  # payload records whose signature did not verify, so far
        self.dropped_silent = 0  # peers dropped for `silent_rounds` rounds without a payload
        self._round: int | None = None  # the round of this peer's latest exchange
        self._rejected_seen: set[str] = set()  # bad records counted in the current round
        self._proven: dict[int, int] = {}  # peer -> newest round of its valid payloads seen
        self._silent: dict[int, int] = {}  # peer -> consecutive rounds waited for in vain
        self._dropped: set[int] = set()  # peers not waited for (silent_rounds without payload)
        self._probed: dict[tuple[int, int], bool] = {}  # (peer, claim) -> proven (this round)
        self._reads: dict[int, dict[Any, Any]] = {}  # round -> its records, read while probing

    # keys
    def _round_key(self, round_: int) -> str:
        return f"{self.settings.name}:round:{round_}"

    @property
    def _members_key(self) -> str:
        return f"{self.settings.name}:members"

    # records
    def _open_payload(self, round_: int, peer: Any, record: Any) -> bytes | tuple[str, str]:
        """The payload of `peer`'s record under round `round_`'s key, or (kind, why) it is not:
        kind 'forged' (its signature does not verify) or 'stale' (another round or peer than
        the key says, not a swarm record, not a peer id)."""
        if not (_is_int(peer) and 0 <= peer < self.world_size):
            return "stale", f"subkey {peer!r} is not a peer id"
        if not isinstance(record, bytes):
            return "stale", "not a swarm record"
        opened = self.signer.open(f"{self._round_key(round_)}/{peer}", record)
        if opened is None:
            return "forged", "its signature does not verify"
        data = unpack(opened, round_=round_, peer=peer)
        if isinstance(data, str):
            return "stale", data
        return data

    def _prove(self, peer: int, round_: int) -> None:
        """A valid payload of `peer`'s (round `round_`) arrived: it is a member."""
        self._proven[peer] = max(self._proven.get(peer, round_), round_)
        self._silent.pop(peer, None)
        if peer in self._dropped:
            self._dropped.discard(peer)
            log.info("peer %d: peer %d sends payloads again: a member again", self.rank, peer)

    def _probe(self, peer: int, claim: int) -> bool:
        """Whether a payload of `peer` proves its claim to be in round `claim`: its payload of
        that round or of the one before (it finished that one and announced the next). Reads
        at most those two rounds' keys, once per round of this peer."""
        if self._proven.get(peer, -1) >= claim - 1:
            return True
        if (peer, claim) not in self._probed:
            ok = False
            for r in (claim, claim - 1):
                if r < 1:
                    continue
                if r not in self._reads:
                    self._reads[r] = self.board.read(self._round_key(r))
                rec = self._reads[r].get(peer)
                if rec is not None and isinstance(self._open_payload(r, peer, rec), bytes):
                    self._prove(peer, r)
                    ok = True
                    break
            self._probed[(peer, claim)] = ok
        return self._probed[(peer, claim)]

    # membership
    def _heartbeat(self, state: str, round_: int) -> None:
        expires = self.board.now() + self.settings.member_ttl_s
        value = seal_heartbeat(self.signer, self._members_key, self.rank, state, round_, expires)
        self.board.publish(self._members_key, self.rank, value, expires)

    def _reject(self, bad: dict[str, str]) -> None:
        new = {k: v for k, v in bad.items() if k not in self._rejected_seen}
        if new:  # each bad record counted once per round, not per poll
            self._rejected_seen |= set(new)
            self.rejected_records += len(new)
            log.warning(
                "peer %d: rejected %d heartbeat record(s): %s",
                self.rank,
                len(new),
                "; ".join(f"{k}: {v}" for k, v in sorted(new.items())),
            )

    def _heartbeats(self) -> dict[int, tuple[str, int]]:
        """Other peers' heartbeats that verify: peer -> (state, round). The rest is counted."""
        now, beats, bad = self.board.now(), {}, {}
        for peer, v in self.board.read(self._members_key).items():
            if _is_int(peer) and peer == self.rank:
                continue
            if not (_is_int(peer) and 0 <= peer < self.world_size):
                bad[repr((peer, v))[:200]] = "not a peer id"
                continue
            got = open_heartbeat(self.signer, self._members_key, peer, v, now)
            if isinstance(got, str):
                bad[repr((peer, v))[:200]] = got
            else:
                beats[peer] = got
        self._reject(bad)
        for p in list(self._dropped | set(self._silent)):
            if p not in beats or beats[p][0] == LEFT:  # gone: it starts afresh if it comes back
                self._dropped.discard(p)
                self._silent.pop(p, None)
        for p, (state, _) in beats.items():
            if state == LEFT:
                self._proven.pop(p, None)
        return beats

    def _reference(self, claims: dict[int, int]) -> int | None:
        """The swarm's round as far as payloads prove it: the lower median of the newest rounds
        of the live members' payloads and this peer's own round; before any payload, the lower
        median of the claims."""
        proven = [self._proven[p] for p in claims if p in self._proven and p not in self._dropped]
        if self._round is not None:
            proven.append(self._round)
        if proven:
            return _lower_median(proven)
        return _lower_median(list(claims.values())) if claims else None

    def members(self) -> dict[int, int]:
        """Live peers (other than this one) -> the round each claims (signed heartbeats).

        Heartbeats are untrusted input: a record is used only if its subkey is a peer id in
        range, its signature verifies (with the swarm's secret), it has not expired, and its
        value is `[state, round, expires]` with state 'live' or 'left' and round an int >= 0
        within `max_round + 1` and at most `max_round_skew` beyond the swarm's round as the
        members' payloads prove it (`_reference`), unless a payload of that peer proves the
        claim; anything else is dropped and counted (`rejected_records`, `RoundInfo.rejected`).
        A peer listed here is a member only once a payload of it arrived (see `exchange`)."""
        claims = {p: r for p, (state, r) in self._heartbeats().items() if state == LIVE}
        bad = {}
        limit = self.settings.max_round
        if limit is not None:
            bad |= {repr((p, r)): "beyond the run" for p, r in claims.items() if r > limit + 1}
            claims = {p: r for p, r in claims.items() if r <= limit + 1}
        ref = self._reference(claims)
        if ref is not None:
            top = ref + self.settings.max_round_skew
            far = {p: r for p, r in claims.items() if r > top and not self._probe(p, r)}
            bad |= {repr((p, r)): f"ahead of the swarm's round {ref}" for p, r in far.items()}
            claims = {p: r for p, r in claims.items() if p not in far}
        self._reject(bad)
        return claims

    def join_step(self, done: int) -> int:
        """The last step this peer should count as done when it (re)joins: its own `done`, or
        the swarm's current round minus one when the swarm is further along.

        The swarm's round comes from the members' payloads: a live member's claim counts when
        a payload of it proves the claim (`_probe`); the newest such claim at most
        `max_round_skew` beyond their lower median is the swarm's round. An initial peer
        (`settings.start_peers`) first waits at the start barrier, so that the initial peers
        start round `done + 1` together (the newest checkpoint among them, when they all
        resume): their claims count there without a payload."""
        self._probed, self._reads = {}, {}
        trusted = {}
        if self.settings.start_peers:
            self._start_barrier(done)
        elif self.settings.join_round > done:
            self._await_round(self.settings.join_round)
        claims = self.members()
        if self.settings.start_peers:
            trusted = {p: r for p, r in claims.items() if p in self.settings.start_peers}
        rounds = {p: r for p, r in claims.items() if p not in self._dropped and self._probe(p, r)}
        rounds = {**trusted, **rounds}
        ahead = 0
        if rounds:
            top = _lower_median(list(rounds.values())) + self.settings.max_round_skew
            ahead = max(r for r in rounds.values() if r <= top)
        self._probed, self._reads = {}, {}
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
        announced itself (a signed heartbeat: live, or already left), `start_timeout_s`
        passed, or a stop."""
        s = self.settings
        others = {p for p in s.start_peers if p != self.rank and 0 <= p < self.world_size}
        t0 = self.clock.monotonic()
        beat = t0
        self._heartbeat(LIVE, done + 1)
        log.info("peer %d: at the start barrier, waiting for peers %s", self.rank, sorted(others))
        while True:
            came = {p for p in self._heartbeats() if p in others}
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

    def _await_round(self, round_: int) -> None:
        """Wait, silent, until a live member claims round `round_ + 1` (the swarm finished
        `round_`, where this peer's schedule has it join), every peer heard of has left,
        `start_timeout_s` passed without a live member, or a stop."""
        s = self.settings
        t0 = last_live = self.clock.monotonic()
        log.info("peer %d: waiting for the swarm to reach round %d", self.rank, round_ + 1)
        while not self.should_stop():
            beats = self._heartbeats()
            live = [r for state, r in beats.values() if state == LIVE]
            now = self.clock.monotonic()
            if live:
                last_live = now
                if max(live) > round_:
                    break
            elif beats:  # everyone it heard of has left: nobody to wait for
                log.warning("peer %d: every peer left before round %d", self.rank, round_ + 1)
                break
            if now - last_live >= s.start_timeout_s:
                log.warning(
                    "peer %d: no live peer for %.0f s; joining without waiting for round %d",
                    self.rank,
                    s.start_timeout_s,
                    round_ + 1,
                )
                break
            self.clock.sleep(s.poll_s)
        self.join_waited_s = self.clock.monotonic() - t0

    def ready(self) -> None:
        self._heartbeat(LIVE, self._next)

    # one round
    def exchange(self, round_: int, payload: bytes, *, max_bytes: int) -> dict[int, bytes | None]:
        """Publish this peer's payload of `round_`, then wait for the live peers whose claim is
        at most `round_` (the others are past it, or lie): a member (a payload of it arrived
        before) until its payload is there or `deadline_s` passed, a candidate (none yet) at
        most `candidate_grace_s`. A payload record whose signature does not verify does not
        count as the peer's; one that verifies but is stale does (the peer has answered)."""
        s = self.settings
        t0, w0 = self.clock.monotonic(), time.perf_counter()
        self._round, self._rejected_seen = round_, set()
        self._probed, self._reads = {}, {}
        self._heartbeat(LIVE, round_)
        self._publish(round_, payload)
        self.stats.bytes_sent += len(payload)
        info = RoundInfo(late=self._count_late())
        deadline = t0 + s.deadline_s
        grace = t0 + min(s.candidate_grace_s, s.deadline_s)
        key = self._round_key(round_)
        checked: dict[Any, tuple[Any, bytes | tuple[str, str]]] = {}
        while True:
            if self.should_stop():
                self.stats.seconds += time.perf_counter() - w0
                raise ExchangeAborted(f"stopped while waiting for round {round_}")
            records = self.board.read(key)
            for peer, rec in records.items():
                if _is_int(peer) and peer == self.rank:
                    continue
                seen = checked.get(peer)
                if seen is None or (seen[0] is not rec and seen[0] != rec):
                    checked[peer] = (rec, self._open_payload(round_, peer, rec))
            claims = self.members()
            waited = {p for p, r in claims.items() if r <= round_ and p not in self._dropped}
            members = {p for p in waited if p in self._proven}
            answered = {
                p
                for p, (_, got) in checked.items()
                if p in records and not (isinstance(got, tuple) and got[0] == "forged")
            }
            now = self.clock.monotonic()
            pending = (members - answered) | (
                (waited - members - answered) if now < grace else set()
            )
            if not pending:
                break
            if now >= deadline:
                info.timed_out = True
                break
            self.clock.sleep(s.poll_s)
        out: dict[int, bytes | None] = {}
        for peer in records:
            if _is_int(peer) and peer == self.rank:
                continue
            got = checked[peer][1]
            if isinstance(got, tuple):
                kind, why = got
                log.warning("peer %d round %d: dropped a record: %s", self.rank, round_, why)
                if kind == "forged":
                    info.forged += 1
                else:
                    info.stale += 1
                continue
            self._prove(peer, round_)
            out[peer] = self.stats.received(got, max_bytes)
        for p in sorted(waited - set(out)):  # waited for in vain this round
            self._silent[p] = self._silent.get(p, 0) + 1
            if self._silent[p] >= s.silent_rounds and p not in self._dropped:
                self._dropped.add(p)
                self.dropped_silent += 1
                info.dropped += 1
                log.warning(
                    "peer %d: dropped peer %d: no valid payload of it in %d rounds (%s)",
                    self.rank,
                    p,
                    self._silent[p],
                    "a member" if p in self._proven else "a candidate, never a member",
                )
        present = {p for p in claims if p not in self._dropped}  # live, believed, not dropped
        info.members = sum(p in self._proven for p in present)
        info.candidates = len(present) - info.members
        info.arrived, info.peers = len(out), sorted(out)
        info.rejected = len(self._rejected_seen)
        self.forged_records += info.forged
        sent = getattr(self.board, "sent", None)  # only a simulator's board knows
        if sent is not None:
            info.published = len(sent(key) - {self.rank})
        # This round's exchange is over: announce the next one at once, so that a peer joining
        # while this one still trains on round_ starts at round_ + 1, never at a finished round.
        self._heartbeat(LIVE, round_ + 1)
        self._past[round_] = {p for p in records if p != self.rank}
        for r in [r for r in self._past if r <= round_ - max(1, s.late_window)]:
            del self._past[r]
        self.last = info
        self._reads = {}  # (probed rounds' payloads: not kept between rounds)
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
        record = self.signer.seal(f"{key}/{self.rank}", pack(round_, self.rank, payload))
        if not self.board.publish(key, self.rank, record, expires):
            log.warning(
                "peer %d: the board refused this peer's payload of round %d", self.rank, round_
            )

    def _count_late(self) -> int:
        """Valid payloads of this peer's recent rounds (`late_window`) that arrived after it
        stopped waiting for them; each is counted once, and proves its sender a member."""
        late = 0
        for r, seen in self._past.items():
            for p, rec in self.board.read(self._round_key(r)).items():
                if p == self.rank or p in seen:
                    continue
                seen.add(p)
                if isinstance(self._open_payload(r, p, rec), bytes):
                    late += 1
                    self._prove(p, r)
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
