"""The store transport: payloads through a key-value store, tolerant of lost peers.

Why not a collective: a gloo/NCCL all_gather cannot skip a rank, so one dead or stalled node
fails the collective on every other node and leaves the process group unusable. Here every node
`set`s its payload of step t under its own key and reads its peers' keys, so a missing peer is
only a missing key: after `timeout_s` (or at once, when the peer is known to have exited) the
node logs it, drops the peer for good and carries on with the others, or alone.

The store is a `torch.distributed.TCPStore` (plain TCP, no collectives): hosted by `ftis run`'s
parent process on one machine (so it outlives any node), or by torchrun's agent on the master
machine (`TORCHELASTIC_USE_AGENT_STORE`), or by rank 0 when the variables come from elsewhere.
Keys, under the prefix `ftis/` (plus torchrun's run id and restart count):

    hello/<rank>       what the node must agree on with its peers, and its first RL step
    hb/<rank>          heartbeat counter, bumped every `heartbeat_s` by a background thread
    ready/<rank>       set once the node's model is built (after any warm start)
    x/<step>/<rank>    the node's payload of that step (deleted two steps later)
    left/<rank>        set when the node exits (by itself, or by the launcher when it dies)

Every value a node or the launcher `set`s is authenticated: HMAC-SHA256 over key and value
with the run's secret, which the launcher hands its children in the environment
(`FTIS_STORE_SECRET`, never on the command line). A value whose tag does not verify (written
by something outside the run) is ignored and counted (`forged`): it cannot mark a peer as left,
stand in for a payload or a handshake. (Heartbeats are counters, `add`, and cannot be signed:
a forged beat can only delay a lost peer's detection until its payload's timeout.) Without a
secret (a hand-started torchrun group) values travel unsigned, as before, with a warning.
A payload larger than `CHUNK_BYTES` travels in chunks `x/<step>/<rank>/<i>` below torch's
per-value limit, with `x/<step>/<rank>` naming their count; a reader accepts at most as many
chunks as `max_bytes` allows.

A peer is lost when (a) `left/<peer>` exists, (b) its heartbeat has not moved for `timeout_s`
(the process or its machine is gone), or (c) it is ready but its payload of the current step
has not arrived within `timeout_s` (it stalled). Payloads are bytes validated by
`ftis.exchange.wire`, never pickles.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from ftis.exchange.transport import ExchangeAborted, TransportLost, TransportStats, rank_from_env

log = logging.getLogger(__name__)

HOSTED_ENV = "FTIS_STORE_HOSTED"  # set by `ftis run`: the parent process hosts the store
SECRET_ENV = "FTIS_STORE_SECRET"  # set by `ftis run` for its children: the run's store secret
# torch's TCPStore refuses (resets the connection on) a value above 8 MiB: payloads travel in
# chunks well below it.
CHUNK_BYTES = 4 * 2**20
_SEALED = b"FTS1"
_TAG = hashlib.sha256().digest_size
_PAYLOAD, _CHUNKED = b"P", b"C"
_CHUNK_INDEX = struct.Struct("<II")  # chunks, total bytes
_POLL_MIN_S, _POLL_MAX_S = 0.001, 0.02  # a peer's payload is noticed within 20 ms


class PeerGroupError(RuntimeError):
    """The group could not form (a peer exited or never showed up)."""


def new_secret() -> str:
    """A fresh per-run store secret (hex), for the launcher to hand its children."""
    return secrets.token_hex(32)


class Signer:
    """Seals store values with the run's secret (HMAC-SHA256 over key and value) and opens
    them; without a secret values pass unchanged (an unauthenticated group)."""

    def __init__(self, secret: bytes | None) -> None:
        self.secret = secret

    @classmethod
    def from_env(cls) -> Signer:
        """The secret in FTIS_STORE_SECRET (hex); none, with a warning, when it is unset."""
        raw = os.environ.get(SECRET_ENV, "")
        if not raw:
            log.warning(
                "%s is not set: store writes are not authenticated (anything that reaches the "
                "store's port can forge them); `ftis run` sets it, a hand-started group should "
                "give every node the same secret",
                SECRET_ENV,
            )
            return cls(None)
        try:
            return cls(bytes.fromhex(raw))
        except ValueError:
            raise PeerGroupError(f"{SECRET_ENV} must be hex (as `ftis run` writes it)") from None

    def _tag(self, key: str, value: bytes) -> bytes:
        assert self.secret is not None
        return hmac.new(self.secret, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def seal(self, key: str, value: bytes | str) -> bytes:
        value = value.encode() if isinstance(value, str) else value
        if self.secret is None:
            return value
        return _SEALED + self._tag(key, value) + value

    def open(self, key: str, sealed: bytes) -> bytes | None:
        """The value, or None when its tag does not verify (not written by the run)."""
        if self.secret is None:
            return sealed
        head = len(_SEALED) + _TAG
        if len(sealed) < head or not sealed.startswith(_SEALED):
            return None
        tag, value = sealed[len(_SEALED) : head], sealed[head:]
        return value if hmac.compare_digest(tag, self._tag(key, value)) else None


def _prefix() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        return f"ftis/{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return "ftis"


def host_store(host: str = "127.0.0.1") -> tuple[dist.Store, dist.Store, int]:
    """Start a store server in this process: (server, prefixed view, port). `ftis run` hosts
    the store of a one-machine run, so that it outlives every node."""
    server = dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    return server, dist.PrefixStore(_prefix(), server), server.port


def mark_left(store: dist.Store, rank: int, reason: str, *, signer: Signer | None = None) -> None:
    """Tell the peers that `rank` is gone (the launcher calls this when a node process dies),
    sealed with `signer` (default: the secret in the environment)."""
    signer = signer or Signer.from_env()
    store.set(f"left/{rank}", signer.seal(f"left/{rank}", reason))


def read_left(store: dist.Store, rank: int, signer: Signer) -> str | None:
    """Why `rank` left, if an authentic `left/<rank>` exists; None otherwise (absent, or
    forged: a value whose tag does not verify)."""
    if not store.check([f"left/{rank}"]):
        return None
    value = signer.open(f"left/{rank}", store.get(f"left/{rank}"))
    return None if value is None else value.decode(errors="replace")


def connect_store(timeout_s: float) -> tuple[dist.Store, int, int]:
    """(prefixed store, rank, world_size) from torchrun's variables: RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT. A client of the launcher's or torchrun agent's store when there is
    one, else rank 0 hosts it."""
    rank, world_size = rank_from_env(PeerGroupError, "the peers")
    hosted = (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        or os.environ.get(HOSTED_ENV) == "1"
    )
    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    try:
        store = dist.TCPStore(
            addr,
            int(port),
            world_size=None if hosted else world_size,
            is_master=not hosted and rank == 0,
            wait_for_workers=False,
            timeout=timedelta(seconds=max(1.0, min(timeout_s, 300.0))),
        )
    except (RuntimeError, ValueError) as e:
        raise PeerGroupError(
            f"cannot reach the store at MASTER_ADDR={addr} MASTER_PORT={port} ({e}); check that "
            "rank 0's machine is up and the port is open (and free, on rank 0)"
        ) from e
    return dist.PrefixStore(_prefix(), store), rank, world_size


class Membership:
    """This node's presence in the group: a heartbeat thread, the group-forming handshake,
    liveness of peers, and the `left` mark on exit."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        timeout_s: float,
        signer: Signer | None = None,
    ) -> None:
        self.store = store
        self.signer = signer or Signer.from_env()
        self.forged = 0  # values that did not verify, each counted once
        self._forged_seen: set[tuple[str, bytes]] = set()
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.heartbeat_s = max(0.05, min(2.0, timeout_s / 10))
        self.lost: dict[int, str] = {}
        self._beats: dict[int, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._broken = False
        store.add(f"hb/{rank}", 1)
        self._thread = threading.Thread(target=self._beat, name="ftis-heartbeat", daemon=True)
        self._thread.start()

    def get(self, key: str, *, store: dist.Store | None = None) -> bytes | None:
        """The authentic value of `key` (in `store`, default this membership's), or None when
        it is absent or forged (counted)."""
        store = store or self.store
        if not store.check([key]):
            return None
        sealed = store.get(key)
        value = self.signer.open(key, sealed)
        if value is None:
            digest = hashlib.sha256(sealed).digest()
            if (key, digest) not in self._forged_seen:
                self._forged_seen.add((key, digest))
                self.forged += 1
                log.warning(
                    "rank %d: ignored a value under %r that was not written by this run "
                    "(authentication failed)",
                    self.rank,
                    key,
                )
        return value

    def set(self, key: str, value: bytes | str, *, store: dist.Store | None = None) -> None:
        (store or self.store).set(key, self.signer.seal(key, value))

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.store.add(f"hb/{self.rank}", 1)
            except RuntimeError:  # the store is gone; the main thread finds out on its own
                return

    def gather(self, value: str, *, timeout_s: float | None = None) -> list[str]:
        """Every rank's `value` (the group-forming handshake). Raises PeerGroupError when a
        peer exits or does not show up within the timeout: a group forms whole or not at all."""
        self.set(f"hello/{self.rank}", value)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        out: dict[int, str] = {self.rank: value}
        pause = _POLL_MIN_S
        while len(out) < self.world_size:
            for p in range(self.world_size):
                if p in out:
                    continue
                hello = self.get(f"hello/{p}")
                if hello is not None:
                    out[p] = hello.decode("utf-8", errors="replace")
                elif (why := self.get(f"left/{p}")) is not None:
                    raise PeerGroupError(
                        f"rank {p} exited before the group formed ({why.decode(errors='replace')})"
                    )
            if len(out) < self.world_size:
                if time.monotonic() > deadline:
                    absent = sorted(set(range(self.world_size)) - set(out))
                    raise PeerGroupError(
                        f"ranks {absent} did not join within {timeout_s or self.timeout_s:g} s "
                        "(exchange.timeout_s); start every node, from the same config"
                    )
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
        return [out[p] for p in range(self.world_size)]

    def why_gone(self, peer: int, *, waiting_since: float | None) -> str | None:
        """Why `peer` counts as lost now, or None while it may still answer."""
        if peer in self.lost:
            return self.lost[peer]
        now = time.monotonic()
        why = self.get(f"left/{peer}")
        if why is not None:
            return f"it left ({why.decode(errors='replace')})"
        beat = int(self.store.add(f"hb/{peer}", 0))
        last = self._beats.get(peer)
        if last is None or last[0] != beat:
            self._beats[peer] = (beat, now)
        elif now - last[1] > self.timeout_s:
            return f"no heartbeat for {now - last[1]:.0f} s"
        if waiting_since is not None and now - waiting_since > self.timeout_s:
            return f"no payload within {self.timeout_s:g} s (exchange.timeout_s)"
        return None

    def drop(self, peer: int, reason: str, *, step: int) -> None:
        if peer not in self.lost:
            self.lost[peer] = reason
            live = self.world_size - 1 - len(self.lost)
            log.warning(
                "rank %d: lost peer %d at step %d: %s; carrying on with %d peer(s)",
                self.rank,
                peer,
                step,
                reason,
                live,
            )

    def broken(self, err: Exception, *, step: int) -> None:
        """The store itself is unreachable: every peer is lost, the node carries on alone."""
        if not self._broken:
            self._broken = True
            log.error(
                "rank %d: the store is unreachable at step %d (%s); training alone",
                self.rank,
                step,
                err,
            )
        for p in range(self.world_size):
            if p != self.rank:
                self.lost.setdefault(p, "the store is unreachable")

    @property
    def is_broken(self) -> bool:
        return self._broken

    def leave(self, reason: str) -> None:
        """Mark this node as gone (idempotent) and stop the heartbeat."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            mark_left(self.store, self.rank, reason, signer=self.signer)
        except RuntimeError:
            pass


class StoreTransport:
    """`Transport` through a store: tolerant of peers that die, stall or leave.

    Args:
        membership: this node's `Membership` (heartbeat, lost peers).
        first_steps: the first round of every rank (they differ after a resume in which one
            node's checkpoint is behind the others': it catches up alone until the others'
            first round). A peer takes part in round t when its first round is <= t.
        should_stop: polled while waiting; when it returns True before every payload of the
            round has arrived, `exchange` raises ExchangeAborted (Ctrl-C during a wait).
        on_store_lost: what to do when the store itself becomes unreachable (its host died):
            "stop" (default) raises TransportLost, so the node checkpoints and stops with a
            message saying how to resume; "continue" drops every peer and goes on alone.

    `exchange` returns the payload of every live peer that takes part in the round; a peer that
    is lost is absent (and stays lost). A payload over `max_bytes` comes back as None.
    """

    def __init__(
        self,
        membership: Membership,
        *,
        first_steps: list[int],
        should_stop: Callable[[], bool] | None = None,
        on_store_lost: str = "stop",
    ) -> None:
        if len(first_steps) != membership.world_size:
            raise ValueError(
                f"first_steps has {len(first_steps)} entries, world is {membership.world_size}"
            )
        if on_store_lost not in ("stop", "continue"):
            raise ValueError(f"on_store_lost must be 'stop' or 'continue', got {on_store_lost!r}")
        self.m = membership
        self.store = membership.store
        self.rank = membership.rank
        self.world_size = membership.world_size
        self.first_steps = first_steps
        self.should_stop = should_stop or (lambda: False)
        self.on_store_lost = on_store_lost
        self.stats = TransportStats(lost=membership.lost)
        self._ready_seen: dict[int, float] = {}
        self._chunks: dict[int, int] = {}  # step -> chunks this node posted for it

    def ready(self) -> None:
        try:
            self.m.set(f"ready/{self.rank}", "1", store=self.store)
        except RuntimeError as e:
            self._store_lost(e, step=self.first_steps[self.rank])

    @property
    def live_peers(self) -> list[int]:
        return [p for p in range(self.world_size) if p != self.rank and p not in self.m.lost]

    def exchange(self, round_: int, payload: bytes, *, max_bytes: int) -> dict[int, bytes | None]:
        if self.should_stop():
            raise ExchangeAborted(f"stop requested before the exchange of round {round_}")
        t0 = time.perf_counter()
        raw: dict[int, bytes] = {}
        if not self.m.is_broken:
            try:
                raw = self._trade(payload, round_, max_bytes=max_bytes)
            except RuntimeError as e:  # the store went away mid-round
                self._store_lost(e, step=round_)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.bytes_sent += len(payload)
        out: dict[int, bytes | None] = {}
        for p, data in raw.items():
            if data is None:  # more chunks than max_bytes allows: not even read
                self.stats.oversized += 1
                out[p] = None
                continue
            self.stats.bytes_received += len(data)
            if len(data) > max_bytes:
                self.stats.oversized += 1
                out[p] = None
            else:
                out[p] = data
        return out

    def _store_lost(self, err: Exception, *, step: int) -> None:
        if self.on_store_lost == "stop":
            raise TransportLost(
                f"the exchange's store became unreachable at round {step} ({err}): its host "
                "(the `ftis run` process, or torchrun's agent on the master machine) is gone. "
                "This node stops rather than silently train alone; resume the run with "
                "`ftis run --resume RUN_DIR` once every node can reach a store again, or set "
                "exchange.on_store_lost=continue to let nodes carry on alone"
            ) from err
        self.m.broken(err, step=step)

    def _post(self, step: int, payload: bytes) -> None:
        """Write this node's payload of `step`: in one value, or in chunks below the store's
        value limit followed by the index that names them (so a reader that sees the index
        finds every chunk)."""
        key = f"x/{step}/{self.rank}"
        if len(payload) <= CHUNK_BYTES:
            self.m.set(key, _PAYLOAD + payload, store=self.store)
            return
        n = -(-len(payload) // CHUNK_BYTES)
        for i in range(n):
            self.m.set(
                f"{key}/{i}", payload[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES], store=self.store
            )
        self._chunks[step] = n
        self.m.set(key, _CHUNKED + _CHUNK_INDEX.pack(n, len(payload)), store=self.store)

    def _retract(self, step: int) -> None:
        key = f"x/{step}/{self.rank}"
        self.store.delete_key(key)
        for i in range(self._chunks.pop(step, 0)):
            self.store.delete_key(f"{key}/{i}")

    def _fetch(self, peer: int, step: int, max_bytes: int) -> tuple[bool, bytes | None]:
        """(arrived, payload) of `peer` at `step`: (False, None) while there is no authentic
        value; (True, None) for a chunked payload larger than `max_bytes` (not read)."""
        key = f"x/{step}/{peer}"
        head = self.m.get(key, store=self.store)
        if head is None:
            return False, None
        if head[:1] == _PAYLOAD:
            return True, head[1:]
        if head[:1] != _CHUNKED or len(head) != 1 + _CHUNK_INDEX.size:
            return True, b""  # authentic but malformed: the codec rejects an empty payload
        n, total = _CHUNK_INDEX.unpack(head[1:])
        if total > max_bytes or n != -(-total // CHUNK_BYTES):
            return True, None
        parts = [self.m.get(f"{key}/{i}", store=self.store) for i in range(n)]
        if any(p is None for p in parts):
            return True, b""
        return True, b"".join(parts)  # type: ignore[arg-type]

    def _trade(self, payload: bytes, step: int, *, max_bytes: int) -> dict[int, bytes | None]:
        """Post this node's payload of `step`, then collect the payload of every live peer that
        takes part in this step, dropping the ones that are gone."""
        self._post(step, payload)
        if step - 2 >= self.first_steps[self.rank]:
            # Every live peer has read it: it posted step - 1 after reading our step - 2.
            self._retract(step - 2)
        pending = {p for p in self.live_peers if self.first_steps[p] <= step}
        got: dict[int, bytes | None] = {}
        waiting_since = time.monotonic()
        pause = _POLL_MIN_S
        while pending:
            for p in sorted(pending):
                arrived, data = self._fetch(p, step, max_bytes)
                if arrived:
                    got[p] = data
                    pending.discard(p)
                    continue
                if (
                    p not in self._ready_seen
                    and self.m.get(f"ready/{p}", store=self.store) is not None
                ):
                    self._ready_seen[p] = time.monotonic()
                since = max(waiting_since, self._ready_seen[p]) if p in self._ready_seen else None
                reason = self.m.why_gone(p, waiting_since=since)
                if reason is not None:
                    self.m.drop(p, reason, step=step)
                    pending.discard(p)
            if pending:
                if self.should_stop():
                    raise ExchangeAborted(f"stop requested while waiting for round {step}")
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
        return got

    def close(self) -> None:
        """Nothing to release: the membership (and the `left` mark) belongs to its creator."""
