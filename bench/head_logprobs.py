"""The lm-head and log-softmax of one SmolLM2-135M update batch: whole (tokens x vocab) logits
against ftis's chunked head (`ftis.models.logprobs.chunked_token_logprobs`), forward and
backward, in f32 and under bf16 autocast (issue 51, item 2).

    python -m bench.head_logprobs            # 2700 tokens x 576 hidden x 49,152 vocab
    python -m bench.head_logprobs --tokens 512
    python -m bench.head_logprobs --out docs/results/chunked-head   # also writes .json and .md

Each variant runs in a fresh interpreter (peak RSS is per process), one thread; it prints the
peak resident memory the head's forward and backward added above the process's memory before
them, and the median time of --reps passes. The shapes are SmolLM2-135M's (random weights: the
work does not depend on their values). What varies by machine: the times, and under bf16 the
speed (a CPU without bf16 units gains nothing); the memory follows from the shapes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HIDDEN, VOCAB = 576, 49152
VARIANTS = (("whole", "f32"), ("chunked", "f32"), ("whole", "bf16"), ("chunked", "bf16"))


def _one(mode: str, dtype: str, tokens: int, reps: int) -> dict:
    import resource
    import statistics
    import time

    import torch

    from ftis.models.logprobs import chunked_token_logprobs, gather_logprobs

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, tokens, HIDDEN, generator=g, requires_grad=True)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.02).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (1, tokens), generator=g)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(reps):
        hidden.grad = weight.grad = None
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            if mode == "whole":
                out = gather_logprobs(torch.nn.functional.linear(hidden, weight), targets)
            else:
                out = chunked_token_logprobs(hidden, weight, targets)
        out.sum().backward()
        times.append(time.perf_counter() - t0)
        del out
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "mode": mode,
        "dtype": dtype,
        "peak_rss_added_mib": round((peak - before) / 1024, 1),
        "median_s": round(statistics.median(times), 4),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2700)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    ap.add_argument("--one", nargs=2, metavar=("MODE", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(_one(*args.one, args.tokens, args.reps)))
        return []
    rows = []
    for mode, dtype in VARIANTS:
        cmd = [sys.executable, "-m", "bench.head_logprobs", "--one", mode, dtype]
        cmd += ["--tokens", str(args.tokens), "--reps", str(args.reps)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    table = ["| head | dtype | peak RSS added (MiB) | median (s) |", "|---|---|---:|---:|"]
    table += [
        f"| {r['mode']} | {r['dtype']} | {r['peak_rss_added_mib']} | {r['median_s']} |"
        for r in rows
    ]
    print("\n".join(table))
    if args.out is not None:
        from bench.common import environment

        env = environment()
        env["threads"] = "1"  # each variant's interpreter sets one thread
        record = {"tokens": args.tokens, "reps": args.reps, "environment": env, "rows": rows}
        args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
        cmd = f"python -m bench.head_logprobs --tokens {args.tokens} --reps {args.reps}"
        head = __doc__.split("\n\n")[0]
        lines = [
            "# Chunked lm-head: memory and time",
            "",
            f"Written by `{cmd} --out {args.out}`. {head}",
            "",
            f"{args.tokens} tokens x {HIDDEN} hidden x {VOCAB} vocabulary, one thread, median of"
            f" {args.reps} passes. Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()),
            "",
            *table,
            "",
        ]
        args.out.with_suffix(".md").write_text("\n".join(lines))
    return rows


if __name__ == "__main__":
    main()
