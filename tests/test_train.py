import copy

import pytest
import torch

from ftis.models.loading import ModelConfig, build_model
from ftis.rollout.types import RolloutBatch
from ftis.tasks import ArithmeticTaskConfig, build_task
from ftis.train import phases
from ftis.train.node import Node
from ftis.warmstart import WarmStartConfig, cache_key, warm_start
from tests.conftest import tiny_node

TASK = build_task(ArithmeticTaskConfig(ops={"+": 1.0}))


def _node(method="f-tis", lr=1e-3) -> Node:
    return tiny_node(method, lr=lr)


def _batch(node: Node, n_prompts=3, g=4) -> RolloutBatch:
    train = TASK.split("train")
    problems = [train[i] for i in range(n_prompts)]
    return phases.generate(node, TASK, problems, slots=(0, g), cfg=_train_cfg(g), step=1)


def _train_cfg(g=4):
    from ftis.config import TrainConfig

    return TrainConfig(max_new_tokens=5, group_size=g)


def _grads_after_update(node: Node, batch, adv, mb: int) -> list[torch.Tensor]:
    node = copy.deepcopy(node)
    node.optimizer = torch.optim.SGD(node.model.parameters(), lr=0.0)  # keep grads, move nothing
    captured = {}
    orig_step = node.optimizer.step

    def step():
        captured["g"] = [p.grad.clone() for p in node.model.parameters()]
        orig_step()

    node.optimizer.step = step
    phases.update(node, TASK, batch, adv, loss_cfg=node.cfg.loss, micro_batch_size=mb)
    return captured["g"]


@pytest.mark.parametrize("method", ["f-tis", "vis", "nois"])
def test_micro_batches_change_nothing(method):
    node = _node(method)
    batch = _batch(node)
    # Off-policy sampler log-probs so the IS weights and the filter are exercised.
    batch.sampler_logprobs = batch.sampler_logprobs - 0.3 * batch.mask
    adv = torch.linspace(-1, 1, batch.num_sequences)
    whole = _grads_after_update(node, batch, adv, mb=0)
    for mb in (1, 5):
        split = _grads_after_update(node, batch, adv, mb=mb)
        for a, b in zip(whole, split):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_non_finite_loss_skips_the_update():
    node = _node("nois")
    batch = _batch(node)
    before = [p.detach().clone() for p in node.model.parameters()]
    adv = torch.full((batch.num_sequences,), float("nan"))
    with pytest.raises(phases.NonFiniteError):
        phases.update(node, TASK, batch, adv, loss_cfg=node.cfg.loss, micro_batch_size=0)
    assert all(torch.equal(a, b) for a, b in zip(before, node.model.parameters()))
    assert all(p.grad is None for p in node.model.parameters())


def test_score_uses_the_receivers_verifier():
    node = _node()
    tok = node.tokenizer
    train = TASK.split("train")
    problems = [train[0], train[1]]
    texts = [problems[0].answer, "nope"]
    ids = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts]
    width = max(map(len, ids))
    comp = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])
    batch = RolloutBatch(
        prompt_index=torch.tensor([0, 1]),
        generator=torch.tensor([1, 1]),
        completion_ids=comp,
        lengths=torch.tensor([len(x) for x in ids]),
        sampler_logprobs=torch.zeros(comp.shape),
    )
    assert phases.score(TASK, tok, batch).tolist() == [1.0, 0.0]


def test_prompt_assignment():
    idx = list(range(10))
    mine = [phases.assign_prompts(idx, rank=r, world_size=3, scheme="vertical") for r in range(3)]
    assert sorted(i for m in mine for i in m) == idx
    assert all(
        phases.sample_slots(rank=r, world_size=3, scheme="vertical", group_size=8) == (0, 8)
        for r in range(3)
    )
    assert all(
        phases.assign_prompts(idx, rank=r, world_size=3, scheme="horizontal") == idx
        for r in range(3)
    )
    slots = [
        phases.sample_slots(rank=r, world_size=3, scheme="horizontal", group_size=8)
        for r in range(3)
    ]
    assert slots == [(0, 3), (3, 3), (6, 2)]  # disjoint, covering all G = 8 slots
    assert phases.step_prompts(0, 5, 8, 10**9) == phases.step_prompts(0, 5, 8, 10**9)
    assert phases.step_prompts(0, 5, 8, 10**9) != phases.step_prompts(0, 6, 8, 10**9)
    with pytest.raises(ValueError, match="prompts_per_step"):
        phases.step_prompts(0, 1, 20, 10)


def test_warm_start_is_cached_and_deterministic(tmp_path, monkeypatch):
    model_cfg = ModelConfig(preset="llama-xs")
    ws = WarmStartConfig(steps=5, batch_size=8)
    task_cfg = ArithmeticTaskConfig(ops={"+": 1.0})
    monkeypatch.setenv("FTIS_CACHE", str(tmp_path / "a"))
    a = warm_start(model_cfg, ws, task_cfg)
    mtime = (a / "meta.json").stat().st_mtime_ns
    assert warm_start(model_cfg, ws, task_cfg) == a  # cache hit: not retrained
    assert (a / "meta.json").stat().st_mtime_ns == mtime
    monkeypatch.setenv("FTIS_CACHE", str(tmp_path / "b"))
    b = warm_start(model_cfg, ws, task_cfg)
    wa = build_model(ModelConfig(path=str(a))).state_dict()
    wb = build_model(ModelConfig(path=str(b))).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # Anything that changes the weights changes the key.
    other = ws.model_copy(update={"mix": {"+": 1.0, "-": 1.0}})
    assert cache_key(model_cfg, other, task_cfg) != cache_key(model_cfg, ws, task_cfg)


def test_warm_start_mix_needs_the_arithmetic_task():
    from ftis.tasks import GSM8KTaskConfig, fixture_path

    gsm = GSM8KTaskConfig(
        train_file=str(fixture_path("gsm8k_tiny_train.jsonl")),
        test_file=str(fixture_path("gsm8k_tiny_test.jsonl")),
    )
    with pytest.raises(ValueError, match="only applies to the arithmetic task"):
        warm_start(ModelConfig(preset="llama-xs"), WarmStartConfig(steps=1, mix={"+": 1.0}), gsm)


@pytest.mark.parametrize("method", ["f-tis", "vis"])
def test_skipping_zero_advantage_sequences_is_exact(method):
    node = _node(method)
    batch = _batch(node)
    batch.sampler_logprobs = batch.sampler_logprobs - 0.3 * batch.mask
    adv = torch.linspace(-1, 1, batch.num_sequences)
    adv[:4] = 0.0  # a group whose rewards were all equal
    adv[7] = 0.0

    def run(skip: bool):
        n = copy.deepcopy(node)
        grads = {}
        step = n.optimizer.step

        def capture():
            grads["g"] = [p.grad.clone() for p in n.model.parameters()]
            step()

        n.optimizer.step = capture
        m = phases.update(
            n, TASK, batch, adv, loss_cfg=n.cfg.loss, micro_batch_size=5, skip_zero_advantage=skip
        )
        return grads["g"], m

    # Gradients, not weights: Adam's first step is lr * sign(g), which turns fp noise on a
    # near-zero gradient element into a full-size step.
    g_full, m_full = run(False)
    g_skip, m_skip = run(True)
    for a, b in zip(g_full, g_skip):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert m_skip["loss"] == pytest.approx(m_full["loss"], abs=1e-6)
    assert m_skip["active_frac"] == pytest.approx(1 - 5 / batch.num_sequences)


def test_all_zero_advantages_still_step_adam_like_a_zero_gradient():
    node = _node("f-tis")
    batch = _batch(node)
    # Give Adam momentum first, so a zero-gradient step still moves the weights.
    phases.update(
        node,
        TASK,
        batch,
        torch.linspace(-1, 1, batch.num_sequences),
        loss_cfg=node.cfg.loss,
        micro_batch_size=0,
    )
    zeros = torch.zeros(batch.num_sequences)
    a, b = copy.deepcopy(node), copy.deepcopy(node)
    phases.update(
        a, TASK, batch, zeros, loss_cfg=a.cfg.loss, micro_batch_size=0, skip_zero_advantage=False
    )
    phases.update(
        b, TASK, batch, zeros, loss_cfg=b.cfg.loss, micro_batch_size=0, skip_zero_advantage=True
    )
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-7, rtol=0)


def test_samples_do_not_depend_on_how_prompts_are_split():
    """Vertical sharing between identical nodes samples what one node sampling everything would."""
    node = _node()
    train = TASK.split("train")
    problems = [train[i] for i in range(4)]
    cfg = _train_cfg(4)
    together = phases.generate(node, TASK, problems, slots=(0, 4), cfg=cfg, step=3)
    parts = [
        phases.generate(node, TASK, problems[r::2], slots=(0, 4), cfg=cfg, step=3) for r in range(2)
    ]
    # Horizontal: two nodes sampling slots 0-1 and 2-3 of every group.
    halves = [
        phases.generate(node, TASK, problems, slots=(2 * r, 2), cfg=cfg, step=3) for r in range(2)
    ]

    def rows(batch, index, width):
        ids = batch.completion_ids[batch.prompt_index == index]
        return torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=0)

    for i, p in enumerate(problems):
        want = rows(together, p.index, 8)
        assert torch.equal(rows(parts[i % 2], p.index, 8), want)
        assert torch.equal(torch.cat([rows(h, p.index, 8) for h in halves]), want)
    other_step = phases.generate(node, TASK, problems, slots=(0, 4), cfg=cfg, step=4)
    assert not torch.equal(rows(other_step, 0, 8), rows(together, 0, 8))


def test_nan_logits_while_sampling_never_reach_the_weights():
    node = _node("f-tis")
    hook = node.model.lm_head.register_forward_hook(lambda mod, inp, out: out * float("nan"))
    batch = _batch(node)  # sampling itself must not raise
    hook.remove()
    assert torch.isnan(batch.sampler_logprobs[batch.mask]).all()
    before = [p.detach().clone() for p in node.model.parameters()]
    adv = torch.linspace(-1, 1, batch.num_sequences)
    with pytest.raises(phases.NonFiniteError):
        phases.update(node, TASK, batch, adv, loss_cfg=node.cfg.loss, micro_batch_size=0)
    assert all(torch.equal(a, b) for a, b in zip(before, node.model.parameters()))
