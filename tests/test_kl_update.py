"""The KL term in the update (loss.beta, docs/math.md §14): off by default and then free, zero
against an unchanged reference, linear in beta, split-invariant, the LoRA reference is the base
with adapters disabled, and a resumed run reproduces the uninterrupted run's KL and loss."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from ftis.config import LossConfig, RunConfig
from ftis.core.kl import kl_penalty
from ftis.models.logprobs import completion_logprobs
from ftis.tasks import ArithmeticTaskConfig, build_task
from ftis.train import sampling
from ftis.train import update as update_mod
from ftis.train.loop import train_node
from tests.conftest import tiny_node, tiny_run_config

TASK = build_task(ArithmeticTaskConfig(ops={"+": 1.0}))


def _kl_node(beta: float, *, lora=None):
    node = tiny_node("f-tis", lr=1e-3, lora=lora)
    if lora is not None:
        from ftis.models.loading import attach_lora

        node.model = attach_lora(node.model, node.cfg.model.lora)
        node.optimizer = torch.optim.SGD(
            [p for p in node.model.parameters() if p.requires_grad], lr=0.0
        )
    else:
        node.ref_model = copy.deepcopy(node.model).eval().requires_grad_(False)
    node.cfg = node.cfg.model_copy(
        update={
            "loss": LossConfig(method="f-tis", beta=beta),
            "optim": node.cfg.optim.model_copy(update={"grad_clip": 1e30}),
        }
    )
    return node


def _batch(node, g=4):
    from ftis.config import TrainConfig

    problems = [TASK.split("train")[i] for i in range(3)]
    cfg = TrainConfig(max_new_tokens=5, group_size=g)
    return sampling.generate(node, TASK, problems, slots=(0, g), cfg=cfg, step=1)


def _perturb(model, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g))


def _update(node, batch, adv, mb=0, beta=None):
    """(metrics, gradients the optimizer would step with) of one update on a copy of `node`."""
    node = copy.deepcopy(node)
    loss_cfg = node.cfg.loss if beta is None else node.cfg.loss.model_copy(update={"beta": beta})
    node.optimizer = torch.optim.SGD([p for p in node.model.parameters() if p.requires_grad], lr=0)
    captured = {}
    orig = node.optimizer.step

    def step():
        captured["g"] = [p.grad.clone() for p in node.model.parameters() if p.requires_grad]
        orig()

    node.optimizer.step = step
    m = update_mod.update(node, TASK, batch, adv, loss_cfg=loss_cfg, micro_batch_size=mb)
    return m, captured["g"]


def _expected_kl(model, ref_model, batch, tokenizer):
    """The k3 penalty computed outside the update: both models score the batch whole."""
    from ftis.rollout.sampler import left_pad

    train = TASK.split("train")
    prompts = [TASK.prompt_ids(train[i], tokenizer) for i in batch.prompt_index.tolist()]
    ids, pmask = left_pad(prompts, tokenizer.pad_token_id)
    kw = dict(
        prompt_ids=ids,
        prompt_mask=pmask,
        completion_ids=batch.completion_ids,
        completion_mask=batch.mask.long(),
    )
    with torch.no_grad():
        lp = completion_logprobs(model, **kw)
        ref = completion_logprobs(ref_model, **kw)
    return float(
        kl_penalty(lp, ref_logprobs=ref, mask=batch.mask, num_sequences=batch.num_sequences)
    )


def test_beta_zero_computes_nothing_extra():
    node = tiny_node("f-tis")  # no reference at all: any use of one would raise
    batch = _batch(node)
    adv = torch.linspace(-1, 1, batch.num_sequences)
    m = update_mod.update(node, TASK, batch, adv, loss_cfg=node.cfg.loss, micro_batch_size=0)
    assert "kl" not in m
    with pytest.raises(RuntimeError, match="no KL reference"):
        with node.reference():
            pass


def test_kl_is_zero_against_an_unchanged_reference_and_changes_no_gradient():
    node = _kl_node(0.5)
    batch = _batch(node)
    adv = torch.linspace(-1, 1, batch.num_sequences)
    adv[:4] = 0.0  # a zero-advantage group: run anyway under beta > 0, still exact
    m, g = _update(node, batch, adv)
    m0, g0 = _update(node, batch, adv, beta=0.0)
    assert m["kl"] == 0.0
    assert m["loss"] == pytest.approx(m0["loss"], abs=1e-7)
    for a, b in zip(g, g0):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)


def test_kl_value_is_k3_against_the_reference_and_its_gradient_is_linear_in_beta():
    node = _kl_node(0.1)
    batch = _batch(node)
    _perturb(node.model)
    adv = torch.linspace(-1, 1, batch.num_sequences)
    m1, g1 = _update(node, batch, adv)
    _, g2 = _update(node, batch, adv, beta=0.2)
    m0, g0 = _update(node, batch, adv, beta=0.0)
    expected = _expected_kl(node.model, node.ref_model, batch, node.tokenizer)
    assert expected > 1e-4  # the perturbation moved the model away from its reference
    assert m1["kl"] == pytest.approx(expected, rel=1e-4)
    assert m1["loss"] == pytest.approx(m0["loss"] + 0.1 * expected, rel=1e-4, abs=1e-7)
    diff1 = torch.cat([(a - b).flatten() for a, b in zip(g1, g0)])
    diff2 = torch.cat([(a - b).flatten() for a, b in zip(g2, g0)])
    assert diff1.norm() > 1e-4
    torch.testing.assert_close(diff2, 2 * diff1, atol=1e-6, rtol=1e-3)


def test_kl_micro_batches_change_nothing():
    node = _kl_node(0.3)
    batch = _batch(node)
    _perturb(node.model)
    adv = torch.linspace(-1, 1, batch.num_sequences)
    m, g = _update(node, batch, adv, mb=0)
    for mb in (1, 5):
        ms, gs = _update(node, batch, adv, mb=mb)
        assert ms["kl"] == pytest.approx(m["kl"], rel=1e-5)
        for a, b in zip(g, gs):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_lora_nodes_reference_is_its_base_with_adapters_disabled():
    from ftis.models.config import LoraConfig
    from ftis.models.loading import build_model

    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    node = _kl_node(0.5, lora=lora)
    assert node.ref_model is None
    batch = _batch(node)
    adv = torch.linspace(-1, 1, batch.num_sequences)
    m, _ = _update(node, batch, adv)
    assert m["kl"] == 0.0  # LoRA's B starts at 0: the adapted model is its base
    _perturb(node.model)  # only the adapters are trainable: the base is untouched
    m, _ = _update(node, batch, adv)
    plain = build_model(node.cfg.model)  # the same seeded base, built afresh, no adapters
    expected = _expected_kl(node.model, plain, batch, node.tokenizer)
    assert expected > 1e-4
    assert m["kl"] == pytest.approx(expected, rel=1e-4)


def _run_cfg(steps: int) -> RunConfig:
    # one-digit sums after 60 warm-start steps: about a third correct, so groups disagree and
    # every step trains
    data = tiny_run_config(steps=steps, prompts_per_step=8)
    data["task"].update(max_digits=1, test_size=4)
    data["nodes"][0]["warm_start"]["steps"] = 60
    data["nodes"][0]["loss"] = {"beta": 0.5}
    data["eval"] = {"every": 0, "size": 8, "pass_samples": 0}
    data["checkpoint"] = {"every": 1, "keep": 3}
    return RunConfig.model_validate(data)


def _rows(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss/kl" in r}


def test_a_resumed_run_reproduces_the_kl_and_the_loss(tmp_path):
    """The reference is rebuilt from the warm start at resume (not saved): the resumed steps'
    loss/kl and loss/loss are the uninterrupted run's."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    train_node(_run_cfg(3), rank=0, run_dir=whole)
    train_node(_run_cfg(1), rank=0, run_dir=part)
    train_node(_run_cfg(3), rank=0, run_dir=part, resume=True)
    a, b = _rows(whole), _rows(part)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert a[3]["loss/kl"] > 0  # two steps away from the reference
    for step in (2, 3):
        for k in ("loss/kl", "loss/loss"):
            assert b[step][k] == pytest.approx(a[step][k], rel=1e-5, abs=1e-9), (step, k)


def test_beta_with_the_drop_filter_mode_is_refused_with_the_fix():
    from ftis.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="loss.filter_mode=zero or loss.beta=0"):
        load_config(None, ["nodes.0.loss.beta=0.1", "nodes.0.loss.filter_mode=drop"])
