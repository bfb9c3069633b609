"""A node's moving parts: its model, tokenizer and optimizer, built from its config."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase

from ftis.config import NodeConfig, OptimConfig, TrainConfig
from ftis.models.loading import (
    attach_lora,
    build_model,
    count_parameters,
    load_tokenizer,
)
from ftis.models.precision import SAMPLER_DTYPES, SamplerCopy
from ftis.models.sources import model_label
from ftis.warmstart import starting_model

if TYPE_CHECKING:
    from ftis.rollout.engine import VllmEngine

log = logging.getLogger(__name__)


@dataclass
class Node:
    cfg: NodeConfig
    rank: int
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    # The KL reference (loss.beta > 0, full fine-tuning): a frozen copy of the model as built,
    # i.e. at step 0. None otherwise; a LoRA node's reference is its base with the adapters
    # disabled (`reference`), so it needs no copy.
    ref_model: torch.nn.Module | None = None
    # train.sampler_dtype bfloat16: the low-precision copy the sampler runs on (made on first use)
    sampler_copy: SamplerCopy | None = None
    # train.rollout_engine vllm: the node's vLLM engine (ftis.rollout.engine), made on first use
    engine: VllmEngine | None = None

    @property
    def samples_elsewhere(self) -> bool:
        """True when the rollouts come from weights other than the trainer's own (a bf16 copy or
        a vLLM engine), so the update's ratios see a sampler/trainer mismatch."""
        return self.sampler_copy is not None or self.engine is not None

    def rollout_engine(self, train: TrainConfig) -> VllmEngine:
        """The node's vLLM engine (train.rollout_engine vllm), started on first use from the
        node's current weights."""
        if self.engine is None:
            from ftis.rollout.engine import EngineSettings, VllmEngine

            settings = EngineSettings(**train.vllm.model_dump(), seed=train.seed)
            self.engine = VllmEngine(self.model, self.tokenizer, settings)
        return self.engine

    def close(self) -> None:
        """Release what the node holds outside its tensors (the vLLM engine)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def sampling_model(self, dtype: str = "float32") -> torch.nn.Module:
        """The model a rollout samples from: the node's own, or (`train.sampler_dtype`
        bfloat16) a copy in that dtype holding its current weights."""
        target = SAMPLER_DTYPES[dtype]
        if target is None or target == next(self.model.parameters()).dtype:
            return self.model
        if self.sampler_copy is None or self.sampler_copy.dtype != target:
            self.sampler_copy = SamplerCopy(target)
        return self.sampler_copy.synced(self.model)

    @property
    def name(self) -> str:
        return self.cfg.name

    @contextlib.contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """The KL reference model (docs/math.md §14), for scoring without grad: the frozen
        step-0 copy, or, under LoRA, this node's own model with its adapters disabled for the
        duration of the block."""
        if self.ref_model is not None:
            yield self.ref_model
        elif hasattr(self.model, "disable_adapter"):
            with self.model.disable_adapter():
                yield self.model
        else:
            raise RuntimeError(
                f"node {self.name} has no KL reference: it is built when loss.beta > 0"
            )


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    return torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas)


def build_node(cfg: NodeConfig, *, rank: int, task_cfg: BaseModel, warm_progress=None) -> Node:
    """Load the node's starting weights (`ftis.warmstart.starting_model`: shipped, cached or
    warm-started here, or the model as configured), attach LoRA, and make the optimizer."""
    from ftis.train.allocator import keep_large_blocks

    keep_large_blocks()  # once per process: a real model's large buffers reused, not refaulted
    model_cfg = starting_model(cfg.model, cfg.warm_start, task_cfg, progress=warm_progress)
    tokenizer = load_tokenizer(model_cfg)
    model = build_model(model_cfg)
    if model_cfg.lora is not None:
        model = attach_lora(model, model_cfg.lora)
    model.train()
    ref_model = None
    if cfg.loss.beta > 0 and model_cfg.lora is None:
        # Built before any checkpoint is loaded, so on resume too this is the step-0 model: the
        # warm start (cached, deterministic) or the seeded initialisation.
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    trainable, total = count_parameters(model)
    log.info(
        "node %s: %s, %d of %d parameters trainable",
        cfg.name,
        model_label(cfg.model),
        trainable,
        total,
    )
    return Node(
        cfg=cfg,
        rank=rank,
        model=model,
        tokenizer=tokenizer,
        optimizer=build_optimizer(model, cfg.optim),
        ref_model=ref_model,
    )
