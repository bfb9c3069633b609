"""Neighbour-only gossip over torch.distributed (gloo), with real processes: the message codec,
mixing with announced degrees, a rejected (non-finite) message, and a lost agent whose
neighbours renormalise and carry on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ftis.algos.dpo.gossip import decode, encode
from ftis.exchange.store import HOSTED_ENV, host_store, mark_left

ROOT = Path(__file__).resolve().parents[2]


def test_the_message_codec_rejects_what_does_not_fit():
    theta = torch.tensor([1.0, -2.0, 3.5])
    msg = encode(7, 2, theta)
    assert msg.tolist() == [7.0, 3.0, 2.0, 1.0, -2.0, 3.5]
    degree, back = decode(msg, round_=7, size=3, world_size=4)
    assert degree == 2 and torch.equal(back, theta)
    assert "round" in decode(msg, round_=8, size=3, world_size=4)
    assert "numbers" in decode(msg[:-1], round_=7, size=3, world_size=4)
    assert "degree" in decode(encode(7, 4, theta), round_=7, size=3, world_size=4)  # > world - 1
    assert "degree" in decode(encode(7, 0, theta), round_=7, size=3, world_size=4)
    nan = encode(7, 2, torch.tensor([1.0, float("nan"), float("inf")]))
    assert decode(nan, round_=7, size=3, world_size=4) == "2 non-finite parameters"


def _agent(out_dir: str) -> None:
    """One agent of a triangle (run in a subprocess), through the algorithm's own
    `Gossip.round` over a real `NeighbourChannel`: each round it adds (rank + 1) * round to its
    parameters (its "local steps"), then gossips. Agent 2 sends NaN in round 2 and dies at the
    start of round 3."""
    from types import SimpleNamespace

    from ftis.algos.dpo.gossip import HEADER, Gossip
    from ftis.exchange.neighbours import NeighbourChannel

    rank = int(os.environ["RANK"])
    ch = NeighbourChannel.join(first_step=1, size=HEADER + 2, timeout_s=30.0)
    algorithm = SimpleNamespace(
        topology="complete",
        degree=None,
        graph_seed=0,
        edge_indices=lambda cfg: None,
        consensus="off",  # logging traffic over the store: not what this test is about
        sketch_size=16,
    )
    ctx = SimpleNamespace(
        rank=rank, cfg=SimpleNamespace(nodes=[0, 1, 2], algorithm=algorithm), transport=None
    )
    param = torch.nn.Parameter(torch.tensor([float(rank), 10.0 * rank]))
    gossip = Gossip(ctx, [param], ch)
    log = []
    for rnd in range(1, 5):
        if rank == 2 and rnd == 3:
            os._exit(17)
        with torch.no_grad():
            param.add_((rank + 1) * rnd)
            if rank == 2 and rnd == 2:
                param[1] = float("nan")
        out = gossip.round(rnd)
        log.append({"round": rnd, "theta": param.detach().tolist(), **out})
    ch.close()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(log))


@pytest.mark.chaos_case("gossip DPO", "NaN message, lost agent")
def test_gossip_between_processes_rejects_nan_and_survives_a_lost_agent(tmp_path):
    server, store, port = host_store()
    env = {
        **os.environ,
        "WORLD_SIZE": "3",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        HOSTED_ENV: "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    code = f"from tests.exchange.test_neighbours import _agent; _agent({str(tmp_path)!r})"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**env, "RANK": str(r)},
            cwd=ROOT,
            stderr=(tmp_path / f"{r}.log").open("w"),
        )
        for r in range(3)
    ]
    deadline = time.monotonic() + 120
    marked = False
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if not marked and procs[2].poll() is not None:  # as `ftis run`'s launcher does
            mark_left(store, 2, f"its process exited with code {procs[2].returncode}")
            marked = True
        time.sleep(0.05)
    errs = [(tmp_path / f"{r}.log").read_text()[-2000:] for r in range(3)]
    for p in procs:
        if p.poll() is None:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0, 17], errs
    logs = {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)}
    # round 1: 0, 1, 2 start at (0, 0), (1, 10), (2, 20) and add 1, 2, 3: (1, 1), (3, 12),
    # (5, 23). Complete graph of 3, every degree 2: all weights 1/3 -> the mean (3, 12).
    for r in (0, 1):
        one = logs[r][0]
        assert (one["gossip/neighbours"], one["gossip/mixed"]) == (2, 2)
        assert one["gossip/self_weight"] == pytest.approx(1 / 3, abs=1e-12)
        assert one["theta"] == pytest.approx([3.0, 12.0], abs=1e-5)
    # round 2: add 2, 4 (and 6 for agent 2): 0 at (5, 14), 1 at (7, 16). Agent 2's message has
    # a NaN: rejected, its 1/3 stays with the receiver: 0 -> 2/3 (5, 14) + 1/3 (7, 16)
    for r in (0, 1):
        assert logs[r][1]["gossip/rejected"] == 1 and logs[r][1]["gossip/mixed"] == 1
        assert logs[r][1]["gossip/self_weight"] == pytest.approx(2 / 3, abs=1e-12)
    assert logs[0][1]["theta"] == pytest.approx([17 / 3, 44 / 3], abs=1e-5)
    assert logs[1][1]["theta"] == pytest.approx([19 / 3, 46 / 3], abs=1e-5)
    # round 3: agent 2 died at its start. 0 and 1 add 3 and 6: a = (17/3 + 3, 44/3 + 3),
    # b = (19/3 + 6, 46/3 + 6). Whether they learned it before the exchange (degree 1 each:
    # W = 1/2) or during it (they had announced degree 2: W = 1/3, agent 2's share stays with
    # each), both used the same weight w, so 0 -> (1 - w) a + w b and 1 -> (1 - w) b + w a.
    a = torch.tensor([17 / 3 + 3, 44 / 3 + 3])
    b = torch.tensor([19 / 3 + 6, 46 / 3 + 6])
    w = 1 - logs[0][2]["gossip/self_weight"]
    assert w == 1 - logs[1][2]["gossip/self_weight"]
    assert w in (pytest.approx(1 / 3, abs=1e-12), pytest.approx(0.5, abs=1e-12))
    assert logs[0][2]["theta"] == pytest.approx(((1 - w) * a + w * b).tolist(), abs=1e-5)
    assert logs[1][2]["theta"] == pytest.approx(((1 - w) * b + w * a).tolist(), abs=1e-5)
    # round 4: agent 2 is lost for both; one neighbour each, W = 1/2 over the remaining graph
    for r in (0, 1):
        assert logs[r][2]["gossip/lost_total"] == 1 and logs[r][3]["gossip/neighbours"] == 1
        assert logs[r][3]["gossip/self_weight"] == pytest.approx(0.5, abs=1e-12)
        # the live graph is the edge 0-1: W = [[1/2, 1/2], [1/2, 1/2]], rho 0
        assert logs[r][3]["gossip/rho"] == pytest.approx(0.0, abs=1e-12)
    assert logs[0][3]["theta"] == logs[1][3]["theta"]  # the mean of the two, the same bits
    del store, server


def _starter(digest: str) -> None:
    from ftis.exchange.neighbours import NeighbourChannel
    from ftis.exchange.store import PeerGroupError

    try:
        NeighbourChannel.join(first_step=1, size=4, timeout_s=30.0, start_digest=digest)
    except PeerGroupError as e:
        print(e)
        raise SystemExit(3) from None


@pytest.mark.chaos_case("gossip DPO", "agents that start apart")
def test_agents_that_start_from_different_weights_are_refused(tmp_path):
    """Issue 37: gossip DPO checked at config level that agents start alike, but warm starts
    trained on different CPUs differ in their last bits and went unnoticed. The digests of the
    starting weights are exchanged: a difference is one clear error on every agent."""
    _server, _, port = host_store()  # the server lives as long as the test
    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        HOSTED_ENV: "1",
        "PYTHONPATH": str(ROOT),
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from tests.exchange.test_neighbours import _starter; _starter({d!r})",
            ],
            env={**env, "RANK": str(r)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for r, d in enumerate(("aaaa", "bbbb"))
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [3, 3], outs
    assert all("start from different weights (digest by rank: 0: aaaa, 1: bbbb)" in o for o in outs)
