"""Sampling a node's completions for a step: G completions per prompt with the node's current
model, driven by noise keyed by (seed, step, prompt) so that who samples a slot never changes
what is sampled (docs/design.md)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from ftis.config import TrainConfig
from ftis.models.precision import model_compute_dtype
from ftis.rollout.sampler import Samples, sample
from ftis.rollout.types import RolloutBatch
from ftis.tasks.base import Problem, Task
from ftis.train.node import Node


def group_noise(
    seed: int, step: int, prompt_index: int, group_size: int, length: int
) -> torch.Tensor:
    """(G, length) uniforms that drive the sampling of one prompt's group at one step.

    Keyed by (seed, step, prompt) only, so a completion slot gets the same randomness whichever
    node samples it: splitting a step's prompts among identical nodes gives the same samples as
    one node sampling them all, and a resumed run samples what the uninterrupted one did.
    """
    key = hashlib.blake2b(f"ftis-sample:{seed}:{step}:{prompt_index}".encode(), digest_size=8)
    g = torch.Generator().manual_seed(int.from_bytes(key.digest(), "little") & ((1 << 63) - 1))
    return torch.rand((group_size, length), generator=g)


def generate(
    node: Node,
    task: Task,
    problems: Sequence[Problem],
    *,
    slots: tuple[int, int],
    cfg: TrainConfig,
    step: int,
) -> RolloutBatch:
    """Sample the completion slots `slots` = (first, count) of each problem's group with the
    node's current model, with the step's per-prompt noise (see `group_noise`)."""
    tok = node.tokenizer
    first, num_samples = slots
    if not problems or num_samples == 0:
        return RolloutBatch.empty(tok.pad_token_id)
    prompts = [task.prompt_ids(p, tok) for p in problems]
    # what both samplers are told alike
    draw = dict(
        max_new_tokens=cfg.max_new_tokens,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
    )
    if cfg.rollout_engine == "vllm":
        out = _engine_sample(node, prompts, problems, first, num_samples, cfg, step, draw)
    else:
        # A joint group (sharing.scheme joint) has n x G slots; a prefix of a group's noise is
        # the same whatever its length, so slot s gets the same uniforms under every scheme.
        slots_total = max(cfg.group_size, first + num_samples)
        noise = torch.cat(
            [
                group_noise(cfg.seed, step, p.index, slots_total, cfg.max_new_tokens)[
                    first : first + num_samples
                ]
                for p in problems
            ]
        )
        model = node.sampling_model(cfg.sampler_dtype)
        out = sample(
            model,
            prompts,
            num_samples=num_samples,
            noise=noise,
            # a low-precision copy runs in its own dtype, not under the model's autocast
            compute_dtype=None
            if model is not node.model
            else model_compute_dtype(node.cfg.model.compute_dtype),
            **draw,
        )
    n = out.completion_ids.shape[0]
    index = torch.tensor([p.index for p in problems], dtype=torch.long)
    return RolloutBatch(
        prompt_index=index.repeat_interleave(num_samples),
        generator=torch.full((n,), node.rank, dtype=torch.long),
        completion_ids=out.completion_ids.cpu(),
        lengths=out.lengths.cpu(),
        sampler_logprobs=out.logprobs.cpu(),
    )


def _engine_sample(
    node: Node,
    prompts: list[list[int]],
    problems: Sequence[Problem],
    first: int,
    num_samples: int,
    cfg: TrainConfig,
    step: int,
    draw: dict,
) -> Samples:
    """The slots through the node's vLLM engine (train.rollout_engine vllm), after giving it
    the node's current weights; one seed per completion slot (`completion_seed`)."""
    from ftis.rollout.engine import completion_seed

    engine = node.rollout_engine(cfg)
    engine.push(node.model)
    seeds = [
        [completion_seed(cfg.seed, step, p.index, first + j) for j in range(num_samples)]
        for p in problems
    ]
    return engine.sample(prompts, seeds, **draw)
