import copy

import pytest
import torch

from ftis.algos.ftis import sharing
from ftis.models.loading import ModelConfig, build_model
from ftis.rollout.types import RolloutBatch
from ftis.tasks import ArithmeticTaskConfig, build_task
from ftis.train import sampling, scoring
from ftis.train import update as update_mod
from ftis.train.node import Node
from ftis.warmstart import WarmStartConfig, cache_key, warm_start
from tests.conftest import tiny_node

TASK = build_task(ArithmeticTaskConfig(ops={"+": 1.0}))


def _node(method="f-tis", lr=1e-3) -> Node:
    return tiny_node(method, lr=lr)


def _batch(node: Node, n_prompts=3, g=4) -> RolloutBatch:
    train = TASK.split("train")
    problems = [train[i] for i in range(n_prompts)]
    return sampling.generate(node, TASK, problems, slots=(0, g), cfg=_train_cfg(g), step=1)


def _train_cfg(g=4):
    from ftis.config import TrainConfig

    return TrainConfig(max_new_tokens=5, group_size=g)


def _grads_after_update(node: Node, batch, adv, mb: int, **kw) -> list[torch.Tensor]:
    """The accumulated gradients the optimizer would step with, before any clipping: the clip
    is set out of reach (and checked to be), since clipping to norm 1 would hide a gradient
    that is off by any factor."""
    node = copy.deepcopy(node)
    node.cfg = node.cfg.model_copy(
        update={"optim": node.cfg.optim.model_copy(update={"grad_clip": 1e30})}
    )
    node.optimizer = torch.optim.SGD(node.model.parameters(), lr=0.0)  # keep grads, move nothing
    captured = {}
    orig_step = node.optimizer.step

    def step():
        captured["g"] = [p.grad.clone() for p in node.model.parameters()]
        orig_step()

    node.optimizer.step = step
    m = update_mod.update(node, TASK, batch, adv, loss_cfg=node.cfg.loss, micro_batch_size=mb, **kw)
    assert m["grad_norm"] < 1e30
    return captured["g"]


def test_gradient_capture_sees_the_scale_of_the_gradient():
    """The micro-batch tests compare these gradients: they must change with the loss's scale
    (a split that doubled the gradient would be caught, unlike after clipping to norm 1)."""
    node = _node("vis")
    batch = _batch(node)
    adv = torch.linspace(-1, 1, batch.num_sequences)
    once = _grads_after_update(node, batch, adv, mb=0)
    twice = _grads_after_update(node, batch, 2 * adv, mb=0)
    norm = torch.sqrt(sum((g**2).sum() for g in once))
    assert norm > 1.0  # above the default clip: clipping would have hidden the factor 2
    for a, b in zip(once, twice):
        torch.testing.assert_close(2 * a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("method", ["f-tis", "vis", "nois", "tis"])
def test_an_update_moves_the_model_toward_the_rewarded_answer(method):
    """A group where the answer is known: two completions are right, two wrong. After a few
    updates on it the right completion is more likely and the wrong one less likely."""
    from ftis.models.logprobs import completion_logprobs
    from ftis.rollout.sampler import left_pad

    node = _node(method, lr=1e-3)  # 1e-2 overshoots: Adam's first steps are lr * sign(g)
    tok = node.tokenizer
    problem = TASK.split("train")[0]
    wrong = str(int(problem.answer) + 1)
    texts = [problem.answer, wrong, problem.answer, wrong]
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    width = max(map(len, ids))
    completion = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i in ids])
    lengths = torch.tensor([len(i) for i in ids])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    prompt_ids, prompt_mask = left_pad([TASK.prompt_ids(problem, tok)] * 4, tok.pad_token_id)

    def logprobs() -> torch.Tensor:  # (4, T), this model now
        with torch.no_grad():
            lp = completion_logprobs(
                node.model,
                prompt_ids=prompt_ids,
                prompt_mask=prompt_mask,
                completion_ids=completion,
                completion_mask=mask.long(),
            )
        return torch.where(mask, lp, torch.zeros_like(lp))

    before = logprobs().sum(1)
    for _ in range(3):
        batch = RolloutBatch(
            prompt_index=torch.full((4,), problem.index),
            generator=torch.zeros(4, dtype=torch.long),
            completion_ids=completion,
            lengths=lengths,
            sampler_logprobs=logprobs(),  # on-policy: sampled by this model
        )
        rewards = scoring.score(TASK, tok, batch)
        assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
        adv = scoring.advantages_for(batch, rewards, "std")
        update_mod.update(node, TASK, batch, adv, loss_cfg=node.cfg.loss, micro_batch_size=0)
    after = logprobs().sum(1)
    assert after[0] > before[0] + 0.05 and after[1] < before[1] - 0.05, (before, after)


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


@pytest.mark.parametrize(
    "loss",
    [
        {"method": "f-tis", "filter_mode": "drop", "filter_threshold": 0.02},
        {"method": "f-tis", "filter_stat_norm": "padded", "filter_threshold": 0.02},
        {"method": "f-vis", "filter_mode": "drop", "filter_stat_norm": "padded"},
    ],
)
def test_micro_batches_change_nothing_under_the_authors_filter_readings(loss):
    """filter_mode 'drop' and filter_stat_norm 'padded' used to depend on the split (each
    micro-batch divided by its own kept count / averaged over its own width)."""
    from ftis.config import LossConfig

    node = _node()
    node.cfg = node.cfg.model_copy(update={"loss": LossConfig(**loss)})
    batch = _batch(node, n_prompts=4)
    # Lengths that differ between micro-batches (the padded statistic divides by a width) ...
    short = torch.arange(batch.num_sequences) % 3 == 0
    batch.lengths = torch.where(short, torch.full_like(batch.lengths, 2), batch.lengths)
    batch.completion_ids = torch.where(
        batch.mask, batch.completion_ids, node.tokenizer.pad_token_id
    )
    batch.sampler_logprobs = torch.where(batch.mask, batch.sampler_logprobs, 0.0)
    # ... and off-policy by a different amount per sequence, so some are filtered and some not.
    shift = torch.linspace(0.0, 0.6, batch.num_sequences)[:, None]
    batch.sampler_logprobs = batch.sampler_logprobs - shift * batch.mask
    adv = torch.linspace(-1, 1, batch.num_sequences)
    whole = _grads_after_update(node, batch, adv, mb=0)
    for mb in (1, 3, 5):
        split = _grads_after_update(node, batch, adv, mb=mb)
        for a, b in zip(whole, split):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_own_samples_have_ratio_one_at_any_temperature():
    """Sampled at T = 0.7, scored by the same node: every IS weight is 1 (the receiver scores
    the tempered distribution the sampler drew from), so TIS truncates nothing."""
    from ftis.config import LossConfig, TrainConfig

    node = _node()
    node.cfg = node.cfg.model_copy(update={"loss": LossConfig(method="tis", is_cap=1.01)})
    cfg = TrainConfig(max_new_tokens=5, group_size=4, temperature=0.7)
    problems = [TASK.split("train")[i] for i in range(3)]
    batch = sampling.generate(node, TASK, problems, slots=(0, 4), cfg=cfg, step=1)
    adv = torch.linspace(-1, 1, batch.num_sequences)

    def stats(temperature: float) -> dict[str, float]:
        n = copy.deepcopy(node)
        return update_mod.update(
            n, TASK, batch, adv, loss_cfg=n.cfg.loss, micro_batch_size=0, temperature=temperature
        )

    m = stats(0.7)
    assert m["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m["is_weight_max"] == pytest.approx(1.0, abs=1e-3) and m["truncated_frac"] == 0
    untempered = stats(1.0)  # what the receiver used to score: ratios far from 1
    assert abs(untempered["is_weight_mean"] - 1.0) > 0.05 or untempered["truncated_frac"] > 0.05


def test_non_finite_loss_skips_the_update():
    node = _node("nois")
    batch = _batch(node)
    before = [p.detach().clone() for p in node.model.parameters()]
    adv = torch.full((batch.num_sequences,), float("nan"))
    with pytest.raises(update_mod.NonFiniteError):
        update_mod.update(node, TASK, batch, adv, loss_cfg=node.cfg.loss, micro_batch_size=0)
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
    assert scoring.score(TASK, tok, batch).tolist() == [1.0, 0.0]


def test_prompt_assignment():
    idx = list(range(10))
    mine = [sharing.assign_prompts(idx, rank=r, world_size=3, scheme="vertical") for r in range(3)]
    assert sorted(i for m in mine for i in m) == idx
    assert all(
        sharing.sample_slots(rank=r, world_size=3, scheme="vertical", group_size=8) == (0, 8)
        for r in range(3)
    )
    assert all(
        sharing.assign_prompts(idx, rank=r, world_size=3, scheme="horizontal") == idx
        for r in range(3)
    )
    slots = [
        sharing.sample_slots(rank=r, world_size=3, scheme="horizontal", group_size=8)
        for r in range(3)
    ]
    assert slots == [(0, 3), (3, 3), (6, 2)]  # disjoint, covering all G = 8 slots
    assert sharing.step_prompts(0, 5, 8, 10**9) == sharing.step_prompts(0, 5, 8, 10**9)
    assert sharing.step_prompts(0, 5, 8, 10**9) != sharing.step_prompts(0, 6, 8, 10**9)
    with pytest.raises(ValueError, match="prompts_per_step"):
        sharing.step_prompts(0, 1, 20, 10)


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
        m = update_mod.update(
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
    update_mod.update(
        node,
        TASK,
        batch,
        torch.linspace(-1, 1, batch.num_sequences),
        loss_cfg=node.cfg.loss,
        micro_batch_size=0,
    )
    zeros = torch.zeros(batch.num_sequences)
    a, b = copy.deepcopy(node), copy.deepcopy(node)
    update_mod.update(
        a, TASK, batch, zeros, loss_cfg=a.cfg.loss, micro_batch_size=0, skip_zero_advantage=False
    )
    update_mod.update(
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
    together = sampling.generate(node, TASK, problems, slots=(0, 4), cfg=cfg, step=3)
    parts = [
        sampling.generate(node, TASK, problems[r::2], slots=(0, 4), cfg=cfg, step=3)
        for r in range(2)
    ]
    # Horizontal: two nodes sampling slots 0-1 and 2-3 of every group.
    halves = [
        sampling.generate(node, TASK, problems, slots=(2 * r, 2), cfg=cfg, step=3) for r in range(2)
    ]

    def rows(batch, index, width):
        ids = batch.completion_ids[batch.prompt_index == index]
        return torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=0)

    for i, p in enumerate(problems):
        want = rows(together, p.index, 8)
        assert torch.equal(rows(parts[i % 2], p.index, 8), want)
        assert torch.equal(torch.cat([rows(h, p.index, 8) for h in halves]), want)
    other_step = sampling.generate(node, TASK, problems, slots=(0, 4), cfg=cfg, step=4)
    assert not torch.equal(rows(other_step, 0, 8), rows(together, 0, 8))


def test_nan_logits_while_sampling_never_reach_the_weights():
    node = _node("f-tis")
    hook = node.model.lm_head.register_forward_hook(lambda mod, inp, out: out * float("nan"))
    batch = _batch(node)  # sampling itself must not raise
    hook.remove()
    assert torch.isnan(batch.sampler_logprobs[batch.mask]).all()
    before = [p.detach().clone() for p in node.model.parameters()]
    adv = torch.linspace(-1, 1, batch.num_sequences)
    with pytest.raises(update_mod.NonFiniteError):
        update_mod.update(node, TASK, batch, adv, loss_cfg=node.cfg.loss, micro_batch_size=0)
    assert all(torch.equal(a, b) for a, b in zip(before, node.model.parameters()))


def test_peak_rss_is_this_process_own_high_water_mark():
    """memory/peak_rss_mb reads VmHWM (this address space), not getrusage's ru_maxrss, which a
    child inherits from its launcher through fork + exec."""
    from pathlib import Path

    from ftis.train.loop import peak_rss_mb

    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("no /proc on this platform")
    hwm = next(int(x.split()[1]) for x in status.read_text().splitlines() if x.startswith("VmHWM"))
    assert abs(peak_rss_mb() - hwm / 1024) < 64  # read a moment apart


# ---- no training without signal (issue 22, item 4) ---------------------------------------------


def test_a_round_without_a_usable_group_takes_no_optimizer_step():
    """All advantages 0 (every group skipped or all rewards equal): the weights and the
    optimizer's state stay exactly as they were, and the metrics say no step was taken. Before,
    Adam stepped on the zero gradient and its momentum moved the weights."""
    from ftis.config import TrainConfig

    node = _node("f-tis")
    batch = _batch(node)
    # Give Adam momentum first, so a zero-gradient step would move the weights.
    update_mod.update(
        node,
        TASK,
        batch,
        torch.linspace(-1, 1, batch.num_sequences),
        loss_cfg=node.cfg.loss,
        micro_batch_size=0,
    )
    before = [p.detach().clone() for p in node.model.parameters()]
    adam_step = [s["step"].clone() for s in node.optimizer.state.values()]
    out, skipped = update_mod.train_on_round(
        node, TASK, batch, torch.zeros(batch.num_sequences), train=TrainConfig(), step=2
    )
    assert (out["train/optimizer_steps"], out["train/no_signal"], skipped) == (0.0, 1.0, 0)
    # what the loss did not compute is absent, never 0.0 (issue 55: a plot drew the zeros)
    assert out == {"loss/active_frac": 0.0, "train/optimizer_steps": 0.0, "train/no_signal": 1.0}
    for a, b in zip(before, node.model.parameters()):
        assert torch.equal(a, b)
    assert [s["step"] for s in node.optimizer.state.values()] == adam_step
    out, _ = update_mod.train_on_round(
        node, TASK, batch, torch.linspace(-1, 1, batch.num_sequences), train=TrainConfig(), step=3
    )
    assert (out["train/optimizer_steps"], out["train/no_signal"]) == (1.0, 0.0)
    assert {"loss/loss", "loss/is_weight_mean", "loss/grad_norm"} <= out.keys()


def test_an_update_over_no_sequence_logs_no_loss_quantity():
    """Every advantage of the mini-batch is 0: Adam steps on the zero gradient (as documented),
    but the loss's value, IS weights and fractions were computed over no sequence: left out."""
    node = _node("f-tis")
    batch = _batch(node)
    m = update_mod.update(
        node,
        TASK,
        batch,
        torch.zeros(batch.num_sequences),
        loss_cfg=node.cfg.loss,
        micro_batch_size=0,
    )
    assert m["active_frac"] == 0.0 and m["grad_norm"] == 0.0
    assert not {"loss", "is_weight_mean", "filtered_frac", "kept_sequences"} & m.keys()


def test_a_node_without_signal_stops_after_the_configured_number_of_steps(tmp_path, monkeypatch):
    """Every reward equal (as when a lost peer leaves one completion per group): steps 1-3 take
    no optimizer step, each row says so with the running streak, and at
    train.max_steps_without_signal = 3 the node checkpoints step 3 and stops with a clear error
    instead of running its 5 steps (and exiting 0) without a training signal."""
    import json

    from ftis.config import RunConfig
    from ftis.train import loop
    from ftis.train.checkpoint import checkpoint_step
    from tests.conftest import tiny_run_config

    monkeypatch.setattr(scoring, "score", lambda task, tok, batch: torch.zeros(batch.num_sequences))
    seen = {}
    real_build = loop.build_node

    def build(*a, **k):
        seen["node"] = node = real_build(*a, **k)
        seen["start"] = [p.detach().clone() for p in node.model.parameters()]
        return node

    monkeypatch.setattr(loop, "build_node", build)
    cfg = RunConfig.model_validate(tiny_run_config(steps=5, max_steps_without_signal=3))
    with pytest.raises(loop.NoTrainingSignal, match=r"no usable group for 3 consecutive steps"):
        loop.train_node(cfg, rank=0, run_dir=tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["train/no_signal"] for r in steps] == [1.0, 1.0, 1.0]
    assert [r["train/no_signal_streak"] for r in steps] == [1.0, 2.0, 3.0]
    assert all(r["train/optimizer_steps"] == 0.0 for r in steps)
    # what no update computed is absent from the row, never 0.0 (issue 55)
    assert not any("loss/filtered_frac" in r or "loss/grad_norm" in r for r in steps)
    for a, b in zip(seen["start"], seen["node"].model.parameters()):
        assert torch.equal(a, b)
    assert checkpoint_step(tmp_path / "nodes" / "xs") == 3
    # 0 = never stop: the same run goes to its end.
    cfg = RunConfig.model_validate(tiny_run_config(steps=4, max_steps_without_signal=0))
    loop.train_node(cfg, rank=0, run_dir=tmp_path / "on")


def test_hacpo_round_passes_own_mask_discrepancy_and_a_rising_clip_bound(monkeypatch):
    """train_on_round with 2 epochs x 2 mini-batches: four optimizer updates whose peer clip
    bounds are lo_m = 0.8 + 0.025 m (m = 0..3), each given the own mask and discrepancy of
    exactly its own sequences (checked against the sequences' generator ids)."""
    from ftis.config import TrainConfig

    node = _node("hacpo")
    batch = _batch(node, n_prompts=2, g=4)
    batch.generator[1::2] = 1  # every other sequence is the peer's (rank 1)
    scale = torch.where(batch.generator == 1, 2.5, 1.0)
    calls = []
    real = update_mod.policy_loss

    def spy(logprobs, sampler_logprobs, advantages, mask, **kw):
        calls.append((kw["peer_clip_lower"], kw["own"].clone(), kw["peer_scale"].clone()))
        return real(logprobs, sampler_logprobs, advantages, mask, **kw)

    monkeypatch.setattr(update_mod, "policy_loss", spy)
    adv = torch.linspace(-1, 1, batch.num_sequences)  # no zero: every sequence runs
    out, skipped = update_mod.train_on_round(
        node,
        TASK,
        batch,
        adv,
        train=TrainConfig(update_epochs=2, mini_batches=2, group_size=4),
        step=1,
        own=batch.generator == 0,
        peer_scale=scale,
    )
    assert (out["train/optimizer_steps"], skipped) == (4.0, 0)
    assert [round(c[0], 6) for c in calls] == [0.8, 0.825, 0.85, 0.875]
    for _, own, omega in calls:
        # a mini-batch's own mask and omega agree with each other: omega 2.5 exactly on peers
        assert torch.equal(omega, torch.where(own, 1.0, 2.5))
    assert sum(int((~c[1]).sum()) for c in calls) == 2 * int((batch.generator == 1).sum())


@pytest.mark.parametrize("mb", [0, 5])
def test_withheld_failures_count_in_the_update_scale(mb):
    """Success-gated sharing (docs/math.md §17): a batch missing W withheld completions, updated
    with withheld=W, steps with the gradient of the full batch in which those W rows carry no
    advantage: N counts them, so a sequence's term weighs what full sharing gives it."""
    node = _node("f-tis")
    batch = _batch(node)
    batch.sampler_logprobs = batch.sampler_logprobs - 0.3 * batch.mask
    adv = torch.linspace(-1, 1, batch.num_sequences)
    gone = torch.zeros(batch.num_sequences, dtype=torch.bool)
    gone[[2, 3, 9]] = True  # withheld: never received
    full_adv = torch.where(gone, torch.zeros_like(adv), adv)
    full = _grads_after_update(node, batch, full_adv, mb=mb)
    gated = _grads_after_update(
        node, batch.select(~gone), adv[~gone], mb=mb, withheld=float(gone.sum())
    )
    naive = _grads_after_update(node, batch.select(~gone), adv[~gone], mb=mb)
    for a, b in zip(full, gated):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # without the count the gradient is N / (N - W) times larger: the test can fail
    ratio = batch.num_sequences / (batch.num_sequences - 3)
    for a, b in zip(full, naive):
        torch.testing.assert_close(ratio * a, b, atol=1e-6, rtol=1e-5)


def test_gspo_own_ratios_divide_by_the_trainers_log_probs_under_a_bf16_sampler():
    """Issue 56: with a bf16 sampler the sampler's log-probs differ from the trainer's by its
    rounding, which alone leaves GSPO's clip window (3e-4..4e-4) on most own sequences, so half
    of them give no gradient. With own_ratio_reference 'trainer' (the default) the first update's
    own ratios divide by the trainer's own log-probs at the sampling weights: none is clipped,
    and the precision gap is corrected by a truncated sequence weight instead."""
    from ftis.config import TrainConfig

    train = TrainConfig(max_new_tokens=5, group_size=4, sampler_dtype="bfloat16")

    def clip_frac(reference: str) -> tuple[float, torch.Tensor]:
        node = _node("hacpo")
        node.cfg = node.cfg.model_copy(
            update={"loss": node.cfg.loss.model_copy(update={"own_ratio_reference": reference})}
        )
        problems = [TASK.split("train")[i] for i in range(4)]
        batch = sampling.generate(node, TASK, problems, slots=(0, 4), cfg=train, step=1)
        adv = torch.linspace(-1, 1, batch.num_sequences)
        _old, gap = update_mod.own_ratio_reference(node, TASK, batch, own=None, train=train)
        out, _ = update_mod.train_on_round(node, TASK, batch, adv, train=train, step=1)
        return out["loss/clip_frac"], gap

    by_sampler, none = clip_frac("sampler")
    by_trainer, gap = clip_frac("trainer")
    assert none is None and by_sampler > 0.25  # the rounding alone clips many own sequences
    assert by_trainer == 0.0
    assert gap is not None and bool((gap > 0).all()) and bool((gap <= 2.0).all())
    assert not torch.allclose(gap, torch.ones_like(gap))  # the gap is there, and weighted


def test_the_trainer_reference_changes_nothing_with_an_f32_sampler():
    from ftis.config import TrainConfig

    node = _node("hacpo")
    batch = _batch(node)
    train = TrainConfig(max_new_tokens=5, group_size=4)
    assert update_mod.own_ratio_reference(node, TASK, batch, own=None, train=train) == (None, None)
