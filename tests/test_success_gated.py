"""Success-gated sharing (`sharing.share: successes`, issue 35 item 4; docs/math.md §17): a node
sends only what its verifier rewards; a receiver counts each peer's withheld completions as
reward-0 members of the joint group, so every advantage (GRPO's or HACPO's) and every
capability is what full sharing gives; a peer's "successes" the receiver does not reward are
dropped and counted."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from ftis.algos.ftis.hacpo import Capabilities, joint_advantages
from ftis.cli import app
from ftis.config import RunConfig
from ftis.train import scoring
from tests.conftest import tiny_run_config
from tests.test_hacpo_config import _batch

# Two prompts, G = 3, learner 0 and peer 1. Peer rewards: prompt 4 [1, 0, 0], prompt 9 [0, 0, 0].
PROMPTS = [4, 4, 4, 4, 4, 4, 9, 9, 9, 9, 9, 9]
GEN = [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1]
REWARDS = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
SENT = torch.tensor([True] * 4 + [False, False] + [True] * 3 + [False] * 3)  # peer's successes
WITHHELD = {(4, 1): 2, (9, 1): 3}


def test_grpo_advantages_of_what_was_sent_equal_full_sharings():
    full = scoring.advantages_for(_batch(PROMPTS, GEN), REWARDS, "std", by="prompt")
    b = _batch(PROMPTS, GEN).select(SENT)
    per_prompt = {4: 2, 9: 3}
    gated = scoring.advantages_with_withheld(b, REWARDS[SENT], "std", per_prompt)
    torch.testing.assert_close(gated, full[SENT])
    # without the withheld failures the baseline would be another: the peer's success alone
    # in prompt 4's group of 4 raises the mean
    naive = scoring.advantages_for(b, REWARDS[SENT], "std", by="prompt")
    assert not torch.allclose(naive, full[SENT])


def test_hacpo_advantages_and_capabilities_of_what_was_sent_equal_full_sharings():
    full_caps, gated_caps = Capabilities(), Capabilities()
    full_b = _batch(PROMPTS, GEN)
    full_caps.record(full_b, REWARDS)
    full_adv, full_omega, _ = joint_advantages(full_b, REWARDS, full_caps, learner=0)
    b = full_b.select(SENT)
    gated_caps.record(b, REWARDS[SENT], withheld={1: 5})
    assert gated_caps.get(1) == full_caps.get(1) == pytest.approx(1 / 6)
    adv, omega, m = joint_advantages(b, REWARDS[SENT], gated_caps, learner=0, withheld=WITHHELD)
    torch.testing.assert_close(adv, full_adv[SENT])
    torch.testing.assert_close(omega, full_omega[SENT])
    assert m["hacpo/irregular_sequences"] == 0


def test_a_peer_that_sent_nothing_is_still_a_peer_in_hacpos_rows():
    """Peer 1 withheld all of prompt 9's completions and sent one success for prompt 4; peer 2
    withheld everything. Both are in the groups (as failures) and in the per-pair rows."""
    b = _batch([4, 4, 4, 4, 9, 9, 9], [0, 0, 0, 1, 0, 0, 0])
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    withheld = {(4, 1): 2, (9, 1): 3, (4, 2): 3, (9, 2): 3}
    caps = Capabilities()
    caps.record(b, r, withheld={1: 5, 2: 6})
    assert caps.get(2) == 0.0 and caps.get(1) == pytest.approx(1 / 6)
    _, _, m = joint_advantages(b, r, caps, learner=0, withheld=withheld, names={1: "p", 2: "q"})
    assert m["hacpo/capability/q"] == 0.0 and "hacpo/weight/q" in m
    assert m["hacpo/peer_capability"] == pytest.approx((1 / 6 + 0.0) / 2)
    assert m["hacpo/irregular_sequences"] == 0


def _two_nodes(**sharing):
    data = tiny_run_config(steps=2, prompts_per_step=4)
    data["nodes"] = [
        {
            "name": name,
            "model": {"preset": "llama-xs"},
            "warm_start": {"steps": 150, "batch_size": 32, "lr": 0.003, "seed": seed},
        }
        for name, seed in (("a", 0), ("b", 1))
    ]
    data["sharing"] = {"scheme": "joint", **sharing}
    data["eval"] = {"every": 0, "size": 8, "pass_samples": 0}
    return data


def test_success_gating_needs_joint_groups_and_is_not_for_a_swarm():
    data = _two_nodes(share="successes")
    RunConfig.model_validate(data)
    data["sharing"]["scheme"] = "vertical"
    with pytest.raises(ValidationError, match="set sharing.scheme: joint"):
        RunConfig.model_validate(data)
    data["sharing"]["scheme"] = "joint"
    data["algorithm"] = {"kind": "swarm", "backend": "sim"}
    with pytest.raises(ValidationError, match="not supported in a swarm"):
        RunConfig.model_validate(data)


@pytest.mark.long
def test_a_gated_run_sends_successes_and_drops_a_peers_failures(tmp_path):
    """Node `a` rewards everything (its own verifier says every completion is a success), so it
    sends all it answers; `b` sends only what the task's verifier rewards. b drops and counts
    a's completions it does not reward; a receives exactly what b sent."""
    (tmp_path / "lenient.py").write_text(
        "def always(prompt, completion, fields):\n    return 1.0\n"
    )
    data = _two_nodes(share="successes")
    data["nodes"][0]["reward"] = [{"function": f"{tmp_path / 'lenient.py'}:always"}]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    by = {(r["node"], r["step"]): r for r in rows if r["step"] >= 1}
    own = 4 * 4  # prompts x G
    dropped = 0
    for step in (1, 2):
        a, b = by[("a", step)], by[("b", step)]
        assert a["exchange/gated_sent"] == own  # every completion is a success to a
        assert b["exchange/gated_sent"] <= own
        assert a["exchange/gated_failures_dropped"] == 0  # b sent what a also rewards
        assert a["exchange/sequences_received"] == b["exchange/gated_sent"]
        dropped += b["exchange/gated_failures_dropped"]
        kept = b["exchange/sequences_received"]
        assert kept + b["exchange/gated_failures_dropped"] == own
        # the update's N counts every withheld failure (docs/math.md §17): b's are a's
        # completions it dropped; a's are what b did not send
        assert b["exchange/withheld_counted"] == b["exchange/gated_failures_dropped"]
        assert a["exchange/withheld_counted"] == own - b["exchange/gated_sent"]
    assert dropped > 0  # a 150-step warm start answers some sums wrong
