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
    hb/<rank>          heartbeat "<beats> <last step posted>", rewritten every `heartbeat_s` by
                       a background thread and right after each payload is posted
    ready/<rank>       set once the node's model is built (after any warm start)
    x/<step>/<rank>    the node's payload of that step (deleted two steps later)
    left/<rank>        set when the node exits (by itself, or by the launcher when it dies)

Every value a node or the launcher `set`s is encrypted and authenticated (AES-256-GCM, the
store key as associated data) under the run's secret, which the launcher hands its children in
the environment (`FTIS_STORE_SECRET`, never on the command line): a local client that reaches
the store's port reads no sample, heartbeat or handshake in clear, and a value that does not
decrypt (written by something outside the run, or moved from another key) is ignored and
counted (`forged`): it cannot mark a peer as left, stand in for a payload, a heartbeat or a
handshake. Every record is a value that ftis `set`s and
`get`s: the store never parses one (torch's `add` would, and a stranger's `set('hb/1', 'abc')`
made every later `add` fail on the server), so no record of the wrong type reaches torch.
Without a secret (a hand-started torchrun group on one machine) values travel unsigned, with a
warning; a store on an address other than loopback refuses to start without one.

The store listens on loopback (127.0.0.1) unless MASTER_ADDR names another address (a multi-host
group): torch's own server listens on every interface, so ftis binds the socket itself and hands
it over (`master_listen_fd`).
A payload larger than `CHUNK_BYTES` travels in chunks `x/<step>/<rank>/<i>` below torch's
per-value limit, with `x/<step>/<rank>` naming their count; a reader accepts at most as many
chunks as `max_bytes` allows.

A peer is lost when (a) an authentic `left/<peer>` exists (or existed: a departure once read
stays read, so deleting the mark hides nothing), or (b) its heartbeat has not advanced for
`timeout_s` (the process or its machine is gone). A beat is a time in ms that only grows; an
authentic heartbeat older than one already seen (a replay) is counted (`stale_heartbeats`)
and is no sign of life. A payload that is not there is *missed*,
not lost: when the peer's heartbeat says it posted the step but no authentic payload is there
(overwritten or deleted by something outside the run), at once; when it is ready and alive but
its payload has not arrived within `timeout_s` (it stalled), after that wait. A missed payload
skips the peer for that round (counted); `max_missed` consecutive misses drop it (c). Payloads
are bytes validated by `ftis.exchange.wire`, never pickles.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
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
_SEALED = b"FTS2"  # FTS1 was HMAC-SHA256 over values in clear
_NONCE, _TAG = 12, 16  # AES-GCM's nonce and tag
_PAYLOAD, _CHUNKED = b"P", b"C"
_CHUNK_INDEX = struct.Struct("<II")  # chunks, total bytes
_POLL_MIN_S, _POLL_MAX_S = 0.001, 0.02  # a peer's payload is noticed within 20 ms


class PeerGroupError(RuntimeError):
    """The group could not form (a peer exited or never showed up)."""


def new_secret() -> str:
    """A fresh per-run store secret (hex), for the launcher to hand its children."""
    return secrets.token_hex(32)


class Signer:
    """Seals store values with the run's secret and opens them: AES-256-GCM (the
    `cryptography` package) under a key derived from the secret, a fresh nonce per value and
    the store key as associated data, so a value is both unreadable and unforgeable without the
    secret, and cannot be moved to another key. Without a secret values pass unchanged (an
    unauthenticated group)."""

    def __init__(self, secret: bytes | None) -> None:
        self.secret = secret
        self._aead = None
        if secret is not None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            key = hmac.new(secret, b"ftis store values, AES-256-GCM", hashlib.sha256).digest()
            self._aead = AESGCM(key)

    @classmethod
    def from_env(cls) -> Signer:
        """The secret in FTIS_STORE_SECRET (hex); none, with a warning, when it is unset."""
        raw = os.environ.get(SECRET_ENV, "")
        if not raw:
            log.warning(
                "%s is not set: store writes are neither authenticated nor private (anything "
                "that reaches the store's port can read and forge them); `ftis run` sets it, a "
                "hand-started group should give every node the same secret",
                SECRET_ENV,
            )
            return cls(None)
        try:
            return cls(bytes.fromhex(raw))
        except ValueError:
            raise PeerGroupError(f"{SECRET_ENV} must be hex (as `ftis run` writes it)") from None

    def seal(self, key: str, value: bytes | str) -> bytes:
        value = value.encode() if isinstance(value, str) else value
        if self._aead is None:
            return value
        nonce = secrets.token_bytes(_NONCE)
        return _SEALED + nonce + self._aead.encrypt(nonce, value, key.encode())

    def open(self, key: str, sealed: bytes) -> bytes | None:
        """The value, or None when it does not decrypt under this key (not written by the
        run, or written under another key)."""
        if self._aead is None:
            return sealed
        from cryptography.exceptions import InvalidTag

        head = len(_SEALED) + _NONCE
        if len(sealed) < head + _TAG or not sealed.startswith(_SEALED):
            return None
        try:
            return self._aead.decrypt(sealed[len(_SEALED) : head], sealed[head:], key.encode())
        except InvalidTag:
            return None


def _prefix() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        return f"ftis/{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return "ftis"


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) resolves to a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def gloo_on_loopback() -> None:
    """Make gloo (torch.distributed's CPU backend) listen on the loopback interface when the
    group's MASTER_ADDR is loopback (one machine) and the user did not choose an interface
    (GLOO_SOCKET_IFNAME): gloo otherwise binds the address of the machine's hostname."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or not is_loopback(
        os.environ.get("MASTER_ADDR", "127.0.0.1")
    ):
        return
    for _, name in socket.if_nameindex():
        if name == "lo" or name.startswith("lo0"):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


def listen_socket(host: str, port: int = 0) -> tuple[int, int]:
    """(file descriptor, port) of a TCP socket listening on `host` only (port 0: the OS picks),
    for torch's TCPStore server, which would otherwise listen on every interface."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return sock.detach(), port  # the store owns the descriptor from now on


def _server(host: str, port: int, *, timeout: timedelta, world_size=None) -> dist.TCPStore:
    fd, port = listen_socket(host, port)
    try:
        return dist.TCPStore(
            host,
            port,
            world_size=world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise


def host_store(host: str = "127.0.0.1") -> tuple[dist.Store, dist.Store, int]:
    """Start a store server in this process, listening on `host` only: (server, prefixed view,
    port). `ftis run` hosts the store of a one-machine run, so that it outlives every node."""
    server = _server(host, 0, timeout=timedelta(seconds=60))
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
    if not os.environ.get(SECRET_ENV) and not is_loopback(addr):
        raise PeerGroupError(
            f"MASTER_ADDR={addr} is not a loopback address: a group across machines needs a "
            f"shared secret, or anyone who reaches the port can write its store. Set {SECRET_ENV} "
            "to the same hex string on every node (e.g. the output of `python -c 'import "
            "secrets; print(secrets.token_hex(32))'`), given through the environment, never on "
            "a command line"
        )
    timeout = timedelta(seconds=max(1.0, min(timeout_s, 300.0)))
    try:
        if not hosted and rank == 0:  # this rank hosts the store: on MASTER_ADDR only
            store = _server(addr, int(port), timeout=timeout, world_size=world_size)
        else:
            store = dist.TCPStore(
                addr,
                int(port),
                world_size=None if hosted else world_size,
                is_master=False,
                wait_for_workers=False,
                timeout=timeout,
            )
    except (RuntimeError, ValueError, OSError) as e:
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
        self._posted: dict[int, int] = {}  # peer -> the last step its heartbeat says it posted
        self._stop = threading.Event()
        self._broken = False
        self._beat_lock = threading.Lock()
        self._beat_count = 0
        self.posted = -(2**62)  # the last step this node posted (heartbeats carry it)
        self.heartbeat_errors = 0  # beats the store refused (the thread reports and goes on)
        self.stale_beats = 0  # authentic heartbeats older than one already seen (replayed)
        self._stale_seen: set[tuple[int, int]] = set()  # (peer, beat) counted once
        self._left_seen: dict[int, str] = {}  # departures read once: a deleted mark still counts
        self.beat()
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
                if len(self._forged_seen) > 100_000:  # a flood: remember the recent ones only
                    self._forged_seen.clear()
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

    def beat(self, *, posted: int | None = None) -> None:
        """Write this node's heartbeat, "<beats> <last step posted>", signed: a `set`, never
        torch's `add`, so a stranger's value under the key cannot make the store fail it."""
        with self._beat_lock:
            if posted is not None:
                self.posted = max(self.posted, posted)
            # the beat is a time in ms, kept increasing: a restarted process's beats still
            # advance past the ones it wrote before (a reader trusts only advancing beats)
            self._beat_count = max(self._beat_count + 1, time.time_ns() // 1_000_000)
            self.set(f"hb/{self.rank}", f"{self._beat_count} {self.posted}")

    def _beat(self) -> None:
        failing = False
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.beat()
            except Exception as e:  # report, count, and keep beating: never die silently
                self.heartbeat_errors += 1
                if not failing:
                    log.warning(
                        "rank %d: the store refused a heartbeat (%s: %s); retrying every %.2g s",
                        self.rank,
                        type(e).__name__,
                        e,
                        self.heartbeat_s,
                    )
                failing = True
            else:
                if failing:
                    log.warning("rank %d: heartbeats go through again", self.rank)
                failing = False

    def peer_posted(self, peer: int) -> int:
        """The last step `peer`'s authentic heartbeat says it posted (very negative if none)."""
        self._read_beat(peer)
        return self._posted.get(peer, -(2**62))

    def _read_beat(self, peer: int) -> int | None:
        """The beat count of `peer`'s authentic heartbeat (None: absent, forged or malformed);
        records the step it says it posted."""
        raw = self.get(f"hb/{peer}")
        if raw is None:
            return None
        try:
            beat, posted = (int(x) for x in raw.split())
        except ValueError:
            return None
        self._posted[peer] = max(posted, self._posted.get(peer, posted))
        return beat

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

    def why_gone(self, peer: int) -> str | None:
        """Why `peer` counts as lost now (it left, or its authentic heartbeat has not moved for
        `timeout_s`), or None while it may still answer. A forged heartbeat is not a beat."""
        if peer in self.lost:
            return self.lost[peer]
        if peer in self._left_seen:  # deleting the mark afterwards cannot hide the departure
            return self._left_seen[peer]
        now = time.monotonic()
        why = self.get(f"left/{peer}")
        if why is not None:
            self._left_seen[peer] = f"it left ({why.decode(errors='replace')})"
            return self._left_seen[peer]
        beat = self._read_beat(peer)
        last = self._beats.get(peer)
        # Only a beat count above every one seen is a sign of life (issue 57): a replayed
        # heartbeat is authentic but old, so it neither refreshes the peer nor hides its death;
        # it is counted. A peer whose beats stop advancing is lost one timeout_s later.
        if last is None or (beat is not None and beat > last[0]):
            self._beats[peer] = (beat if beat is not None else -1, now)
        else:
            if beat is not None and beat < last[0] and (peer, beat) not in self._stale_seen:
                self._stale_seen.add((peer, beat))
                self.stale_beats += 1
                log.warning(
                    "rank %d: peer %d's heartbeat went back from beat %d to %d (replayed); ignored",
                    self.rank,
                    peer,
                    last[0],
                    beat,
                )
            if now - last[1] > self.timeout_s:
                return f"no advancing heartbeat for {now - last[1]:.0f} s"
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
        max_missed: consecutive rounds a live peer's payload may be missed (overwritten,
            deleted, or late by `timeout_s`) before it is dropped; each miss skips the peer
            for that round only (counted in `stats.missed`).

    `exchange` returns the payload of every live peer that takes part in the round; a peer that
    is lost or missed is absent (a lost one stays lost). A payload over `max_bytes` comes back
    as None.
    """

    def __init__(
        self,
        membership: Membership,
        *,
        first_steps: list[int],
        should_stop: Callable[[], bool] | None = None,
        on_store_lost: str = "stop",
        max_missed: int = 3,
    ) -> None:
        if max_missed < 1:
            raise ValueError(f"max_missed must be >= 1, got {max_missed}")
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
        self.max_missed = max_missed
        self.stats = TransportStats(lost=membership.lost)
        self._ready_seen: dict[int, float] = {}
        self._misses: dict[int, int] = {}  # peer -> consecutive rounds missed
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
        self.stats.forged = self.m.forged
        self.stats.heartbeat_errors = self.m.heartbeat_errors
        self.stats.stale_heartbeats = self.m.stale_beats
        out: dict[int, bytes | None] = {}
        for p, data in raw.items():
            if data is None:  # more chunks than max_bytes allows: not even read
                self.stats.oversized += 1
                out[p] = None
                continue
            out[p] = self.stats.received(data, max_bytes)
        return out

    def _store_lost(self, err: Exception, *, step: int) -> None:
        if self.on_store_lost == "stop":
            if _answers(self.store):
                what = (
                    f"the exchange's store failed a request at round {step} ({err}) although "
                    "its host still accepts connections (a bug, or something outside the run "
                    "wrote to it)"
                )
            else:
                what = (
                    f"the exchange's store became unreachable at round {step} ({err}): its host "
                    "(the `ftis run` process, or torchrun's agent on the master machine) is gone"
                )
            raise TransportLost(
                f"{what}. This node stops rather than silently train alone; resume the run with "
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

    def _miss(self, peer: int, step: int, why: str) -> None:
        """`peer`'s payload of `step` is missed: skip it this round; drop it after
        `max_missed` consecutive misses."""
        self.stats.missed += 1
        n = self._misses[peer] = self._misses.get(peer, 0) + 1
        log.warning(
            "rank %d: skipped peer %d in round %d: %s (%d of %d consecutive misses allowed)",
            self.rank,
            peer,
            step,
            why,
            n,
            self.max_missed,
        )
        if n >= self.max_missed:
            self.m.drop(peer, f"{why}, {n} rounds in a row", step=step)

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
        self.m.beat(posted=step)  # peers that find no authentic payload now know it was lost
        pending = {p for p in self.live_peers if self.first_steps[p] <= step}
        got: dict[int, bytes | None] = {}
        waiting_since = time.monotonic()
        pause = _POLL_MIN_S
        while pending:
            for p in sorted(pending):
                arrived, data = self._fetch(p, step, max_bytes)
                if not arrived and self.m.peer_posted(p) >= step:
                    # its heartbeat, written after the payload, says it posted: read once more,
                    # then the payload was overwritten or deleted by something outside the run
                    arrived, data = self._fetch(p, step, max_bytes)
                    if not arrived:
                        self._miss(p, step, "its payload was overwritten or deleted in the store")
                        pending.discard(p)
                        continue
                if arrived:
                    got[p] = data
                    self._misses.pop(p, None)
                    pending.discard(p)
                    continue
                if (
                    p not in self._ready_seen
                    and self.m.get(f"ready/{p}", store=self.store) is not None
                ):
                    self._ready_seen[p] = time.monotonic()
                reason = self.m.why_gone(p)
                if reason is not None:
                    self.m.drop(p, reason, step=step)
                    pending.discard(p)
                    continue
                since = max(waiting_since, self._ready_seen[p]) if p in self._ready_seen else None
                if since is not None and time.monotonic() - since > self.m.timeout_s:
                    self._miss(p, step, f"no payload within {self.m.timeout_s:g} s")
                    pending.discard(p)
            if pending:
                if self.should_stop():
                    raise ExchangeAborted(f"stop requested while waiting for round {step}")
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
        return got

    def close(self) -> None:
        """Nothing to release: the membership (and the `left` mark) belongs to its creator."""


def _answers(store: dist.Store) -> bool:
    """Whether the host of `store` (a TCPStore, possibly behind a PrefixStore) still accepts a
    TCP connection: a failed request from a store that answers is not a lost host."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return False
    host, port = store.host, store.port
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False
