"""`ftis export RUN_DIR NODE`: a LoRA node's checkpoint becomes a merged, standalone model
directory that transformers alone loads and generates from, computing what the trained node
computes; bad requests end in one clear line."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from typer.testing import CliRunner

from ftis.cli import app
from ftis.config import RunConfig
from ftis.train.checkpoint import load_checkpoint
from ftis.train.loop import train_node
from ftis.train.node import build_node
from tests.conftest import tiny_run_config


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    # one-digit sums after 60 warm-start steps: groups disagree, so both steps train
    data = tiny_run_config(steps=2, prompts_per_step=8)
    data["task"].update(max_digits=1, test_size=4)
    data["nodes"][0]["warm_start"]["steps"] = 60
    data["nodes"][0]["model"]["lora"] = {"r": 4, "alpha": 8}
    data["nodes"][0]["optim"] = {"lr": 0.05}  # so that the adapters move visibly in 2 steps
    data["eval"] = {"every": 0, "size": 8, "pass_samples": 0}
    data["checkpoint"] = {"every": 1, "keep": 3}
    cfg = RunConfig.model_validate(data)
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    train_node(cfg, rank=0, run_dir=run_dir)
    return cfg, run_dir


def test_a_lora_node_exports_merged_and_loads_with_transformers_alone(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, run_dir = lora_run
    out = tmp_path / "merged"
    res = CliRunner().invoke(app, ["export", str(run_dir), "xs", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert not (out / "adapter_config.json").exists()  # merged, not an adapter
    meta = json.loads((out / "ftis_export.json").read_text())
    assert meta["step"] == 2 and meta["lora_merged"] is True

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok.encode("12+34=", add_special_tokens=False)])
    gen = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > ids.shape[1]
    assert isinstance(tok.decode(gen[0, ids.shape[1] :]), str)

    # the export computes what the trained node (base + adapters) computes
    node = build_node(cfg.nodes[0], rank=0, task_cfg=cfg.task)
    load_checkpoint(node, run_dir / "nodes" / "xs" / "step-000002")
    node.model.eval()
    with torch.no_grad():
        want = node.model(input_ids=ids).logits
        got = model(input_ids=ids).logits
        with node.model.disable_adapter():
            base = node.model(input_ids=ids).logits
    assert (want - base).abs().max() > 1e-3  # the adapters did change the model
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_export_of_an_earlier_step_and_bad_requests(lora_run, tmp_path):
    _, run_dir = lora_run
    runner = CliRunner()
    res = runner.invoke(
        app, ["export", str(run_dir), "xs", "--step", "1", "--out", str(tmp_path / "s1")]
    )
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "s1" / "ftis_export.json").read_text())["step"] == 1
    res = runner.invoke(app, ["export", str(run_dir), "nope"])
    assert res.exit_code == 2 and "no node 'nope'" in res.output and "xs" in res.output
    res = runner.invoke(app, ["export", str(run_dir), "xs", "--step", "7"])
    assert res.exit_code == 2 and "no checkpoint of step 7" in res.output
    res = runner.invoke(
        app, ["export", str(run_dir), "xs", "--step", "1", "--out", str(tmp_path / "s1")]
    )
    assert res.exit_code == 2 and "not empty" in res.output
    assert "Traceback" not in res.output


def test_a_full_fine_tuned_node_exports_its_checkpoint_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    data = tiny_run_config(steps=1)
    data["eval"] = {"every": 0, "size": 8, "pass_samples": 0}
    cfg = RunConfig.model_validate(data)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    train_node(cfg, rank=0, run_dir=run_dir)
    res = CliRunner().invoke(app, ["export", str(run_dir), "xs"])
    assert res.exit_code == 0, res.output
    out = run_dir / "export" / "xs-step-000001"
    assert json.loads((out / "ftis_export.json").read_text())["lora_merged"] is False
    got = AutoModelForCausalLM.from_pretrained(out).state_dict()
    want = AutoModelForCausalLM.from_pretrained(run_dir / "nodes" / "xs" / "step-000001" / "model")
    for k, v in want.state_dict().items():
        assert torch.equal(got[k], v), k


def test_export_needs_no_reward_module_and_writes_a_model_card(tmp_path, monkeypatch):
    """A run trained with a reward from a module of the user's (issue 55): from a place where
    that module cannot be imported, export still works (it reads the weights, the model and
    tokenizer sources and the prompt format, not the reward), and the export's README.md says
    what the model is, how it was trained, the run's last evaluation and the commands."""
    import sys

    from transformers import AutoModelForCausalLM

    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "my_reward_mod.py").write_text(
        "def score(prompt, completion, fields):\n    return float(completion.strip() == fields['answer'])\n"
    )
    monkeypatch.syspath_prepend(str(mod))
    data = tiny_run_config(steps=1)
    data["task"]["reward"] = [{"function": "my_reward_mod:score"}]
    data["eval"] = {"every": 0, "size": 8, "pass_samples": 0}
    cfg = RunConfig.model_validate(data)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    train_node(cfg, rank=0, run_dir=run_dir)
    # the reward's module is gone: a run would refuse the config, export must not
    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))
    sys.path.remove(str(mod))
    sys.modules.pop("my_reward_mod", None)
    from ftis.rewards import _cache

    _cache.pop("my_reward_mod:score", None)
    from ftis.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="cannot import 'my_reward_mod'"):
        load_config(run_dir / "config.yaml")
    res = CliRunner().invoke(app, ["export", str(run_dir), "xs"])
    assert res.exit_code == 0, res.output
    out = run_dir / "export" / "xs-step-000001"
    AutoModelForCausalLM.from_pretrained(out)
    card = (out / "README.md").read_text()
    final = [
        json.loads(x)
        for x in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"eval/accuracy"' in x
    ][-1]
    assert f"## The run's evaluation at step {final['step']} (greedy)" in card
    assert f"| eval/accuracy | {final['eval/accuracy']:.4g} |" in card
    assert "| base model | ftis preset llama-xs |" in card and "| steps | 1 of 1 |" in card
    assert f"ftis export {run_dir} xs --step 1 --out {out}" in card
