"""HACPO in the swarm (issue 35, item 3): every payload carries the sender's policy version and
sampling settings; a receiver rejects malformed or impossible metadata (counted like any bad
payload), drops and counts samples from a policy too far behind its own or drawn with
truncated sampling, and forgets the capability of a peer not seen for a window; a simulated
swarm with churn runs HACPO to the end and logs per-peer capabilities and the stale count."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from ftis.algos.ftis.hacpo import Capabilities
from ftis.algos.swarm.meta import HEADER_BYTES, MAGIC, SampleMeta, SwarmCodec, unpack
from ftis.exchange.codec import RolloutCodec
from ftis.exchange.wire import PayloadError
from ftis.rollout.types import RolloutBatch
from tests.conftest import tiny_run_config


def _batch(generator: int = 1, n: int = 2) -> RolloutBatch:
    return RolloutBatch(
        prompt_index=torch.zeros(n, dtype=torch.long),
        generator=torch.full((n,), generator, dtype=torch.long),
        completion_ids=torch.full((n, 3), 5, dtype=torch.long),
        lengths=torch.full((n,), 3, dtype=torch.long),
        sampler_logprobs=torch.full((n, 3), -0.5),
    )


def test_metadata_round_trips_and_travels_before_the_batch():
    codec = SwarmCodec.wrapping(RolloutCodec(vocab_size=32, max_tokens=4))
    codec.start(7, SampleMeta(6, 0.7, 0.9, 20))
    data = codec.encode(_batch())
    assert data[:4] == MAGIC
    receiver = SwarmCodec.wrapping(RolloutCodec(vocab_size=32, max_tokens=4))
    receiver.start(7, SampleMeta(6, 1.0))
    back = receiver.decode(data, peer=1)
    assert torch.equal(back.completion_ids[:, :3], _batch().completion_ids)
    meta = receiver.received[1]
    assert (meta.policy_step, meta.top_k) == (6, 20) and meta.truncated
    assert meta.temperature == pytest.approx(0.7) and meta.top_p == pytest.approx(0.9)
    assert receiver.max_payload == RolloutCodec(vocab_size=32, max_tokens=4).max_payload + 21


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ((MAGIC, 1, 7, 1.0, 1.0, 0), "not before round 7"),  # a future (its own round's) step
        ((MAGIC, 1, 2**32 - 1, 1.0, 1.0, 0), "not before round"),  # a negative step, wrapped
        ((MAGIC, 1, 3, 0.0, 1.0, 0), "temperature"),
        ((MAGIC, 1, 3, float("nan"), 1.0, 0), "temperature"),
        ((MAGIC, 1, 3, 1.0, 1.5, 0), "top_p"),
        ((MAGIC, 1, 3, 1.0, 0.0, 0), "top_p"),
        ((MAGIC, 1, 3, 1.0, 1.0, 2**30), "top_k"),
        ((b"FTRB", 1, 3, 1.0, 1.0, 0), "magic"),
        ((MAGIC, 9, 3, 1.0, 1.0, 0), "version 9"),
    ],
)
def test_impossible_metadata_is_a_payload_error(fields, match):
    data = struct.pack("<4sBIffI", *fields) + b"rest"
    with pytest.raises(PayloadError, match=match):
        unpack(data, round_=7)


def test_a_payload_without_metadata_is_rejected():
    with pytest.raises(PayloadError, match="no sample metadata"):
        unpack(b"FTRB" + bytes(HEADER_BYTES), round_=3)
    with pytest.raises(PayloadError, match="no sample metadata"):
        unpack(b"short", round_=3)


def test_capabilities_forget_a_peer_not_seen_for_a_window():
    caps = Capabilities(window=2)
    both = RolloutBatch.concat([_batch(0), _batch(1)], 0)
    caps.record(both, torch.tensor([1.0, 1.0, 1.0, 0.0]), step=1)
    caps.record(_batch(0), torch.tensor([0.0, 1.0]), step=2)
    caps.record(_batch(0), torch.tensor([0.0, 0.0]), step=3)
    assert caps.forget(3) == [] and caps.get(1) == 0.5  # last seen at step 1: 2 steps ago
    assert caps.forget(4) == [1] and caps.get(1) == 0.0  # 3 steps: forgotten
    assert caps.get(0) == pytest.approx(0.25)  # 0's window: steps 2 and 3
    state = caps.state_dict()
    again = Capabilities(window=2)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert again.last_seen == {0: 3} and again.get(0) == pytest.approx(0.25)


def _rows(run_dir, node):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("node") == node]


def test_a_simulated_swarm_runs_hacpo_with_churn_and_drops_a_stale_peers_samples(tmp_path):
    from ftis.algos.swarm.launch import run_swarm
    from ftis.config import RunConfig

    d = tiny_run_config(steps=6)
    d["nodes"] = [
        {**d["nodes"][0], "name": n, "loss": {"method": "hacpo"}} for n in ("a", "b", "c")
    ]
    d["eval"] = {"every": 6, "size": 16}
    d["checkpoint"] = {"every": 2}
    d["algorithm"] = {
        "kind": "swarm",
        "max_peers": 4,
        "deadline_s": 10.0,
        "member_ttl_s": 30.0,
        "max_staleness": 1,
        # b crashes after round 3 (its last checkpoint: step 2) and rejoins at round 4: its
        # policy is then 2 steps behind the others' for one round
        "churn": {"b": {"leave_at": 3, "crash": True, "rejoin_at": 4}},
    }
    cfg = RunConfig.model_validate(d)
    result = run_swarm(cfg, tmp_path)
    assert result.exit_codes == {"a": 0, "b": 0, "c": 0}
    a, b, c = (_rows(tmp_path, n) for n in "abc")
    assert [r["step"] for r in a] == list(range(7))
    trained = {r["step"]: r for r in a if r["step"] > 0}
    # per-peer capability, weight and discrepancy, by name, while the peer is there
    assert "hacpo/capability/c" in trained[1] and "hacpo/weight/b" in trained[1]
    assert "hacpo/discrepancy/b" in trained[2]
    # b's round-5 samples come from its step-2 policy: a and c drop them as stale
    assert trained[5]["swarm/stale_samples"] == cfg.train.prompts_per_step * cfg.train.group_size
    assert trained[5]["swarm/peer_policy_age"] == pytest.approx(1.0)  # (2 + 0) / 2 peers
    assert all(trained[s]["swarm/stale_samples"] == 0 for s in (1, 2, 3, 6))
    assert trained[6]["swarm/stale_samples_total"] == trained[5]["swarm/stale_samples"]
    assert all(r["swarm/rejected"] == 0 for r in a[1:] + b[1:] + c[1:])
