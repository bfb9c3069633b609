"""The lm-head and log-softmax of one SmolLM2-135M update batch: whole (tokens x vocab) logits
against ftis's chunked head (`ftis.models.logprobs.chunked_token_logprobs`), forward and
backward, in f32 and under bf16 autocast (issue 51, item 2).

    python -m bench.head_logprobs            # 2700 tokens x 576 hidden x 49,152 vocab
    python -m bench.head_logprobs --tokens 512

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
    print(f"{'head':<8} {'dtype':<5} {'peak RSS added (MiB)':>21} {'median (s)':>11}")
    for r in rows:
        print(f"{r['mode']:<8} {r['dtype']:<5} {r['peak_rss_added_mib']:>21} {r['median_s']:>11}")
    return rows


if __name__ == "__main__":
    main()
