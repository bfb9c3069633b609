"""The ReCo study (studies/reco.yaml): its grid, what each method sets, and that it reuses the
reasoning study's cached warm starts."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ftis.config import load_config
from ftis.study import load_study
from ftis.warmstart import cache_key

ROOT = Path(__file__).resolve().parents[1]


def _key(cfg, node) -> str:
    return cache_key(node.model, node.warm_start, cfg.task)


def test_grid_and_methods():
    study = load_study(ROOT / "studies" / "reco.yaml")
    runs = {r.id: r for r in study.runs}
    assert len(runs) == 18
    assert Counter((r.pairing, r.method) for r in study.runs) == {
        **{("single", m): 3 for m in ("grpo", "reco-w", "reco-r", "reco")},
        **{("size", m): 3 for m in ("f-tis", "f-reco")},
    }
    levels = {  # method -> (loss, response weights, token ratio, TIS weight) on every node
        "grpo": ("vis", True, True, False),  # reco_* fields are ignored by vis and f-tis
        "reco-w": ("reco", True, False, False),
        "reco-r": ("reco", False, True, False),
        "reco": ("reco", True, True, False),
        "f-tis": ("f-tis", True, True, False),
        "f-reco": ("f-reco", True, True, True),
    }
    for r in study.runs:
        cfg = r.config
        want = levels[r.method]
        got = {
            (
                n.loss.method,
                n.loss.reco_response_weights,
                n.loss.reco_token_ratio,
                n.loss.reco_tis,
            )
            for n in cfg.nodes
        }
        assert got == {want}, r.id
        assert len(cfg.nodes) == (1 if r.pairing == "single" else 2)
        # samples reused (the token ratio acts only then), pass@k up to 64 from 64 samples
        assert (cfg.train.update_epochs, cfg.train.mini_batches, cfg.train.steps) == (2, 2, 40)
        assert cfg.eval.pass_samples == 64 and cfg.eval.pass_k == [1, 2, 4, 8, 16, 32, 64]
        assert cfg.eval.every == 20 and cfg.eval.pass_problems == 32


def test_warm_starts_are_the_reasoning_studys():
    size = load_config(ROOT / "studies" / "reasoning-configs" / "size.yaml")
    single = load_config(ROOT / "studies" / "reco-configs" / "single.yaml")
    (node,) = single.nodes
    large = next(n for n in size.nodes if n.name == "large")
    assert node == large and single.task == size.task and single.train == size.train
    assert _key(single, node) == _key(size, large)  # one cache entry for both pairings
    study = load_study(ROOT / "studies" / "reco.yaml")
    keys = {_key(r.config, n) for r in study.runs for n in r.config.nodes}
    assert keys == {_key(size, n) for n in size.nodes}
