"""GPU check of the vLLM rollout engine: configs/smollm2.yaml on one CUDA GPU with the CUDA vLLM
build, a bf16 engine beside an f32 trainer, a few steps; prints the engine's throughput and the
mismatch statistics.

    FTIS_VLLM=1 bash scripts/setup.sh                  # on the GPU machine: .venv-vllm with vllm
    .venv-vllm/bin/python scripts/gpu_check_vllm.py    # a few minutes
    .venv-vllm/bin/python scripts/gpu_check_vllm.py --dry-run   # CPU, tiny model (tests)

Needs SmolLM2-135M in ftis's cache (`ftis models fetch smollm2-135m-instruct`, no network on the
GPU machine: copy $FTIS_CACHE/models there). Prints one JSON object last: seconds per step
spent sampling (the engine's start in the first, the weight push in every one), the tokens
generated per second after the first step, and per step the mismatch (`rollout/mismatch_k3`) and the share of tokens whose IS
weight was capped (`loss/truncated_frac`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def overrides(dry_run: bool, steps: int) -> list[str]:
    """The --set list of the check's run."""
    common = [
        "train.rollout_engine=vllm",
        "train.vllm.dtype=bfloat16",
        f"train.steps={steps}",
        "checkpoint.every=0",
        "eval.every=0",
        "log.progress=false",
    ]
    if dry_run:  # a tiny model on the CPU: the whole path except CUDA
        return common + [
            "nodes.0.model={preset: llama-m}",
            "task={kind: arithmetic, ops: {'+': 1.0}, max_digits: 2, test_size: 16}",
            "nodes.0.warm_start={steps: 150, batch_size: 32, lr: 0.003}",
            "nodes.0.optim.lr=0.001",
            "train.prompts_per_step=8",
            "train.max_new_tokens=6",
            "train.vllm.kv_cache_gib=1",
            "train.vllm.max_model_len=128",
            "eval.size=16",
        ]
    return common + [
        "nodes.0.model.device=cuda",
        "train.prompts_per_step=64",
        "train.max_new_tokens=256",
        "train.vllm.gpu_memory_utilization=0.3",
    ]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model (for tests)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    args = ap.parse_args(argv)
    import torch
    from typer.testing import CliRunner

    from ftis.cli import app
    from ftis.rollout.engine import require_vllm

    vllm = require_vllm()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --dry-run")
    out = Path(args.out or tempfile.mkdtemp(prefix="ftis-gpu-vllm-"))
    argv_run = ["run", str(ROOT / "configs" / "smollm2.yaml"), "--out", str(out)]
    for o in overrides(args.dry_run, args.steps):
        argv_run += ["--set", o]
    t0 = time.perf_counter()
    res = CliRunner().invoke(app, argv_run)
    wall = time.perf_counter() - t0
    if res.exit_code != 0:
        print(res.output, file=sys.stderr)
        raise SystemExit(f"the run failed (exit {res.exit_code}); its logs are in {out}/logs")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) >= 1 and "time/sample" in r]
    tokens = [r.get("train/generated_tokens", 0.0) for r in steps]
    sample_s = [r["time/sample"] for r in steps]
    result = {
        "device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(0),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "wall_s": wall,
        "steps": len(steps),
        "sample_s_per_step": sample_s,
        # the first step's includes the engine's start; the rest are steady state
        "tokens_per_s_after_first": (sum(tokens[1:]) / sum(sample_s[1:]))
        if len(steps) > 1
        else None,
        "mismatch_k3": [r.get("rollout/mismatch_k3") for r in steps],
        "truncated_frac": [r.get("loss/truncated_frac") for r in steps],
        "run_dir": str(out),
    }
    for k, v in result.items():
        print(f"{k}: {v}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
