"""The prompts task (your own rows: `prompt` or `messages`), tasks registered by plugins, the
GSM8K warm start's target, and the zero-reward warnings."""

from __future__ import annotations

import json
import logging
from typing import Literal

import pytest

from ftis.config import ConfigError, load_config
from ftis.models.tokenizer import char_tokenizer
from ftis.tasks import GSM8KTask, PromptsTask, TaskConfigBase, build_task, register_task
from ftis.tasks.base import Problem, TaskDataError

ROWS = [
    {"messages": [{"role": "user", "content": f"{i}+1?"}], "answer": str(i + 1)} for i in range(8)
] + [{"prompt": "say hi", "answer": "hi", "level": 3}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_rows_split_and_fields(tmp_path):
    f = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    task = PromptsTask({"train_file": f, "test_fraction": 0.25})
    train, test = task.split("train"), task.split("test")
    # ceil(0.25 * 9) = 3 held out, the rest trains; disjoint, and the same on every build
    assert (len(train), len(test)) == (6, 3)
    assert {p.question for p in train}.isdisjoint({p.question for p in test})
    again = PromptsTask({"train_file": f, "test_fraction": 0.25})
    assert [p.question for p in again.split("test")] == [p.question for p in test]
    hi = next(p for p in (*train, *test) if p.question == "say hi")
    assert hi.fields["level"] == 3 and hi.answer == "hi"
    chat = next(p for p in (*train, *test) if p.question != "say hi")
    assert chat.question.startswith("user: ") and chat.question.endswith("+1?")


def test_plain_prompt_without_a_chat_template(tmp_path):
    f = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    task = PromptsTask({"train_file": f, "test_file": f, "system_prompt": "be brief"})
    tok = char_tokenizer()
    assert tok.chat_template is None
    by_q = {p.question: p for p in task.split("test")}
    ids = task.prompt_ids(by_q["say hi"], tok)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids[1:]) == "system: be brief\nuser: say hi\nassistant: "
    chat = by_q["user: 0+1?"]
    assert tok.decode(task.prompt_ids(chat, tok)[1:]) == "user: 0+1?\nassistant: "


def test_chat_template_applied_per_tokenizer(tmp_path):
    f = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    task = PromptsTask({"train_file": f, "test_file": f})
    tok = char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    chat = next(p for p in task.split("test") if p.question == "user: 3+1?")
    assert tok.decode(task.prompt_ids(chat, tok)) == "[user]3+1?[assistant]"
    plain = PromptsTask({"train_file": f, "test_file": f, "use_chat_template": False})
    assert tok.decode(plain.prompt_ids(chat, tok)[1:]) == "user: 3+1?\nassistant: "


def test_csv_and_a_saved_dataset_directory(tmp_path):
    (tmp_path / "rows.csv").write_text("prompt,answer\nwhat is 2+2,4\nwhat is 3+3,6\n")
    task = PromptsTask({"train_file": str(tmp_path / "rows.csv"), "test_fraction": 0.5})
    assert sorted(p.answer for p in (*task.split("train"), *task.split("test"))) == ["4", "6"]
    datasets = pytest.importorskip("datasets")
    ds = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}] * 3),
            "test": datasets.Dataset.from_list([{"prompt": "b", "answer": "2"}]),
        }
    )
    ds.save_to_disk(str(tmp_path / "saved"))
    spec = f"hf://{tmp_path / 'saved'}"
    task = PromptsTask({"train_file": spec, "test_file": spec})
    assert [p.question for p in task.split("train")] == ["a", "a", "a"]
    assert [p.question for p in task.split("test")] == ["b"]


def test_bad_rows_are_one_clear_error(tmp_path):
    f = write_jsonl(tmp_path / "rows.jsonl", [{"text": "x"}, {"text": "y"}])
    with pytest.raises(TaskDataError, match="neither 'prompt' nor 'messages'.*set prompt_field"):
        PromptsTask({"train_file": f, "test_fraction": 0.5})


def test_the_prompts_task_needs_a_reward_and_a_warm_start_target(tmp_path):
    f = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    base = [f"task={json.dumps({'kind': 'prompts', 'train_file': f})}"]
    with pytest.raises(ConfigError, match="no built-in reward.*set task.reward"):
        load_config(None, [*base, "nodes.0.warm_start=null"])
    with pytest.raises(ConfigError, match="task.warmstart_field"):
        load_config(None, [*base, "task.reward=builtin:exact_match"])  # the default has one
    cfg = load_config(
        None, [*base, "task.reward=builtin:exact_match", "task.warmstart_field=answer"]
    )
    task = build_task(cfg.task)
    p = task.split("train")[0]
    assert task.warmstart_target(p) == p.fields["answer"]
    assert task.reward(p, p.fields["answer"]) == 1.0


# ---- a task registered by a plugin ----------------------------------------------------------


class EchoConfig(TaskConfigBase):
    kind: Literal["echo"] = "echo"
    word: str = "ok"


class EchoTask:
    name = "echo"
    eval_splits = ("test",)

    def __init__(self, cfg: EchoConfig) -> None:
        self.cfg = cfg
        self.problems = [Problem(i, f"say {cfg.word}", cfg.word) for i in range(4)]

    def split(self, name):
        return self.problems

    def prompt_ids(self, problem, tokenizer):
        return tokenizer.encode(problem.question, add_special_tokens=False)

    def reward(self, problem, completion):
        return 1.0 if completion == problem.answer else 0.0


def test_a_registered_task_validates_and_builds_like_a_built_in_one():
    register_task("echo", EchoConfig, EchoTask)
    cfg = load_config(None, ['task={"kind": "echo", "word": "yo"}', "nodes.0.warm_start=null"])
    assert isinstance(cfg.task, EchoConfig) and cfg.task.word == "yo"
    task = build_task(cfg.task)
    assert task.reward_fn.names == ["echo:reward"]  # its own method, by default
    assert task.reward(task.split("test")[0], "yo") == 1.0
    with pytest.raises(ConfigError, match="did you mean task.word"):
        load_config(None, ['task={"kind": "echo", "wrd": "yo"}'])
    with pytest.raises(ConfigError, match="unknown task kind 'nope'.*echo"):
        load_config(None, ['task={"kind": "nope"}'])


# ---- GSM8K warm start and zero-reward warnings ---------------------------------------------


def test_gsm8k_warm_start_trains_on_the_rewards_full_format():
    task = GSM8KTask(
        {
            "train_file": "fixture:gsm8k_tiny_train.jsonl",
            "test_file": "fixture:gsm8k_tiny_test.jsonl",
        }
    )
    first = task.split("train")[0]
    # the record: "In total she picks 14+9=<<14+9=23>>23 apples.\nAfter giving some away she has
    # 23-5=<<23-5=18>>18 apples.\n#### 18"
    assert task.warmstart_target(first) == (
        "<think> In total she picks 14+9=23 apples. After giving some away she has 23-5=18 "
        "apples. </think><answer> 18 </answer>"
    )
    for p in task.split("train"):
        assert task.reward(p, task.warmstart_target(p)) == 1.0, p


def test_zero_rewards_of_the_first_steps_are_warned_about(caplog):
    from ftis.report import zero_reward_warnings
    from ftis.train.loop import _reward_stats, _warn_if_zero_rewards

    rows = (
        [
            {
                "step": s,
                "node": "a",
                "reward/scored": 8.0,
                "reward/nonzero": 0.0,
                "reward/errors/m:f": 1.0 if s == 2 else 0.0,
            }
            for s in range(7)
        ]
        + [
            {"step": s, "node": "b", "reward/scored": 8.0, "reward/nonzero": float(s == 4)}
            for s in range(7)
        ]
        + [{"step": 0, "node": "c"}]
    )  # rows without the counters say nothing
    line, failures = zero_reward_warnings(rows)
    assert line.startswith("node a: all 48 completions scored in steps 0-5 earned reward 0")
    assert "m:f failed" in line and "samples.jsonl" in line
    # the failing function also gets its own line (its count; no first message in these rows)
    assert (
        failures
        == "node a: reward m:f failed on 1 of the 56 completions scored (each scored 0 from it)."
    )

    task = build_task({"kind": "arithmetic", "reward": "builtin:gsm8k_format"})
    p = task.split("test")[0]
    task.rewards([p, p], ["1", "2"])
    assert _reward_stats(task)["reward/nonzero"] == 0.0
    with caplog.at_level(logging.WARNING, logger="ftis.train.loop"):
        _warn_if_zero_rewards(task, "a", 5)
    assert "every one of the 2 completions scored in steps 0-5 earned reward 0" in caplog.text
    assert "special tokens" in caplog.text
    caplog.clear()
    task.rewards([p], ["<think> </think><answer> 1 </answer>"])
    with caplog.at_level(logging.WARNING, logger="ftis.train.loop"):
        _warn_if_zero_rewards(task, "a", 5)
    assert caplog.text == ""


def test_a_task_from_ftis_plugins(tmp_path, monkeypatch):
    (tmp_path / "shout_plugin.py").write_text(
        "from typing import Literal\n"
        "from ftis.tasks import TaskConfigBase, register_task\n"
        "class ShoutConfig(TaskConfigBase):\n"
        "    kind: Literal['shout'] = 'shout'\n"
        "register_task('shout', ShoutConfig, 'tests.tasks.test_prompts:EchoTask')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="unknown task kind 'shout'"):
        load_config(None, ['task={"kind": "shout"}', "nodes.0.warm_start=null"])
    monkeypatch.setenv("FTIS_PLUGINS", "shout_plugin")
    cfg = load_config(None, ['task={"kind": "shout"}', "nodes.0.warm_start=null"])
    assert cfg.task.kind == "shout" and type(cfg.task).__name__ == "ShoutConfig"


def test_a_warm_start_needs_no_reward_but_a_target(tmp_path):
    from ftis.tasks import PromptsTaskConfig
    from ftis.warmstart import warmstart_task
    from ftis.warmstart_config import WarmStartConfig

    f = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    ws = WarmStartConfig(steps=1)
    # the reward may live on the nodes only: the warm start builds the task without one
    task = warmstart_task(PromptsTaskConfig(train_file=f, warmstart_field="answer"), ws)
    p = task.split("train")[0]
    assert task.warmstart_target(p) == p.fields["answer"]
    with pytest.raises(ValueError, match="warm_start refused.*warmstart_field"):
        warmstart_task(PromptsTaskConfig(train_file=f), ws)
