"""Reliability: dishonest peers, non-finite numbers, crash and resume, atomic checkpoints,
Ctrl-C. Every test runs in this process on the tiny llama-xs preset (docs/RELIABILITY.md)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ftis.algos.ftis import adversary, sharing
from ftis.cli import app
from ftis.config import RunConfig
from ftis.core.losses import policy_loss
from ftis.exchange import PayloadError, decode_rollouts, encode_rollouts
from ftis.rollout.types import RolloutBatch
from ftis.tasks import ArithmeticTaskConfig, build_task
from ftis.train import checkpoint as ckpt_mod
from ftis.train import sampling, scoring
from ftis.train import update as update_mod
from ftis.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from ftis.train.loop import train_node
from ftis.train.metrics import truncate_rows
from ftis.train.node import Node
from tests.conftest import tiny_node, tiny_run_config

runner = CliRunner()
TASK = build_task(ArithmeticTaskConfig(ops={"+": 1.0}))
VOLATILE = ("time/", "train/step_seconds", "train/elapsed_seconds", "exchange/", "memory/")


def _node(method="f-tis", lora=None) -> Node:
    return tiny_node(method, lora=lora)


def _batch(node: Node, n_prompts=4, g=4, step=1) -> RolloutBatch:
    from ftis.config import TrainConfig

    train = TASK.split("train")
    cfg = TrainConfig(max_new_tokens=5, group_size=g)
    problems = [train[i] for i in range(n_prompts)]
    return sampling.generate(node, TASK, problems, slots=(0, g), cfg=cfg, step=step)


def _params(node):
    return [p.detach().clone() for p in node.model.parameters()]


# ---- prompt checks: a peer may only answer the prompts it was dealt -----------------------------


def test_peer_prompt_checks():
    idx = [7, 3, 9, 4, 1]
    quota = sharing.peer_prompt_quota(idx, peer=1, world_size=2, scheme="vertical", group_size=4)
    assert quota == {3: 4, 4: 4}
    ok = RolloutBatch(
        prompt_index=torch.tensor([3, 3, 4]),
        generator=torch.ones(3, dtype=torch.long),
        completion_ids=torch.ones(3, 2, dtype=torch.long),
        lengths=torch.full((3,), 2),
        sampler_logprobs=torch.zeros(3, 2),
    )
    assert sharing.check_peer_batch(ok, quota, train_size=10) is None
    other = ok.select(torch.tensor([0, 1, 2]))
    other.prompt_index = torch.tensor([3, 7, 4])  # prompt 7 is the other node's
    assert "not assigned" in sharing.check_peer_batch(other, quota, train_size=10)
    flood = ok.select(torch.zeros(5, dtype=torch.long))  # 5 sequences for prompt 3, share is 4
    assert "more than the peer's share" in sharing.check_peer_batch(flood, quota, train_size=10)
    outside = ok.select(torch.tensor([0]))
    outside.prompt_index = torch.tensor([12])
    assert "outside the train split" in sharing.check_peer_batch(outside, quota, train_size=10)
    # horizontal: every prompt, at most this peer's share of G (3 of G = 8 for rank 2 of 3)
    h = sharing.peer_prompt_quota(idx, peer=2, world_size=3, scheme="horizontal", group_size=8)
    assert h == dict.fromkeys(idx, 2)


@settings(max_examples=1000, deadline=None, database=None)
@given(
    st.lists(st.integers(-3, 30), max_size=24),
    st.integers(0, 2),
    st.sampled_from(["vertical", "horizontal"]),
)
def test_prompt_check_accepts_exactly_the_assigned_prompts(idx, peer, scheme):
    """1,000 random prompt columns: accepted if and only if every index is one this peer was
    dealt at this step, at most its share of times."""
    step = [1, 5, 9, 13, 17, 21, 26]
    quota = sharing.peer_prompt_quota(step, peer=peer, world_size=3, scheme=scheme, group_size=4)
    n = len(idx)
    batch = RolloutBatch(
        prompt_index=torch.tensor(idx, dtype=torch.long),
        generator=torch.full((n,), peer),
        completion_ids=torch.ones(n, 1, dtype=torch.long),
        lengths=torch.ones(n, dtype=torch.long),
        sampler_logprobs=torch.zeros(n, 1),
    )
    ok = all(i in quota and idx.count(i) <= quota[i] for i in idx)
    assert (sharing.check_peer_batch(batch, quota, train_size=27) is None) == ok


# ---- adversarial but well-formed peers ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["zero-logprobs", "random-tokens", "duplicate"])
def test_adversarial_batches_are_well_formed(kind):
    node = _node()
    honest = _batch(node)
    bad = adversary.adversarial(
        honest, kind, vocab_size=len(node.tokenizer), generator=torch.Generator().manual_seed(0)
    )
    # They pass the wire and the prompt checks: only the loss can defend against them.
    data = encode_rollouts(bad, vocab_size=len(node.tokenizer))
    back = decode_rollouts(data, vocab_size=len(node.tokenizer), max_tokens=5, pad_id=0)
    assert torch.equal(back.prompt_index, honest.prompt_index)
    quota = dict.fromkeys(honest.prompt_index.tolist(), 4)
    assert sharing.check_peer_batch(back, quota, train_size=len(TASK.split("train"))) is None
    m = honest.mask
    if kind == "zero-logprobs":
        assert (bad.sampler_logprobs[m] == 0).all() and (honest.sampler_logprobs[m] < 0).any()
    elif kind == "random-tokens":
        assert torch.equal(bad.lengths, honest.lengths)
        assert (bad.completion_ids[m] != honest.completion_ids[m]).float().mean() > 0.5
    else:
        assert (bad.completion_ids == bad.completion_ids[0]).all()


def _grad(method, *, receiver, claimed, advantage):
    """d loss / d receiver log-probs for N = 2 sequences of T = 3 tokens."""
    lp = torch.full((2, 3), receiver, requires_grad=True)
    loss, m = policy_loss(
        lp,
        torch.full((2, 3), claimed),
        torch.full((2,), advantage),
        torch.ones(2, 3, dtype=bool),
        method=method,
    )
    loss.backward()
    return lp.grad, m


def test_garbage_tokens_move_nois_but_not_f_tis():
    """Garbage the receiver would never sample (log-prob -12) with plausible claimed log-probs
    (-0.5) and no reward (advantage -1): NoIS pushes on every token with full weight; F-TIS's
    filter sees a divergence of e^11.5 - 11.5 - 1 > 50 and drops the sequences: zero gradient."""
    nois, _ = _grad("nois", receiver=-12.0, claimed=-0.5, advantage=-1.0)
    ftis, m = _grad("f-tis", receiver=-12.0, claimed=-0.5, advantage=-1.0)
    assert (nois != 0).all() and (ftis == 0).all() and float(m["filtered_frac"]) == 1.0


def test_false_zero_log_probs_are_down_weighted_by_f_tis():
    """A peer claims probability 1 (log-prob 0) for tokens the receiver gives log-prob -2. With a
    positive advantage NoIS takes the full step; F-TIS weighs each token by the IS ratio
    exp(-2 - 0) = 0.135 (below the cap C = 2): the lie shrinks the peer's own influence."""
    nois, _ = _grad("nois", receiver=-2.0, claimed=0.0, advantage=1.0)
    ftis, _ = _grad("f-tis", receiver=-2.0, claimed=0.0, advantage=1.0)
    torch.testing.assert_close(ftis, nois * torch.exp(torch.tensor(-2.0)), rtol=1e-5, atol=0)


# ---- non-finite numbers never reach the weights ------------------------------------------------


def test_nan_sampler_logprobs_are_refused_by_the_wire_and_skipped_by_the_update():
    node = _node("f-tis")
    batch = _batch(node)
    batch.sampler_logprobs[0, 0] = float("nan")
    with pytest.raises(ValueError):
        encode_rollouts(batch, vocab_size=len(node.tokenizer))
    # A NaN that bypassed the wire (an in-process peer): the update is skipped, weights intact.
    before = _params(node)
    adv = torch.linspace(-1, 1, batch.num_sequences)
    with pytest.raises(update_mod.NonFiniteError):
        update_mod.update(node, TASK, batch, adv, loss_cfg=node.cfg.loss, micro_batch_size=0)
    assert all(torch.equal(a, b) for a, b in zip(before, node.model.parameters()))


def test_a_nan_log_prob_on_the_wire_is_a_payload_error():
    """A NaN can reach a receiver two ways: a version-1 sender's plain f32 log-probs, or a
    version-2 exact payload whose exponent would decode to inf/NaN. Both are payload errors."""
    import struct
    import zlib

    from tests.exchange.test_wire import CHAR_VOCAB, craft

    v1 = craft(version=1, lps=struct.pack("<3f", -1, float("nan"), -1))
    with pytest.raises(PayloadError, match="not finite"):
        decode_rollouts(v1, vocab_size=CHAR_VOCAB, max_tokens=5)
    node = _node()
    data = bytearray(encode_rollouts(_batch(node), vocab_size=len(node.tokenizer)))
    good = decode_rollouts(bytes(data), vocab_size=len(node.tokenizer), max_tokens=5)
    assert torch.isfinite(good.sampler_logprobs).all()
    # the exact format's log-prob section starts with e_top: the largest exponent sent, which a
    # sender of finite values never sets to 255 (the exponent of inf and NaN)
    e_top = (
        int(torch.floor(torch.log2(-good.sampler_logprobs[good.sampler_logprobs < 0])).max()) + 127
    )
    where = [i for i in range(len(data) - 4) if data[i] == e_top]
    assert where, "e_top byte not found"
    hits = 0
    for i in where:
        bad = bytearray(data)
        bad[i] = 255
        bad[-4:] = zlib.crc32(bytes(bad[:-4])).to_bytes(4, "little")
        try:
            out = decode_rollouts(bytes(bad), vocab_size=len(node.tokenizer), max_tokens=5)
        except PayloadError as e:
            hits += "e_top 255" in str(e)
        else:  # a byte elsewhere with the same value: still no non-finite value may come out
            assert torch.isfinite(out.sampler_logprobs).all()
    assert hits == 1


def test_nan_logits_skip_the_update_and_are_counted(tmp_path, monkeypatch):
    """The node's own model produces NaN logits in the update of step 2 (a forward hook): the
    update is skipped and counted, the weights stay finite, and step 3 trains normally."""
    from ftis.train import loop, scoring

    # Rewards 0, 1, 0, 1...: every group has a signal, so every round runs an update (a round
    # without one takes no optimizer step at all, issue 22).
    monkeypatch.setattr(
        scoring, "score", lambda task, tok, batch: torch.arange(batch.num_sequences) % 2.0
    )
    poisoned = {"on": False}
    real_build = loop.build_node

    def build(*a, **k):
        node = real_build(*a, **k)
        head = node.model.get_output_embeddings()
        # Only in train mode: the update's forward pass, not sampling (see RELIABILITY.md).
        head.register_forward_hook(
            lambda mod, inp, out: out * float("nan") if poisoned["on"] and mod.training else out
        )
        captured["node"] = node
        return node

    captured = {}
    monkeypatch.setattr(loop, "build_node", build)
    # Run every sequence through the model, even in groups whose advantages are all 0.
    real_update = update_mod.update
    monkeypatch.setattr(
        "ftis.train.update.update",
        lambda *a, **k: real_update(*a, **k, skip_zero_advantage=False),
    )

    def progress(event, **info):
        if event == "step":
            poisoned["on"] = info["step"] == 1  # on during step 2 only

    cfg = RunConfig.model_validate(tiny_run_config(steps=3))
    train_node(cfg, rank=0, run_dir=tmp_path, progress=progress)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    by = {r["step"]: r for r in rows}
    assert by[2]["train/skipped_update"] == 1 and by[2]["train/skipped_updates_total"] == 1
    assert by[3]["train/skipped_update"] == 0 and by[3]["train/skipped_updates_total"] == 1
    assert all(torch.isfinite(p).all() for p in captured["node"].model.parameters())


def test_a_nan_reward_counts_as_zero(tmp_path, monkeypatch):
    """The task's reward (its built-in exact match) returns NaN on every other completion: those
    completions score 0 and are counted (reward/errors/<function>), training goes on."""
    import ftis.rewards
    from ftis.rewards import builtin

    real = builtin.exact_match
    calls = []

    def sometimes_nan(prompt, completion, fields):
        calls.append(1)
        return float("nan") if len(calls) % 2 else real(prompt, completion, fields)

    monkeypatch.setattr(builtin, "exact_match", sometimes_nan)
    # the resolved-reward cache too; monkeypatch restores both afterwards
    monkeypatch.setitem(ftis.rewards._cache, "builtin:exact_match", sometimes_nan)
    cfg = RunConfig.model_validate(tiny_run_config(steps=2))
    train_node(cfg, rank=0, run_dir=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] > 0]
    assert sum(r.get("reward/errors/builtin:exact_match", 0) for r in trained) > 0
    assert all(r["train/skipped_update"] == 0 and r["reward/mean"] is not None for r in trained)
    rewards, n = scoring.finite_rewards(torch.tensor([1.0, float("nan"), float("inf"), 0.0]))
    assert n == 2 and rewards.tolist() == [1.0, 0.0, 0.0, 0.0]


# ---- checkpoints: atomic, complete ------------------------------------------------------------


def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    node = _node()
    save_checkpoint(node, tmp_path, 1, keep=2)
    weights = _params(node)
    real_save = torch.save

    def dies_midway(obj, path, *a, **k):
        real_save(obj, path, *a, **k)
        with open(path, "r+b") as f:  # half the file written, then the "kill"
            f.truncate(os.path.getsize(path) // 2)
        raise KeyboardInterrupt("killed during save")

    with torch.no_grad():
        for p in node.model.parameters():
            p.add_(1.0)
    monkeypatch.setattr(ckpt_mod.torch, "save", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(node, tmp_path, 2, keep=2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001"]
    fresh = _node()
    state = load_checkpoint(fresh, latest_checkpoint(tmp_path))
    assert state["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(weights, fresh.model.parameters()))
    # a `latest` that names a missing directory falls back to the newest complete one
    (tmp_path / "latest").write_text("step-000009\n")
    assert latest_checkpoint(tmp_path).name == "step-000001"


def test_truncate_rows_keeps_other_nodes_and_drops_torn_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "node": n} for s in range(4) for n in ("a", "b")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "no')
    assert truncate_rows(path, "a", after_step=1) == 3  # a's steps 2, 3 and the torn line
    left = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["node"], r["step"]) for r in left if r["node"] == "a"] == [("a", 0), ("a", 1)]
    assert len([r for r in left if r["node"] == "b"]) == 4
    assert truncate_rows(path, "b", after_step=None) == 4


# ---- crash, Ctrl-C and resume reproduce the uninterrupted run ---------------------------------


def _write(tmp_path, data, name):
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(data))
    return str(cfg)


def _rows(out, name="metrics.jsonl"):
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def _assert_same_rows(a, b):
    assert [(r["node"], r["step"]) for r in a] == [(r["node"], r["step"]) for r in b]
    for ra, rb in zip(a, b):
        ka = {k for k in ra if not k.startswith(VOLATILE)}
        assert ka == {k for k in rb if not k.startswith(VOLATILE)}
        for k in ka:
            assert ra[k] == pytest.approx(rb[k], abs=1e-6), (ra["step"], k)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_crash_then_resume_reproduces_the_uninterrupted_run(tmp_path, lora):
    data = tiny_run_config(steps=4)
    data["checkpoint"] = {"every": 2}
    data["eval"]["every"] = 1  # step 3's evaluation is written before the crash, then redone
    if lora:
        data["nodes"][0]["model"]["lora"] = {"r": 4, "alpha": 8}
        data["nodes"][0]["optim"] = {"lr": 0.01}
    full = tmp_path / "full"
    res = runner.invoke(app, ["run", _write(tmp_path, data, "full"), "--out", str(full)])
    assert res.exit_code == 0, res.output

    data["testing"] = {
        "crash_at_step": {data["nodes"][0]["name"]: 4}
    }  # after step 3's row, before its checkpoint
    out = tmp_path / "crashed"
    res = runner.invoke(app, ["run", _write(tmp_path, data, "crash"), "--out", str(out)])
    assert res.exit_code == 1 and "ftis run --resume" in res.output, res.output
    assert [r["step"] for r in _rows(out)] == [0, 1, 2, 3]
    res = runner.invoke(app, ["run", "--resume", str(out), "--set", "testing.crash_at_step={}"])
    assert res.exit_code == 0, res.output
    _assert_same_rows(_rows(full), _rows(out))  # step 3 redone, not duplicated; 3-4 identical
    for name in ("evals.jsonl", "samples.jsonl"):  # the same lines: none lost, none repeated
        assert _rows(out, name) == _rows(full, name)
    assert [r["step"] for r in _rows(out, "evals.jsonl")] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert (out / "report.md").exists()


def test_ctrl_c_writes_a_checkpoint_and_resume_reproduces_the_run(tmp_path):
    data = tiny_run_config(steps=4)
    full = tmp_path / "full"
    res = runner.invoke(app, ["run", _write(tmp_path, data, "full"), "--out", str(full)])
    assert res.exit_code == 0, res.output

    out = tmp_path / "stopped"
    out.mkdir()
    cfg = RunConfig.model_validate(data)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))

    def ctrl_c_after_step_2(event, **info):
        if event == "step" and info["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)

    res = train_node(
        cfg,
        rank=0,
        run_dir=out,
        progress=ctrl_c_after_step_2,
    )
    assert res.interrupted and res.last_step == 2
    assert latest_checkpoint(out / "nodes" / "xs").name == "step-000002"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler removed
    res = runner.invoke(app, ["run", "--resume", str(out)])
    assert res.exit_code == 0, res.output
    _assert_same_rows(_rows(full), _rows(out))


# ---- resume: user errors ----------------------------------------------------------------------


def test_resume_errors_are_actionable(tmp_path):
    res = runner.invoke(app, ["run", "--resume", str(tmp_path)])
    assert res.exit_code == 2 and "not a run directory (no config.yaml)" in res.output
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tiny_run_config()))
    res = runner.invoke(app, ["run", "--resume", str(tmp_path)])
    assert res.exit_code == 2 and "has no checkpoints" in res.output and "--overwrite" in res.output
    res = runner.invoke(app, ["run", "x.yaml", "--resume", str(tmp_path)])
    assert res.exit_code == 2 and "drop CONFIG" in res.output
    res = runner.invoke(app, ["run", "--resume", str(tmp_path), "--set", "train.steps=-1"])
    assert res.exit_code == 2 and "train.steps" in res.output
    assert "Traceback" not in res.output
