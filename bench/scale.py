"""Realistic scale: a 23M-parameter Llama (`llama-20m`, random init) at 64 and 256 completion
tokens, G = 8, 8 prompts, on the machine's own limit.

Measured side by side in one `ftis bench` run, every measured run in a fresh process that reports
its own peak memory (VmHWM of /proc/self/status, read inside that process):

- one GRPO step (sample + score + update, one optimizer step per generation round) in ftis vs
  TRL's `GRPOTrainer`: same preset and init seed (identical weights), prompts, G, length,
  AdamW, lr, grad clip, micro-batches of 16 sequences (TRL: per-device batch 16, gradient
  accumulation 4, one generation round per optimizer step). EOS is suppressed on both sides so
  every completion has exactly `length` tokens, and the reward is a synthetic one that varies
  within every group (the share of digits in the completion text): a random model never solves
  the task, and all-zero rewards would let ftis skip the update altogether;
- rollout with per-token log-probs: ftis's sampler vs HF `generate(output_logits=True)` with the
  log-probs gathered from its logits in one pass (the strongest plain-HF baseline), and vs
  `generate` followed by a separate scoring forward pass;
- the machine's dense matmul throughput, measured with torch matmuls at the model's linear shapes
  (the update's micro-batch token count, and the sampler's N rows), and the utilisation (model
  FLOPs / s over that peak) of the update and sampling phases;
- a torch.profiler profile of one ftis step: where its sampling and update time goes.

Each measurement is `python -m bench.scale '<json>'` in its own process; the parent only
orchestrates and reads one JSON line back.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LR = 1e-5


@dataclass(frozen=True)
class ScaleConfig:
    """One realistic-scale configuration (the full bench's and the quick one differ in lengths
    and repetitions only)."""

    preset: str = "llama-20m"
    prompts: int = 8  # B
    group: int = 8  # G
    micro_batch: int = 16  # sequences per forward/backward in the update (both sides)
    lengths: tuple[int, ...] = (64, 256)
    steps: int = 2  # measured training steps per process (after `warmup`)
    warmup: int = 1
    rounds: int = 2  # processes per side, ftis and TRL alternating
    rollout_reps: int = 2  # measured rollouts per process (after one warm-up)
    profile_length: int = 64
    ablation: bool = True  # also time the sampler with DynamicCache and with forward per step
    bf16: bool = True  # also one ftis and one TRL step process in bf16 at the first length


FULL = ScaleConfig(steps=3, rounds=1, rollout_reps=3)
QUICK = ScaleConfig(lengths=(64,), steps=1, rounds=1, rollout_reps=1, ablation=False)
# For tests: tiny shapes, same code paths.
TINY = ScaleConfig(
    preset="llama-xs", prompts=2, group=2, micro_batch=2, lengths=(4,), steps=1, warmup=1,
    rounds=1, rollout_reps=1, profile_length=4, ablation=False,
)  # fmt: skip
# (the ablation workers are each run by tests/test_bench_scale.py; TINY skips their processes)


# ----------------------------------------------------------------------------- in the child


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM), MiB. Unlike getrusage's ru_maxrss, VmHWM
    belongs to the process's own address space: nothing of the parent's carries over through
    fork + exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def digit_share_rewards(texts: list[str]) -> list[float]:
    """The synthetic reward both trainers use: the share of digits in the completion."""
    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in texts]


def _prompts(tok, n: int) -> list[list[int]]:
    from bench.common import TASK
    from ftis.tasks import build_task

    task = build_task(TASK)
    train = task.split("train")
    return [task.prompt_ids(train[i], tok) for i in range(n)]


def _prompt_width(c: ScaleConfig) -> int:
    """The longest of the bench's prompts, in tokens (the sampler's left-padded width)."""
    from ftis.models.presets import preset_tokenizer

    return max(len(p) for p in _prompts(preset_tokenizer(c.preset), c.prompts))


def _model(preset: str):
    from ftis.models.loading import ModelConfig, build_model, load_tokenizer

    cfg = ModelConfig(preset=preset)
    return build_model(cfg), load_tokenizer(cfg)


def model_shape(preset: str) -> dict[str, int]:
    from ftis.models.presets import PRESETS
    from ftis.models.tokenizer import char_tokenizer

    p = PRESETS[preset]
    return dict(
        layers=p.layers,
        hidden=p.hidden,
        heads=p.heads,
        kv_heads=p.kv_heads,
        intermediate=p.intermediate,
        vocab=len(char_tokenizer()),
    )


def linear_shapes(preset: str) -> list[tuple[int, int, int]]:
    """(in, out, count) of every matmul with weights: per layer q, k, v, o, gate, up, down
    (count = layers), and the LM head (count 1)."""
    s = model_shape(preset)
    d, hd = s["hidden"], s["hidden"] // s["heads"]
    q, kv, f = s["heads"] * hd, s["kv_heads"] * hd, s["intermediate"]
    L = s["layers"]
    return [(d, q, L), (d, kv, 2 * L), (q, d, L), (d, f, 2 * L), (f, d, L), (d, s["vocab"], 1)]


def forward_flops(preset: str, *, tokens: int, logits: int, attended: int) -> float:
    """Model FLOPs of a forward pass: 2 per weight per token for the layers, 2 * d * V per
    position whose logits are computed, and 4 * d per (query, key) pair per layer (QK^T and AV).
    `attended` = number of (query, key) pairs over the pass."""
    s = model_shape(preset)
    per_token = sum(2 * i * o * c for i, o, c in linear_shapes(preset)[:-1])
    return (
        per_token * tokens
        + 2 * s["hidden"] * s["vocab"] * logits
        + 4 * s["hidden"] * s["layers"] * attended
    )


def update_flops(preset: str, prompt_lens: list[int], n: int, length: int) -> float:
    """Model FLOPs of ftis's update on N = n completions of `length` tokens: each unique prompt
    once, the completions on top of its cache; backward = 2x forward."""
    P = max(prompt_lens)
    fwd = forward_flops(
        preset,
        tokens=sum(prompt_lens),
        logits=len(prompt_lens),
        attended=sum(p * (p + 1) // 2 for p in prompt_lens),
    ) + forward_flops(
        preset,
        tokens=n * (length - 1),
        logits=n * (length - 1),
        attended=n * sum(P + t + 1 for t in range(length - 1)),
    )
    return 3.0 * fwd


def sample_flops(preset: str, prompt_lens: list[int], group: int, length: int) -> float:
    """Model FLOPs of sampling `group` completions of `length` tokens per prompt: the prompts
    (repeated per completion, as the sampler runs them) and every decode step."""
    P = max(prompt_lens)
    n = len(prompt_lens) * group
    return forward_flops(
        preset,
        tokens=group * sum(prompt_lens),
        logits=n,
        attended=group * sum(p * (p + 1) // 2 for p in prompt_lens),
    ) + forward_flops(
        preset,
        tokens=n * (length - 1),
        logits=n * (length - 1),
        attended=n * sum(P + t + 1 for t in range(length - 1)),
    )


def _ftis_round(
    node, task, prompts, *, cfg: dict, step: int, timings: dict | None = None, phase=None
):
    """One ftis GRPO step: sample (EOS suppressed), score, advantages, update. `phase(name)`:
    a context manager factory wrapped around the sample and update phases (the profiler)."""
    import contextlib

    import torch

    phase = phase or (lambda name: contextlib.nullcontext())

    from ftis.config import LossConfig
    from ftis.core.advantages import group_advantages
    from ftis.rollout.sampler import decode_completions, sample
    from ftis.rollout.types import RolloutBatch
    from ftis.train import update as update_mod

    B, G, T = len(prompts), cfg["group"], cfg["length"]
    tok = node.tokenizer
    c0 = time.process_time()
    t0 = time.perf_counter()
    with phase("sample"):
        s = sample(
            # train.sampler_dtype bfloat16: the node's bf16 copy, refreshed from its weights
            # (the refresh is part of the sampling time, as in training)
            node.sampling_model(cfg.get("sampler_dtype", "float32")),
            prompts,
            num_samples=G,
            max_new_tokens=T,
            eos_id=-1,
            pad_id=tok.pad_token_id,
            generator=torch.Generator().manual_seed(step),
        )
    batch = RolloutBatch(
        prompt_index=torch.arange(B).repeat_interleave(G),
        generator=torch.zeros(B * G, dtype=torch.long),
        completion_ids=s.completion_ids,
        lengths=s.lengths,
        sampler_logprobs=s.logprobs,
    )
    t1, c1 = time.perf_counter(), time.process_time()
    rewards = torch.tensor(
        digit_share_rewards(decode_completions(tok, s.completion_ids, s.lengths))
    )
    adv = group_advantages(rewards.view(B, G), scale="std").flatten()
    t2, c2 = time.perf_counter(), time.process_time()
    with phase("update"):
        update_mod.update(
            node,
            task,
            batch,
            adv,
            loss_cfg=LossConfig(method="grpo"),
            micro_batch_size=cfg["micro_batch"],
        )
    t3, c3 = time.perf_counter(), time.process_time()
    if timings is not None:
        for k, v in (
            ("sample", t1 - t0),
            ("score", t2 - t1),
            ("update", t3 - t2),
            ("step", t3 - t0),
            ("sample_cpu", c1 - c0),
            ("score_cpu", c2 - c1),
            ("update_cpu", c3 - c2),
            ("step_cpu", c3 - c0),
        ):
            timings.setdefault(k, []).append(v)


def _ftis_node(cfg: dict):
    from bench.common import TASK
    from ftis.config import LossConfig, NodeConfig, OptimConfig
    from ftis.models.loading import ModelConfig
    from ftis.tasks import build_task
    from ftis.train.node import Node, build_optimizer

    task = build_task(TASK)
    node_cfg = NodeConfig(
        name="bench",
        model=ModelConfig(preset=cfg["preset"], compute_dtype=cfg.get("compute_dtype", "float32")),
        optim=OptimConfig(lr=LR),
        loss=LossConfig(method="grpo"),
    )
    model, tok = _model(cfg["preset"])
    node = Node(
        cfg=node_cfg,
        rank=0,
        model=model,
        tokenizer=tok,
        optimizer=build_optimizer(model, node_cfg.optim),
    )
    # The task's train problems 0..B-1 (`update` rebuilds prompts from prompt_index).
    return node, task, _prompts(tok, cfg["prompts"])


def ftis_step(cfg: dict) -> dict:
    node, task, prompts = _ftis_node(cfg)
    timings: dict[str, list[float]] = {}
    for step in range(cfg["warmup"] + cfg["steps"]):
        _ftis_round(
            node,
            task,
            prompts,
            cfg=cfg,
            step=step,
            timings=timings if step >= cfg["warmup"] else None,
        )
    lens = [len(p) for p in prompts]
    return {
        **timings,
        "update_flops": update_flops(
            cfg["preset"], lens, len(prompts) * cfg["group"], cfg["length"]
        ),
        "sample_flops": sample_flops(cfg["preset"], lens, cfg["group"], cfg["length"]),
    }


def trl_step(cfg: dict) -> dict:
    from bench.common import TASK, step_timer, train_trl_grpo
    from ftis.tasks import build_task

    # bf16: TRL's bf16=True (autocast to bf16, f32 weights and optimizer), against ftis's
    # model.compute_dtype bfloat16 (the same mixed precision).
    bf16 = cfg.get("compute_dtype", "float32") == "bfloat16"
    model, tok = _model(cfg["preset"])
    train = build_task(TASK).split("train")
    B, G, T = cfg["prompts"], cfg["group"], cfg["length"]
    total = cfg["warmup"] + cfg["steps"]
    # The same B prompts every step, as on the ftis side.
    rows = [
        {"prompt": tok.bos_token + train[i].question} for _ in range(total + 1) for i in range(B)
    ]

    def reward(completions, **_):
        return digit_share_rewards(completions)

    timer, times, cpu = step_timer()

    mb = cfg["micro_batch"]
    train_trl_grpo(
        model,
        tok,
        rows,
        reward,
        lr=LR,
        callback=timer,
        bf16=bf16,
        logging_strategy="no",
        per_device_train_batch_size=mb,
        gradient_accumulation_steps=B * G // mb,
        steps_per_generation=B * G // mb,
        num_generations=G,
        max_completion_length=T,
        # every completion exactly T tokens, as on the ftis side
        generation_kwargs={"min_new_tokens": T},
        max_steps=total,
    )
    return {"step": times[cfg["warmup"] :], "step_cpu": cpu[cfg["warmup"] :]}


def _hf_generate(model, ids, mask, *, length: int, pad_id: int, one_pass: bool):
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=length,
        eos_token_id=None,  # never stops early: exactly `length` tokens, as ftis with eos_id=-1
        pad_token_id=pad_id,
        output_logits=one_pass,
        return_dict_in_generate=one_pass,
    )


def rollout(cfg: dict) -> dict:
    import torch

    from ftis.models.logprobs import completion_logprobs, gather_logprobs
    from ftis.rollout.sampler import left_pad, sample

    model, tok = _model(cfg["preset"])
    model.eval()
    prompts = _prompts(tok, cfg["prompts"])
    G, T, pad = cfg["group"], cfg["length"], tok.pad_token_id
    method = cfg["method"]
    gen = torch.Generator().manual_seed(0)

    if method == "ftis_dynamic_cache":
        # Ablation: the sampler with transformers' DynamicCache (grown by torch.cat every step),
        # what ftis used before the preallocated cache (rollout/cache.py).
        from transformers import DynamicCache

        import ftis.rollout.sampler as sampler_mod

        sampler_mod.preallocated_cache = lambda capacity: DynamicCache()
    if method == "ftis_forward":
        # Ablation: the sampler calling the model's forward for every decode step instead of
        # its direct decode step (rollout/decode.py), as ftis did before.
        import ftis.rollout.sampler as sampler_mod

        sampler_mod.decode_step = lambda model, attention: None

    @torch.no_grad()
    def once():
        if method in ("ftis", "ftis_dynamic_cache", "ftis_forward"):
            return sample(
                model,
                prompts,
                num_samples=G,
                max_new_tokens=T,
                eos_id=-1,
                pad_id=pad,
                generator=gen,
            ).logprobs
        ids, mask = left_pad([p for p in prompts for _ in range(G)], pad)
        if method == "hf_one_pass":
            out = _hf_generate(model, ids, mask, length=T, pad_id=pad, one_pass=True)
            # raw logits of every step, (N, T, V); temperature 1, no top-k/p: the sampled
            # distribution, so this is the sampler's log-prob of each token
            logits = torch.stack(out.logits, dim=1)
            return gather_logprobs(logits, out.sequences[:, ids.shape[1] :])
        out = _hf_generate(model, ids, mask, length=T, pad_id=pad, one_pass=False)
        comp = out[:, ids.shape[1] :]
        return completion_logprobs(
            model,
            prompt_ids=ids,
            prompt_mask=mask,
            completion_ids=comp,
            completion_mask=torch.ones_like(comp),
        )

    times, cpu = [], []
    for r in range(cfg["reps"] + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        lp = once()
        if r:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    assert lp.shape == (len(prompts) * G, T), lp.shape
    return {"s": times, "cpu_s": cpu}


def matmul_peak(cfg: dict) -> dict:
    """Dense matmul throughput at the model's linear shapes, FLOP/s.

    `update`: M = the update's tokens per micro-batch, forward (x W^T) and both backward products
    (dY W and dY^T X) of every linear shape; `decode`: M = N rows, forward only. For each, the
    best shape is the machine's peak here, and `*_floor_s` is the time every linear matmul of
    one update / one rollout would take at its measured speed (attention, norms, activations,
    the optimizer and Python excluded): the floor a perfect implementation could approach.

    Each shape is timed alone, over and over, so its weight stays in the CPU's caches. A decode
    step cannot do that: it multiplies every weight of the model once (94 MB in f32 at
    `llama-20m`, more than the L3 of most CPUs), so its weights stream from memory. Hence
    `decode_streamed_floor_s`: one decode step's linear matmuls in the model's order, each on
    its own weight tensor (as many as the model has), timed as a whole; the floor of a rollout
    that has to read its weights every step."""
    import torch

    def bench(fn, flops: float) -> tuple[float, float]:
        fn()
        ts = []
        for _ in range(cfg["reps"]):
            t0 = time.process_time()
            fn()
            ts.append(time.process_time() - t0)
        ts.sort()
        t = ts[len(ts) // 2]
        return flops / t, t

    import ftis.models.loading as loading

    shapes = linear_shapes(cfg["preset"])
    dtype = loading.DTYPES[cfg.get("dtype", "float32")]
    out: dict[str, float] = {}
    g = torch.Generator().manual_seed(0)
    for name, m, backward in (
        ("update", cfg["update_tokens"], True),
        ("decode", cfg["decode_rows"], False),
    ):
        best, floor = 0.0, 0.0
        for i, o, count in shapes:
            x = torch.randn(m, i, generator=g).to(dtype)
            w = torch.randn(o, i, generator=g).to(dtype)
            dy = torch.randn(m, o, generator=g).to(dtype)
            flops = 2.0 * m * i * o
            fns = [lambda x=x, w=w: torch.nn.functional.linear(x, w)]
            if backward:
                fns += [lambda dy=dy, w=w: dy @ w, lambda dy=dy, x=x: dy.t() @ x]
            for fn in fns:
                rate, t = bench(fn, flops)
                best, floor = max(best, rate), floor + t * count
        out[f"{name}_peak_flops"] = best
        out[f"{name}_floor_s"] = floor
    m = cfg["decode_rows"]
    xs = {i: torch.randn(m, i, generator=g).to(dtype) for i, _, _ in shapes}
    # Per layer q, k, v, o, gate, up, down (the order of linear_shapes), then the LM head.
    weights = []
    layers = model_shape(cfg["preset"])["layers"]
    for _ in range(layers):
        for i, o, count in shapes[:-1]:
            weights += [torch.randn(o, i, generator=g).to(dtype) for _ in range(count // layers)]
    i, o, _ = shapes[-1]
    weights.append(torch.randn(o, i, generator=g).to(dtype))

    def one_step():
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)

    out["decode_streamed_floor_s"] = bench(one_step, 1.0)[1]
    if cfg.get("context"):
        out["decode_attention_floor_s"] = _attention_floor(cfg, dtype, bench)
    return out


def _attention_floor(cfg: dict, dtype, bench) -> float:
    """One decode step's attention over a KV cache of `context` positions, every layer on its
    own keys and values: the two products alone (q K^T, then the weights times V, batched
    matmuls; no softmax, no mask), or torch's SDPA kernel if that is faster. A decode step must
    read the whole cache once per layer, so at long contexts this is memory traffic the size of
    the cache, on top of the weights'. The cost is linear in the context, so a rollout's is
    this step's, at the mean context, times its length."""
    import torch

    s = model_shape(cfg["preset"])
    n, ctx = cfg["decode_rows"], int(cfg["context"])
    hd = s["hidden"] // s["heads"]
    kv, g = s["kv_heads"], s["heads"] // s["kv_heads"]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(n, kv, g, hd, generator=gen).to(dtype)
    caches = [
        tuple(torch.randn(n, kv, ctx, hd, generator=gen).to(dtype) for _ in "kv")
        for _ in range(s["layers"])
    ]

    def products():
        for k, v in caches:
            torch.matmul(torch.matmul(q, k.transpose(-1, -2)), v)

    def sdpa():
        for k, v in caches:
            torch.nn.functional.scaled_dot_product_attention(q, k, v)

    return min(bench(products, 1.0)[1], bench(sdpa, 1.0)[1])


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")


def _is_attention(key: str) -> bool:
    return "scaled_dot_product" in key or "flash_attention" in key


def profile(cfg: dict) -> dict:
    """torch.profiler over one ftis step (after a warm-up step), the sampling and the update
    phases profiled apart: per phase, its wall time, the top ops by self CPU time, and the
    shares of matmuls, attention, other torch ops and time outside any torch op (Python, HF
    glue, allocation between ops)."""
    node, task, prompts = _ftis_node(cfg)
    return profile_node(node, task, prompts, cfg)


def profile_node(node, task, prompts, cfg: dict) -> dict:
    """`profile`'s measurement on a built node (bench.update_profile: SmolLM2)."""
    import contextlib

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    _ftis_round(node, task, prompts, cfg=cfg, step=0)
    profs: dict = {}

    @contextlib.contextmanager
    def phase(name):
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            yield
        profs[name] = prof

    timings: dict[str, list[float]] = {}
    _ftis_round(node, task, prompts, cfg=cfg, step=1, timings=timings, phase=phase)
    out: dict = {"step_s": timings["step"][0]}
    for name, prof in profs.items():
        wall = timings[name][0]
        ops = prof.key_averages()
        self_s = sum(e.self_cpu_time_total for e in ops) / 1e6
        matmul = sum(e.self_cpu_time_total for e in ops if e.key in MATMUL_OPS) / 1e6
        attn = sum(e.self_cpu_time_total for e in ops if _is_attention(e.key)) / 1e6
        top = sorted(ops, key=lambda e: -e.self_cpu_time_total)[:8]
        out[name] = {
            "s": wall,
            "top_ops": [
                {
                    "op": e.key,
                    "calls": e.count,
                    "s": e.self_cpu_time_total / 1e6,
                    "share": e.self_cpu_time_total / 1e6 / wall,
                }
                for e in top
            ],
            "matmul_share": matmul / wall,
            "attention_share": attn / wall,
            "other_ops_share": (self_s - matmul - attn) / wall,
            "outside_ops_share": max(wall - self_s, 0.0) / wall,
        }
    return out


WORKERS = {
    "ftis_step": ftis_step,
    "trl_step": trl_step,
    "rollout": rollout,
    "matmul_peak": matmul_peak,
    "profile": profile,
}


def _child_main(arg: str) -> None:
    import torch

    cfg = json.loads(arg)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = WORKERS[cfg["kind"]](cfg)
    result["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(result))


# ----------------------------------------------------------------------------- in the parent


def child(kind: str, **cfg) -> dict:
    """Run one measurement in a fresh process; its JSON result (with its own peak_rss_mb)."""
    from bench.common import json_child

    return json_child("bench.scale", json.dumps({"kind": kind, **cfg}))


def _median(xs: list[float]) -> float:
    from bench.common import median

    return median(xs)


ROLLOUTS = ("ftis", "hf_one_pass", "hf_two_pass", "ftis_dynamic_cache", "ftis_forward")


def ro_methods(ro: dict) -> list[str]:
    return [m for m in ROLLOUTS if m in ro]


def run(quick: bool, config: ScaleConfig | None = None) -> dict:
    """Every figure twice: `*_s` from the wall clock and `*_cpu_s` from the process's CPU
    time. With one thread per process the CPU time is the work itself, unaffected by other jobs
    taking the cores; ratios and utilisation use it (the matmul peak is measured the same way),
    the wall-clock ratios are reported beside them. FTIS_BENCH_SCALE=tiny runs TINY instead
    (the test suite's end-to-end check of `ftis bench --quick --json`: same code, seconds)."""
    if config is None and os.environ.get("FTIS_BENCH_SCALE") == "tiny":
        config = TINY
    c = config or (QUICK if quick else FULL)
    base = dict(preset=c.preset, prompts=c.prompts, group=c.group, micro_batch=c.micro_batch)
    out: dict = {"config": asdict(c), "params_m": _params_m(c.preset), "load_before": _load()}
    n = c.prompts * c.group
    for T in c.lengths:
        p = f"len{T}_"
        kw = dict(base, length=T, steps=c.steps, warmup=c.warmup)
        ours: dict[str, list[float]] = {}
        theirs: dict[str, list[float]] = {}
        for _ in range(c.rounds):
            r = child("ftis_step", **kw)
            for k in ("step", "sample", "score", "update"):
                for suffix in ("", "_cpu"):
                    ours.setdefault(k + suffix, []).extend(r[k + suffix])
            flops_u, flops_s = r["update_flops"], r["sample_flops"]
            out[p + "ftis_step_peak_rss_mb"] = max(
                out.get(p + "ftis_step_peak_rss_mb", 0), r["peak_rss_mb"]
            )
            r = child("trl_step", **kw)
            for k in ("step", "step_cpu"):
                theirs.setdefault(k, []).extend(r[k])
            out[p + "trl_step_peak_rss_mb"] = max(
                out.get(p + "trl_step_peak_rss_mb", 0), r["peak_rss_mb"]
            )
        for k, v in ours.items():
            out[p + f"ftis_{k.replace('_cpu', '')}_{'cpu_' if k.endswith('_cpu') else ''}s"] = (
                _median(v)
            )
        out[p + "trl_step_s"] = _median(theirs["step"])
        out[p + "trl_step_cpu_s"] = _median(theirs["step_cpu"])
        out[p + "trl_step_time_ratio"] = out[p + "ftis_step_cpu_s"] / out[p + "trl_step_cpu_s"]
        out[p + "trl_step_time_ratio_wall"] = out[p + "ftis_step_s"] / out[p + "trl_step_s"]
        out[p + "update_flops"] = flops_u
        out[p + "sample_flops"] = flops_s

        ro: dict[str, list[float]] = {}
        for _ in range(c.rounds):
            for method in ROLLOUTS if c.ablation else ROLLOUTS[:3]:
                r = child("rollout", **base, length=T, method=method, reps=c.rollout_reps)
                ro.setdefault(method, []).extend(r["s"])
                ro.setdefault(method + "_cpu", []).extend(r["cpu_s"])
                key = p + f"rollout_{method}_peak_rss_mb"
                out[key] = max(out.get(key, 0.0), r["peak_rss_mb"])
        for m in ro_methods(ro):
            out[p + f"rollout_{m}_s"] = _median(ro[m])
            out[p + f"rollout_{m}_cpu_s"] = _median(ro[m + "_cpu"])
            out[p + f"rollout_{m}_tokens_per_s"] = n * T / out[p + f"rollout_{m}_cpu_s"]
        for base_m, name in (
            ("hf_one_pass", "one_pass"),
            ("hf_two_pass", "two_pass"),
            ("ftis_dynamic_cache", "dynamic_cache"),
            ("ftis_forward", "forward_step"),
        ):
            if base_m not in ro:
                continue
            out[p + f"rollout_time_ratio_{name}"] = (
                out[p + "rollout_ftis_cpu_s"] / out[p + f"rollout_{base_m}_cpu_s"]
            )
            out[p + f"rollout_time_ratio_{name}_wall"] = (
                out[p + "rollout_ftis_s"] / out[p + f"rollout_{base_m}_s"]
            )

        peak = child(
            "matmul_peak",
            preset=c.preset,
            update_tokens=c.micro_batch * T,
            decode_rows=n,
            reps=5,
            context=_prompt_width(c) + T / 2,
        )
        out[p + "matmul_peak_flops"] = peak["update_peak_flops"]
        out[p + "matmul_decode_peak_flops"] = peak["decode_peak_flops"]
        out[p + "update_matmul_floor_s"] = peak["update_floor_s"] * n / c.micro_batch
        out[p + "sample_matmul_floor_s"] = peak["decode_floor_s"] * T
        out[p + "sample_streamed_floor_s"] = peak["decode_streamed_floor_s"] * T
        out[p + "sample_attention_floor_s"] = peak["decode_attention_floor_s"] * T
        out[p + "update_flops_per_s"] = flops_u / out[p + "ftis_update_cpu_s"]
        out[p + "update_mfu"] = out[p + "update_flops_per_s"] / peak["update_peak_flops"]
        out[p + "sample_flops_per_s"] = flops_s / out[p + "rollout_ftis_cpu_s"]
        out[p + "sample_mfu"] = out[p + "sample_flops_per_s"] / peak["update_peak_flops"]
        out[p + "sample_mfu_decode_shapes"] = (
            out[p + "sample_flops_per_s"] / peak["decode_peak_flops"]
        )
        # Each phase's time as a multiple of its own matmul floor (same run, CPU seconds): the
        # rollout (the sampler alone), the update, and the whole step (sample + score + update
        # against the sum of the sampling and update floors).
        out[p + "rollout_floor_multiple"] = (
            out[p + "rollout_ftis_cpu_s"] / out[p + "sample_matmul_floor_s"]
        )
        out[p + "rollout_streamed_floor_multiple"] = (
            out[p + "rollout_ftis_cpu_s"] / out[p + "sample_streamed_floor_s"]
        )
        # ... and against what a decode step cannot avoid: its matmuls with the weights read
        # from memory, plus its attention over the cache.
        out[p + "rollout_decode_floor_multiple"] = out[p + "rollout_ftis_cpu_s"] / (
            out[p + "sample_streamed_floor_s"] + out[p + "sample_attention_floor_s"]
        )
        out[p + "update_floor_multiple"] = (
            out[p + "ftis_update_cpu_s"] / out[p + "update_matmul_floor_s"]
        )
        out[p + "step_floor_multiple"] = out[p + "ftis_step_cpu_s"] / (
            out[p + "sample_matmul_floor_s"] + out[p + "update_matmul_floor_s"]
        )
        if c.bf16 and T == c.lengths[0]:
            out.update(_bf16_pair(p, kw, c, n, T))
    out["profile"] = child("profile", **base, length=c.profile_length)
    out["load_after"] = _load()
    head = c.lengths[0]
    out["scale_trl_step_time_ratio"] = out[f"len{head}_trl_step_time_ratio"]
    out["scale_rollout_time_ratio_one_pass"] = out[f"len{head}_rollout_time_ratio_one_pass"]
    out["scale_update_mfu"] = out[f"len{head}_update_mfu"]
    for key in (
        "rollout_floor_multiple",
        "rollout_streamed_floor_multiple",
        "rollout_decode_floor_multiple",
        "step_floor_multiple",
        "update_floor_multiple",
    ):
        out[f"scale_{key}"] = out[f"len{head}_{key}"]
    if c.bf16:
        out["scale_trl_step_time_ratio_bf16"] = out[f"len{head}_trl_step_time_ratio_bf16"]
    return out


def _bf16_pair(p: str, kw: dict, c: ScaleConfig, n: int, T: int) -> dict:
    """One ftis step process with `model.compute_dtype: bfloat16` and one TRL process with
    `bf16=True` (both: f32 weights and optimizer, forward passes under bf16 autocast), side by side (CPU seconds), and the bf16 matmul floors of the same shapes,
    so the bf16 step has its own floor multiple."""
    out: dict = {}
    ours = child("ftis_step", **kw, compute_dtype="bfloat16")
    theirs = child("trl_step", **kw, compute_dtype="bfloat16")
    for k in ("step", "sample", "update"):
        out[p + f"bf16_ftis_{k}_cpu_s"] = _median(ours[k + "_cpu"])
    out[p + "bf16_trl_step_cpu_s"] = _median(theirs["step_cpu"])
    out[p + "bf16_ftis_step_peak_rss_mb"] = ours["peak_rss_mb"]
    out[p + "bf16_trl_step_peak_rss_mb"] = theirs["peak_rss_mb"]
    out[p + "trl_step_time_ratio_bf16"] = (
        out[p + "bf16_ftis_step_cpu_s"] / out[p + "bf16_trl_step_cpu_s"]
    )
    peak = child(
        "matmul_peak",
        preset=c.preset,
        update_tokens=c.micro_batch * T,
        decode_rows=n,
        reps=5,
        dtype="bfloat16",
    )
    out[p + "bf16_matmul_peak_flops"] = peak["update_peak_flops"]
    out[p + "bf16_update_matmul_floor_s"] = peak["update_floor_s"] * n / c.micro_batch
    out[p + "bf16_sample_matmul_floor_s"] = peak["decode_floor_s"] * T
    out[p + "bf16_step_floor_multiple"] = out[p + "bf16_ftis_step_cpu_s"] / (
        out[p + "bf16_update_matmul_floor_s"] + out[p + "bf16_sample_matmul_floor_s"]
    )
    return out


def _load() -> float:
    """The 1-minute load average (what else was running while this was measured)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return float("nan")


def _params_m(preset: str) -> float:
    s = model_shape(preset)
    body = sum(i * o * c for i, o, c in linear_shapes(preset)[:-1])
    return (body + s["vocab"] * s["hidden"]) / 1e6


if __name__ == "__main__":
    _child_main(sys.argv[1])
