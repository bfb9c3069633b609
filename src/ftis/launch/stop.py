"""One stop protocol for every launcher (docs/RELIABILITY.md, "Stopping a run").

SIGINT (Ctrl-C), SIGTERM (`kill`, `docker stop`, a job scheduler) and the launcher's own death
end every mode the same way: each participant checkpoints its last completed step, every child
process and daemon the run started (worker processes, Ray's processes and actors, hivemind's
DHT processes and p2pd daemons) is gone within a bounded time, and `ftis run` exits 130 with the
resume command. The pieces, shared by every launcher:

    StopSignals          a launcher of child processes (ftis.launch.multi, the swarm launcher):
                         the handler only records a signal; the launcher's loop forwards it to
                         every live child and kills those still running GRACE_S later
    interrupt_on_sigterm SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does,
                         for launchers whose stop path is KeyboardInterrupt (the swarm
                         simulator and launcher)
    die_with_parent      a preexec_fn: the kernel sends the child SIGTERM when its launcher dies,
                         even by SIGKILL, which cannot be forwarded (Linux)
    exit_with            for processes another program starts (Ray's client workers): a thread
                         that ends this process once the launcher is gone
    reaping_orphans      the launcher adopts every orphan among its descendants (Linux's child
                         subreaper), so that processes whose own parent died first (a Ray worker
                         after its raylet, a p2pd after its peer) are still found and ended
    end_processes        SIGTERM, then SIGKILL after a grace period, to a set of processes
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

INTERRUPTED = 130  # the exit code of a run stopped by a signal after its checkpoints
DISK_FULL = 3  # a node's exit code when its disk filled up (the launcher says so)
GRACE_S = 120.0  # how long stopped children may take to checkpoint before they are killed
LEFTOVER_GRACE_S = 5.0  # how long a leftover daemon gets between SIGTERM and SIGKILL
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _handlers(handler: Callable, signals: Iterable[int] = _SIGNALS) -> Iterator[None]:
    """Install `handler` for `signals` (unless ignored, as in a background job) until exit; the
    previous handlers afterwards. Only the main thread can install handlers: elsewhere a no-op."""
    if not _in_main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in signals}
    replaced = {s: h for s, h in previous.items() if h not in (signal.SIG_IGN, None)}
    for s in replaced:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in replaced.items():
            signal.signal(s, h)


class StopSignals:
    """SIGINT and SIGTERM to a launcher of child processes: the handler only records them; the
    launcher's loop calls `forward`, which passes each on to every live child, then kills the
    children still running `grace_s` after the first."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.pending: list[int] = []
        self.deadline: float | None = None

    def __call__(self, signum: int, frame=None) -> None:
        self.pending.append(signum)
        if self.deadline is None:
            self.deadline = time.monotonic() + self.grace_s

    @property
    def requested(self) -> bool:
        return self.deadline is not None

    def forward(self, procs: Iterable[subprocess.Popen]) -> None:
        procs = list(procs)
        while self.pending:
            sig = self.pending.pop(0)
            for p in procs:
                if p.poll() is None:
                    p.send_signal(sig)
        if self.deadline is not None and time.monotonic() > self.deadline:
            for p in procs:
                if p.poll() is None:
                    log.warning("pid %d did not stop within %.0f s: killed", p.pid, self.grace_s)
                    p.kill()

    def installed(self) -> contextlib.AbstractContextManager[None]:
        """Handle SIGINT and SIGTERM (unless ignored) until exit."""
        return _handlers(self)


def on_signals(
    handler: Callable, signals: Iterable[int]
) -> contextlib.AbstractContextManager[None]:
    """`handler` for `signals` (unless ignored) until exit, in the main thread only (elsewhere a
    no-op); the previous handlers afterwards."""
    return _handlers(handler, tuple(signals))


def _raise_interrupt(signum: int, frame=None) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def interrupt_on_sigterm() -> contextlib.AbstractContextManager[None]:
    """SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does (unless SIGTERM is
    ignored): the launcher's Ctrl-C path (checkpoint, stop, exit 130) serves both."""
    return _handlers(_raise_interrupt, (signal.SIGTERM,))


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """Linux: a preexec_fn that has the kernel send the child `sig` (SIGTERM: it checkpoints
    and stops) when its launcher dies, even by SIGKILL. None elsewhere."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent, sig = os.getpid(), int(sig)

    def preexec() -> None:  # in the child, between fork and exec
        prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(INTERRUPTED)

    return preexec


_watched: set[int] = set()


def exit_with(launcher: int, *, poll_s: float = 1.0, code: int = INTERRUPTED) -> None:
    """Start (once per launcher) a daemon thread that ends this process with `code` as soon as
    process `launcher` is gone: for processes that ftis does not start itself and so cannot give
    a preexec_fn (Ray starts the client workers). Nothing when this process is the launcher."""
    if launcher == os.getpid() or launcher in _watched:
        return
    _watched.add(launcher)

    def watch() -> None:
        while alive(launcher):
            time.sleep(poll_s)
        log.warning("the launcher (pid %d) is gone: this process exits", launcher)
        os._exit(code)

    threading.Thread(target=watch, name="ftis-exit-with-launcher", daemon=True).start()


def alive(pid: int) -> bool:
    """Running (not a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        if sys.platform.startswith("linux"):
            return False
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True


def _processes() -> dict[int, tuple[str, int]]:
    """pid -> (state, parent pid) of every process, from /proc (empty elsewhere)."""
    out: dict[int, tuple[str, int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[int(entry)] = (fields[0], int(fields[1]))
    return out


def descendants(root: int | None = None) -> set[int]:
    """Every live process below `root` (default: this one), from /proc (empty elsewhere)."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for pid, (state, ppid) in _processes().items():
        if state != "Z":
            children.setdefault(ppid, []).append(pid)
    out: set[int] = set()
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def end_processes(pids: Iterable[int], *, grace_s: float = LEFTOVER_GRACE_S) -> list[int]:
    """SIGTERM to each live process of `pids`, SIGKILL to those still alive `grace_s` later.
    Returns the pids that were still alive when called."""
    live = [p for p in set(pids) if p != os.getpid() and alive(p)]
    for p in live:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in live):
        time.sleep(0.05)
    for p in live:
        if alive(p):
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
    return live


@contextlib.contextmanager
def reaping_orphans(*, grace_s: float = LEFTOVER_GRACE_S, what: str = "child") -> Iterator[None]:
    """While inside, this process adopts the orphans among its descendants (Linux's child
    subreaper); on exit, every descendant started inside and still alive is ended
    (`end_processes`) and its exit status collected. For launchers whose children start
    daemons of their own (Ray's raylet and workers, hivemind's p2pd)."""
    prctl = _prctl()
    before = descendants()
    was_reaper = ctypes.c_int(0)
    if prctl is not None:
        prctl(37, ctypes.byref(was_reaper))  # PR_GET_CHILD_SUBREAPER
        prctl(_PR_SET_CHILD_SUBREAPER, 1)
    try:
        yield
    finally:
        left = end_processes(descendants() - before, grace_s=grace_s)
        if left:
            log.info("ended %d leftover %s process(es) of the run", len(left), what)
        if prctl is not None:
            # adopted orphans that have exited: collect their status, or they stay zombies
            me = os.getpid()
            for pid, (state, ppid) in _processes().items():
                if ppid == me and state == "Z" and pid not in before:
                    with contextlib.suppress(ChildProcessError, OSError):
                        os.waitpid(pid, os.WNOHANG)
            prctl(_PR_SET_CHILD_SUBREAPER, was_reaper.value)
