"""Rollout cost: ftis's sampler (log-probs recorded while sampling, KV cache) vs HF `generate`
followed by a separate scoring forward pass, which is what the F-TIS authors' code does.

Same model, prompts, group size, temperature 1 and completion length (EOS suppressed in both so
every completion has exactly `length` tokens). Median seconds per batch, interleaved. Also
interleaved, as an ablation: ftis's sampler calling the model's `forward` for every decode step
instead of its direct decode step (ftis.rollout.decode; the same tokens and log-probs).
"""

from __future__ import annotations

import time

import torch

from bench.common import TASK, median
from ftis.models.loading import ModelConfig, build_model, load_tokenizer
from ftis.models.logprobs import completion_logprobs
from ftis.rollout import sampler as sampler_mod
from ftis.rollout.sampler import left_pad, sample
from ftis.tasks import build_task


def _prompts(tok, n: int) -> list[list[int]]:
    task = build_task(TASK)
    train = task.split("train")
    return [task.prompt_ids(train[i], tok) for i in range(n)]


@torch.no_grad()
def hf_generate_then_score(model, prompts, *, group: int, length: int, pad_id: int) -> torch.Tensor:
    ids, mask = left_pad([p for p in prompts for _ in range(group)], pad_id)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=length,
        min_new_tokens=length,
        pad_token_id=pad_id,
    )
    comp = out[:, ids.shape[1] :]
    return completion_logprobs(
        model,
        prompt_ids=ids,
        prompt_mask=mask,
        completion_ids=comp,
        completion_mask=torch.ones_like(comp),
    )


def run(quick: bool, model_path: str) -> dict[str, float]:
    cfg = ModelConfig(path=model_path)
    model, tok = build_model(cfg), load_tokenizer(cfg)
    model.eval()
    group, n_prompts = 8, 16
    results = {}
    for length in (16,) if quick else (16, 64):
        prompts = _prompts(tok, n_prompts)
        reps = 3 if quick else 7
        ours, theirs, forward = [], [], []
        gen = torch.Generator().manual_seed(0)

        def ftis_sample(prompts=prompts, length=length, gen=gen):
            sample(
                model,
                prompts,
                num_samples=group,
                max_new_tokens=length,
                eos_id=-1,
                pad_id=tok.pad_token_id,
                generator=gen,
            )

        direct_step = sampler_mod.decode_step
        for r in range(reps + 1):
            t0 = time.perf_counter()
            ftis_sample()
            t1 = time.perf_counter()
            hf_generate_then_score(
                model, prompts, group=group, length=length, pad_id=tok.pad_token_id
            )
            t2 = time.perf_counter()
            sampler_mod.decode_step = lambda model, attention: None
            try:
                ftis_sample()
            finally:
                sampler_mod.decode_step = direct_step
            t3 = time.perf_counter()
            if r:  # the first round warms up all three
                ours.append(t1 - t0)
                theirs.append(t2 - t1)
                forward.append(t3 - t2)
        results[f"rollout_ftis_s_len{length}"] = median(ours)
        results[f"rollout_hf_s_len{length}"] = median(theirs)
        results[f"rollout_ftis_forward_s_len{length}"] = median(forward)
        results[f"rollout_time_ratio_len{length}"] = median(ours) / median(theirs)
    results["rollout_time_ratio"] = results["rollout_time_ratio_len16"]
    results["rollout_sequences"] = float(group * n_prompts)
    return results
