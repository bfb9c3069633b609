"""`ftis check CONFIG`: everything a run would check, then the plan, before any minute is spent.

It validates the config (fields, reward functions importable and callable in their form,
`ftis.preflight`'s model paths and packages), builds each node's task (data files are read:
a bad row is named by its file and line) and each node (models resolved, warm starts made or
taken from the cache, as the run's first step would), then measures one probe step per node on
this machine: a round of generation at the config's settings, its rewards, one optimizer update
(on a copy of the node: the run starts from the same weights). It prints per node the trainable
parameters, tokens generated and trained per step, the probe's seconds and the process's peak
memory, a sample completion with what each reward term gave it and how often each term fired
over the probe's completions (a term that never fires is visible before the run), and the
estimated total. The estimate is rough: one probe step, the run's own evaluations timed from a
few problems, and nodes that run side by side in a real run are probed one after another here.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

PROBED = ("ftis", "swarm")  # the algorithms whose step is sample, score, update


@dataclass
class NodePlan:
    name: str
    model: str
    trainable: int
    total: int
    generated_per_step: float  # completion tokens this node generates in a step (probe's mean)
    trained_per_step: int  # sequences this node trains on in a step
    step_seconds: float
    eval_seconds: float  # one evaluation of every split at eval.size
    peak_rss_mib: float
    sample_question: str = ""
    sample_completion: str = ""
    sample_terms: dict[str, float] = field(default_factory=dict)
    fired: dict[str, tuple[int, int]] = field(default_factory=dict)  # term: (nonzero, scored)


@dataclass
class Plan:
    name: str
    steps: int
    evaluations: int
    nodes: list[NodePlan]
    cores: int
    # how many of the run's processes compute at once (the swarm simulator: 1, every peer in
    # one process, one after another); None: one per node
    busy: int | None = None

    @property
    def total_seconds(self) -> float:
        """Every node's steps and evaluations, the run's busy processes side by side on the
        cores they share."""
        work = sum(
            n.step_seconds * self.steps + n.eval_seconds * self.evaluations for n in self.nodes
        )
        busy = len(self.nodes) if self.busy is None else self.busy
        return work / max(1, min(busy, self.cores))


def evaluations_of(cfg: Any) -> int:
    """How many evaluations a run makes: step 0, every eval.every steps, and the last."""
    steps, every = cfg.train.steps, cfg.eval.every
    at = {0, steps}
    if every:
        at |= set(range(every, steps + 1, every))
    return len(at)


def sequences_trained(cfg: Any) -> int:
    """Sequences one node trains on per step under the config's sharing scheme."""
    n, g, p = len(cfg.nodes), cfg.train.group_size, cfg.train.prompts_per_step
    if cfg.sharing.scheme == "joint":
        return n * g * p
    return g * p


def _own_prompts_and_slots(cfg: Any, rank: int) -> tuple[int, int]:
    """(prompts, completions per prompt) node `rank` generates in a step."""
    n, g, p = len(cfg.nodes), cfg.train.group_size, cfg.train.prompts_per_step
    if cfg.sharing.scheme == "joint" or n == 1:
        return p, g
    if cfg.sharing.scheme == "horizontal":
        return p, max(1, math.ceil(g / n))
    return max(1, math.ceil(p / n)), g


def plan_run(cfg: Any, *, eval_probe: int = 64) -> Plan:
    """Build every node and task of `cfg`, probe one step of each, and return the plan (errors:
    ConfigError, TaskDataError, RewardError, ModelLoadError... as a run would raise them)."""
    from ftis.models.loading import count_parameters
    from ftis.offline_eval import SplitsView
    from ftis.preflight import check_run
    from ftis.tasks import build_task
    from ftis.train import sampling, scoring
    from ftis.train.evaluate import evaluate, greedy_cache
    from ftis.train.loop import peak_rss_mb
    from ftis.train.node import build_node
    from ftis.train.update import train_on_round

    check_run(cfg)
    if cfg.algorithm.kind not in PROBED:
        raise ValueError(
            f"ftis check probes the sampling algorithms ({', '.join(PROBED)}); algorithm.kind "
            f"{cfg.algorithm.kind!r} was validated but is not probed"
        )
    plans = []
    for rank, node_cfg in enumerate(cfg.nodes):
        task = build_task(cfg.task, reward=node_cfg.reward)
        train = task.split("train")
        if len(train) == 0:
            raise ValueError(f"node {node_cfg.name}: the task's train split is empty")
        node = build_node(node_cfg, rank=rank, task_cfg=cfg.task)
        trainable, total = count_parameters(node.model)
        prompts, slots = _own_prompts_and_slots(cfg, rank)
        problems = [train[i % len(train)] for i in range(prompts)]
        probe = copy.deepcopy(node)  # the probe's update must not touch the run's weights
        t0 = time.perf_counter()
        batch = sampling.generate(probe, task, problems, slots=(0, slots), cfg=cfg.train, step=1)
        rewards = scoring.score(task, probe.tokenizer, batch)
        adv = scoring.advantages_for(batch, rewards, probe.cfg.loss.advantage_scale)
        train_on_round(probe, task, batch, adv, train=cfg.train, step=1)
        step_seconds = time.perf_counter() - t0
        generated = float(batch.lengths.float().sum()) if batch.num_sequences else 0.0
        texts = scoring.decode_for_reward(probe.tokenizer, batch.completion_ids, batch.lengths)
        shown = [train[i] for i in batch.prompt_index.tolist()]
        fired, first = _term_scores(task, shown, texts)
        # one evaluation: greedy on one batch of the first split (at most 64 problems, the
        # greedy cache off), scaled to every split at eval.size and to pass@k's samples
        sizes = [min(cfg.eval.size, len(task.split(s))) for s in task.eval_splits]
        k = max(1, min(sizes[0], cfg.eval.batch_size, eval_probe))
        few = cfg.eval.model_copy(update={"size": k, "pass_samples": 0})
        first_split = SplitsView(task, task.eval_splits[:1])
        t0 = time.perf_counter()
        with greedy_cache(False):
            evaluate(probe, first_split, few, cfg.train, seed=0)
        per_problem = (time.perf_counter() - t0) / k
        eval_seconds = per_problem * sum(sizes)
        if cfg.eval.pass_samples:
            eval_seconds += (
                per_problem * cfg.eval.pass_samples * min(cfg.eval.pass_problems, sizes[0])
            )
        model = node_cfg.model
        plans.append(
            NodePlan(
                name=node_cfg.name,
                model=model.name or model.preset or model.gguf or str(model.path),
                trainable=trainable,
                total=total,
                generated_per_step=generated,
                trained_per_step=sequences_trained(cfg),
                step_seconds=step_seconds,
                eval_seconds=eval_seconds,
                peak_rss_mib=peak_rss_mb(),
                sample_question=shown[0].question if shown else "",
                sample_completion=texts[0] if texts else "",
                sample_terms=first,
                fired=fired,
            )
        )
        del probe, node
    return Plan(
        cfg.name,
        cfg.train.steps,
        evaluations_of(cfg),
        plans,
        os.cpu_count() or 1,
        busy=cfg.algorithm.busy_processes(cfg),
    )


def _term_scores(task: Any, problems: list, texts: list[str]):
    """({term: (completions it gave a non-zero value, completions scored)}, {term: its value on
    the first completion}), each configured reward term scored alone (unweighted)."""
    from ftis.rewards.runtime import Reward

    reward = getattr(task, "reward_fn", None)
    if reward is None or not texts:
        return {}, {}
    fired, first = {}, {}
    for t in reward.terms:
        alone = Reward(
            [(t.name, t.fn, 1.0, t.per_problem, t.report, t.batched)], max_error_share=1.0
        )
        alone.chat_of = reward.chat_of
        values = alone.score(problems, texts)
        fired[t.name] = (sum(1 for v in values if v != 0), len(values))
        first[t.name] = float(values[0])
    return fired, first


def fmt_seconds(s: float) -> str:
    if s < 90:
        return f"{s:.1f} s"
    if s < 5400:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


__all__ = ["NodePlan", "Plan", "evaluations_of", "fmt_seconds", "plan_run", "sequences_trained"]
