"""Neighbour-only point-to-point exchange over torch.distributed (gloo on CPU, NCCL on GPU).

Gossip needs each agent to trade one tensor with its graph neighbours, and with nobody else: on
a sparse graph the traffic per round is O(degree), not O(world). `NeighbourChannel.exchange`
posts one `isend` and one `irecv` per neighbour (all at once, so no ordering can deadlock), then
waits for each. The tensors are plain float32 numbers, never pickles; what they mean is the
caller's business.

Lost peers. A collective cannot skip a dead rank, but point-to-point traffic can: with gloo each
pair of ranks has its own connection, so when a peer dies its neighbours' pending operations
with it fail at once ("Connection closed by peer") while every other pair keeps working
(measured on torch 2.13). A peer is lost, and never contacted again, when:
(a) the launcher marked it gone in the run's store (`left/<rank>`, checked before each round),
(b) an operation with it fails, or (c) it does not answer within `timeout_s` (a gloo timeout
closes the pair, so there is no retrying). NCCL has no such isolation: a peer that dies
mid-exchange can stall or abort its neighbours (docs/dpo.md); use gloo where agents may be lost.

Forming the group. Every rank posts its first round and its tensor size in the store under
`gossip/hello/<rank>`; a rank that left before everyone arrived fails the group on every rank
(PeerGroupError), and ranks that disagree on the size fail it too. Then the process group forms
through the same store (`init_process_group(store=...)`), so `ftis run`'s launcher, torchrun's
agent, or rank 0 hosts everything, as for `StoreTransport`.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ftis.exchange.store import (
    HOSTED_ENV,
    PeerGroupError,
    Signer,
    _prefix,
    gloo_on_loopback,
    read_left,
)
from ftis.exchange.transport import TransportStats, rank_from_env

log = logging.getLogger(__name__)

_POLL_S = 0.02


class NeighbourChannel:
    """Point-to-point exchange of one fixed-size tensor with chosen peers (see module doc).

    Build it with `NeighbourChannel.join(...)` in a process started by `ftis run` or torchrun.
    `first_steps[r]`: the first round rank r runs in this process's run (they differ after a
    resume in which some ranks' checkpoints are behind). `lost`: rank -> why, for every peer this
    rank has given up on. `stats` counts the bytes (pass the shell transport's stats to count
    gossip traffic under the same `exchange/*` metrics).
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        store: dist.Store,
        first_steps: list[int],
        size: int,
        timeout_s: float,
        device: torch.device,
        stats: TransportStats | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self._signer = Signer.from_env()  # `left` marks are sealed with the run's secret
        self.first_steps = first_steps
        self.size = size
        self.timeout_s = timeout_s
        self.device = device
        self.stats = stats if stats is not None else TransportStats()
        self.lost: dict[int, str] = {}
        self._closed = False

    @classmethod
    def join(
        cls,
        *,
        first_step: int,
        size: int,
        timeout_s: float,
        backend: str = "auto",
        stats: TransportStats | None = None,
        start_digest: str = "",
    ) -> NeighbourChannel:
        """Form the group (every rank calls this once): connect to the run's store, agree on the
        tensor size and on the starting weights (`start_digest`: a digest of the weights an
        agent starts a fresh run from, "" on a resume; compared when every agent starts fresh),
        learn every rank's first round, initialise the process group."""
        rank, world = rank_from_env(PeerGroupError, "the gossip group")
        store = _client_store(timeout_s)
        hello = f"{first_step},{size},{start_digest}"
        first_steps = _handshake(store, rank, world, hello, timeout_s)
        sizes = {int(v.split(",")[1]) for v in first_steps}
        if len(sizes) > 1:
            raise PeerGroupError(
                f"agents exchange tensors of different sizes {sorted(sizes)}: every agent must "
                "train the same architecture with the same trainable parameters"
            )
        starts = [v.split(",")[2] if v.count(",") >= 2 else "" for v in first_steps]
        if all(starts) and len(set(starts)) > 1:  # every agent starts fresh (a resume sends "")
            raise PeerGroupError(
                "agents start from different weights (digest by rank: "
                + ", ".join(f"{r}: {d or '?'}" for r, d in enumerate(starts))
                + "): gossip averages the agents' weights, which assumes one starting model. A "
                "warm start trained on each machine differs with the CPU's kernels; give every "
                "agent the same files (a shipped base model, or one warm-start directory copied "
                "into each machine's FTIS_CACHE, or model.path)"
            )
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be auto, gloo or nccl, got {backend!r}")
        device = torch.device("cpu")
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", rank))
            torch.cuda.set_device(local % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
        gloo_on_loopback()
        if not dist.is_initialized():
            dist.init_process_group(
                backend,
                store=dist.PrefixStore("gossip/pg", store),
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=timeout_s),
            )
        log.info("rank %d/%d joined the gossip group (%s)", rank, world, backend)
        return cls(
            rank=rank,
            world_size=world,
            store=store,
            first_steps=[int(v.split(",")[0]) for v in first_steps],
            size=size,
            timeout_s=timeout_s,
            device=device,
            stats=stats,
        )

    def takes_part(self, peer: int, round_: int) -> bool:
        """Whether `peer` is alive (as far as this rank knows) and runs round `round_`."""
        return peer not in self.lost and self.first_steps[peer] <= round_

    def check_left(self, peers: list[int], round_: int) -> None:
        """Drop the peers the launcher has marked gone (`left/<rank>` in the store)."""
        for p in peers:
            if p in self.lost:
                continue
            try:
                why = read_left(self.store, p, self._signer)  # None when absent or forged
            except RuntimeError:  # the store is gone: rely on the connections themselves
                return
            if why is not None:
                self._drop(p, f"it left ({why})", round_)

    def exchange(
        self, round_: int, tensor: torch.Tensor, peers: list[int]
    ) -> dict[int, torch.Tensor]:
        """Send `tensor` ((size,) float32) to every peer in `peers` and receive theirs; returns
        the tensors received (on the CPU). A peer whose send or receive failed or timed out is
        absent from the answer and lost from now on."""
        if self._closed:
            raise RuntimeError("the gossip channel is closed")
        if tensor.shape != (self.size,) or tensor.dtype != torch.float32:
            raise ValueError(f"exchange takes a ({self.size},) float32 tensor")
        t0 = time.perf_counter()
        out = tensor.detach().to(self.device).contiguous()
        bufs = {p: torch.empty(self.size, dtype=torch.float32, device=self.device) for p in peers}
        works: list[tuple[int, dist.Work]] = []
        failed: dict[int, str] = {}
        tag = round_ % (1 << 30)  # gloo matches on tags: a stray message of another round cannot
        for p in peers:  # land in this one (NCCL ignores tags and keeps per-pair order instead)
            try:
                works.append((p, dist.isend(out, p, tag=tag)))
                works.append((p, dist.irecv(bufs[p], p, tag=tag)))
            except RuntimeError as e:
                failed.setdefault(p, _why(e))
        for p, work in works:
            if p in failed:
                continue
            try:
                if not work.wait(timeout=timedelta(seconds=self.timeout_s)):
                    failed.setdefault(p, f"no answer within {self.timeout_s:g} s")
            except RuntimeError as e:
                failed.setdefault(p, _why(e))
        got = {}
        for p in peers:
            if p in failed:
                self._drop(p, failed[p], round_)
                continue
            self.stats.bytes_sent += 4 * self.size
            self.stats.bytes_received += 4 * self.size
            got[p] = bufs[p].cpu()
        self.stats.seconds += time.perf_counter() - t0
        return got

    def _drop(self, peer: int, why: str, round_: int) -> None:
        if peer not in self.lost:
            self.lost[peer] = why
            self.stats.lost[peer] = why
            log.warning("rank %d: lost peer %d at round %d: %s", self.rank, peer, round_, why)

    def close(self) -> None:
        """Leave the process group (idempotent)."""
        if not self._closed and dist.is_initialized():
            dist.destroy_process_group()
        self._closed = True


def _why(err: Exception) -> str:
    msg = str(err).splitlines()[0] if str(err) else type(err).__name__
    return msg.split("] ", 1)[-1][:200]  # drop gloo's source location


def _client_store(timeout_s: float) -> dist.Store:
    """A client of the run's store (the launcher's, torchrun agent's, or rank 0's, which
    `connect_store` already started in this process), under the same key prefix."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        store = dist.TCPStore(
            addr,
            port,
            is_master=False,
            wait_for_workers=False,
            timeout=timedelta(seconds=max(1.0, min(timeout_s, 300.0))),
        )
    except (RuntimeError, ValueError) as e:
        hosted = os.environ.get(HOSTED_ENV) == "1"
        raise PeerGroupError(
            f"cannot reach the store at MASTER_ADDR={addr} MASTER_PORT={port} ({e})"
            + ("" if hosted else "; start the agents with `ftis run` or torchrun")
        ) from e
    return dist.PrefixStore(_prefix(), store)


def _handshake(store: dist.Store, rank: int, world: int, value: str, timeout_s: float) -> list[str]:
    """Every rank's `value`; PeerGroupError when a rank leaves or does not come in time."""
    store.set(f"gossip/hello/{rank}", value)
    deadline = time.monotonic() + max(timeout_s, 120.0)
    got: dict[int, str] = {rank: value}
    signer = Signer.from_env()
    while len(got) < world:
        for p in range(world):
            if p in got:
                continue
            if store.check([f"gossip/hello/{p}"]):
                got[p] = store.get(f"gossip/hello/{p}").decode()
            elif (why := read_left(store, p, signer)) is not None:
                raise PeerGroupError(f"rank {p} exited before the gossip group formed ({why})")
        if len(got) < world:
            if time.monotonic() > deadline:
                absent = sorted(set(range(world)) - set(got))
                raise PeerGroupError(f"ranks {absent} did not join the gossip group in time")
            time.sleep(_POLL_S)
    return [got[p] for p in range(world)]
