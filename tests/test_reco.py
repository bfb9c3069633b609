"""ReCo in training (docs/math.md §8) and several optimizer steps per generation round.

Phase-level tests on a llama-xs node built in-process (random init, char tokenizer); one tiny
run through the node shell; the shipped configs/reco.yaml is checked for what it promises.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from ftis.algos.base import NodeContext
from ftis.algos.ftis.algorithm import FTISAlgorithm
from ftis.config import LossConfig, RunConfig, load_config
from ftis.core.reco import reco_weights
from ftis.exchange.transport import LocalTransport
from ftis.tasks import ArithmeticTaskConfig, build_task
from ftis.train import sampling
from ftis.train import update as update_mod
from ftis.train.node import Node
from ftis.train.timing import PhaseTimer
from tests.conftest import tiny_node, tiny_run_config

TASK = build_task(ArithmeticTaskConfig(ops={"+": 1.0}))
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: a second intra-op thread buys nothing, and on a shared machine
    an oversubscribed thread pool made this file several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _node(method: str = "reco", **loss) -> Node:
    node = tiny_node(method, lr=1e-3)
    node.cfg = node.cfg.model_copy(update={"loss": LossConfig(method=method, **loss)})
    return node


def _batch(node: Node, n_prompts: int = 3, g: int = 4):
    from ftis.config import TrainConfig

    problems = [TASK.split("train")[i] for i in range(n_prompts)]
    cfg = TrainConfig(max_new_tokens=5, group_size=g)
    return sampling.generate(node, TASK, problems, slots=(0, g), cfg=cfg, step=1)


def _grads(node: Node, batch, adv, mb: int) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The gradients the optimizer would step with (clip out of reach, SGD at lr 0)."""
    node = copy.deepcopy(node)
    node.cfg = node.cfg.model_copy(
        update={"optim": node.cfg.optim.model_copy(update={"grad_clip": 1e30})}
    )
    node.optimizer = torch.optim.SGD(node.model.parameters(), lr=0.0)
    captured = {}
    orig_step = node.optimizer.step

    def step():
        captured["g"] = [p.grad.clone() for p in node.model.parameters()]
        orig_step()

    node.optimizer.step = step
    m = update_mod.update(node, TASK, batch, adv, loss_cfg=node.cfg.loss, micro_batch_size=mb)
    return captured["g"], m


def _algorithm(node: Node, **train) -> FTISAlgorithm:
    data = tiny_run_config(**train)
    data["nodes"][0]["loss"] = node.cfg.loss.model_dump()
    cfg = RunConfig.model_validate(data)
    ctx = NodeContext(cfg, 0, node, TASK, LocalTransport(), PhaseTimer(), first_step=1)
    return FTISAlgorithm(ctx)


# ---- ReCo in the update -------------------------------------------------------------------------


def test_reco_update_does_not_depend_on_the_micro_batch_size():
    """Response weights are normalised within whole groups: the update computes them over the
    whole batch before it splits it, so every split gives the same gradient."""
    # A random-init model gives every token p ~ 1/V, so raw weights 1/(G pbar) are large: a high
    # cap keeps them apart (at w_max = 5 they would all clip to 5 and normalise to 1).
    node = _node("f-reco", reco_tis=True, reco_w_max=1e3)
    batch = _batch(node, n_prompts=2)
    # Off-policy by a different amount per sequence: ratios != 1 and weights != 1.
    shift = torch.linspace(0.0, 0.6, batch.num_sequences)[:, None]
    batch.sampler_logprobs = batch.sampler_logprobs - shift * batch.mask
    adv = torch.linspace(-1, 1, batch.num_sequences)
    whole, m = _grads(node, batch, adv, mb=0)
    assert m["reco_weight_max"] > m["reco_weight_min"] + 0.1
    assert m["variance_ratio_mean"] != pytest.approx(1.0, abs=1e-3)
    for mb in (1, 3):  # 3 cuts both groups of 4
        split, _ = _grads(node, batch, adv, mb=mb)
        for a, b in zip(whole, split):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # The weights matter: without them the gradient differs (the test above can fail).
    off = _node("f-reco", reco_tis=True, reco_response_weights=False)
    unweighted, m_off = _grads(off, batch, adv, mb=0)
    assert "reco_weight_max" not in m_off
    assert any(not torch.allclose(a, b, atol=1e-5) for a, b in zip(whole, unweighted))


def test_reco_with_both_levels_off_updates_like_vis():
    node = _node("reco", reco_response_weights=False, reco_token_ratio=False)
    vis = _node("vis")
    vis.model.load_state_dict(node.model.state_dict())
    batch = _batch(node)
    batch.sampler_logprobs = batch.sampler_logprobs - 0.3 * batch.mask
    adv = torch.linspace(-1, 1, batch.num_sequences)
    a, ma = _grads(node, batch, adv, mb=0)
    b, mb = _grads(vis, batch, adv, mb=0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert ma == mb


# ---- several optimizer steps per round -----------------------------------------------------------


def test_round_plan_by_hand():
    assert update_mod.round_plan(7) == [None]
    assert update_mod.round_plan(7, epochs=3) == [None, None, None]
    plan = update_mod.round_plan(7, epochs=2, mini_batches=3, seed=5)
    assert [len(p) for p in plan] == [3, 2, 2, 3, 2, 2]
    for epoch in (plan[:3], plan[3:]):
        assert sorted(torch.cat(epoch).tolist()) == list(range(7))  # each pass is a permutation
    assert not torch.equal(torch.cat(plan[:3]), torch.cat(plan[3:]))  # reshuffled per pass
    again = update_mod.round_plan(7, epochs=2, mini_batches=3, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(plan, again))  # seeded
    other = update_mod.round_plan(7, epochs=2, mini_batches=3, seed=6)
    assert any(not torch.equal(a, b) for a, b in zip(plan, other))
    # Fewer sequences than mini-batches: the empty parts are left out.
    assert [len(p) for p in update_mod.round_plan(2, mini_batches=3)] == [1, 1]
    assert update_mod.minibatch_seed(0, 1) != update_mod.minibatch_seed(0, 2)
    with pytest.raises(ValueError):
        update_mod.round_plan(3, epochs=0)


def test_mean_step_metrics_by_hand():
    steps = [
        {"loss": 1.0, "is_weight_max": 2.0, "reco_weight_min": 0.5, "grad_norm": 3.0},
        {"loss": 2.0, "is_weight_max": 5.0, "reco_weight_min": 0.25, "grad_norm": 1.0},
        {"loss": 6.0, "is_weight_max": 1.0, "reco_weight_min": 0.75},
    ]
    assert update_mod.mean_step_metrics(steps) == {
        "loss": 3.0,
        "is_weight_max": 5.0,
        "reco_weight_min": 0.25,
        "grad_norm": 2.0,  # over the steps that report it
    }
    assert update_mod.mean_step_metrics([]) == {}


@pytest.mark.parametrize("method", ["f-tis", "reco"])
def test_default_round_is_the_single_update_bit_for_bit(method):
    """update_epochs = mini_batches = 1 (the defaults) is what the algorithm did before: one
    `update` on the whole batch, same weights, same loss/* metrics."""
    node = _node(method)
    batch = _batch(node)
    batch.sampler_logprobs = batch.sampler_logprobs - 0.2 * batch.mask
    adv = torch.linspace(-1, 1, batch.num_sequences)
    before = copy.deepcopy(node)
    expected = update_mod.update(
        before, TASK, batch, adv, loss_cfg=before.cfg.loss, micro_batch_size=0, temperature=1.0
    )
    out = _algorithm(node)._update(batch, adv, step=1)
    assert all(
        torch.equal(a, b) for a, b in zip(before.model.parameters(), node.model.parameters())
    )
    assert {k.removeprefix("loss/"): v for k, v in out.items() if k.startswith("loss/")} == expected
    assert out["train/optimizer_steps"] == 1 and out["train/skipped_update"] == 0


def test_several_steps_reuse_the_rounds_samples(monkeypatch):
    node = _node("reco")
    batch = _batch(node)  # on-policy: sampled by this very model
    adv = torch.linspace(-1, 1, batch.num_sequences)
    calls = []
    real = update_mod.update

    def spy(node_, task, part, part_adv, **kw):
        m = real(node_, task, part, part_adv, **kw)
        calls.append((part, part_adv, kw["sequence_weights"], m))
        return m

    monkeypatch.setattr("ftis.train.update.update", spy)
    out = _algorithm(node, update_epochs=2, mini_batches=2)._update(batch, adv, step=3)
    assert out["train/optimizer_steps"] == 4 and len(calls) == 4
    whole_w = reco_weights(batch.sampler_logprobs, batch.mask, batch.prompt_index, 4)
    plan = update_mod.round_plan(
        batch.num_sequences, epochs=2, mini_batches=2, seed=update_mod.minibatch_seed(0, 3)
    )
    for idx, (part, part_adv, w, _) in zip(plan, calls):
        # The sampler's log-probs, the round's advantages and whole-group weights, every step.
        assert torch.equal(part.sampler_logprobs, batch.sampler_logprobs[idx])
        assert torch.equal(part_adv, adv[idx])
        torch.testing.assert_close(w, whole_w[idx])
    first, later = calls[0][3], calls[-1][3]
    # Step 1 is on-policy: every ratio is 1. The last step sees a model that moved 3 times.
    assert first["variance_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert first["is_weight_max"] == pytest.approx(1.0, abs=1e-5)
    assert abs(later["is_weight_mean"] - 1.0) > 1e-3
    assert abs(later["variance_ratio_mean"] - 1.0) > 1e-3
    ms = [c[3] for c in calls]
    assert out["loss/grad_norm"] == pytest.approx(sum(m["grad_norm"] for m in ms) / 4)
    assert out["loss/is_weight_max"] == max(m["is_weight_max"] for m in ms)


@pytest.mark.chaos_case("ReCo", "non-finite mini-batch")
def test_a_non_finite_mini_batch_is_skipped_and_the_others_run():
    node = _node("vis")
    batch = _batch(node)
    adv = torch.linspace(-1, 1, batch.num_sequences)
    adv[0] = float("nan")  # lands in exactly one of the two mini-batches
    alg = _algorithm(node, mini_batches=2)
    out = alg._update(batch, adv, step=1)
    assert out["train/optimizer_steps"] == 1 and out["train/skipped_update"] == 1
    assert out["train/skipped_updates_total"] == 1 and "loss/loss" in out
    assert all(torch.isfinite(p).all() for p in node.model.parameters())


# ---- runs ----------------------------------------------------------------------------------------


def test_a_reco_run_logs_its_metrics_and_pass_at_k(tmp_path, monkeypatch):
    from ftis.train import scoring
    from ftis.train.loop import train_node

    # Rewards 0, 1, 0, 1... give every group a signal: a round without one takes no optimizer
    # step (issue 22), and this tiny model answers every prompt of a group alike.
    monkeypatch.setattr(
        scoring, "score", lambda task, tok, batch: torch.arange(batch.num_sequences) % 2.0
    )

    data = tiny_run_config(steps=2, update_epochs=2, mini_batches=2)
    data["nodes"][0]["loss"] = {"method": "f-reco", "reco_tis": True}
    data["eval"] = {"every": 0, "size": 8, "pass_samples": 8, "pass_k": [1, 8], "pass_problems": 4}
    train_node(RunConfig.model_validate(data), rank=0, run_dir=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/optimizer_steps" in r]
    assert [r["train/optimizer_steps"] for r in steps] == [4.0, 4.0]
    for key in ("loss/variance_ratio_mean", "loss/reco_weight_max", "loss/clip_frac"):
        assert all(key in r for r in steps), key
    assert sum("eval/pass@8" in r for r in rows) == 2  # step 0 and the end


def test_the_shipped_reco_config():
    cfg = load_config(ROOT / "configs" / "reco.yaml")
    assert len(cfg.nodes) == 1
    assert cfg.nodes[0].loss.method in ("reco", "f-reco")
    assert 64 in cfg.eval.pass_k and cfg.eval.pass_samples >= 64
    assert cfg.train.update_epochs * cfg.train.mini_batches > 1  # the token ratio can act


def test_the_reco_configs_grpo_baseline_differs_in_the_loss_method_alone():
    """configs/reco.yaml's header gives its GRPO baseline as `--set nodes.0.loss.method=vis`:
    every other setting (warm start, reuse, seeds, evaluation) is the same."""
    text = (ROOT / "configs" / "reco.yaml").read_text()
    assert "ftis run configs/reco.yaml --set nodes.0.loss.method=vis" in text
    reco = load_config(ROOT / "configs" / "reco.yaml").model_dump()
    grpo = load_config(ROOT / "configs" / "reco.yaml", ["nodes.0.loss.method=vis"]).model_dump()
    assert (reco["nodes"][0]["loss"]["method"], grpo["nodes"][0]["loss"]["method"]) == (
        "reco",
        "vis",
    )
    grpo["nodes"][0]["loss"]["method"] = "reco"
    assert grpo == reco
