"""GPU check: a randomly initialised Qwen2.5-0.5B-shaped model (no download), ftis's sampler vs
HF `generate(output_logits=True)`, and a few F-TIS steps, on one NVIDIA GPU.

    scripts/gpu_check.sh            # on a GPU machine (no network needed), a few minutes
    scripts/gpu_check.sh --dry-run  # the same code on the CPU with a tiny shape (seconds)

Prints one line per figure and, last, one JSON object with all of them: tokens/s of both
samplers, the rollout time ratio, seconds per F-TIS step (sample + update), peak memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ftis.core.advantages import group_advantages
from ftis.core.losses import policy_loss
from ftis.models.logprobs import gather_logprobs, shared_prompt_completion_logprobs
from ftis.rollout.sampler import left_pad, sample

# Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B), written out: nothing is downloaded.
QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run(*, dry_run: bool, prompts: int, group: int, length: int, steps: int) -> dict:
    from transformers import AutoModelForCausalLM, Qwen2Config

    device = torch.device("cpu" if dry_run else "cuda")
    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run for the CPU check")
    dtype = torch.float32 if dry_run else torch.bfloat16
    shape = TINY if dry_run else QWEN25_05B
    torch.manual_seed(0)
    cfg = Qwen2Config(**shape, use_sliding_window=False, pad_token_id=0, eos_token_id=1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    plist = [
        torch.randint(2, shape["vocab_size"], (int(n),), generator=g).tolist()
        for n in torch.randint(16, 48, (prompts,), generator=g)
    ]
    n = prompts * group
    out: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dry_run": dry_run,
        "params_m": params / 1e6,
        "dtype": str(dtype),
        "sequences": n,
        "length": length,
    }

    def ftis_rollout():
        return sample(
            model, plist, num_samples=group, max_new_tokens=length, eos_id=-1, pad_id=0, generator=g
        )

    @torch.no_grad()
    def hf_rollout():
        ids, mask = left_pad([p for p in plist for _ in range(group)], 0)
        ids, mask = ids.to(device), mask.to(device)
        res = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=length,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        return gather_logprobs(torch.stack(res.logits, 1), res.sequences[:, ids.shape[1] :])

    for name, fn in (("ftis", ftis_rollout), ("hf_one_pass", hf_rollout)):
        fn()  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        s = time.perf_counter() - t0
        out[f"rollout_{name}_s"] = s
        out[f"rollout_{name}_tokens_per_s"] = n * length / s
    out["rollout_time_ratio_one_pass"] = out["rollout_ftis_s"] / out["rollout_hf_one_pass_s"]

    # F-TIS steps on own samples (sample + receiver log-probs + loss + AdamW step).
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    prompt_ids, prompt_mask = left_pad(plist, 0)
    prompt_of = torch.arange(prompts).repeat_interleave(group)
    times = []
    for step in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        s = ftis_rollout()
        rewards = (s.completion_ids % 2 == 0).float().mean(1).view(prompts, group)  # synthetic
        adv = group_advantages(rewards, scale="std").flatten().to(device)
        mask = torch.ones_like(s.completion_ids, dtype=torch.bool)
        lp = shared_prompt_completion_logprobs(
            model,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            prompt_of=prompt_of,
            completion_ids=s.completion_ids,
            completion_mask=mask.long(),
        )
        loss, _ = policy_loss(lp, s.logprobs.to(device), adv, mask.to(device), method="f-tis")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if step:
            times.append(time.perf_counter() - t0)
        if not torch.isfinite(loss):
            raise SystemExit(f"non-finite loss at step {step}")
    out["ftis_step_s"] = sorted(times)[len(times) // 2] if times else float("nan")
    out["peak_memory_mb"] = _peak_mb(device)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shape (for tests)")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--length", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    a = ap.parse_args(argv)
    res = run(
        dry_run=a.dry_run,
        prompts=a.prompts or (2 if a.dry_run else 8),
        group=a.group if not a.dry_run else min(a.group, 2),
        length=a.length or (8 if a.dry_run else 256),
        steps=a.steps or (2 if a.dry_run else 4),
    )
    for k, v in res.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
