"""The paper-scale configs (configs/paper/): they validate, carry the paper's hyper-parameters
(ftis-method.md section 8), and start on tiny stand-ins: every model path replaced by a tiny Qwen2
saved with the character tokenizer and a chat template, the data by the shipped fixtures, 1 step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from ftis.cli import app
from ftis.config import load_config
from ftis.models.presets import preset_config
from ftis.models.tokenizer import char_tokenizer
from ftis.study import load_study

ROOT = Path(__file__).resolve().parents[1]
PAPER = sorted((ROOT / "configs" / "paper").glob("*.yaml"))
MAX_TOKENS = 760  # the paper's limit, prompt included
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Hub model -> (tiny preset, init seed) standing in for it
STAND_INS = {
    "Qwen/Qwen2.5-1.5B": ("qwen2-s", 0),
    "Qwen/Qwen2.5-Coder-1.5B": ("qwen2-s", 1),
    "Qwen/Qwen2.5-3B": ("qwen2-m", 0),
}


def test_there_is_one_config_per_pairing():
    assert [p.stem for p in PAPER] == ["expertise", "params", "size"]


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_paper_hyper_parameters(path):
    cfg = load_config(path)
    t = cfg.train
    assert (t.group_size, t.prompts_per_step, t.steps, t.temperature) == (12, 16, 50, 1.0)
    assert t.max_new_tokens < MAX_TOKENS and cfg.sharing.scheme == "vertical"
    assert cfg.task.kind == "gsm8k" and cfg.task.use_chat_template is True
    assert cfg.task.test_size == 512 and cfg.task.ood_file and cfg.eval.pass_samples == 0
    assert len(cfg.nodes) == 2
    for node in cfg.nodes:
        assert node.model.path in STAND_INS and node.warm_start is None
        o = node.optim
        assert (o.name, o.weight_decay, o.grad_clip) == ("adam", 0.0, 1.0)
        assert o.lr == (1e-4 if node.model.lora else 1e-6)
        assert node.loss.method == "f-tis"
        if node.model.lora:
            lora = node.model.lora
            assert (lora.r, lora.alpha, lora.dropout) == (128, 256, 0.0)
    if path.stem == "params":  # LoRA and full fine-tuning of the same base
        assert len({n.model.path for n in cfg.nodes}) == 1
        assert [n.model.lora is not None for n in cfg.nodes] == [True, False]


def test_the_gpu_study_expands():
    study = load_study(ROOT / "studies" / "paper-gpu.yaml")
    assert {r.pairing for r in study.runs} == {"size", "expertise", "params"}
    assert all(r.config.train.group_size == 12 for r in study.runs)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, str]:
    """Tiny local models saved like Hub checkpoints (config, weights, tokenizer with a template)."""
    root = tmp_path_factory.mktemp("stand-ins")
    out = {}
    for name, (preset, seed) in STAND_INS.items():
        path = root / name.replace("/", "--")
        config = preset_config(preset)
        config.max_position_embeddings = 2048  # the chat-templated GSM8K prompts are long in chars
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        tok = char_tokenizer()
        tok.chat_template = TEMPLATE
        tok.save_pretrained(path)
        out[name] = str(path)
    return out


@pytest.mark.long
@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_paper_config_starts_on_stand_ins(path, stand_ins, tmp_path):
    cfg = load_config(path)
    overrides = [
        "task.train_file=fixture:gsm8k_tiny_train.jsonl",
        "task.test_file=fixture:gsm8k_tiny_test.jsonl",
        "task.ood_file=fixture:math_tiny.jsonl",
        "task.test_size=2",
        "task.ood_size=2",
        "train.steps=1",
        "train.prompts_per_step=2",
        "train.group_size=2",
        "train.max_new_tokens=4",
        "eval.size=2",
        "eval.batch_size=4",
        "log.progress=false",
    ]
    for i, node in enumerate(cfg.nodes):
        overrides.append(f"nodes.{i}.model.path={stand_ins[node.model.path]}")
    if cfg.nodes[0].model.lora:
        overrides.append("nodes.0.model.lora.r=4")  # r=128 exceeds the stand-in's width
    out = tmp_path / "run"
    args = ["run", str(path), "--out", str(out)]
    for o in overrides:
        args += ["--set", o]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    done = {r["node"] for r in rows if r["step"] == 1}
    assert done == {n.name for n in cfg.nodes}
    assert all("eval/ood/accuracy" in r for r in rows if r["step"] == 1)
