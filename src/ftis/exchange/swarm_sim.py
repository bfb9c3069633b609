"""Many swarm peers in one process: a deterministic scheduler with virtual time, and a board on it.

    Scheduler   runs each simulated peer in its own thread, one at a time: a peer runs until it
                waits (`SimClock.sleep`, i.e. polling the board for a round's payloads, or the
                start barrier), then the peer (or timer) due next in virtual time runs; ties go
                in the order peers were given (their ids). Computation takes no virtual time, so
                deadlines, heartbeats and expiries depend on the schedule only, never on how
                loaded the machine is: a run is the same every time.
    SimBoard    `MemoryBoard` on the scheduler's virtual clock: the same records, expiries and
                size limit as on the DHT, read by the same `SwarmTransport`.

A peer's thread keeps its own global RNG streams (python, torch): they are swapped in and out
with its turns, as if each peer were its own process, so a peer's checkpoint restores its own
streams only.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ftis.exchange.swarm import MemoryBoard


@dataclass(eq=False)
class SimTask:
    """One simulated peer's thread. `result` / `error`: what its function returned / raised."""

    name: str
    order: int
    fn: Callable[[], Any]
    wake: float = 0.0
    done: bool = False
    result: Any = None
    error: BaseException | None = None
    go: threading.Event = field(default_factory=threading.Event)
    rng: tuple | None = None  # (python, torch) RNG states while it is not running
    thread: threading.Thread | None = None


class Scheduler:
    """A cooperative discrete-event scheduler: one simulated peer runs at a time; the next is the
    one due first in virtual time (ties: the order it was spawned with)."""

    def __init__(self) -> None:
        self.t = 0.0
        self._tasks: list[SimTask] = []
        self._by_thread: dict[int, SimTask] = {}
        self._yielded = threading.Event()
        self._running: SimTask | None = None  # the peer whose turn it is
        self.clock = SimClock(self)

    # what a peer's thread calls ---------------------------------------------------------------
    def _current(self) -> SimTask:
        task = self._by_thread.get(threading.get_ident())
        if task is None:
            raise RuntimeError("SimClock.sleep called outside a simulated peer's thread")
        return task

    def _sleep(self, seconds: float) -> None:
        task = self._current()
        task.wake = self.t + max(0.0, seconds)
        task.rng = (random.getstate(), torch.get_rng_state())
        task.go.clear()
        self._running = None
        self._yielded.set()
        task.go.wait()
        random.setstate(task.rng[0])
        torch.set_rng_state(task.rng[1])

    # what the simulation's driver calls -------------------------------------------------------
    def spawn(self, name: str, order: int, fn: Callable[[], Any]) -> SimTask:
        """A new simulated peer, due now; it starts when the scheduler gives it its turn."""
        task = SimTask(name, order, fn, wake=self.t)
        task.rng = (random.getstate(), torch.get_rng_state())

        def body() -> None:
            task.go.wait()
            self._by_thread[threading.get_ident()] = task
            random.setstate(task.rng[0])
            torch.set_rng_state(task.rng[1])
            try:
                task.result = task.fn()
            except BaseException as e:  # a crash of one peer never stops the others
                task.error = e
            finally:
                task.done = True
                self._running = None
                self._yielded.set()

        task.thread = threading.Thread(target=body, name=f"sim-{name}", daemon=True)
        task.thread.start()
        self._tasks.append(task)
        return task

    def run(self, between: Callable[[], None] | None = None) -> None:
        """Run until every peer's function returned. `between()` runs after every turn (it may
        spawn peers, e.g. the churn schedule's joins). Called again after a KeyboardInterrupt, it
        first lets the peer whose turn it was finish its turn."""
        if self._running is not None:
            self._yielded.wait()
        while True:
            if between is not None:
                between()
            live = [t for t in self._tasks if not t.done]
            nxt = min(live, key=lambda t: (t.wake, t.order), default=None)
            if nxt is None:
                return
            self.t = max(self.t, nxt.wake)
            self._yielded.clear()
            saved = (random.getstate(), torch.get_rng_state())
            self._running = nxt
            nxt.go.set()
            self._yielded.wait()
            random.setstate(saved[0])
            torch.set_rng_state(saved[1])
            if nxt.done and nxt.thread is not None:
                nxt.thread.join()

    @property
    def tasks(self) -> list[SimTask]:
        return list(self._tasks)


class SimClock:
    """The `Clock` of every simulated peer (`ftis.exchange.swarm.Clock`): virtual seconds."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._s = scheduler

    def monotonic(self) -> float:
        return self._s.t

    def sleep(self, seconds: float) -> None:
        self._s._sleep(seconds)


class SimBoard(MemoryBoard):
    """An in-memory board on the scheduler's virtual clock. It also notes which peers took part
    in each round (entered its exchange, a slow peer before its payload lands), for the
    simulation's `swarm/published` figure."""

    def __init__(self, scheduler: Scheduler, *, max_value_bytes: int = 16 * 2**20) -> None:
        super().__init__(max_value_bytes=max_value_bytes)
        self._sched = scheduler
        self._sent: dict[str, set[int]] = {}

    def now(self) -> float:
        return self._sched.t

    def note_sent(self, key: str, subkey: int) -> None:
        self._sent.setdefault(key, set()).add(subkey)

    def sent(self, key: str) -> set[int]:
        """Peers that took part in `key`'s round so far (their payload on time or not)."""
        return set(self._sent.get(key, ()))
