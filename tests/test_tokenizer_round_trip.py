"""A node's tokenizer encodes and decodes as the one its weights were trained with, through
every path that reloads it: a warm-start directory, a checkpoint (resume), an exported model
and a peer's handshake (the fingerprint), for every preset.

transformers 5 rebuilds a qwen2 directory's tokenizer as `Qwen2Tokenizer` from the vocabulary
and merges with its own pre-tokenizer; before ftis loaded the saved `tokenizer.json` as it is,
"user: rev szy:\\nassistant: " lost its spaces and newline on every qwen2 preset and the BPE's
digit merges were lost ("457" became "4 5 7").
"""

from __future__ import annotations

import json

import pytest
import yaml
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from typer.testing import CliRunner

from ftis.models.loading import ModelConfig, load_tokenizer, tokenizer_fingerprint
from ftis.models.presets import PRESETS, preset_config, preset_tokenizer

TEXTS = [
    "user: rev szy:\nassistant: ",
    "457 + 1998 = 2455\n\n",
    "  two  spaces,\ttab and trailing space ",
    "Ünïcödé: naïve café — 東京 🚀",
    "Question: what is 7*6?\nAnswer: 42",
]


def _same(tok, ref) -> None:
    for text in TEXTS:
        ids = ref.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_special_tokens=False) == ids, (type(tok).__name__, text)
        assert tok.decode(ids) == ref.decode(ids), text
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(ref)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
    )


def _model_dir(name: str, path) -> None:
    """What a warm start and a checkpoint write: the model's config and the tokenizer."""
    preset_config(name).save_pretrained(path)
    preset_tokenizer(name).save_pretrained(path)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_saved_directory_reloads_to_the_presets_tokenizer(name, tmp_path):
    _model_dir(name, tmp_path)
    _same(load_tokenizer(ModelConfig(path=str(tmp_path))), preset_tokenizer(name))


def test_the_reload_is_not_what_plain_autotokenizer_gives_for_qwen2(tmp_path):
    # the check above can fail: plain AutoTokenizer on the same directory encodes otherwise,
    # and its fingerprint tells the two apart (so a peer never exchanges ids with it)
    _model_dir("qwen2-bpe", tmp_path)
    ref = preset_tokenizer("qwen2-bpe")
    plain = AutoTokenizer.from_pretrained(tmp_path)
    text = "user: rev szy:\nassistant: 457"
    if plain.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False):
        pytest.skip("this transformers keeps the saved pre-tokenizer for qwen2")
    assert tokenizer_fingerprint(plain) != tokenizer_fingerprint(ref)


@pytest.mark.parametrize("name", ["qwen2-bpe", "qwen2-s"])
def test_warm_start_resume_and_export_keep_the_tokenizer(name, tmp_path):
    """A qwen2 node after a (shipped, copied) warm start, its checkpoint, a resume and its
    export: each tokenizer encodes as the preset's."""
    from ftis.cli import app
    from ftis.config import RunConfig
    from ftis.train.loop import train_node
    from ftis.train.node import build_node

    # configs/cross-tokenizer.yaml's warm start and task exactly (its default test split too:
    # the warm start's key covers the task), so the shipped base is copied, not trained
    ws = {"steps": 1200, "batch_size": 64, "lr": 0.002}
    task = {"kind": "arithmetic", "seed": 0, "ops": {"+": 1.0}, "min_digits": 1, "max_digits": 2}
    if name == "qwen2-s":
        task = {"kind": "reasoning", "seed": 0, "test_size": 4}
        ws = None
    data = {
        "name": "rt",
        "task": task,
        "nodes": [{"name": "q", "model": {"preset": name}, "warm_start": ws}],
        "train": {"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 2},
        "eval": {"every": 0, "size": 4, "pass_samples": 0},
        "checkpoint": {"every": 1, "keep": 1},
        "log": {"progress": False},
    }
    if ws is None:
        del data["nodes"][0]["warm_start"]
    cfg = RunConfig.model_validate(data)
    ref = preset_tokenizer(name)
    node = build_node(cfg.nodes[0], rank=0, task_cfg=cfg.task)
    _same(node.tokenizer, ref)  # after the warm start (its directory reloaded)

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    train_node(cfg, rank=0, run_dir=run_dir)
    ckpt = run_dir / "nodes" / "q" / "step-000001" / "model"
    _same(load_tokenizer(ModelConfig(path=str(ckpt))), ref)  # the checkpoint's copy
    _same(build_node(cfg.nodes[0], rank=0, task_cfg=cfg.task).tokenizer, ref)  # a resume

    out = tmp_path / "export"
    res = CliRunner().invoke(app, ["export", str(run_dir), "q", "--out", str(out)])
    assert res.exit_code == 0, res.output
    # the export's tokenizer adds the BOS ftis prepends to plain prompts (prompt_format), and
    # otherwise encodes as the node's does
    ref = preset_tokenizer(name)
    ref.add_bos_token = True
    _same(load_tokenizer(ModelConfig(path=str(out))), ref)
    # without ftis: the loader the export names reproduces the tokenizer
    _same(PreTrainedTokenizerFast.from_pretrained(out), ref)
    meta = json.loads((out / "ftis_export.json").read_text())
    if meta["tokenizer_loader"] == "AutoTokenizer":
        _same(AutoTokenizer.from_pretrained(out), ref)
    else:  # transformers rebuilds qwen2's tokenizer: the export says so
        assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(out)) != tokenizer_fingerprint(
            ref
        )
