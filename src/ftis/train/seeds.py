"""Every seed a run derives from `train.seed`, in one place, with names.

The formulas are fixed: changing one changes every run's numbers for the same config.
Sampling noise during training is keyed separately, by (seed, step, prompt)
(`ftis.train.sampling.group_noise`), and prompt order by (seed, step)
(`ftis.algos.ftis.sharing.step_prompts`).
"""

from __future__ import annotations

_RANK_STRIDE = 7919  # a prime: distinct ranks of one seed never share a torch seed
_EVAL_STRIDE = 104729  # a prime: evaluations at different steps draw different samples
_ADVERSARY_STRIDE = 1_000_003  # a prime larger than any step * rank product in practice


def node_seed(seed: int, rank: int) -> int:
    """The torch global seed of node `rank` (dropout, LoRA init, anything not keyed itself)."""
    return seed * _RANK_STRIDE + rank


def eval_seed(seed: int, step: int) -> int:
    """The generator seed of the evaluation at `step` (pass@k sampling)."""
    return seed + _EVAL_STRIDE * step


def adversary_seed(seed: int, step: int, rank: int) -> int:
    """The generator seed with which a testing adversary corrupts its batch of `step`."""
    return seed * _ADVERSARY_STRIDE + _RANK_STRIDE * step + rank


def swarm_sample_seed(seed: int, rank: int) -> int:
    """The sampling seed of swarm peer `rank`: every peer samples whole groups of the same
    prompts, so each needs its own noise (with the run's seed, two peers of one model would
    draw identical completions)."""
    return seed * _ADVERSARY_STRIDE + _EVAL_STRIDE * (rank + 1) + 1
