"""Fault injection for tests and research only (docs/style.md principle 17): faulty clients are
injected by a test, through `run_federated(..., faults=FaultPlan(...))` (FGRPO),
`run_fed_dpo(..., faults=...)` (FedDPO) or `make_client_app(..., faults=...)`, never through a
user-facing config field.

A fault replaces what an honest client would send in one round:

    nan-delta         one delta tensor holds a NaN
    wrong-shape       one delta tensor has an extra row
    wrong-name        one delta tensor is renamed
    int-delta         one delta tensor is an integer array
    nan-performance   the performance signal is NaN (FGRPO)
    bad-count         the sample count (num-examples) is -1
    drop              the client fails the round (its ClientApp raises: Flower replies an error)
    kill-worker       the process running the client's round dies (SIGKILL, as the kernel's
                      out-of-memory killer would): under Flower's simulation a Ray worker is
                      lost mid-round (in process, where that would kill the test: a 'drop')

Each must be rejected by the server for that round (or counted as dropped), never aggregated.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

FAULT_KINDS = (
    "nan-delta",
    "wrong-shape",
    "wrong-name",
    "int-delta",
    "nan-performance",
    "bad-count",
    "drop",
    "kill-worker",
)


class InjectedDropout(RuntimeError):
    """A client's round failed on purpose (fault 'drop' or testing.crash_at_step)."""


@dataclass(frozen=True)
class FaultPlan:
    """(client name, round) -> fault kind."""

    faults: Mapping[tuple[str, int], str] = field(default_factory=dict)
    origin_pid: int = field(default_factory=os.getpid)  # the process that made the plan

    def __post_init__(self) -> None:
        bad = sorted({k for k in self.faults.values() if k not in FAULT_KINDS})
        if bad:
            raise ValueError(f"unknown fault kinds {bad}; choose from {', '.join(FAULT_KINDS)}")

    def kind(self, client: str, round_: int) -> str | None:
        return self.faults.get((client, round_))

    def before_round(self, client: str, round_: int) -> None:
        """Apply the faults that strike before the client's work ('kill-worker')."""
        if self.kind(client, round_) != "kill-worker":
            return
        if os.getpid() == self.origin_pid:  # the client runs in the test's own process
            raise InjectedDropout("injected fault: kill-worker (in process: a dropout)")
        log.warning("injected fault: killing the worker (pid %d) of client %s", os.getpid(), client)
        os.kill(os.getpid(), signal.SIGKILL)


def corrupt(kind: str, arrays: dict[str, np.ndarray], metrics: dict[str, Any]) -> None:
    """Apply fault `kind` to a client's outgoing arrays and metrics, in place (or raise
    InjectedDropout for 'drop')."""
    name = sorted(arrays)[0]
    if kind == "kill-worker":  # struck before the round (FaultPlan.before_round)
        return
    if kind == "drop":
        raise InjectedDropout("injected fault: the client drops out of this round")
    if kind == "nan-delta":
        a = arrays[name].copy()
        a.reshape(-1)[0] = np.nan
        arrays[name] = a
    elif kind == "wrong-shape":
        a = arrays[name]
        arrays[name] = np.concatenate([a, a[:1]], axis=0) if a.ndim else a.reshape(1)
    elif kind == "wrong-name":
        arrays[name + ".renamed"] = arrays.pop(name)
    elif kind == "int-delta":
        arrays[name] = arrays[name].astype(np.int64)
    elif kind == "nan-performance":
        metrics["performance"] = float("nan")
    elif kind == "bad-count":
        metrics["num-examples"] = -1
    else:
        raise ValueError(f"unknown fault kind {kind!r}")
