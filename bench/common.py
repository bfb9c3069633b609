"""Shared bench helpers: a warm-started tiny model to benchmark on, medians, environment."""

from __future__ import annotations

import os
import platform
import statistics

import torch

from ftis.models.loading import ModelConfig
from ftis.tasks import ArithmeticTaskConfig
from ftis.warmstart import WarmStartConfig, warm_start

TASK = ArithmeticTaskConfig(ops={"+": 1.0})


def bench_model(quick: bool) -> tuple[str, str]:
    """(preset, path) of a warm-started model whose rewards vary, so GRPO groups are realistic.

    Full runs use the embedded default's large node (llama-m, 500 warm-start steps, shared with
    `ftis run`'s cache); --quick uses llama-s with a short warm start.
    """
    if quick:
        preset, ws = "llama-s", WarmStartConfig(steps=150, batch_size=64, lr=0.002)
    else:
        preset, ws = "llama-m", WarmStartConfig(steps=500, batch_size=64, lr=0.001)
    return preset, str(warm_start(ModelConfig(preset=preset), ws, TASK))


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def environment() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
        "cpus": str(os.cpu_count()),
        "machine": platform.machine(),
    }
