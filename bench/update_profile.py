"""Where a SmolLM2-135M-Instruct update spends its time, f32 against `model.compute_dtype:
bfloat16` under each `model.compute_mode` (autocast; cast_weights: the update on a bf16 copy of
the weights, f32 masters) (issue 51, item 1: profile first). One ftis GRPO step of bench.trl_real's shape
(8 prompts x 4 completions of 32 tokens, micro-batches of 16) after a warm-up step, under
torch.profiler, in a fresh process per variant: per phase its wall time, the shares of
matmuls, attention, other ops and time outside any op, and the top ops by self CPU time.

    python -m bench.update_profile [--out docs/results/update-profile]

Needs `ftis models fetch smollm2-135m-instruct`. Run it on an otherwise idle machine: the
shares are of wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "results" / "update-profile"


def _child_main(arg: str) -> None:
    import torch

    from bench.scale import _ftis_round, profile_node
    from bench.trl_real import GROUP, LENGTH, LR, MICRO, _setup
    from ftis.config import LossConfig, NodeConfig, OptimConfig
    from ftis.train.loop import peak_rss_mb
    from ftis.train.node import Node, build_optimizer

    cfg = json.loads(arg)
    torch.set_num_threads(int(cfg.get("threads", 1)))
    import os

    from ftis.train.allocator import keep_large_blocks

    os.environ["FTIS_MALLOC_KEEP"] = cfg.get("malloc_keep", "1")
    keep_large_blocks()  # as build_node does; FTIS_MALLOC_KEEP=0 (the last variant) opts out
    model_cfg, model, tok, task, prompts = _setup(cfg["compute_dtype"], cfg["compute_mode"])
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
    shape = {"group": GROUP, "length": LENGTH, "micro_batch": MICRO}
    out = profile_node(node, task, prompts, shape)
    # the same step again without the profiler (whose per-op cost falls unevenly on the
    # variants): the wall times the ratios are read from
    timings: dict[str, list[float]] = {}
    _ftis_round(node, task, prompts, cfg=shape, step=2, timings=timings)
    out["plain"] = {k: timings[k][0] for k in ("sample", "update", "step")}
    out["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(out))


# label: (model.compute_dtype, model.compute_mode, FTIS_MALLOC_KEEP: ftis.train.allocator)
VARIANTS = {
    "f32": ("float32", "autocast", "1"),
    "bf16 autocast": ("bfloat16", "autocast", "1"),
    "bf16 cast_weights": ("bfloat16", "cast_weights", "1"),
    "bf16 cast_weights, FTIS_MALLOC_KEEP=0": ("bfloat16", "cast_weights", "0"),
}


def measure(threads: int = 1) -> dict:
    from bench.common import json_child
    from ftis.study.runner import code_version

    return {
        "commit": code_version(),
        "threads": threads,
        "variants": {
            label: json_child(
                "bench.update_profile",
                "--child",
                json.dumps(
                    {
                        "compute_dtype": dtype,
                        "compute_mode": mode,
                        "malloc_keep": keep,
                        "threads": threads,
                    }
                ),
                threads=threads,
            )
            for label, (dtype, mode, keep) in VARIANTS.items()
        },
    }


def markdown(r: dict) -> str:
    v = r["variants"]
    lines = [
        "# Where a SmolLM2-135M update spends its time: f32, bf16 autocast, bf16 cast_weights",
        "",
        f"Produced by `python -m bench.update_profile` at commit `{r['commit']}` "
        f"({r['threads']} thread(s); bench.trl_real's step: 8 "
        "prompts x 4 completions of 32 tokens, micro-batches of 16), each variant in a fresh "
        "process: a warm-up step, a step under torch.profiler, then the same step without it. "
        "Shares are of the profiled phase's wall time, from torch.profiler's self CPU times; "
        "they, and every time, vary by CPU (its bf16 units) and torch build.",
        "",
        "| phase | compute | wall s | matmul | attention | other ops | outside ops |",
        "|---|---|---|---|---|---|---|",
    ]
    for dtype, res in v.items():
        for phase in ("sample", "update"):
            p = res[phase]
            lines.append(
                f"| {phase} | {dtype} | {p['s']:.2f} | {100 * p['matmul_share']:.0f}% | "
                f"{100 * p['attention_share']:.0f}% | {100 * p['other_ops_share']:.0f}% | "
                f"{100 * p['outside_ops_share']:.0f}% |"
            )
    base = v["f32"]["plain"]["update"]
    lines += [
        "",
        "Without the profiler: the update's wall time, and its ratio to f32's, in this run:",
        "",
        "| compute | update s | / f32 | step s |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {label} | {res['plain']['update']:.2f} | {res['plain']['update'] / base:.2f} | "
        f"{res['plain']['step']:.2f} |"
        for label, res in v.items()
    ]
    for dtype, res in v.items():
        lines += [
            "",
            f"Top ops of the update, {dtype}:",
            "",
            "| op | calls | s | share |",
            "|---|---|---|---|",
        ]
        for e in res["update"]["top_ops"]:
            lines.append(f"| `{e['op']}` | {e['calls']} | {e['s']:.3f} | {100 * e['share']:.1f}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    from bench.trl_real import available

    why = available()
    if why:
        print(f"skipped: {why}", file=sys.stderr)
        return 2
    r = measure(args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(r, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(r))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child_main(sys.argv[2])
    else:
        sys.exit(main())
