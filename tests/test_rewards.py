"""Pluggable rewards (ftis.rewards): weights, async functions, errors caught per completion, the
built-in rewards as registry entries, node rewards over the task's, and the special-token case
of issue 24 (tags that are special tokens of the tokenizer must reach the reward)."""

from __future__ import annotations

import asyncio
import logging
import sys
import types

import pytest
import torch

from ftis.config import ConfigError, load_config
from ftis.rewards import REWARDS, RewardTerm, resolve_reward
from ftis.rewards.runtime import Reward, RewardedTask
from ftis.tasks import ArithmeticTaskConfig, GSM8KTask, build_task
from ftis.tasks.base import Problem

# A module of user rewards, importable as "user_rewards_mod:NAME".
MOD = types.ModuleType("user_rewards_mod")


def _has_yes(prompt, completion, fields):
    return 1.0 if "yes" in completion else 0.0


def _short(prompt, completion, fields):
    return -0.1 * len(completion)


def _boom(prompt, completion, fields):
    if completion == "bad":
        return 1 / 0
    return 2.0


def _not_a_number(prompt, completion, fields):
    return "high"


def _two_args(prompt, completion):
    return 1.0


MOD.has_yes, MOD.short, MOD.boom = _has_yes, _short, _boom
MOD.not_a_number, MOD.two_args = _not_a_number, _two_args
sys.modules["user_rewards_mod"] = MOD


def problems(n: int) -> list[Problem]:
    return [Problem(i, f"q{i}", str(i), fields={"extra": i * 10}) for i in range(n)]


def terms(*spec) -> list[RewardTerm]:
    return [RewardTerm(function=f, weight=w) for f, w in spec]


def test_weighted_sum_of_functions():
    r = Reward(terms(("user_rewards_mod:has_yes", 1.0), ("user_rewards_mod:short", 0.5)))
    got = r.score(problems(2), ["yes", "no!"])
    # "yes": 1*1 + 0.5*(-0.1*3) = 0.85; "no!": 0 + 0.5*(-0.3) = -0.15
    assert got == pytest.approx([0.85, -0.15], abs=1e-12)
    assert r.pop_stats() == {
        "reward/scored": 2.0,
        "reward/nonzero": 2.0,
        "reward/errors/user_rewards_mod:has_yes": 0.0,
        "reward/errors/user_rewards_mod:short": 0.0,
    }


def test_a_function_gets_prompt_completion_and_the_rows_fields():
    seen = []
    r = Reward([("spy", lambda p, c, f: seen.append((p, c, dict(f))) or 0.0, 1.0)])
    r.score(problems(2)[1:], ["out"])
    assert seen == [("q1", "out", {"question": "q1", "answer": "1", "extra": 10})]


def test_async_functions_of_a_batch_run_concurrently():
    n = 6
    state = {"in_flight": 0, "all": asyncio.Event()}  # binds to the loop that first awaits it

    async def together(prompt, completion, fields):
        # Completes only when all n calls are in flight at once: run one by one, the first
        # call would wait for the others until its timeout, raise, and score 0.
        state["in_flight"] += 1
        if state["in_flight"] == n:
            state["all"].set()
        await asyncio.wait_for(state["all"].wait(), timeout=5)
        return float(len(completion))

    r = Reward([("together", together, 2.0)])
    got = r.score(problems(n), ["a" * i for i in range(n)])
    assert got == [2.0 * i for i in range(n)]
    assert r.pop_stats()["reward/scored"] == n


def test_an_exception_scores_zero_for_that_completion_is_counted_and_named(caplog):
    r = Reward(
        terms(("user_rewards_mod:boom", 1.0), ("user_rewards_mod:has_yes", 1.0)),
        max_error_share=1.0,  # 2 failures of 3 would stop the run (below)
    )
    with caplog.at_level(logging.WARNING, logger="ftis.rewards.runtime"):
        got = r.score(problems(3), ["bad", "yes", "bad"])
    # boom gives 0 on "bad" (it raised), 2 on "yes"; has_yes adds 1 on "yes"
    assert got == [0.0, 3.0, 0.0]
    stats = r.pop_stats()
    assert stats["reward/errors/user_rewards_mod:boom"] == 2.0
    assert stats["reward/errors/user_rewards_mod:has_yes"] == 0.0
    warnings = [rec.getMessage() for rec in caplog.records]
    assert len(warnings) == 1  # once per function, not once per completion
    assert "user_rewards_mod:boom" in warnings[0]
    assert "ZeroDivisionError" in warnings[0] and "in _boom" in warnings[0]
    assert r.pop_stats()["reward/errors/user_rewards_mod:boom"] == 0.0  # counts are per row


def test_a_value_that_is_not_a_number_is_an_error():
    r = Reward(terms(("user_rewards_mod:not_a_number", 1.0)), max_error_share=1.0)
    assert r.score(problems(1), ["x"]) == [0.0]
    assert r.pop_stats()["reward/errors/user_rewards_mod:not_a_number"] == 1.0


@pytest.mark.parametrize(
    "value, expected",
    [
        ("user_rewards_mod:has_yes", [("user_rewards_mod:has_yes", 1.0)]),
        (
            ["user_rewards_mod:has_yes", "builtin:gsm8k_format"],
            [("user_rewards_mod:has_yes", 1.0), ("builtin:gsm8k_format", 1.0)],
        ),
        ({"user_rewards_mod:has_yes": 2.0}, [("user_rewards_mod:has_yes", 2.0)]),
        (
            [{"function": "user_rewards_mod:short", "weight": 0.25}],
            [("user_rewards_mod:short", 0.25)],
        ),
    ],
)
def test_reward_shorthands_in_the_config(value, expected):
    cfg = ArithmeticTaskConfig(reward=value)
    assert [(t.function, t.weight) for t in cfg.reward] == expected


@pytest.mark.parametrize(
    "value, message",
    [
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("user_rewards_mod:nope", "has no 'nope'"),
        ("user_rewards_mod:two_args", "cannot be called as fn(prompt, completion, fields)"),
        ("builtin:nope", "no built-in reward 'builtin:nope'"),
        ("justaname", "is not 'module:function'"),
    ],
)
def test_a_bad_reward_is_one_clear_config_error(value, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"task.reward={value}"])
    assert "task.reward" in str(err.value) or "reward" in str(err.value)
    assert message in str(err.value)


def test_a_reward_file_is_found_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "myrw.py").write_text("def score(prompt, completion, fields):\n    return 7.0\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["task.reward=myrw.py:score"])
    assert cfg.task.reward[0].function == f"{tmp_path / 'myrw.py'}:score"  # kept absolute
    task = build_task(cfg.task)
    assert task.reward_fn.names == ["myrw.py:score"]  # the name in rows and logs
    p = task.split("test")[0]
    assert task.reward(p, "anything") == 7.0


def test_a_nodes_reward_replaces_the_tasks():
    cfg = load_config(
        None,
        ["task.reward=user_rewards_mod:has_yes", "nodes.0.reward=user_rewards_mod:short"],
    )
    assert cfg.nodes[0].reward[0].function == "user_rewards_mod:short"
    task = build_task(cfg.task, reward=cfg.nodes[0].reward)
    assert task.reward_fn.names == ["user_rewards_mod:short"]
    assert task.reward(task.split("test")[0], "yes") == pytest.approx(-0.3)


def test_builtin_rewards_are_registry_entries_equal_to_the_tasks_own():
    assert {"builtin:gsm8k", "builtin:gsm8k_format", "builtin:gsm8k_answer"} <= set(REWARDS)
    gsm = GSM8KTask(
        {
            "train_file": "fixture:gsm8k_tiny_train.jsonl",
            "test_file": "fixture:gsm8k_tiny_test.jsonl",
        }
    )
    p = gsm.split("test")[0]
    gold = p.answer
    fields = {"question": p.question, "answer": gold}
    cases = {
        f"<think> x </think><answer> {gold} </answer>": (1.0, 1.0, 1.0),
        f"<think> x </think><answer> {gold} </answer> more": (0.0, 0.0, 1.0),
        "<think> x </think><answer> -1 </answer>": (0.0, 1.0, 0.0),
        f"<answer> {gold} </answer>": (0.0, 0.0, 1.0),
    }
    full, fmt, ans = (
        resolve_reward(f"builtin:{n}") for n in ("gsm8k", "gsm8k_format", "gsm8k_answer")
    )
    for text, (want_full, want_fmt, want_ans) in cases.items():
        assert gsm.reward(p, text) == want_full == full(p.question, text, fields), text
        assert fmt(p.question, text, fields) == want_fmt, text
        assert ans(p.question, text, fields) == want_ans, text
    # the default reward of a built task is the built-in one, named
    built = build_task(gsm.cfg)
    assert built.reward_fn.names == ["builtin:gsm8k"]
    arith = build_task(ArithmeticTaskConfig())
    assert arith.reward_fn.names == ["builtin:exact_match"]
    q = arith.split("test")[0]
    assert arith.reward(q, f" {q.answer}\n") == 1.0 and arith.reward(q, q.answer + "0") == 0.0


def test_special_token_tags_reach_the_reward():
    """Issue 24: with <answer>/</answer> added as special tokens of the tokenizer, decoding with
    skip_special_tokens=True deleted the tags and every reward was 0, silently."""
    from ftis.models.tokenizer import char_tokenizer
    from ftis.rollout.sampler import decode_completions
    from ftis.rollout.types import RolloutBatch
    from ftis.train.scoring import score

    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<answer>", "</answer>"]})
    answer_id = tok.convert_tokens_to_ids("<answer>")
    assert answer_id in tok.all_special_ids
    task = build_task(ArithmeticTaskConfig(ops={"+": 1.0}, reward="builtin:gsm8k_answer"))
    train = task.split("train")
    gold = train[0].answer
    ids = tok.encode(f"<answer>{gold}</answer>", add_special_tokens=False)
    assert ids[0] == answer_id and len(ids) == 2 + len(gold)  # the tags are single tokens
    row = ids + [tok.eos_token_id, tok.pad_token_id]
    batch = RolloutBatch(
        prompt_index=torch.tensor([0]),
        generator=torch.tensor([0]),
        completion_ids=torch.tensor([row]),
        lengths=torch.tensor([len(ids) + 1]),  # the EOS is a real token; the pad is not
        sampler_logprobs=torch.zeros(1, len(row)),
    )
    # before: the tags vanish from the text the reward reads, the reward is 0
    old_text = decode_completions(tok, batch.completion_ids, batch.lengths)[0]
    assert old_text == gold
    assert task.reward(train[0], old_text) == 0.0
    # now: the tags are kept, EOS dropped, and the completion earns its reward
    assert score(task, tok, batch).tolist() == [1.0]


def test_rewarded_task_delegates_everything_else():
    task = build_task(ArithmeticTaskConfig())
    assert isinstance(task, RewardedTask)
    assert task.name == "arithmetic" and task.eval_splits == task.task.eval_splits
    assert task.extract_answer(" 12 ") == "12"  # the task's own optional method
