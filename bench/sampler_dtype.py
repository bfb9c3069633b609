"""The bf16 sampler against the f32 one, and against what a user would write (transformers'
`generate`), side by side in one run (issue 38; `train.sampler_dtype: bfloat16`).

    python -m bench.sampler_dtype          # writes docs/results/bf16-sampler.md and .json
    python -m bench.sampler_dtype --quick  # llama-20m only, one thread, 2 repetitions

Each model samples 8 prompts x 4 completions of exactly 64 new tokens (EOS never ends a
sequence, so every variant does the same work), temperature 1. Variants, interleaved within
each repetition so that load on the machine hits them alike: ftis's sampler on the f32 model;
ftis's sampler on the bf16 copy a node keeps (`SamplerCopy`, its refresh from the f32 weights
included in the time, as in training); `generate` on the f32 model; `generate` on a bf16 model.
Times are medians over the repetitions, in seconds; ratios are bf16 / f32. SmolLM2-135M runs
when it is in ftis's cache (`ftis models fetch smollm2-135m-instruct`), else it is skipped with
the reason. What varies by machine: everything but the token counts; a CPU without bf16 units
(the header says whether this one has them) gains little or loses.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench.common import cpu_bf16_units, cpu_model, median
from ftis.study.runner import code_version

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "results" / "bf16-sampler"
PROMPTS, SAMPLES, PROMPT_LEN, NEW = 8, 4, 48, 64
VARIANTS = ("ftis f32", "ftis bf16", "generate f32", "generate bf16")


def _models(quick: bool) -> list[tuple[str, object, str | None]]:
    """(label, ModelConfig, why skipped)."""
    from ftis.models.config import ModelConfig

    out = [("llama-20m", ModelConfig(preset="llama-20m"), None)]
    if quick:
        return out
    from ftis.models.real import named_entry, read_manifest
    from ftis.models.sources import named_model

    name = "smollm2-135m-instruct"
    why = None
    if read_manifest(named_entry(named_model(name))) is None:
        why = f"not in ftis's cache: run `ftis models fetch {name}` first"
    out.append(("SmolLM2-135M", ModelConfig(name=name), why))
    return out


def _variants(model, vocab: int):
    from ftis.models.precision import SamplerCopy
    from ftis.rollout.sampler import sample

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (PROMPTS, PROMPT_LEN), generator=g).tolist()
    noise = torch.rand(PROMPTS * SAMPLES, NEW, generator=g)
    copy = SamplerCopy(torch.bfloat16)
    bf16_model = copy.synced(model)  # made once, as a node makes it at its first rollout
    hf_bf16 = bf16_model  # the same weights for `generate`

    def ftis(m):
        def run():
            sample(
                m(),
                prompts,
                num_samples=SAMPLES,
                max_new_tokens=NEW,
                eos_id=-1,
                pad_id=0,
                temperature=1.0,
                noise=noise,
            )

        return run

    ids = torch.tensor(prompts)

    def generate(m):
        def run():
            with torch.no_grad():
                m.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    num_return_sequences=SAMPLES,
                    max_new_tokens=NEW,
                    min_new_tokens=NEW,
                    pad_token_id=0,
                )

        return run

    return {
        "ftis f32": ftis(lambda: model),
        "ftis bf16": ftis(lambda: copy.synced(model)),  # the refresh is part of the cost
        "generate f32": generate(model),
        "generate bf16": generate(hf_bf16),
    }


def measure(quick: bool) -> dict:
    from ftis.models.loading import build_model

    reps = 2 if quick else 3
    thread_counts = [1] if quick else sorted({1, torch.get_num_threads()})
    rows, skipped = [], []
    for label, cfg, why in _models(quick):
        if why is not None:
            skipped.append({"model": label, "why": why})
            continue
        model = build_model(cfg).eval()
        vocab = model.config.vocab_size
        params = sum(p.numel() for p in model.parameters())
        runs = _variants(model, vocab)
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for fn in runs.values():  # warm-up: first calls allocate and pick kernels
                fn()
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for _ in range(reps):
                for v in VARIANTS:
                    t0 = time.perf_counter()
                    runs[v]()
                    times[v].append(time.perf_counter() - t0)
            med = {v: median(times[v]) for v in VARIANTS}
            rows.append(
                {
                    "model": label,
                    "parameters": params,
                    "threads": threads,
                    "seconds": med,
                    "all_seconds": times,
                    "ftis_ratio": med["ftis bf16"] / med["ftis f32"],
                    "generate_ratio": med["generate bf16"] / med["generate f32"],
                    "ftis_bf16_vs_generate_bf16": med["ftis bf16"] / med["generate bf16"],
                }
            )
    return {
        "commit": code_version(),  # the checkout, "+dirty" when src/ has uncommitted edits
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "bf16_units": cpu_bf16_units(),
        "reps": reps,
        "rows": rows,
        "skipped": skipped,
    }


def markdown(r: dict) -> str:
    units = r["bf16_units"]
    if units in (None, "none"):
        units = "none found in /proc/cpuinfo: expect little or no gain"
    lines = [
        "# The bf16 sampler on CPU",
        "",
        f"Generated by `python -m bench.sampler_dtype` at commit `{r['commit']}` (torch "
        f"{r['torch']}); do not edit by hand. CPU: {r['cpu']}; bf16 units: {units}. "
        f"{PROMPTS} prompts x {SAMPLES} completions of exactly {NEW} new tokens (prompts of "
        f"{PROMPT_LEN} tokens), temperature 1; median of {r['reps']} interleaved repetitions, "
        "seconds. 'ftis bf16' samples from the bf16 copy a node keeps and includes refreshing "
        "it from the f32 weights, as every rollout does; `generate` is transformers' own "
        "sampling loop on the same weights (f32, and cast to bf16), the baseline a user would "
        "write.",
        "",
        "| model | threads | ftis f32 | ftis bf16 | bf16 / f32 | generate f32 | generate bf16 "
        "| bf16 / f32 | ftis bf16 / generate bf16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        s = row["seconds"]
        lines.append(
            f"| {row['model']} ({row['parameters'] / 1e6:.1f}M) | {row['threads']} | "
            f"{s['ftis f32']:.2f} | {s['ftis bf16']:.2f} | **{row['ftis_ratio']:.3f}** | "
            f"{s['generate f32']:.2f} | {s['generate bf16']:.2f} | {row['generate_ratio']:.3f} | "
            f"{row['ftis_bf16_vs_generate_bf16']:.3f} |"
        )
    for s in r["skipped"]:
        lines.append(f"| {s['model']} | - | skipped: {s['why']} | | | | | | |")
    lines += [
        "",
        "Targets (issue 38): bf16 / f32 of ftis's sampler at most 0.55 on SmolLM2-135M and 0.6 "
        "on llama-20m, on a CPU with bf16 units. Machines are noisy: the repetitions of each "
        "variant are in the .json beside this file.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="llama-20m only, 1 thread, 2 reps")
    args = p.parse_args(argv)
    r = measure(args.quick)
    text = markdown(r)
    if not args.quick:
        OUT.with_suffix(".json").write_text(json.dumps(r, indent=2) + "\n")
        OUT.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
