"""DPO as a node-shell algorithm (kind `dpo`): summed log-probs with the prompt masked, the
frozen reference, local steps, evaluation, exact resume, and the config's errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from typer.testing import CliRunner

from ftis.algos.dpo.local import LocalDPO, Reference, batch_indices, summed_logprobs
from ftis.cli import app
from ftis.config import OptimConfig, RunConfig
from ftis.core.dpo import dpo_loss
from ftis.models.logprobs import completion_logprobs
from ftis.preferences.data import PreferencePair
from ftis.preferences.tokens import collate, tokenize_pairs
from ftis.train.loop import train_node
from ftis.train.node import build_optimizer
from tests.conftest import tiny_node, tiny_run_config

VOLATILE = ("time/", "train/step_seconds", "train/elapsed_seconds", "memory/")
PAIRS = [
    PreferencePair("12+34=", "2+4=6,1+3=4#46", "2+4=6,1+3=4#47"),
    PreferencePair("5*7=", "35", "36"),
    PreferencePair("90+9=", "99", "9"),
    PreferencePair("1+1=", "2", "11"),
]


def tiny_dpo_config(steps: int = 3, kind: str = "dpo", **algorithm) -> dict:
    """A DPO run that finishes in seconds: llama-xs, the reasoning task with 2-digit problems."""
    data = tiny_run_config(steps=steps)
    data["task"] = {
        "kind": "reasoning",
        "min_digits": 2,
        "max_digits": 2,
        "test_size": 16,
        "ood": {},
    }
    data["algorithm"] = {
        "kind": kind,
        "local_steps": 2,
        "batch_size": 4,
        "data": {"train_pairs": 16, "eval_pairs": 8, "max_length": 40, "max_prompt_length": 12},
        **algorithm,
    }
    data["nodes"][0]["optim"] = {"lr": 0.001}
    data["train"]["max_new_tokens"] = 24
    data["eval"] = {"every": 2, "size": 8, "pass_samples": 0}
    return data


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def test_summed_logprobs_mask_the_prompt_and_including_it_leaves_the_loss_unchanged():
    node = tiny_node()
    tok = node.tokenizer
    data = tokenize_pairs(PAIRS, tok, max_length=32, max_prompt_length=12)
    batch = collate(data, [0, 1, 2, 3], pad_id=tok.pad_token_id)
    got = summed_logprobs(node.model, batch)
    # by hand for pair 2's rejected row (row 4 + 2): one forward of its own, no padding
    p, r = data.prompts[2], data.rejected[2]
    lp = completion_logprobs(
        node.model,
        prompt_ids=torch.tensor([p]),
        prompt_mask=torch.ones(1, len(p), dtype=torch.long),
        completion_ids=torch.tensor([r]),
        completion_mask=torch.ones(1, len(r), dtype=torch.long),
    )
    assert float(got[6].detach()) == pytest.approx(float(lp.sum().detach()), abs=1e-4)
    # include_prompt adds log pi(prompt) to chosen and rejected alike: the margin cancels it
    inc = summed_logprobs(
        node.model, collate(data, [0, 1, 2, 3], pad_id=tok.pad_token_id, include_prompt=True)
    )
    extra = inc - got
    torch.testing.assert_close(extra[:4], extra[4:], atol=1e-4, rtol=0)
    assert bool((extra < 0).all())  # the prompt's own log-probs
    ref = got.detach() + 0.3
    a, _ = dpo_loss(got[:4], got[4:], ref[:4], ref[4:])
    b, _ = dpo_loss(inc[:4], inc[4:], ref[:4], ref[4:])
    assert float(a.detach()) == pytest.approx(float(b.detach()), abs=1e-5)


def test_batches_cover_every_pair_once_per_epoch_and_are_reproducible():
    seen = [i for k in range(3) for i in batch_indices(6, 2, k, seed=1, salt="a")]
    assert sorted(seen) == list(range(6))  # steps 0-2 of batch 2 = one epoch of 6 pairs
    assert batch_indices(6, 4, 5, seed=1, salt="a") == batch_indices(6, 4, 5, seed=1, salt="a")
    epochs = [
        tuple(i for k in range(3) for i in batch_indices(6, 2, k, seed=1, salt=s)) for s in "ab"
    ]
    assert epochs[0] != epochs[1]  # agents draw their own order


def test_local_dpo_learns_its_pairs_against_a_frozen_reference():
    node = tiny_node(lr=0.01)
    tok = node.tokenizer
    data = tokenize_pairs(PAIRS, tok, max_length=32, max_prompt_length=12)
    ref = Reference.frozen_copy(node.model)
    local = LocalDPO(
        node.model, node.optimizer, ref, data, pad_id=tok.pad_token_id, beta=0.5, batch_size=4
    )
    before = local.evaluate(data)
    # policy = reference: every margin is 0, so the loss is log 2 and no pair has margin > 0
    assert before["eval/dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert before["eval/reward_accuracy"] == 0.0 and before["eval/reward_margin"] == 0.0
    batch = collate(data, [0, 1, 2, 3], pad_id=tok.pad_token_id)
    ref_lp = ref.logprobs(batch)
    m = local.train(15, first=0)
    assert m["train/skipped_steps"] == 0 and m["loss/dpo"] < math.log(2)
    after = local.evaluate(data)
    assert after["eval/dpo_loss"] < 0.5 * math.log(2)
    assert after["eval/reward_accuracy"] == 1.0 and after["eval/preference_accuracy"] == 1.0
    torch.testing.assert_close(ref.logprobs(batch), ref_lp)  # the reference never moved


def test_sft_weight_adds_the_chosen_nll_and_is_off_by_default():
    node = tiny_node()
    tok = node.tokenizer
    data = tokenize_pairs(PAIRS[:2], tok, max_length=32, max_prompt_length=12)
    ref = Reference.frozen_copy(node.model)
    pure = LocalDPO(
        node.model,
        torch.optim.SGD(node.model.parameters(), lr=0.0),
        ref,
        data,
        pad_id=tok.pad_token_id,
        batch_size=2,
    )
    m = pure.train(1, first=0)
    assert m["loss/total"] == m["loss/dpo"] == pytest.approx(math.log(2), abs=1e-6)
    rpo = LocalDPO(
        node.model,
        torch.optim.SGD(node.model.parameters(), lr=0.0),
        ref,
        data,
        pad_id=tok.pad_token_id,
        batch_size=2,
        sft_weight=0.5,
    )
    m = rpo.train(1, first=0)
    # lr 0: the policy is the reference, DPO gives log 2; the NLL is the mean per-token NLL
    assert m["loss/total"] == pytest.approx(
        math.log(2) + 0.5 * m["train/chosen_nll_per_token"], abs=1e-5
    )
    assert m["train/chosen_nll_per_token"] > 0


def test_a_lora_reference_is_the_model_with_its_adapters_off():
    from ftis.models.loading import LoraConfig, attach_lora

    node = tiny_node()
    node.model = attach_lora(node.model, LoraConfig(r=2, alpha=4))
    node.optimizer = build_optimizer(node.model, OptimConfig(lr=0.05))
    tok = node.tokenizer
    data = tokenize_pairs(PAIRS, tok, max_length=32, max_prompt_length=12)
    batch = collate(data, [0, 1, 2, 3], pad_id=tok.pad_token_id)
    ref = Reference.adapters_off(node.model)
    start = ref.logprobs(batch)
    torch.testing.assert_close(start, summed_logprobs(node.model, batch).detach())  # B = 0
    LocalDPO(node.model, node.optimizer, ref, data, pad_id=tok.pad_token_id).train(5, first=0)
    torch.testing.assert_close(ref.logprobs(batch), start)
    assert not torch.allclose(summed_logprobs(node.model, batch).detach(), start)


def test_sgd_is_an_optimizer_choice():
    opt = build_optimizer(torch.nn.Linear(2, 2), OptimConfig(name="sgd", lr=0.1, momentum=0.9))
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.9


def test_dpo_runs_through_the_shell_and_resumes_exactly(tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    cfg = RunConfig.model_validate(tiny_dpo_config(steps=4))
    train_node(cfg, rank=0, run_dir=whole)
    rows = _rows(whole)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    first, last = rows[0], rows[-1]
    assert {"eval/preference_accuracy", "eval/reward_accuracy", "eval/accuracy"} <= set(first)
    assert first["eval/reward_accuracy"] == 0.0 and first["eval/dpo_loss"] == pytest.approx(
        math.log(2)
    )
    assert {"loss/dpo", "train/reward_margin", "train/local_steps_total"} <= set(rows[1])
    assert last["train/local_steps_total"] == 8  # 4 rounds of E = 2
    # the same run in two halves: stop after round 2, resume to round 4
    train_node(RunConfig.model_validate(tiny_dpo_config(steps=2)), rank=0, run_dir=part)
    train_node(cfg, rank=0, run_dir=part, resume=True)
    resumed = _rows(part)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    for a, b in zip(rows, resumed):
        a, b = _stable(a), _stable(b)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], abs=1e-6), (a["step"], k)


def test_a_resume_with_another_starting_model_is_refused(tmp_path):
    train_node(RunConfig.model_validate(tiny_dpo_config(steps=1)), rank=0, run_dir=tmp_path)
    changed = tiny_dpo_config(steps=2)
    changed["nodes"][0]["warm_start"]["seed"] = 1  # another warm start: another reference
    from ftis.train.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="reference model rebuilt on resume"):
        train_node(RunConfig.model_validate(changed), rank=0, run_dir=tmp_path, resume=True)


def test_a_malformed_preferences_file_stops_ftis_run_with_a_config_error(tmp_path):
    bad = tmp_path / "prefs.jsonl"
    bad.write_text(
        '{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": "2+2=", "chosen": 4}\n'
    )
    data = tiny_dpo_config()
    data["algorithm"]["data"] = {"source": "jsonl", "path": str(bad), "eval_pairs": 1}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(app, ["run", str(cfg), "--out", str(tmp_path / "run")])
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.split())
    assert f"preferences file '{bad}', line 2: field 'chosen'" in out.replace("\n", "")
    assert "Traceback" not in res.output


def test_jsonl_data_is_sharded_and_held_out(tmp_path):
    from ftis.algos.dpo.data import agent_pairs
    from ftis.preferences import fixture_path

    data = tiny_dpo_config()
    data["nodes"].append({**data["nodes"][0], "name": "ys"})
    data["algorithm"]["data"] = {"source": "jsonl", "path": str(fixture_path()), "eval_pairs": 4}
    cfg = RunConfig.model_validate(data)
    (t0, h0), (t1, h1) = agent_pairs(cfg, 0), agent_pairs(cfg, 1)
    assert h0 == h1 and len(h0) == 4  # one held-out set for a shared file
    assert len(t0) == len(t1) == 4 and not set(t0) & set(t1)  # the other 8 rows, dealt out
    assert not (set(t0) | set(t1)) & set(h0)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"topology": "edges", "edges": [["xs", "ys"]]}, "not connected"),
        ({"topology": "edges", "edges": [["xs", "nobody"]]}, "names 'nobody'"),
        ({"topology": "random-regular", "degree": 3}, "no 3-regular graph on 3 agents"),
        ({"data": {"agents": {"nobody": {}}}}, "unknown nodes"),
        ({"data": {"corruptions": {"typo": 1.0}}}, "unknown corruption"),
        ({"data": {"max_length": 10, "max_prompt_length": 10}}, "must be below"),
        ({"data": {"eval_pairs": 17}}, r"held-out problems \(task.test_size = 16\)"),
        ({"data": {"agents": {"xs": {"task": {"skills": {"nope": 1.0}}}}}}, "agents.xs.task"),
    ],
)
def test_gossip_config_errors_say_what_to_fix(change, match):
    data = tiny_dpo_config(kind="gossip-dpo")
    data["nodes"] += [{**data["nodes"][0], "name": n} for n in ("ys", "zs")]
    change = dict(change)
    data["algorithm"]["data"].update(change.pop("data", {}))
    data["algorithm"].update(change)
    with pytest.raises(ValueError, match=match):
        RunConfig.model_validate(data)


def test_gossip_needs_one_architecture():
    data = tiny_dpo_config(kind="gossip-dpo")
    data["nodes"].append({**data["nodes"][0], "name": "ys", "model": {"preset": "llama-s"}})
    with pytest.raises(ValueError, match=r"nodes\[ys\].model.preset differs"):
        RunConfig.model_validate(data)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model": {"preset": "llama-xs", "init_seed": 1}}, r"nodes\[ys\].model.init_seed"),
        ({"warm_start": {"steps": 7, "batch_size": 8, "lr": 0.003}}, r"nodes\[ys\].warm_start"),
    ],
)
def test_gossip_refuses_agents_that_start_from_different_weights(change, match):
    """Another init seed or warm start gives another start, hence another DPO reference and
    averages of networks initialised apart: refused, naming the field and both ways out;
    `different_starts: true` runs it anyway."""
    data = tiny_dpo_config(kind="gossip-dpo")
    data["nodes"].append({**data["nodes"][0], "name": "ys", **change})
    with pytest.raises(ValueError, match=match) as err:
        RunConfig.model_validate(data)
    assert "different_starts: true" in str(err.value)
    data["algorithm"]["different_starts"] = True
    RunConfig.model_validate(data)  # accepted when asked for
