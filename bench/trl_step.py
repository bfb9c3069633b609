"""Training step time: one on-policy GRPO step in ftis vs TRL's GRPOTrainer (CPU, no vLLM).

Same warm-started model (identical weights), prompts (with the same BOS), group size, completion
limit (sampling stops at EOS in both), temperature 1, AdamW, lr, grad clip 1, beta = 0, one
optimizer step per generation round, the same reward function. Median seconds per step after
warm-up steps, the two trainers run one after the other, twice, interleaved.
"""

from __future__ import annotations

import time

from bench.common import TASK, median, train_trl_grpo
from ftis.algos.ftis import sharing
from ftis.config import LossConfig, NodeConfig, OptimConfig, TrainConfig
from ftis.models.loading import ModelConfig, build_model, load_tokenizer
from ftis.tasks import build_task
from ftis.train import sampling, scoring
from ftis.train import update as update_mod
from ftis.train.node import Node, build_optimizer

LR = 1e-5


def ftis_steps(
    model_path: str,
    *,
    prompts: int,
    group: int,
    length: int,
    steps: int,
    warmup: int,
    skip_zero_advantage: bool = True,
) -> tuple[list[float], float]:
    """(seconds per step, mean completion length)."""
    task = build_task(TASK)
    cfg = NodeConfig(
        name="bench",
        model=ModelConfig(path=model_path),
        optim=OptimConfig(lr=LR),
        loss=LossConfig(method="grpo"),
    )
    model, tok = build_model(cfg.model), load_tokenizer(cfg.model)
    node = Node(
        cfg=cfg, rank=0, model=model, tokenizer=tok, optimizer=build_optimizer(model, cfg.optim)
    )
    train = task.split("train")
    tc = TrainConfig(max_new_tokens=length, group_size=group, prompts_per_step=prompts)
    times, lengths = [], []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        idx = sharing.step_prompts(0, step + 1, prompts, len(train))
        problems = [train[k] for k in idx]
        batch = sampling.generate(node, task, problems, slots=(0, group), cfg=tc, step=step + 1)
        rewards = scoring.score(task, tok, batch)
        adv = scoring.advantages_for(batch, rewards, "std")
        update_mod.update(
            node,
            task,
            batch,
            adv,
            loss_cfg=cfg.loss,
            micro_batch_size=0,
            skip_zero_advantage=skip_zero_advantage,
        )
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            lengths.append(float(batch.lengths.float().mean()))
    return times, sum(lengths) / len(lengths)


def trl_steps(
    model_path: str, *, prompts: int, group: int, length: int, steps: int, warmup: int
) -> tuple[list[float], float]:
    from transformers import TrainerCallback

    task = build_task(TASK)
    cfg = ModelConfig(path=model_path)
    model, tok = build_model(cfg), load_tokenizer(cfg)
    train = task.split("train")
    n_rows = prompts * (steps + warmup + 2)
    rows = [
        {"prompt": tok.bos_token + train[i].question, "answer": train[i].answer}
        for i in range(n_rows)
    ]

    def reward(completions, answer, **_):
        # The arithmetic task's verifier: exact match of the stripped completion.
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    times: list[float] = []
    lengths: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    train_trl_grpo(
        model,
        tok,
        rows,
        reward,
        lr=LR,
        callback=Timer(),
        logging_strategy="steps",
        logging_steps=1,
        per_device_train_batch_size=prompts * group,
        num_generations=group,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        max_completion_length=length,
        max_steps=steps + warmup,
    )
    return times[warmup:], (sum(lengths[warmup:]) / max(len(lengths[warmup:]), 1))


def run(quick: bool, model_path: str) -> dict[str, float]:
    kw = dict(prompts=16, group=8, length=16, steps=4 if quick else 12, warmup=2)
    ours, theirs, ours_noskip = [], [], []
    len_ours = len_theirs = 0.0
    for _ in range(1 if quick else 2):
        t, len_ours = ftis_steps(model_path, **kw)
        ours += t
        t, len_theirs = trl_steps(model_path, **kw)
        theirs += t
        if not quick:
            ours_noskip += ftis_steps(model_path, **kw, skip_zero_advantage=False)[0]
    out = {
        "ftis_step_s": median(ours),
        "trl_step_s": median(theirs),
        "trl_step_time_ratio": median(ours) / median(theirs),
        "ftis_mean_completion_len": len_ours,
        "trl_mean_completion_len": len_theirs,
    }
    if ours_noskip:
        out["ftis_step_s_no_zero_adv_skip"] = median(ours_noskip)
        out["trl_step_time_ratio_no_zero_adv_skip"] = median(ours_noskip) / median(theirs)
    return out
