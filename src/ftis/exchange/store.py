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

A peer is lost when (a) `left/<peer>` exists, (b) its heartbeat has not moved for `timeout_s`
(the process or its machine is gone), or (c) it is ready but its payload of the current step
has not arrived within `timeout_s` (it stalled). Payloads are bytes validated by
`ftis.exchange.wire`, never pickles.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from ftis.exchange.transport import ExchangeAborted, TransportLost, TransportStats, rank_from_env

log = logging.getLogger(__name__)

HOSTED_ENV = "FTIS_STORE_HOSTED"  # set by `ftis run`: the parent process hosts the store
_POLL_MIN_S, _POLL_MAX_S = 0.001, 0.02  # a peer's payload is noticed within 20 ms


class PeerGroupError(RuntimeError):
    """The group could not form (a peer exited or never showed up)."""


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


def mark_left(store: dist.Store, rank: int, reason: str) -> None:
    """Tell the peers that `rank` is gone (the launcher calls this when a node process dies)."""
    store.set(f"left/{rank}", reason)


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

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, timeout_s: float) -> None:
        self.store = store
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

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.store.add(f"hb/{self.rank}", 1)
            except RuntimeError:  # the store is gone; the main thread finds out on its own
                return

    def gather(self, value: str, *, timeout_s: float | None = None) -> list[str]:
        """Every rank's `value` (the group-forming handshake). Raises PeerGroupError when a
        peer exits or does not show up within the timeout: a group forms whole or not at all."""
        self.store.set(f"hello/{self.rank}", value)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        out: dict[int, str] = {self.rank: value}
        pause = _POLL_MIN_S
        while len(out) < self.world_size:
            for p in range(self.world_size):
                if p in out:
                    continue
                if self.store.check([f"hello/{p}"]):
                    out[p] = self.store.get(f"hello/{p}").decode("utf-8", errors="replace")
                elif self.store.check([f"left/{p}"]):
                    raise PeerGroupError(
                        f"rank {p} exited before the group formed "
                        f"({self.store.get(f'left/{p}').decode(errors='replace')})"
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
        if self.store.check([f"left/{peer}"]):
            return f"it left ({self.store.get(f'left/{peer}').decode(errors='replace')})"
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
            mark_left(self.store, self.rank, reason)
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

    def ready(self) -> None:
        try:
            self.store.set(f"ready/{self.rank}", "1")
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
                raw = self._trade(payload, round_)
            except RuntimeError as e:  # the store went away mid-round
                self._store_lost(e, step=round_)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.bytes_sent += len(payload)
        out: dict[int, bytes | None] = {}
        for p, data in raw.items():
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

    def _trade(self, payload: bytes, step: int) -> dict[int, bytes]:
        """Post this node's payload of `step`, then collect the payload of every live peer that
        takes part in this step, dropping the ones that are gone."""
        store = self.store
        store.set(f"x/{step}/{self.rank}", payload)
        if step - 2 >= self.first_steps[self.rank]:
            # Every live peer has read it: it posted step - 1 after reading our step - 2.
            store.delete_key(f"x/{step - 2}/{self.rank}")
        pending = {p for p in self.live_peers if self.first_steps[p] <= step}
        got: dict[int, bytes] = {}
        waiting_since = time.monotonic()
        pause = _POLL_MIN_S
        while pending:
            for p in sorted(pending):
                key = f"x/{step}/{p}"
                if store.check([key]):
                    got[p] = store.get(key)
                    pending.discard(p)
                    continue
                if p not in self._ready_seen and store.check([f"ready/{p}"]):
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
