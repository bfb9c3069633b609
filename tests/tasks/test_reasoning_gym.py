"""The reasoning-gym task (`task.kind: reasoning-gym`): config checks, held-out splits, prompts,
the reward's two terms, and a short run whose rows hold each dataset's accuracy."""

from __future__ import annotations

import json
import sys

import pytest

from ftis.config import ConfigError, RunConfig, load_config
from ftis.models.tokenizer import char_tokenizer
from ftis.tasks import build_task
from ftis.tasks.reasoning_gym import CORRECT, FORMAT, ReasoningGymTask, build_dataset

rg = pytest.importorskip("reasoning_gym")

# a small question space: held-out questions do come up among the train seeds
SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
MIX = {"basic_arithmetic": {"weight": 1, "options": SMALL}, "chain_sum": 2}


def task_config(**extra) -> str:
    return "task=" + json.dumps({"kind": "reasoning-gym", **extra})


def config_error(**task) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, [task_config(**task), "nodes.0.warm_start=null"])
    return str(e.value)


def test_config_names_and_options_are_checked_when_read():
    msg = config_error(datasets={"basic_arithmetc": 1, "chain_sum": 1})
    assert (
        "task: datasets: unknown reasoning-gym dataset(s) 'basic_arithmetc' (did you mean "
        "'basic_arithmetic'?); known: " in msg
    )
    assert "chain_sum" in msg and "spell_backward" in msg  # the known names are listed

    msg = config_error(datasets={"chain_sum": {"options": {"min_terms": 0}}})
    assert msg.count("\n") == 1  # "invalid config:" and one line
    assert "reasoning-gym dataset 'chain_sum' does not build with options {'min_terms': 0}" in msg

    msg = config_error(datasets={"chain_sum": {"options": {"nonsense": 3}}})
    assert "'chain_sum' does not build" in msg and "nonsense" in msg

    msg = config_error(datasets={"chain_sum": {"options": {"seed": 3}}})
    assert "options ['seed'] are the task's" in msg
    assert "every weight is 0" in config_error(datasets={"chain_sum": 0})

    # names and options pass through unchanged; a list of names weighs each 1
    cfg = load_config(None, [task_config(datasets=MIX), "nodes.0.warm_start=null"])
    assert cfg.task.datasets["basic_arithmetic"].options == SMALL
    assert cfg.task.datasets["chain_sum"].weight == 2
    assert [(t.function, t.weight) for t in cfg.task.reward] == [(CORRECT, 1.0), (FORMAT, 0.0)]
    listed = load_config(None, [task_config(datasets=["chain_sum"]), "nodes.0.warm_start=null"])
    assert listed.task.datasets["chain_sum"].weight == 1.0


def test_without_reasoning_gym_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` fails
    msg = config_error(datasets={"chain_sum": 1})
    assert "needs the reasoning-gym package: pip install 'ftis[reasoning-gym]'" in msg


def test_held_out_questions_are_never_trained_on():
    task = build_task({"kind": "reasoning-gym", "datasets": MIX, "size": 3000, "test_size": 32})
    assert task.eval_splits == ("test", "basic_arithmetic", "chain_sum")
    test, ba, cs = (task.split(s) for s in task.eval_splits)
    assert len(ba) == len(cs) == 32 and len({p.question for p in ba}) == 32
    assert [p.fields["dataset"] for p in test[:4]] == ["basic_arithmetic", "chain_sum"] * 2
    assert [p.index for p in test] == list(range(64))
    held = {p.question for p in test}
    train = task.split("train")
    assert len(train) == 3000
    questions = [p.question for p in train]
    assert held.isdisjoint(questions)
    # the small space does draw held-out questions from the train seeds: they were replaced
    raw = build_dataset("basic_arithmetic", SMALL, seed=0, size=3000)
    replaced = [
        p.index
        for p in train
        if p.fields["dataset"] == "basic_arithmetic" and raw[p.index]["question"] in held
    ]
    assert replaced
    # about twice as many chain_sum problems (weight 2), the same on every build
    n_cs = sum(p.fields["dataset"] == "chain_sum" for p in train)
    assert 0.6 < n_cs / 3000 < 0.73
    again = ReasoningGymTask(
        {"kind": "reasoning-gym", "datasets": MIX, "size": 3000, "test_size": 32}
    )
    assert [p.question for p in again.split("train")[:50]] == questions[:50]
    assert [p.question for p in again.split("test")] == [p.question for p in test]


def test_one_dataset_has_the_test_split_only_and_too_small_a_space_is_an_error():
    task = build_task({"kind": "reasoning-gym", "datasets": ["chain_sum"], "test_size": 4})
    assert task.eval_splits == ("test",)
    tiny = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    with pytest.raises(ValueError, match="'chain_sum' gave only .* distinct questions"):
        build_task(
            {
                "kind": "reasoning-gym",
                "datasets": {"chain_sum": {"options": tiny}},
                "test_size": 400,
            }
        )


def test_prompts_with_and_without_a_chat_template():
    cfg = {"kind": "reasoning-gym", "datasets": ["chain_sum"], "test_size": 2}
    task = build_task(cfg)
    p = task.split("test")[0]
    system = rg.utils.SYSTEM_PROMPTS["direct"]
    assert "<answer>" in system and task.system_prompt == system.strip()
    tok = char_tokenizer()
    assert tok.chat_template is None
    ids = task.prompt_ids(p, tok)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids[1:]) == f"{system.strip()}\n\nQuestion: {p.question}\nAnswer: "

    tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    assert tok.decode(task.prompt_ids(p, tok)) == (
        f"[system]{system.strip()}[user]{p.question}[assistant]"
    )
    own = build_task(
        {**cfg, "system_prompt": "Reply <answer>N</answer>.", "use_chat_template": False}
    )
    assert tok.decode(own.prompt_ids(p, tok)[1:]) == (
        f"Reply <answer>N</answer>.\n\nQuestion: {p.question}\nAnswer: "
    )


def test_the_reward_is_the_datasets_score_of_the_answer_block_and_its_format():
    task = build_task({"kind": "reasoning-gym", "datasets": MIX, "test_size": 2})
    p = task.split("chain_sum")[0]
    right, wrong = p.answer, str(int(p.answer) + 1)
    completions = [
        f"<answer>{right}</answer>",
        f"so <answer> {right} </answer>",  # reasoning-gym's extract_answer strips it
        f"<answer>{wrong}</answer>",
        right,  # no tag: no answer, no format
        f"<answer>{wrong}</answer> then <answer>{right}</answer>",  # the last block counts
    ]
    assert task.rewards([p] * 5, completions) == [1.0, 1.0, 0.0, 0.0, 1.0]
    # the same as the dataset's own score_answer
    dataset = rg.create_dataset("chain_sum", seed=0, size=1)
    assert dataset.score_answer(answer=wrong, entry=p.fields["entry"]) == 0.0
    assert task.pop_reward_stats() == {
        "reward/scored": 5.0,
        "reward/nonzero": 3.0,
        f"reward/{CORRECT}": pytest.approx(3 / 5),
        f"reward/{FORMAT}": pytest.approx(4 / 5),
    }
    assert task.extract_answer("x <answer> 12 </answer>") == "12"
    assert task.warmstart_target(p) == f"<answer>{right}</answer>"
    shaped = build_task(
        {
            "kind": "reasoning-gym",
            "datasets": MIX,
            "test_size": 2,
            "reward": {CORRECT: 0.9, FORMAT: 0.1},
        }
    )
    assert shaped.rewards([p] * 3, completions[2:5]) == pytest.approx([0.1, 0.0, 1.0])


def test_a_short_run_logs_each_datasets_accuracy(tmp_path):
    from ftis.report import summarize
    from ftis.train.loop import train_node

    data = {
        "name": "rg",
        "task": {
            "kind": "reasoning-gym",
            "datasets": {"basic_arithmetic": {"options": SMALL}, "chain_sum": 1},
            "size": 1000,
            "test_size": 4,
            "system_prompt": "Answer as <answer>N</answer>.",
        },
        "nodes": [{"name": "xs", "model": {"preset": "llama-xs"}, "warm_start": None}],
        "train": {"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "eval": {"every": 0, "size": 4, "pass_samples": 0},
        "log": {"progress": False},
    }
    train_node(RunConfig.model_validate(data), rank=0, run_dir=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        for split in ("test", "basic_arithmetic", "chain_sum"):
            assert 0.0 <= r[f"eval/{split}/accuracy"] <= 1.0
        assert 0.0 <= r[f"reward/{CORRECT}"] <= r[f"reward/{FORMAT}"] <= 1.0
    (summary,) = summarize(rows)
    assert {"basic_arithmetic_before", "chain_sum_after", "test_after"} <= set(summary)
