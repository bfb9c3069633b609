"""Shared bench helpers: a warm-started tiny model to benchmark on, medians, environment."""

from __future__ import annotations

import os
import platform
import statistics
from pathlib import Path

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


def train_trl_grpo(
    model, tok, rows: list[dict], reward, *, lr: float, callback, bf16: bool = False, **args
) -> None:
    """Train TRL's GRPOTrainer on `rows` with the settings both TRL baselines share (CPU, no
    logging or saving, temperature 1 with no top-k/top-p, beta 0, loss `grpo`, AdamW at a
    constant `lr`, grad clip 1, seed 0, data in order) and `args` (batch, generations,
    lengths, steps): the same trainer for bench/trl_step.py and bench/scale.py. fp32 unless
    `bf16` (TRL's `bf16=True`: forward passes under bf16 autocast, f32 weights)."""
    import tempfile

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            beta=0.0,
            loss_type="grpo",
            learning_rate=lr,
            max_grad_norm=1.0,
            optim="adamw_torch",
            weight_decay=0.0,
            lr_scheduler_type="constant",
            warmup_steps=0,
            bf16=bf16,
            fp16=False,
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
            shuffle_dataset=False,
            num_iterations=1,
            **args,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            callbacks=[callback],
        )
        trainer.train()


def json_child(module: str, *args: str, threads: int | None = None) -> dict:
    """Run `python -m module args...` from the repository root in a fresh process (src/ and the
    root on its path; OMP_NUM_THREADS = `threads`, else the caller's, else 1) and return the
    JSON object its last stdout line holds; RuntimeError with its stderr's tail if it fails."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "src")])}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def step_timer() -> tuple[object, list[float], list[float]]:
    """A transformers TrainerCallback that times every optimizer step, and the two lists it
    fills: wall-clock seconds and CPU seconds per step."""
    import time

    from transformers import TrainerCallback

    times: list[float] = []
    cpu: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)
            cpu.append(time.process_time() - self.c0)

    return Timer(), times, cpu


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU's name from the first 'model name' line of `cpuinfo`; None where there is no such
    file or line (not Linux, some ARM kernels)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name" and value.strip():
            return " ".join(value.split())
    return None


BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The instruction-set flags of the first 'flags' line of `cpuinfo` (what lscpu prints);
    empty where there is no such file or line."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_bf16_units(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU's bf16 matmul instructions ('amx_bf16 avx512_bf16', 'avx512_bf16', ...), 'none'
    where the flags list neither (bf16 then runs through f32 conversions), None where the
    flags are unknown (no /proc/cpuinfo)."""
    flags = cpu_flags(cpuinfo)
    if not flags:
        return None
    return " ".join(f for f in BF16_FLAGS if f in flags) or "none"


def environment() -> dict[str, str | None]:
    """What a benchmark's numbers depend on besides the code: versions, threads, the CPU (its
    model, the instruction set torch's kernels use here: DEFAULT, AVX2, AVX512, ..., and its bf16
    matmul instructions, `cpu_bf16_units`) and the
    ftis commit that ran (None outside a git checkout; '+dirty' with uncommitted changes under
    src/)."""
    from ftis.study.runner import code_version

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
        "cpus": str(os.cpu_count()),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16_units": cpu_bf16_units(),
        "commit": code_version(),
    }
