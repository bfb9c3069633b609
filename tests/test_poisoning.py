"""Poisoned rollouts (docs/RELIABILITY.md "Poisoned rollouts"): the attacks of a peer whose
samples are right *and* poisoned, the attack-success metric, and the receiver's defences, on
hand-built payloads with expected values derived by hand."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from ftis.algos.ftis import defence as defence_mod
from ftis.algos.ftis.defence import Screen, same_model_caveat, same_model_ranks
from ftis.algos.ftis.poison import forge_margin, poison
from ftis.config import DefenceConfig, LossConfig, PoisonAttack, RunConfig
from ftis.core.defence import (
    implausible,
    max_abs_logprob_gap,
    mean_abs_logratio,
    rare_tokens,
    share_cap,
    update_distrust,
)
from ftis.rewards.decode import decode_for_reward
from ftis.rollout.types import RolloutBatch
from ftis.tasks import build_task
from ftis.tasks.reasoning import ReasoningTaskConfig, solution
from ftis.train.evaluate import attack_success
from tests.conftest import tiny_node

TASK = build_task(ReasoningTaskConfig(test_size=16))
MASK = torch.tensor([[True, True, True, False]] * 2)


# ---- ftis.core.defence: the screens' math ------------------------------------------------------


def test_mean_abs_logratio_and_rare_tokens_by_hand():
    lp = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -12.0, -0.5, 0.0]])
    glp = torch.tensor([[-1.5, -1.0, -0.5, -9.0], [-4.0, -15.0, -3.5, 0.0]])
    # row 0: |0.5| + |-1| + 0 over 3 tokens (the 4th is padding) = 0.5; row 1: (3 + 3 + 3) / 3
    got = mean_abs_logratio(logprobs=lp, sampler_logprobs=glp, mask=MASK)
    assert got.tolist() == pytest.approx([0.5, 3.0], abs=1e-6)
    assert rare_tokens(logprobs=lp, mask=MASK, floor=-10.0).tolist() == [0, 1]


def test_an_implausible_sequence_is_caught_and_an_honest_one_is_not():
    lp = torch.tensor(
        [
            [-0.7, -1.2, -0.3, 0.0],  # honest: the sender's log-probs are close to the receiver's
            [-0.7, -11.0, -0.3, 0.0],  # one token the receiver gives p = e^-11 < e^-10
            [-0.7, -1.2, -0.3, 0.0],  # forged: reported 3 nats below the receiver on every token
        ]
    )
    glp = torch.tensor([[-0.9, -1.0, -0.4, 0.0], [-0.7, -1.0, -0.3, 0.0], [-3.7, -4.2, -3.3, 0.0]])
    mask = torch.tensor([[True, True, True, False]] * 3)
    got = implausible(
        logprobs=lp, sampler_logprobs=glp, mask=mask, max_logratio=2.0, min_token_logprob=-10.0
    )
    # row 0: mean |d| = (0.2 + 0.2 + 0.1) / 3 = 0.17 <= 2, no rare token -> kept;
    # row 1: mean |d| = 10 / 3 = 3.3 > 2 and a rare token -> caught; row 2: mean |d| = 3 > 2
    assert got.tolist() == [False, True, True]
    # with the rare-token allowance at 1 and a wide ratio bound, row 1 passes: the test can fail
    loose = implausible(
        logprobs=lp,
        sampler_logprobs=glp,
        mask=mask,
        max_logratio=4.0,
        min_token_logprob=-10.0,
        max_rare_tokens=1,
    )
    assert loose.tolist() == [False, False, False]


def test_forged_logprobs_of_a_same_model_peer_are_caught():
    lp = torch.tensor([[-0.7, -1.2, -0.3, 0.0], [-0.7, -1.2, -0.3, 0.0]])
    honest = lp + torch.tensor([[1e-4, -2e-4, 0.0, 0.0]])  # numerical noise of a second pass
    forged = lp - math.log(2.0)  # the report that buys TIS's cap C = 2 on every token
    glp = torch.cat([honest[:1], forged[1:]])
    gap = max_abs_logprob_gap(logprobs=lp, sampler_logprobs=glp, mask=MASK)
    assert gap.tolist() == pytest.approx([2e-4, math.log(2.0)], abs=1e-6)
    assert (gap > 0.01).tolist() == [False, True]
    # the same forged report passes the plausibility screen (ln 2 < 2 nats): only the
    # same-model check catches it
    odd = implausible(
        logprobs=lp, sampler_logprobs=glp, mask=MASK, max_logratio=2.0, min_token_logprob=-10.0
    )
    assert odd.tolist() == [False, False]


def test_distrust_is_a_running_mean_of_the_flagged_fraction():
    d = torch.zeros(2)
    d = update_distrust(d, torch.tensor([1.0, 0.0]), rate=0.3)
    assert d.tolist() == pytest.approx([0.3, 0.0])
    d = update_distrust(d, torch.tensor([1.0, float("nan")]), rate=0.3)
    assert d.tolist() == pytest.approx([0.7 * 0.3 + 0.3, 0.0])  # 0.51; NaN: no samples, kept
    with pytest.raises(ValueError, match="rate"):
        update_distrust(d, torch.zeros(2), rate=0.0)


def test_share_cap_keeps_each_peers_first_sequences():
    gen = torch.tensor([0, 0, 1, 1, 1, 1, 2, 2])
    own = gen == 0
    # N = 8, max_share 0.25 -> 2 per peer: peer 1 loses its last two rows; own rows always kept
    keep = share_cap(gen, protected=own, max_share=0.25)
    assert keep.tolist() == [True, True, True, True, False, False, True, True]
    assert share_cap(gen, protected=own, max_share=1.0).all()


# ---- the receiver's screen on hand-built payloads ----------------------------------------------


def _payload() -> RolloutBatch:
    """Rank 0's own 2 rows, then rank 1's 2 rows and rank 2's 2 rows, 3 tokens each."""
    return RolloutBatch(
        prompt_index=torch.tensor([0, 0, 1, 1, 2, 2]),
        generator=torch.tensor([0, 0, 1, 1, 2, 2]),
        completion_ids=torch.full((6, 3), 5),
        lengths=torch.tensor([3, 3, 3, 3, 3, 2]),
        sampler_logprobs=torch.tensor(
            [
                [-0.5, -0.5, -0.5],
                [-0.5, -0.5, -0.5],
                [-0.5, -0.5, -0.5],  # rank 1 (a same-model peer): honest
                [-0.5 - math.log(2), -0.5 - math.log(2), -0.5 - math.log(2)],  # forged
                [-0.5, -0.5, -0.5],  # rank 2: plausible
                [-0.5, -0.5, 0.0],  # implausible: the receiver gives its 1st token e^-12
            ]
        ),
    )


@pytest.fixture
def receiver_logprobs(monkeypatch):
    """The receiver's own log-probs of `_payload()` (the screen scores the whole batch)."""
    lp = torch.tensor([[-0.5, -0.5, -0.5]] * 5 + [[-12.0, -0.5, 0.0]])

    def fake(node, task, batch, *, temperature, micro_batch_size=0):
        assert batch.generator.tolist() == [0, 0, 1, 1, 2, 2]  # one pass over every row
        return lp.clone()

    monkeypatch.setattr(defence_mod.scoring, "model_logprobs", fake)


def test_screen_drops_the_forged_and_the_implausible_rows_only(receiver_logprobs):
    cfg = DefenceConfig(plausibility=True, same_model=True)
    keep, scale, m = Screen(cfg, rank=0, same_model={1}).apply(
        _payload(), node=None, task=None, temperature=1.0
    )
    assert keep.tolist() == [True, True, True, False, True, False]
    assert scale.tolist() == [1.0] * 6
    assert m["defence/same_model_dropped"] == pytest.approx(1 / 4)
    assert m["defence/plausibility_dropped"] == pytest.approx(1 / 4)
    # rank 2 is not a same-model peer: a forged-looking gap of its own would not be checked
    keep2, _, _ = Screen(DefenceConfig(same_model=True), rank=0, same_model=set()).apply(
        _payload(), node=None, task=None, temperature=1.0
    )
    assert keep2.all()


def test_an_implausible_own_sample_is_dropped_but_counts_against_no_one(monkeypatch):
    # the receiver's own second row holds a token it gives e^-11: dropped like a peer's would
    # be, so that same-model peers (who drop it) and the receiver keep training on one batch
    lp = torch.tensor([[-0.5, -0.5, -0.5], [-11.0, -0.5, -0.5]] + [[-0.5, -0.5, -0.5]] * 3)
    lp = torch.cat([lp, torch.tensor([[-0.5, -0.5, 0.0]])])
    monkeypatch.setattr(defence_mod.scoring, "model_logprobs", lambda *a, **k: lp.clone())
    screen = Screen(DefenceConfig(plausibility=True, trust=True), rank=0, same_model=set())
    payload = _payload()
    payload.sampler_logprobs[1] = torch.tensor([-11.0, -0.5, -0.5])  # its honest report
    payload.sampler_logprobs[3] = torch.tensor([-0.5, -0.5, -0.5])  # no forging here
    keep, _, m = screen.apply(payload, node=None, task=None, temperature=1.0)
    assert keep.tolist() == [True, False, True, True, True, True]
    assert m["defence/own_dropped"] == pytest.approx(1 / 2)
    assert m["defence/plausibility_dropped"] == 0.0
    assert screen.trust(1) == screen.trust(2) == 1.0 and 0 not in screen.distrust


def test_trust_down_weights_a_partly_flagged_peer(receiver_logprobs):
    cfg = DefenceConfig(trust=True, trust_rate=0.3, quarantine_below=0.5, downweight_below=0.9)
    screen = Screen(cfg, rank=0, same_model=set())
    # step 1: rank 2 has 1 of 2 rows implausible -> distrust 0.3 * 0.5 = 0.15, trust 0.85;
    # rank 1 (not same-model here, both rows plausible) keeps trust 1. Nothing is dropped.
    keep, scale, _ = screen.apply(_payload(), node=None, task=None, temperature=1.0)
    assert keep.all()
    assert scale.tolist() == pytest.approx([1, 1, 1, 1, 0.85, 0.85])
    # then 0.15 -> 0.255 -> 0.3285 -> ...: distrust_k = 0.5 (1 - 0.7^k) approaches 0.5 from
    # below, so trust stays above quarantine_below = 0.5: down-weighted, never quarantined
    for _ in range(30):
        keep, scale, _ = screen.apply(_payload(), node=None, task=None, temperature=1.0)
    assert keep.all() and 0.5 < screen.trust(2) < 0.51
    # at the default downweight_below = 0.8 the first step's trust 0.85 leaves the weight at 1
    default = Screen(DefenceConfig(trust=True), rank=0, same_model=set())
    _, scale, _ = default.apply(_payload(), node=None, task=None, temperature=1.0)
    assert default.trust(2) == pytest.approx(0.85) and scale.tolist() == [1.0] * 6


def test_quarantine_drops_every_row_of_a_distrusted_peer(receiver_logprobs):
    cfg = DefenceConfig(trust=True, trust_rate=0.6, quarantine_below=0.6)
    screen = Screen(cfg, rank=0, same_model=set())
    # rank 2: flagged fraction 0.5 -> distrust 0.6 * 0.5 = 0.3 (trust 0.7), then
    # 0.4 * 0.3 + 0.3 = 0.42 (trust 0.58 < 0.6): quarantined at the second step
    keep, _, _ = screen.apply(_payload(), node=None, task=None, temperature=1.0)
    assert keep.all() and screen.trust(2) == pytest.approx(0.7)
    keep, _, m = screen.apply(_payload(), node=None, task=None, temperature=1.0)
    assert screen.trust(2) == pytest.approx(0.58)
    assert keep.tolist() == [True, True, True, True, False, False]
    assert m["defence/quarantine_dropped"] == pytest.approx(2 / 4)


def test_length_and_share_bounds():
    b = _payload()
    keep, _, m = Screen(DefenceConfig(max_completion_tokens=2), rank=0, same_model=set()).apply(
        b, node=None, task=None, temperature=1.0
    )
    # only rank 2's second row is 2 tokens long; every other peer row (3 tokens) is dropped,
    # the receiver's own 3-token rows are never dropped
    assert keep.tolist() == [True, True, False, False, False, True]
    assert m["defence/length_dropped"] == pytest.approx(3 / 4)
    keep, _, m = Screen(DefenceConfig(max_peer_share=1 / 6), rank=0, same_model=set()).apply(
        b, node=None, task=None, temperature=1.0
    )
    assert keep.tolist() == [True, True, True, False, True, False]  # one row per peer
    assert m["defence/share_dropped"] == pytest.approx(2 / 4)


def test_same_model_peers_are_those_with_an_equal_node_config():
    nodes = [
        {"name": n, "model": {"preset": "llama-xs"}, "optim": {"lr": lr}}
        for n, lr in (("a", 1e-4), ("b", 1e-4), ("c", 3e-4))
    ]
    cfg = RunConfig.model_validate({"nodes": nodes})
    assert same_model_ranks(cfg, 0) == {1}
    assert same_model_ranks(cfg, 2) == set()


@pytest.mark.parametrize(
    ("loss", "warned"),
    [
        ({"method": "f-tis"}, None),
        ({"method": "nois"}, None),
        ({"method": "hacpo"}, "loss hacpo"),
        ({"method": "f-tis", "shaping_gamma": 0.1}, "f-tis with policy shaping"),
    ],
)
def test_same_model_check_warns_for_losses_that_split_twins_weights(loss, warned):
    """HACPO and policy shaping weigh own and peers' samples differently: same-config twins'
    weights drift apart, so the same-model test flags honest peers (the poisoning study), under
    defence.same_model and under trust, which counts its flags."""
    nodes = [{"name": n, "model": {"preset": "llama-xs"}, "loss": loss} for n in "ab"]
    sharing = {"scheme": "joint"} if loss["method"] == "hacpo" else {}
    on = RunConfig.model_validate(
        {"nodes": nodes, "sharing": sharing, "defence": {"same_model": True}}
    )
    caveat = same_model_caveat(on, 0)
    assert (caveat is None) if warned is None else (warned in caveat and "flags honest" in caveat)
    # trust counts the same-model test's flags even with the check off
    trust = RunConfig.model_validate(
        {"nodes": nodes, "sharing": sharing, "defence": {"trust": True}}
    )
    caveat = same_model_caveat(trust, 0)
    assert (caveat is None) if warned is None else caveat.startswith("defence.trust with")
    plaus = {"nodes": nodes, "sharing": sharing, "defence": {"plausibility": True}}
    assert same_model_caveat(RunConfig.model_validate(plaus), 0) is None  # no same-model test
    # a node without a same-config peer has nothing to misjudge
    other = [nodes[0], {**nodes[1], "optim": {"lr": 3e-4}}]
    apart = {"nodes": other, "sharing": sharing, "defence": {"same_model": True}}
    assert same_model_caveat(RunConfig.model_validate(apart), 0) is None


# ---- the attacks -------------------------------------------------------------------------------


def test_forge_margin_maximises_each_losss_weight():
    assert forge_margin(LossConfig(method="f-tis", is_cap=2.0)) == pytest.approx(math.log(2.0))
    assert forge_margin(LossConfig(method="tis", is_cap=3.0)) == pytest.approx(math.log(3.0))
    assert forge_margin(LossConfig(method="vis", clip_eps=0.2)) == pytest.approx(math.log(1.2))
    assert forge_margin(LossConfig(method="nois")) == 0.0
    assert forge_margin(LossConfig(method="hacpo")) == 0.0
    assert forge_margin(LossConfig(method="f-tis", shaping_gamma=0.1)) == 0.0
    # at glp = lp - ln C the TIS weight min(exp(lp - glp), C) is exactly C
    lp = torch.tensor([-0.3, -2.0])
    glp = lp - forge_margin(LossConfig(method="f-tis"))
    assert torch.minimum(torch.exp(lp - glp), torch.tensor(2.0)).tolist() == pytest.approx([2, 2])


def _own_batch(node) -> RolloutBatch:
    """4 completions of train prompt 0: right, right, wrong, right (rank 3's)."""
    tok = node.tokenizer
    problem = TASK.split("train")[0]
    good = solution(problem.question)
    texts = [good, good, good[:-1] + "0", good]
    rows = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts]
    width = max(map(len, rows))
    ids = torch.full((4, width), tok.pad_token_id)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    return RolloutBatch(
        prompt_index=torch.zeros(4, dtype=torch.long),
        generator=torch.full((4,), 3),
        completion_ids=ids,
        lengths=torch.tensor([len(r) for r in rows]),
        sampler_logprobs=torch.full((4, width), -0.25)
        * (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]),
    )


def test_injection_keeps_the_reward_and_forged_logprobs_sit_ln_c_below_honest():
    torch.manual_seed(0)
    node = tiny_node("f-tis")
    own = _own_batch(node)
    attack = PoisonAttack(kind="inject", text="2+2=5,", group_share=0.5)
    kw = dict(node=node, task=TASK, max_new_tokens=40, temperature=1.0)
    honest, k = poison(own, attack, margin=0.0, **kw)
    forged, k2 = poison(own, attack, margin=math.log(2.0), **kw)
    assert k == k2 == 2  # group_share 0.5 of 4 rows = 2: the first two right ones
    texts = decode_for_reward(node.tokenizer, honest.completion_ids, honest.lengths)
    orig = decode_for_reward(node.tokenizer, own.completion_ids, own.lengths)
    assert texts[:2] == ["2+2=5," + orig[0]] * 2 and texts[2:] == orig[2:]
    problem = TASK.split("train")[0]
    assert [TASK.reward(problem, t) for t in texts] == [1.0, 1.0, 0.0, 1.0]
    mask = honest.mask
    assert bool((honest.sampler_logprobs[:2][mask[:2]] < 0).all())  # rescored, not the -0.25s
    assert torch.equal(honest.sampler_logprobs[2:], forged.sampler_logprobs[2:])
    diff = (honest.sampler_logprobs[:2] - forged.sampler_logprobs[:2])[mask[:2]]
    assert diff.tolist() == pytest.approx([math.log(2.0)] * int(mask[:2].sum()), abs=1e-5)
    assert honest.lengths.tolist() == [own.lengths[0] + 6, own.lengths[1] + 6, *own.lengths[2:]]


def test_long_attack_fills_the_completion_and_a_too_long_one_is_not_sent():
    node = tiny_node("f-tis")
    own = _own_batch(node)
    n0 = int(own.lengths[0])
    long = PoisonAttack(kind="long", text="0+0=0,")
    out, k = poison(
        own, long, node=node, task=TASK, max_new_tokens=n0 + 13, temperature=1.0, margin=0
    )
    # room for 13 more tokens: two whole copies of the 6-token filler; only right rows (3)
    assert k == 3
    texts = decode_for_reward(node.tokenizer, out.completion_ids, out.lengths)
    assert texts[0].startswith("0+0=0,0+0=0,") and not texts[0].startswith("0+0=0," * 3)
    assert out.lengths[0] == n0 + 12
    # an injection that does not fit leaves the row unpoisoned
    _, k = poison(own, long, node=node, task=TASK, max_new_tokens=n0 + 5, temperature=1.0, margin=0)
    assert k == 0


def test_attack_success_counts_completions_with_the_injection():
    texts = ["2+2=5,1*9=9#9", "1*9=9#9", "3+4=7,2+2=5,#1", ""]
    assert attack_success(texts, ["2+2=5,"]) == pytest.approx(2 / 4)
    assert attack_success(texts, ["2+2=5,", "1*9"]) == pytest.approx(3 / 4)
    assert attack_success([], ["x"]) == 0.0


# ---- config errors -------------------------------------------------------------------------------


def _cfg(**extra):
    return {"nodes": [{"name": "a", "model": {"preset": "llama-xs"}}], **extra}


@pytest.mark.parametrize(
    ("defence", "field"),
    [
        ({"max_logratio": 0}, "max_logratio"),
        ({"min_token_logprob": 1}, "min_token_logprob"),
        ({"trust_rate": 1.5}, "trust_rate"),
        ({"quarantine_below": 1}, "quarantine_below"),
        ({"max_peer_share": 0}, "max_peer_share"),
        ({"same_model_tolerance": -1}, "same_model_tolerance"),
        ({"quarantine_below": 0.9}, "quarantine_below"),
    ],
)
def test_bad_defence_values_are_one_clear_error(defence, field):
    from ftis.api import resolve_config
    from ftis.config import ConfigError

    with pytest.raises(ConfigError, match=f"defence.{field}"):
        resolve_config(_cfg(defence=defence))


def test_a_length_bound_above_max_new_tokens_names_the_fix():
    with pytest.raises(ValidationError, match="lower it, or set it to null"):
        RunConfig.model_validate(
            _cfg(defence={"max_completion_tokens": 99}, train={"max_new_tokens": 8})
        )


def test_poisoning_attacks_live_under_testing_adversary_only():
    cfg = RunConfig.model_validate(
        _cfg(testing={"adversary": {"a": {"kind": "inject", "text": "2+2=5,"}}})
    )
    assert cfg.testing.injections() == ["2+2=5,"]
    with pytest.raises(ValidationError):
        RunConfig.model_validate(_cfg(testing={"adversary": {"a": {"kind": "inject"}}}))
    with pytest.raises(ValidationError):
        RunConfig.model_validate(
            _cfg(testing={"adversary": {"a": {"kind": "inject", "text": "x", "group_share": 0}}})
        )


# ---- configs/poisoning.yaml end to end ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.long
def test_the_poisoning_config_logs_attack_success_and_trust_for_every_node(tmp_path):
    """configs/poisoning.yaml at its smallest: four processes, 2 steps of 4 prompts (one per
    node), evaluations of 8 problems at steps 0 and 2. Every node logs attack/success next to
    its accuracy, trust in each of its three peers at every step, and the attacker poisons."""
    import json
    from pathlib import Path

    import ftis

    config = Path(__file__).resolve().parents[1] / "configs" / "poisoning.yaml"
    run_dir = ftis.run(
        config,
        out=tmp_path / "run",
        overrides=[
            "train.steps=2",
            "train.prompts_per_step=4",
            "eval.every=2",
            "eval.size=8",
            "log.progress=false",
        ],
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    names = ["alice", "bob", "carol", "mallory"]
    for node in names:
        mine = [r for r in rows if r["node"] == node]
        evals = {r["step"]: r for r in mine if "eval/accuracy" in r}
        assert sorted(evals) == [0, 2]
        for r in evals.values():
            assert 0.0 <= r["attack/success"] <= 1.0 and "attack/success_greedy" in r
        for step in (1, 2):
            row = next(
                r
                for r in mine
                if r["step"] == step and "trust/" + names[0 if node != "alice" else 1] in r
            )
            trusts = {k for k in row if k.startswith("trust/")}
            assert trusts == {f"trust/{p}" for p in names if p != node}
            assert all(0.0 <= row[k] <= 1.0 for k in trusts)
    sent = [
        r["attack/poisoned_sent"]
        for r in rows
        if r["node"] == "mallory" and "attack/poisoned_sent" in r
    ]
    assert len(sent) == 2
