"""The examples run as documented, at their smallest settings."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ftis.cli import app

ROOT = Path(__file__).resolve().parents[1]
OWN = ROOT / "examples" / "own-reward"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem + "_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_own_reward_prompts_file_is_what_its_script_writes():
    make = _load(OWN / "make_prompts.py")
    assert (OWN / "prompts.jsonl").read_text() == make.text()
    rows = [json.loads(line) for line in (OWN / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 48 and all(r["messages"][-1]["role"] == "user" for r in rows)


def test_own_reward_functions():
    rw = _load(OWN / "my_reward.py")
    f = {"answer": "17"}
    assert rw.exact_answer_short("", "17", f) == 1.0
    assert math.isclose(rw.exact_answer_short("", " 17 apples", f), 1.0 - 0.05 * 7)
    assert rw.exact_answer_short("", "16", f) == 0.0
    import asyncio

    assert asyncio.run(rw.digits_only("", "-3", f)) == 1.0
    assert asyncio.run(rw.digits_only("", "3 x", f)) == 0.0


@pytest.mark.slow
def test_own_reward_example_runs(tmp_path, monkeypatch):
    """Two different models (llama-xs, qwen2-s), the user's reward module, two RL steps after a
    tiny warm start: samples.jsonl holds each model's completions and the rewards they earned,
    recomputed here from the user's functions; `ftis export` writes a merged model that plain
    transformers loads and generates from."""
    monkeypatch.chdir(ROOT)  # the config names its files from the repository root
    out = tmp_path / "run"
    tiny = [
        "train.steps=2",
        "train.prompts_per_step=2",
        "train.group_size=2",
        "train.max_new_tokens=4",
        "eval.size=4",
        "log.progress=false",
        *(f"nodes.{i}.warm_start.steps=5" for i in (0, 1)),
    ]
    args = ["run", str(OWN / "config.yaml"), "--out", str(out)]
    res = CliRunner().invoke(app, args + [a for s in tiny for a in ("--set", s)])
    assert res.exit_code == 0, res.output
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["node"] for s in samples} == {"llama", "qwen"}
    assert {s["step"] for s in samples} == {0, 2}
    rw = _load(OWN / "my_reward.py")
    import asyncio

    prompts = {
        "\n".join(f"{m['role']}: {m['content']}" for m in json.loads(line)["messages"]): json.loads(
            line
        )
        for line in (OWN / "prompts.jsonl").read_text().splitlines()
    }
    for s in samples:
        assert isinstance(s["completion"], str)
        row = prompts[s["question"]]  # what the reward reads; `prompt` is the model's text
        expected = rw.exact_answer_short(s["question"], s["completion"], row) + 0.2 * asyncio.run(
            rw.digits_only(s["question"], s["completion"], row)
        )
        assert math.isclose(s["reward"], expected, abs_tol=1e-6), s
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    name = "reward/errors/my_reward.py:digits_only"
    assert all(r.get(name) == 0.0 for r in rows if r["step"] >= 1)
    assert all(r["reward/scored"] > 0 for r in rows)
    # the user's trained model, merged and standalone: plain transformers loads it and generates
    export = tmp_path / "qwen-export"
    res = CliRunner().invoke(app, ["export", str(out), "qwen", "--out", str(export)])
    assert res.exit_code == 0, res.output
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(export)
    tok = AutoTokenizer.from_pretrained(export)
    ids = torch.tensor([tok.encode("user: 2+3")])
    gen = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > ids.shape[1]


VF = ROOT / "examples" / "verifiers-env"


@pytest.mark.slow
def test_verifiers_env_example_runs(tmp_path, monkeypatch):
    """Two nodes on the example's verifiers SingleTurnEnv, one scored by the environment's
    rubric and one by the TRL-style batched reward beside it, two RL steps after a tiny warm
    start: each node's rewards in samples.jsonl are what the user's own functions give."""
    pytest.importorskip("verifiers", reason="needs pip install 'ftis[verifiers]'")
    monkeypatch.chdir(ROOT)  # the config names its files from the repository root
    out = tmp_path / "run"
    tiny = [
        "train.steps=2",
        "train.prompts_per_step=2",
        "train.group_size=2",
        "eval.size=4",
        "log.progress=false",
        *(f"nodes.{i}.warm_start.steps=5" for i in (0, 1)),
    ]
    args = ["run", str(VF / "config.yaml"), "--out", str(out)]
    res = CliRunner().invoke(app, args + [a for s in tiny for a in ("--set", s)])
    assert res.exit_code == 0, res.output
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["node"] for s in samples} == {"rubric", "trl"}
    env = _load(VF / "my_env.py")
    args = yaml.safe_load((VF / "config.yaml").read_text())["task"]["args"]
    rows = {r["question"]: r for r in env.load_environment(**args).get_dataset()}
    for s in samples:
        gold = rows[s["question"].split("user: ")[1]]["answer"]
        said = [{"role": "assistant", "content": s["completion"]}]
        assert s["reward"] == env.trl_reward([None], [said], [gold])[0], s
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in metrics if r["step"] >= 1]
    assert all("reward/verifiers-rubric:correct" in r for r in trained if r["node"] == "rubric")
    assert all("reward/verifiers-rubric:brief" in r for r in trained if r["node"] == "rubric")
    assert not any("reward/verifiers-rubric:correct" in r for r in trained if r["node"] == "trl")
