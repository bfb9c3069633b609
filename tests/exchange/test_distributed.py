"""DistributedTransport + RolloutCodec over real processes on gloo (loopback only).

Each test starts `world_size` copies of this file as `python test_distributed.py --worker`; the
workers join a group through `init_process_group_from_env` (torchrun's variables), run every
scenario in `worker`, and exit non-zero with a traceback on the first failed check.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ftis.rollout.types import RolloutBatch

VOCAB = 1000
MAX_TOKENS = 10


def peer_batch(rank: int, step: int) -> RolloutBatch:
    """Deterministic batch of `rank` at `step`, so every worker can rebuild every peer's batch.
    Rank 2 sends an empty batch at step 1."""
    n = 0 if (rank, step) == (2, 1) else 3 + 2 * rank
    g = torch.Generator().manual_seed(100 * rank + step)
    lengths = torch.randint(1, MAX_TOKENS + 1, (n,), generator=g)
    t = int(lengths.max()) if n else 0
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return RolloutBatch(
        prompt_index=torch.arange(n) // 2 + 10 * step,
        generator=torch.full((n,), rank),
        completion_ids=torch.where(mask, torch.randint(0, VOCAB, (n, t), generator=g), 0),
        lengths=lengths,
        sampler_logprobs=torch.where(mask, -torch.rand((n, t), generator=g) * 3, 0.0),
    )


def flip_a_byte(data: bytes) -> bytes:
    b = bytearray(data)
    b[len(b) // 2] ^= 0x40
    return bytes(b)


def worker() -> None:  # runs in the child processes
    import logging

    import torch.distributed as dist

    from ftis.exchange import (
        DistributedTransport,
        RolloutCodec,
        RolloutExchange,
        gather_strings,
        init_process_group_from_env,
    )
    from ftis.exchange.distributed import require_agreement

    logging.basicConfig(level=logging.WARNING)
    rank, world = init_process_group_from_env(timeout_s=60)
    assert (rank, world) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    assert dist.get_backend() == "gloo"

    # small strings without pickle, and the agreement check used at group formation
    assert gather_strings(f"tok-{rank}-é" * rank) == [f"tok-{r}-é" * r for r in range(world)]
    require_agreement("same fingerprint", what="tokenizer fingerprint")
    try:
        require_agreement(f"fp{rank}", what="tokenizer fingerprint", hint="Use one tokenizer.")
        raise AssertionError("disagreement not detected")
    except RuntimeError as e:
        assert "tokenizer fingerprint differs between ranks (rank 0: 'fp0'" in str(e), e

    transport = DistributedTransport(rank, world, timeout_s=60)
    ex = RolloutExchange(transport, RolloutCodec(vocab_size=VOCAB, max_tokens=MAX_TOKENS, pad_id=3))
    for step in (0, 1):
        own = peer_batch(rank, step)
        got = ex.all_gather(own)
        assert len(got) == world and got[rank] is own
        for peer in range(world):
            if peer == rank:
                continue
            want, b = peer_batch(peer, step), got[peer]
            assert b is not None
            for name in ("prompt_index", "generator", "lengths"):
                assert torch.equal(getattr(b, name), getattr(want, name)), name
            m = want.mask
            assert torch.equal(b.completion_ids[m], want.completion_ids[m])
            assert (b.completion_ids[~m] == 3).all()  # the receiver's pad id
            assert torch.equal(b.sampler_logprobs, want.sampler_logprobs)  # f32: bit-exact
        s = ex.last_stats
        assert s.rejected == 0 and s.bytes_sent > 0 and s.bytes_received > 0 and s.seconds > 0

    # rank 1 sends a corrupted payload: every other rank gets None for it, the rest is intact
    if rank == 1:
        ex.corrupt_for_test = flip_a_byte
    got = ex.all_gather(peer_batch(rank, 2))
    if rank == 1:
        assert all(b is not None for b in got) and ex.last_stats.rejected == 0
    else:
        assert got[1] is None and ex.last_stats.rejected == 1
        assert all(got[p] is not None for p in range(world) if p != 1)
    ex.corrupt_for_test = None

    # a payload that claims another generator is rejected too (expected_generator = rank)
    lying = peer_batch(rank, 3)
    if rank == 0:
        lying.generator[:] = world - 1
    got = ex.all_gather(lying)
    assert (got[0] is None) == (rank != 0)
    assert ex.last_stats.rejected == (0 if rank == 0 else 1)

    # a batch the encoder refuses (NaN log-prob) does not deadlock: peers reject an empty payload
    bad = peer_batch(rank, 4)
    if rank == world - 1:
        bad.sampler_logprobs[0, 0] = float("nan")
    got = ex.all_gather(bad)
    assert got[rank] is bad
    assert (got[world - 1] is None) == (rank != world - 1)

    # the compact format travels too, within its stated error
    ex_c = RolloutExchange(
        transport,
        RolloutCodec(vocab_size=VOCAB, max_tokens=MAX_TOKENS, logprob_format="compact"),
    )
    got = ex_c.all_gather(peer_batch(rank, 5))
    for peer in range(world):
        want = peer_batch(peer, 5)
        err = (got[peer].sampler_logprobs - want.sampler_logprobs).abs().max().item()
        assert err <= 2.0**-12, err
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_group(world: int) -> None:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--worker"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out}"


@pytest.mark.parametrize("world", [2, 3])
def test_exchange_between_real_processes(world: int) -> None:
    _run_group(world)


def test_requires_a_process_group() -> None:
    from ftis.exchange import DistributedTransport

    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        DistributedTransport(0, 2)


def test_init_from_env_says_what_is_missing(monkeypatch) -> None:
    from ftis.exchange import init_process_group_from_env

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"):
        init_process_group_from_env(10)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    worker()
