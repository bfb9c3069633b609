"""The torch.distributed transport, and every collective the project makes.

One node = one process (torchrun semantics). Each round the group all-gathers the payload sizes
and then the payloads as padded uint8 tensors; a codec (`ftis.exchange.codec`) validates and
decodes them. Payloads are bytes, never pickles: a peer can send garbage, not code.

Collectives cannot skip a rank, so a peer that crashes or stalls makes `exchange` fail after
`timeout_s` with a RuntimeError rather than leave it out.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ftis.exchange.store import gloo_on_loopback
from ftis.exchange.transport import TransportStats, rank_from_env

log = logging.getLogger(__name__)

_MAX_STRING_BYTES = 1 << 20


def init_process_group_from_env(
    timeout_s: float = 1800.0, *, backend: str = "auto"
) -> tuple[int, int]:
    """Join the process group described by torchrun's environment; returns (rank, world_size).

    Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK for the GPU). backend
    "auto" picks NCCL when this machine has a GPU, else gloo; on a group that mixes machines with
    and without GPUs pass "gloo" everywhere. A no-op returning the group's rank and size when a
    group already exists.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world_size = rank_from_env(RuntimeError, "a process group")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    gloo_on_loopback()
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    log.info("rank %d/%d joined the process group (%s)", rank, world_size, backend)
    return rank, world_size


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where this group's tensors must live: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wait(work: dist.Work, timeout_s: float, what: str) -> None:
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise RuntimeError(
            f"exchange: all_gather of {what} did not complete within {timeout_s:g} s "
            "(a peer crashed, stalled, or is running a different step)"
        ) from e


def _all_gather_bytes(
    payload: bytes,
    *,
    group: dist.ProcessGroup | None,
    max_bytes: int,
    timeout_s: float,
) -> list[tuple[int, bytes | None]]:
    """Every rank's (size, bytes): one all_gather of the sizes, one of padded uint8 tensors.

    Every rank pads to min(largest size, max_bytes), so all ranks agree on the tensor size as long
    as they agree on max_bytes. A rank whose size is negative or above max_bytes gets None.
    """
    device = _device(group)
    world_size = dist.get_world_size(group)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes_t = [torch.zeros_like(size) for _ in range(world_size)]
    _wait(dist.all_gather(sizes_t, size, group=group, async_op=True), timeout_s, "payload sizes")
    sizes = [int(s) for s in torch.cat(sizes_t).cpu().tolist()]
    width = max(1, min(max(sizes), max_bytes))
    own = payload[:width]
    buf = torch.zeros(width, dtype=torch.uint8)
    if own:
        buf[: len(own)] = torch.frombuffer(bytearray(own), dtype=torch.uint8)
    buf = buf.to(device)
    bufs = [torch.empty_like(buf) for _ in range(world_size)]
    _wait(dist.all_gather(bufs, buf, group=group, async_op=True), timeout_s, "payloads")
    host = torch.stack(bufs).cpu().numpy()
    return [(s, host[i, :s].tobytes() if 0 <= s <= width else None) for i, s in enumerate(sizes)]


def gather_strings(
    s: str, *, group: dist.ProcessGroup | None = None, timeout_s: float = 300.0
) -> list[str]:
    """Every rank's string, indexed by rank (UTF-8 byte tensors, no pickle; <= 1 MiB each)."""
    gathered = _all_gather_bytes(
        s.encode("utf-8"), group=group, max_bytes=_MAX_STRING_BYTES, timeout_s=timeout_s
    )
    out = []
    for rank, (size, data) in enumerate(gathered):
        if data is None:
            raise ValueError(f"gather_strings: rank {rank} sent {size} bytes (limit 1 MiB)")
        out.append(data.decode("utf-8", errors="replace"))
    return out


def require_agreement(
    value: str,
    *,
    what: str,
    hint: str = "",
    group: dist.ProcessGroup | None = None,
    timeout_s: float = 300.0,
) -> None:
    """Raise the same RuntimeError on every rank unless all ranks pass the same `value`
    (e.g. the tokenizer fingerprint when the group forms)."""
    values = gather_strings(value, group=group, timeout_s=timeout_s)
    if len(set(values)) > 1:
        listing = "; ".join(f"rank {r}: {v[:80]!r}" for r, v in enumerate(values))
        raise RuntimeError(f"{what} differs between ranks ({listing}). {hint}".rstrip())


class DistributedTransport:
    """`Transport` over an initialised torch.distributed group (gloo on CPU, NCCL on GPU).

    Args:
        rank, world_size: this process's place in `group` (checked against it).
        timeout_s: how long a collective may wait for the slowest peer.
        group: the process group; None = the default group.

    Every rank takes part in every round (a collective cannot skip a rank), and every rank must
    pass the same `max_bytes` (it bounds the gathered tensor).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        timeout_s: float = 1800.0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedTransport needs an initialised process group: call "
                "init_process_group_from_env() first"
            )
        if (rank, world_size) != (dist.get_rank(group), dist.get_world_size(group)):
            raise ValueError(
                f"rank/world_size ({rank}, {world_size}) disagree with the process group "
                f"({dist.get_rank(group)}, {dist.get_world_size(group)})"
            )
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.group = group
        self.stats = TransportStats()

    def exchange(self, round_: int, payload: bytes, *, max_bytes: int) -> dict[int, bytes | None]:
        t0 = time.perf_counter()
        gathered = _all_gather_bytes(
            payload, group=self.group, max_bytes=max_bytes, timeout_s=self.timeout_s
        )
        self.stats.seconds += time.perf_counter() - t0
        self.stats.bytes_sent += len(payload)
        out: dict[int, bytes | None] = {}
        for p, (size, data) in enumerate(gathered):
            if p == self.rank:
                continue
            self.stats.bytes_received += max(size, 0)
            self.stats.oversized += data is None
            out[p] = data
        return out

    def ready(self) -> None:
        pass

    def close(self) -> None:
        """Nothing to release: the process group belongs to whoever initialised it."""
