"""Batched rewards in TRL's form (issue 36, item 1): `f(prompts, completions, **columns) ->
list[float | None]`, sync or async, detected from the signature or declared with `batched:
true`; None leaves a completion out of its group's advantages (`reward/excluded`)."""

from __future__ import annotations

import asyncio
import json
import sys
import types

import pytest
import torch

from ftis.config import ConfigError, load_config
from ftis.core.advantages import flat_group_advantages
from ftis.rewards import RewardTerm, is_batched
from ftis.rewards.runtime import Reward
from ftis.rollout.types import RolloutBatch
from ftis.tasks import ArithmeticTaskConfig, build_task
from ftis.tasks.base import Problem
from ftis.train import scoring

MOD = types.ModuleType("trl_style_rewards")
CALLS: list[dict] = []


def accuracy_reward(prompts, completions, answer, **kwargs):
    """As a TRL user writes it: the dataset's columns arrive as lists, one value per
    completion; None (here for a completion that is only "?") is "no reward"."""
    CALLS.append({"prompts": prompts, "completions": completions, "answer": answer, **kwargs})
    return [
        None if c.strip() == "?" else (1.0 if c.strip() == a else 0.0)
        for c, a in zip(completions, answer)
    ]


def length_only(completions, **kwargs):  # TRL's other common shape: no `prompts`
    return [float(len(c)) for c in completions]


async def async_judge(prompts, completions, **kwargs):
    await asyncio.sleep(0)
    return [0.5 for _ in completions]


def declared(**kwargs):  # nothing in the signature says batched: declared in the config
    return [2.0 for _ in kwargs["completions"]]


def named_columns_only(prompts, completions, extra):  # no **kwargs: only what it names
    return [float(e) for e in extra]


def wrong_length(prompts, completions, **kwargs):
    return [1.0]


def not_a_number(prompts, completions, **kwargs):
    return ["1.0" for _ in completions]


def per_completion(prompt, completion, fields):
    return 0.25


for _f in (
    accuracy_reward,
    length_only,
    async_judge,
    declared,
    named_columns_only,
    wrong_length,
    not_a_number,
    per_completion,
):
    setattr(MOD, _f.__name__, _f)
sys.modules["trl_style_rewards"] = MOD


def problems(n: int) -> list[Problem]:
    return [Problem(i, f"q{i}", str(i), fields={"extra": i * 10}) for i in range(n)]


def reward(*spec, **kw) -> Reward:
    return Reward(
        [RewardTerm(function=f"trl_style_rewards:{f}", weight=w, **kw) for f, w in spec],
        max_error_share=1.0,
    )


def test_the_form_is_detected_from_trl_s_parameter_names():
    assert is_batched(accuracy_reward) and is_batched(length_only) and is_batched(async_judge)
    assert not is_batched(per_completion) and not is_batched(declared)
    term = RewardTerm(function="trl_style_rewards:accuracy_reward")
    assert term.batched is None and term.is_batched


def test_a_batched_function_is_called_once_with_the_columns_as_lists():
    CALLS.clear()
    r = reward(("accuracy_reward", 1.0))
    got, excluded = r.score_masked(problems(3), ["0", "7", "2"])
    assert got == [1.0, 0.0, 1.0] and excluded == [False] * 3
    assert len(CALLS) == 1  # once per batch, not per completion
    call = CALLS[0]
    assert call["prompts"] == ["q0", "q1", "q2"]
    assert call["completions"] == ["0", "7", "2"]
    assert call["answer"] == ["0", "1", "2"]
    assert call["extra"] == [0, 10, 20] and call["question"] == ["q0", "q1", "q2"]


def test_none_excludes_a_completion_and_is_counted():
    r = reward(("accuracy_reward", 1.0))
    got, excluded = r.score_masked(problems(3), ["0", "?", "5"])
    assert got == [1.0, 0.0, 0.0]
    assert excluded == [False, True, False]
    stats = r.pop_stats()
    assert stats["reward/excluded"] == 1.0 and stats["reward/scored"] == 3.0
    assert stats["reward/errors/trl_style_rewards:accuracy_reward"] == 0.0  # None is no error
    assert r.pop_stats()["reward/excluded"] == 0.0  # per row


def test_weighted_sum_with_per_completion_and_async_functions():
    r = reward(("accuracy_reward", 2.0), ("length_only", 0.5), ("async_judge", 1.0))
    r.terms.append(Reward([("pc", per_completion, 4.0)]).terms[0])
    got, excluded = r.score_masked(problems(2), ["0", "?"])
    # "0": 2*1 + 0.5*1 + 0.5 + 4*0.25 = 4.0; "?": accuracy None, 0.5*1 + 0.5 + 1 = 2.0
    assert got == pytest.approx([4.0, 2.0])
    assert excluded == [False, False]  # other functions gave "?" a number: it stays


def test_declared_batched_and_named_columns_only():
    r = Reward(
        [
            RewardTerm(function="trl_style_rewards:declared", batched=True),
            RewardTerm(function="trl_style_rewards:named_columns_only", weight=0.1),
        ]
    )
    assert r.score(problems(2), ["a", "b"]) == pytest.approx([2.0, 3.0])


@pytest.mark.parametrize(
    "name, message",
    [
        ("wrong_length", "returned 1 values for 2 completions"),
        ("not_a_number", "returned str '1.0', not a number"),
    ],
)
def test_a_bad_batch_is_an_error_named_by_what_it_returned(name, message, caplog):
    r = reward((name, 1.0))
    with caplog.at_level("WARNING", logger="ftis.rewards.runtime"):
        got, excluded = r.score_masked(problems(2), ["a", "b"])
    assert got == [0.0, 0.0] and excluded == [False, False]  # scored 0, not left out
    stats = r.pop_stats()
    assert stats[f"reward/errors/trl_style_rewards:{name}"] == 2.0
    assert message in stats[f"reward/first_error/trl_style_rewards:{name}"]
    assert "raised" not in caplog.records[0].getMessage()
    assert message in caplog.records[0].getMessage()


def test_the_config_takes_the_batched_form_and_refuses_a_mismatch():
    cfg = load_config(None, ["task.reward=trl_style_rewards:accuracy_reward"])
    assert cfg.task.reward[0].is_batched
    cfg = ArithmeticTaskConfig(reward=[{"function": "trl_style_rewards:declared", "batched": True}])
    assert cfg.reward[0].batched is True
    with pytest.raises(ConfigError, match="cannot be called as fn\\(prompt, completion, fields\\)"):
        load_config(None, ["task.reward=trl_style_rewards:declared"])  # not declared
    with pytest.raises(ConfigError, match="cannot be called as fn\\(prompt, completion, fields\\)"):
        load_config(
            None, ['task.reward=[{"function": "trl_style_rewards:length_only", "batched": false}]']
        )


def test_a_chat_row_gets_trl_s_conversational_form(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": f"say {i}"}], "answer": str(i)} for i in range(4)
    ] + [{"prompt": "plain 9", "answer": "9"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen: dict = {}

    def conv(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [1.0 for _ in completions]

    MOD.conv = conv
    task = build_task(
        {
            "kind": "prompts",
            "train_file": str(path),
            "test_fraction": 0.2,
            "reward": "trl_style_rewards:conv",
        }
    )
    train = list(task.split("train"))
    task.rewards(train, ["x"] * len(train))
    for p, prompt, completion in zip(train, seen["prompts"], seen["completions"]):
        if "messages" in p.fields:
            assert prompt == p.fields["messages"]
            assert completion == [{"role": "assistant", "content": "x"}]
        else:
            assert prompt == "plain 9" and completion == "x"


# -- advantages: an excluded completion has advantage 0 and is not in its group's statistics


def test_flat_group_advantages_leave_out_what_is_not_valid():
    r = torch.tensor([1.0, float("nan"), 0.0, 0.0, 3.0, 1.0, 5.0, 2.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    valid = torch.tensor([True, False, True, True, True, True, False, False])
    for scale in ("std", "none"):
        got = flat_group_advantages(r, g, scale=scale, valid=valid)
        want = torch.zeros(8)
        want[valid] = flat_group_advantages(r[valid], g[valid], scale=scale)
        torch.testing.assert_close(got, want)
        assert got[~valid].eq(0).all()
    # a group left with one valid sequence has no baseline: 0 (std); one with none: 0
    got = flat_group_advantages(
        torch.tensor([1.0, 0.0, 2.0, 3.0]),
        torch.tensor([0, 0, 1, 1]),
        valid=torch.tensor([True, False, False, False]),
    )
    assert got.eq(0).all()
    with pytest.raises(ValueError, match="finite"):  # a valid reward must still be finite
        flat_group_advantages(r, g, valid=torch.ones(8, dtype=torch.bool))


def _batch(tok, texts_by_prompt: dict[int, list[str]]) -> RolloutBatch:
    rows, prompt, lengths = [], [], []
    for p, texts in texts_by_prompt.items():
        for t in texts:
            ids = tok.encode(t, add_special_tokens=False) + [tok.eos_token_id]
            rows.append(ids)
            prompt.append(p)
            lengths.append(len(ids))
    width = max(lengths)
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    return RolloutBatch(
        prompt_index=torch.tensor(prompt),
        generator=torch.zeros(len(rows), dtype=torch.long),
        completion_ids=ids,
        lengths=torch.tensor(lengths),
        sampler_logprobs=torch.zeros(ids.shape),
    )


def test_training_leaves_an_excluded_completion_out_of_its_groups_advantages():
    """scoring.score -> finite_rewards -> select/concat -> advantages_for, as the F-TIS and
    FGRPO steps call them: the excluded completion gets advantage 0, the others the advantages
    of their group without it."""
    from ftis.models.tokenizer import char_tokenizer

    tok = char_tokenizer()
    task = build_task(
        ArithmeticTaskConfig(ops={"+": 1.0}, reward="trl_style_rewards:accuracy_reward")
    )
    train = task.split("train")
    a0, a1 = train[0].answer, train[1].answer
    batch = _batch(tok, {0: [a0, "?", "1", "2"], 1: ["3", a1, a1, "?"]})
    rewards, bad = scoring.finite_rewards(scoring.score(task, tok, batch))
    assert bad == 0
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert task.pop_reward_stats()["reward/excluded"] == 2.0
    adv = scoring.advantages_for(batch, rewards, "std")
    excluded = torch.tensor([False, True, False, False, False, False, False, True])
    want = torch.zeros(8)
    want[~excluded] = flat_group_advantages(rewards[~excluded], batch.prompt_index[~excluded])
    torch.testing.assert_close(adv, want)
    assert adv[0] > 0 and adv[1] == 0 and adv[7] == 0
    # without the mask the "?" completions would pull their groups' baselines down
    plain = flat_group_advantages(rewards, batch.prompt_index)
    assert not torch.allclose(plain, want)
    # the exclusions follow the sequences through the selections of a training step
    order = torch.tensor([4, 5, 6, 7, 0, 1, 2, 3])
    moved = RolloutBatch.concat([batch.select(order[:4]), batch.select(order[4:])], 0)
    torch.testing.assert_close(scoring.advantages_for(moved, rewards[order], "std"), want[order])
    kept = torch.tensor([0, 1, 2, 3])
    got = scoring.advantages_for(batch.select(kept), rewards[kept], "none", by="generator")
    torch.testing.assert_close(
        got,
        flat_group_advantages(
            rewards[kept], batch.prompt_index[kept], scale="none", valid=~excluded[kept]
        ),
    )
    # an explicit mask wins; a later score without exclusions forgets them
    assert (
        scoring.advantages_for(batch, rewards, "std", excluded=torch.zeros(8, dtype=bool))
        .ne(want)
        .any()
    )
    scoring.score(task, tok, _batch(tok, {0: [a0, "1"]}))
    torch.testing.assert_close(scoring.advantages_for(batch, rewards, "std"), plain)
