"""Shared fixtures: an isolated warm-start cache and tiny run configs."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # One cache for the whole session: tests that warm start the same tiny preset share it.
    mp = pytest.MonkeyPatch()
    mp.setenv("FTIS_CACHE", str(tmp_path_factory.mktemp("ftis-cache")))
    yield
    mp.undo()


def tiny_run_config(**train) -> dict:
    """A run config that finishes in a few seconds: llama-xs, 30 warm-start steps, 3 RL steps."""
    return {
        "name": "tiny",
        "task": {
            "kind": "arithmetic",
            "ops": {"+": 1.0},
            "max_digits": 2,
            "test_size": 16,
            "ood": {"ood": {"terms": 3, "size": 16}},
        },
        "nodes": [
            {
                "name": "xs",
                "model": {"preset": "llama-xs"},
                "warm_start": {"steps": 30, "batch_size": 32, "lr": 0.003},
            }
        ],
        "train": {"steps": 3, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4, **train},
        "eval": {"every": 2, "size": 16, "pass_samples": 4, "pass_k": [1, 2], "pass_problems": 8},
        "log": {"progress": False},
    }


def tiny_node(method: str = "f-tis", *, lr: float | None = None, lora=None):
    """A llama-xs node (random init, char tokenizer) built in-process, for phase-level tests."""
    from ftis.config import LossConfig, NodeConfig, OptimConfig
    from ftis.models.loading import ModelConfig, build_model
    from ftis.models.tokenizer import char_tokenizer
    from ftis.train.node import Node, build_optimizer

    optim = OptimConfig() if lr is None else OptimConfig(lr=lr)
    cfg = NodeConfig(
        name="n",
        model=ModelConfig(preset="llama-xs", lora=lora),
        optim=optim,
        loss=LossConfig(method=method),
    )
    model = build_model(cfg.model)
    return Node(
        cfg=cfg,
        rank=0,
        model=model,
        tokenizer=char_tokenizer(),
        optimizer=build_optimizer(model, cfg.optim),
    )
