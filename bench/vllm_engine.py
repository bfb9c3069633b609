"""vLLM as the rollout engine against ftis's own bf16 sampler, side by side in one run, with the
decode floor measured in the same run (issue 52; `train.rollout_engine: vllm`).

    .venv-vllm/bin/python -m bench.vllm_engine                # all shapes; docs/results/vllm-engine.md
    .venv-vllm/bin/python -m bench.vllm_engine --shapes small  # 8 x 4 x 64 only

Needs vLLM (`FTIS_VLLM=1 bash scripts/setup.sh` makes .venv-vllm) and SmolLM2-135M in ftis's cache
(`ftis models fetch smollm2-135m-instruct`). Shapes (prompts x completions x new tokens):
`small` 8 x 4 x 64 (bench.sampler_dtype's), `forced` 64 x 8 x 256 with EOS ignored so every
completion runs to its length, `natural` 64 x 8 on reasoning-gym prompts (configs/smollm2.yaml's
task) with EOS ending completions at their own lengths, up to 256. Variants, interleaved in each
repetition: the vLLM engine in bf16 (the weight push before the rollout included, as in
training) and ftis's sampler on the bf16 copy a node keeps (its refresh included). Both run on
the same threads (the torch default, every core); nothing else should run on the machine.

The decode floor: one decode step's linear layers (every weight of the model once, at the
shape's rows, bf16, each on its own tensor so weights stream from memory as in decoding) timed
here, times the number of decode steps; attention and sampling excluded, so no engine can beat
it. What varies by machine: every time; the ratios less, but a CPU without AMX / AVX512-BF16
gains less from bf16 for both variants.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

from bench.common import cpu_bf16_units, cpu_model, median
from ftis.study.runner import code_version

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "results" / "vllm-engine"
SHAPES = {
    "small": {"prompts": 8, "samples": 4, "new": 64, "natural": False, "reps": 3},
    "forced": {"prompts": 64, "samples": 8, "new": 256, "natural": False, "reps": 1},
    "natural": {"prompts": 64, "samples": 8, "new": 256, "natural": True, "reps": 1},
}
PROMPT_LEN = 48  # random prompts of the two fixed shapes
MODEL = "smollm2-135m-instruct"


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _prompts(shape: dict, tok, vocab: int) -> list[list[int]]:
    if not shape["natural"]:
        g = torch.Generator().manual_seed(0)
        return torch.randint(3, vocab, (shape["prompts"], PROMPT_LEN), generator=g).tolist()
    from ftis.config import load_config
    from ftis.tasks import build_task

    task = build_task(load_config(ROOT / "configs" / "smollm2.yaml").task)
    problems = task.split("train")[: shape["prompts"]]
    return [task.prompt_ids(p, tok) for p in problems]


def _machine_rates(reps: int = 5) -> dict:
    """What this machine can do at best, measured now: memory read bandwidth (bytes/s, a sum over
    1 GiB of float32, far beyond any cache) and dense matmul throughput (FLOP/s, the best of a
    2048^3 product in bf16 and in f32)."""
    big = torch.ones(2**28)  # 1 GiB

    def best(fn) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return min(ts)

    bandwidth = big.numel() * 4 / best(lambda: big.sum())
    flops = 0.0
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(2048, 2048).to(dtype)
        flops = max(flops, 2 * 2048**3 / best(lambda a=a: a @ a))
    return {"bandwidth_bytes_s": bandwidth, "matmul_flops": flops}


def decode_floor(params: int, rows: int, steps: int, rates: dict) -> float:
    """Seconds no engine can beat: every decode step reads every bf16 weight once (memory) and
    multiplies it by the step's rows (2 x params x rows FLOP), whichever takes longer; attention,
    the KV cache's traffic and sampling excluded."""
    per_step = max(
        2 * params / rates["bandwidth_bytes_s"], 2 * params * rows / rates["matmul_flops"]
    )
    return per_step * steps


def measure(shapes: list[str]) -> dict:
    from ftis.models.config import ModelConfig
    from ftis.models.loading import build_model, load_tokenizer
    from ftis.models.precision import SamplerCopy
    from ftis.rollout.engine import EngineSettings, VllmEngine, completion_seed
    from ftis.rollout.sampler import sample

    commit = code_version()  # at the start: the code this run imported
    cfg = ModelConfig(name=MODEL)
    tok = load_tokenizer(cfg)
    model = build_model(cfg).eval()
    rss_trainer = _rss_gib()
    need = max(SHAPES[s]["new"] + 400 for s in shapes)
    t0 = time.perf_counter()
    engine = VllmEngine(
        model, tok, EngineSettings(dtype="bfloat16", kv_cache_gib=4, max_model_len=need)
    )
    start_s = time.perf_counter() - t0
    rss_engine = _rss_gib() - rss_trainer
    copy = SamplerCopy(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    rates = _machine_rates()
    rows = []
    for name in shapes:
        shape = SHAPES[name]
        prompts = _prompts(shape, tok, model.config.vocab_size)
        n_rows = len(prompts) * shape["samples"]
        seeds = [
            [completion_seed(0, 1, i, k) for k in range(shape["samples"])]
            for i in range(len(prompts))
        ]
        eos = tok.eos_token_id if shape["natural"] else -1
        noise = torch.rand(n_rows, shape["new"], generator=torch.Generator().manual_seed(0))
        out: dict[str, dict] = {}

        def run_vllm(prompts=prompts, seeds=seeds, shape=shape):
            push = engine.push(model)
            t = time.perf_counter()
            s = engine.sample(
                prompts,
                seeds,
                max_new_tokens=shape["new"],
                eos_id=tok.eos_token_id,
                pad_id=tok.pad_token_id,
                temperature=1.0,
                stop_at_eos=shape["natural"],
            )
            return s, push, time.perf_counter() - t

        def run_ftis(prompts=prompts, shape=shape, eos=eos, noise=noise):
            t = time.perf_counter()
            m = copy.synced(model)
            push = time.perf_counter() - t
            s = sample(
                m,
                prompts,
                num_samples=shape["samples"],
                max_new_tokens=shape["new"],
                eos_id=eos,
                pad_id=tok.pad_token_id,
                temperature=1.0,
                noise=noise,
            )
            return s, push, time.perf_counter() - t - push

        variants = {"vllm bf16": run_vllm, "ftis bf16": run_ftis}
        if name == "small":
            for fn in variants.values():  # warm-up at the small shape only
                fn()
        times = {v: [] for v in variants}
        pushes = {v: [] for v in variants}
        tokens = {v: 0 for v in variants}
        steps = {v: 0 for v in variants}
        for _ in range(shape["reps"]):
            for v, fn in variants.items():
                t = time.perf_counter()
                s, push, _gen = fn()
                times[v].append(time.perf_counter() - t)
                pushes[v].append(push)
                tokens[v] = int(s.lengths.sum())
                steps[v] = int(s.lengths.max())
        for v in variants:
            out[v] = {
                "seconds": median(times[v]),
                "all_seconds": times[v],
                "push_seconds": median(pushes[v]),
                "tokens": tokens[v],
                "decode_steps": steps[v],
                "tokens_per_s": tokens[v] / median(times[v]),
            }
        rows.append(
            {
                "shape": name,
                **{k: shape[k] for k in ("prompts", "samples", "new", "natural", "reps")},
                "variants": out,
                "floor_s": decode_floor(params, n_rows, max(steps.values()), rates),
                "speedup": out["ftis bf16"]["seconds"] / out["vllm bf16"]["seconds"],
            }
        )
        print(f"{name}: {json.dumps(rows[-1]['variants'])}", file=sys.stderr, flush=True)
    engine.close()
    import vllm

    return {
        "commit": commit,
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "cpu": cpu_model(),
        "bf16_units": cpu_bf16_units(),
        "threads": torch.get_num_threads(),
        "engine_start_s": start_s,
        "trainer_rss_gib": rss_trainer,
        "engine_rss_gib": rss_engine,
        "parameters": params,
        "rates": rates,
        "rows": rows,
    }


def markdown(r: dict) -> str:
    lines = [
        "# vLLM as the rollout engine, on CPU",
        "",
        f"Generated by `.venv-vllm/bin/python -m bench.vllm_engine` at commit `{r['commit']}` "
        f"(torch {r['torch']}, vLLM {r['vllm']}, {r['threads']} threads); do not edit by hand. "
        f"CPU: {r['cpu']}; bf16 units: {r['bf16_units']}. SmolLM2-135M-Instruct, temperature 1. "
        "'vllm bf16' is the engine in the trainer's process with the weight push before each "
        "rollout included; 'ftis bf16' is ftis's own sampler on the bf16 copy a node keeps, its "
        "refresh included. Seconds are medians over the repetitions (interleaved). The floor: "
        "per decode step, reading every bf16 weight once at this machine's memory bandwidth "
        f"({r['rates']['bandwidth_bytes_s'] / 1e9:.1f} GB/s, measured in this run) or "
        "multiplying it by the step's rows at its best dense matmul rate "
        f"({r['rates']['matmul_flops'] / 1e9:.0f} GFLOP/s, measured), whichever is longer, "
        "times the decode steps; attention, the KV cache and sampling excluded.",
        "",
        "| shape | tokens | vllm bf16 s | ftis bf16 s | **vLLM speed-up** | vllm tok/s | "
        "floor s | vllm / floor | ftis / floor | push s (vllm) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        v, f = row["variants"]["vllm bf16"], row["variants"]["ftis bf16"]
        shape = f"{row['prompts']} x {row['samples']} x {row['new']}" + (
            " natural (reasoning-gym, EOS)" if row["natural"] else " (to length)"
        )
        lines.append(
            f"| {row['shape']}: {shape} | {v['tokens']} | {v['seconds']:.1f} | "
            f"{f['seconds']:.1f} | **{row['speedup']:.2f}x** | {v['tokens_per_s']:.0f} | "
            f"{row['floor_s']:.1f} | {v['seconds'] / row['floor_s']:.1f} | "
            f"{f['seconds'] / row['floor_s']:.1f} | {v['push_seconds']:.2f} |"
        )
    lines += [
        "",
        f"Engine start-up: {r['engine_start_s']:.1f} s (writing the start-up directory, "
        "loading, warming up). Resident memory: the trainer's model "
        f"{r['trainer_rss_gib']:.2f} GiB, the engine's on top {r['engine_rss_gib']:.2f} GiB "
        "(peak RSS growth; its KV cache is reserved as train.vllm.kv_cache_gib, 4 GiB here).",
        "",
        "Targets (issue 52): vLLM over ftis's bf16 sampler >= 2x at the two larger shapes; the "
        "weight push <= 0.1x of a training step. The repetitions are in the .json beside this "
        "file.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="small,forced,natural", help="comma-separated shapes")
    p.add_argument("--out", default=str(OUT), help="path without suffix for .md and .json")
    args = p.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        p.error(f"unknown shape(s) {bad}; choose from {', '.join(SHAPES)}")
    r = measure(shapes)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(r, indent=2))
    out.with_suffix(".md").write_text(markdown(r))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
