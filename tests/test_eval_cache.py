"""The greedy-evaluation cache (ftis.train.evaluate.greedy_cache): an evaluation read from it
is exactly the evaluation it replaces, anything that changes the completions changes the key,
a damaged entry is regenerated, and a run's evaluation before training uses it."""

from __future__ import annotations

import json

import pytest
import torch

import ftis.rollout.sampler as sampler_mod
from ftis.config import EvalConfig, TrainConfig
from ftis.tasks import ReasoningTask
from ftis.train import evaluate as ev
from tests.conftest import tiny_node, tiny_run_config

EVAL = EvalConfig(size=12, batch_size=5, pass_samples=0)
TRAIN = TrainConfig(max_new_tokens=6)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FTIS_CACHE", str(tmp_path))
    monkeypatch.delenv("FTIS_EVAL_CACHE", raising=False)
    return tmp_path / "evals"


@pytest.fixture
def greedy_calls(monkeypatch):
    """How many greedy generation calls the evaluation module made."""
    calls = []
    real = ev.sample

    def counting(model, prompts, **kw):
        if kw.get("temperature") == 0:
            calls.append(len(prompts))
        return real(model, prompts, **kw)

    monkeypatch.setattr(ev, "sample", counting)
    monkeypatch.setattr(sampler_mod, "sample", counting)  # greedy_samples' own
    return calls


def _evaluate(node, task, *, cached: bool):
    with ev.greedy_cache(cached):
        return ev.evaluate_detailed(node, task, EVAL, TRAIN, seed=0)


def _entries(cache) -> list:
    return sorted(cache.rglob("*.json")) if cache.exists() else []


def test_a_cached_evaluation_is_the_evaluation_it_replaces(cache, greedy_calls):
    torch.manual_seed(0)
    node, task = tiny_node(), ReasoningTask()
    plain = _evaluate(node, task, cached=False)
    assert not _entries(cache) and greedy_calls == [5, 5, 2] * len(task.eval_splits)
    greedy_calls.clear()
    stored = _evaluate(node, task, cached=True)  # a miss: generated, then stored
    assert len(_entries(cache)) == len(task.eval_splits) and greedy_calls
    greedy_calls.clear()
    read = _evaluate(node, task, cached=True)  # a hit: nothing generated
    assert greedy_calls == []
    assert plain == stored == read  # metrics and every split's outcomes, samples included


def test_what_changes_the_completions_changes_the_key(cache):
    torch.manual_seed(0)
    node = tiny_node()
    prompts = [[1, 2, 3], [4, 5]]
    key = ev.greedy_key(node, prompts, 6, 5)
    assert ev.greedy_key(node, [list(p) for p in prompts], 6, 5) == key  # a pure function
    assert ev.greedy_key(node, prompts[::-1], 6, 5) != key
    assert ev.greedy_key(node, prompts, 7, 5) != key
    assert ev.greedy_key(node, prompts, 6, 4) != key  # batching changes padding
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert ev.greedy_key(node, prompts, 6, 5) != key
    finally:
        torch.set_num_threads(threads)
    eps = node.model.config.rms_norm_eps
    node.model.config.rms_norm_eps = eps * 2  # the same weights, another function
    assert ev.greedy_key(node, prompts, 6, 5) != key
    node.model.config.rms_norm_eps = eps
    assert ev.greedy_key(node, prompts, 6, 5) == key
    with torch.no_grad():
        p = next(node.model.parameters())
        flat = p.view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))  # one ulp of one weight
    assert ev.greedy_key(node, prompts, 6, 5) != key


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: "{not json",
        lambda d: json.dumps({**d, "rows": d["rows"][:-1]}),  # a row short
        lambda d: json.dumps({**d, "rows": [[-1]] + d["rows"][1:]}),  # not a token id
        lambda d: json.dumps({**d, "rows": [list(range(99))] + d["rows"][1:]}),  # too long
        lambda d: json.dumps([1, 2]),
    ],
)
def test_a_damaged_entry_is_regenerated_not_trusted(cache, greedy_calls, damage):
    torch.manual_seed(0)
    node, task = tiny_node(), ReasoningTask()
    want = _evaluate(node, task, cached=True)
    for path in _entries(cache):
        path.write_text(damage(json.loads(path.read_text())))
    greedy_calls.clear()
    assert _evaluate(node, task, cached=True) == want
    assert greedy_calls  # regenerated
    greedy_calls.clear()
    assert _evaluate(node, task, cached=True) == want and greedy_calls == []  # and repaired


def test_switched_off_by_the_environment(cache, monkeypatch):
    monkeypatch.setenv("FTIS_EVAL_CACHE", "0")
    torch.manual_seed(0)
    _evaluate(tiny_node(), ReasoningTask(), cached=True)
    assert not _entries(cache)


def test_an_unwritable_cache_costs_time_only(cache, greedy_calls):
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text("a file where the cache's folder would be")
    torch.manual_seed(0)
    node, task = tiny_node(), ReasoningTask()
    assert _evaluate(node, task, cached=True) == _evaluate(node, task, cached=False)


def test_a_run_reads_its_evaluation_before_training_from_an_earlier_run(
    cache, greedy_calls, tmp_path
):
    """Two runs from the same weights with different seeds: the second generates nothing for
    its evaluation before training, and its step-0 evaluation is the first run's byte for
    byte; later evaluations (other weights) are generated as before."""
    from ftis.config import RunConfig
    from ftis.launch import run_local

    raw = tiny_run_config()
    counts = []
    step0 = []
    for seed in (0, 1):
        cfg = RunConfig.model_validate({**raw, "train": {**raw["train"], "seed": seed}})
        greedy_calls.clear()
        run_local(cfg, tmp_path / f"run{seed}")
        counts.append(len(greedy_calls))
        rows = [json.loads(x) for x in (tmp_path / f"run{seed}" / "evals.jsonl").open()]
        step0.append([r for r in rows if r["step"] == 0])
    assert step0[0] and step0[0] == step0[1]
    # 2 splits (test, ood) of 16 problems, one greedy call each; evaluations at steps 0, 2, 3
    assert counts == [3 * 2, 2 * 2]
