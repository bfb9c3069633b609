"""Presets and study configs of the reasoning benchmark: parameter counts, the size ratio, LoRA,
and the study grid (studies/reasoning.yaml)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from ftis.config import load_config
from ftis.models.config import LoraConfig, ModelConfig
from ftis.models.loading import attach_lora, build_model, count_parameters
from ftis.tasks import ReasoningTaskConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "studies" / "reasoning-configs"


def _params(name: str) -> int:
    return count_parameters(build_model(ModelConfig(preset=name)))[1]


def test_size_pairing_presets_have_the_stated_sizes_and_ratio():
    small, large = _params("llama-xs-deep"), _params("llama-m")
    assert 190_000 < small < 210_000  # "about 0.20M"
    assert 860_000 < large < 880_000  # "0.87M"
    assert large / small >= 4.0
    out = build_model(ModelConfig(preset="llama-xs-deep"))(input_ids=torch.tensor([[1, 5, 6]]))
    assert out.logits.shape[:2] == (1, 3)


def test_lora_node_trains_a_small_fraction_of_the_same_model():
    trainable, total = count_parameters(
        attach_lora(build_model(ModelConfig(preset="llama-m")), LoraConfig(r=16, alpha=32))
    )
    assert total > 860_000 and trainable < total / 5


@pytest.mark.parametrize("pairing", ["size", "expertise", "params"])
def test_pairing_configs_validate(pairing):
    cfg = load_config(CONFIGS / f"{pairing}.yaml")
    assert isinstance(cfg.task, ReasoningTaskConfig)
    assert len(cfg.nodes) == 2
    assert all(n.warm_start is not None for n in cfg.nodes)
    assert "ood" in cfg.task.ood  # the split the study report reads
    assert cfg.train.max_new_tokens >= 40  # the longest OOD trace is 39 characters + EOS


def test_pairings_are_what_they_say():
    size = load_config(CONFIGS / "size.yaml")
    assert [n.model.preset for n in size.nodes] == ["llama-xs-deep", "llama-m"]
    assert size.nodes[0].warm_start == size.nodes[1].warm_start
    exp = load_config(CONFIGS / "expertise.yaml")
    assert {n.model.preset for n in exp.nodes} == {"llama-m"}
    mixes = [n.warm_start.mix for n in exp.nodes]
    assert mixes[0]["add"] > mixes[0]["mul"] and mixes[1]["mul"] > mixes[1]["add"]
    assert exp.task.skills == {"add": 1.0, "mul": 1.0}
    params = load_config(CONFIGS / "params.yaml")
    lora, full = params.nodes
    assert lora.model.lora is not None and full.model.lora is None
    assert lora.model.preset == full.model.preset and lora.warm_start == full.warm_start
    assert params.task == size.task  # one cached llama-m warm start serves both pairings


def test_study_grid():
    from ftis.study.spec import load_study

    study = load_study(ROOT / "studies" / "reasoning.yaml")
    runs = study.runs
    assert len(runs) == 108
    assert len({r.id for r in runs}) == 108
    assert sum(r.node is None for r in runs) == 74  # two-node runs
    seeds = Counter((r.pairing, r.variant) for r in runs if r.node is None)
    for pairing in ("size", "expertise", "params"):
        assert seeds[(pairing, "f-tis")] == 5
        assert seeds[(pairing, "nois")] == 3
        alone = {r.seed for r in runs if r.pairing == pairing and r.method == "alone"}
        assert alone == {0, 1, 2, 3, 4}
    assert seeds[("size", "f-tis h")] == seeds[("size", "vis h")] == 3
    assert seeds[("size", "f-tis g=5")] == seeds[("size", "f-tis g=10")] == 3
    assert seeds[("size-long", "f-tis")] == 2
    long = next(r for r in runs if r.pairing == "size-long")
    assert long.config.train.steps == 100 and long.config.eval.pass_samples == 8
    g5 = next(r for r in runs if r.variant == "f-tis g=5")
    assert all(n.loss.filter_threshold == 5 for n in g5.config.nodes)
