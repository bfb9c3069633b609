"""task kind `verifiers`: a verifiers SingleTurnEnv written in a user's module drives ftis as
written: its dataset (held-out rows when it has no eval dataset), its rubric's functions with
their weights and parser (each a reward term whose failures ftis counts), its chat through a
template or as plain lines; multi-turn environments and group-level functions are refused."""

from __future__ import annotations

import textwrap

import pytest
from pydantic import TypeAdapter

pytest.importorskip("verifiers", reason="task kind verifiers needs pip install 'ftis[verifiers]'")

from ftis.rewards.runtime import task_rewards
from ftis.tasks import TaskConfig, build_task

ENV = """
import verifiers as vf
from datasets import Dataset

ROWS = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(4)]

def _rubric(parser, extra=()):
    def correct(completion, answer, parser, **kwargs):
        return 1.0 if parser.parse_answer(completion).strip() == answer else 0.0

    async def brief(completion):
        return 1.0 if len(completion[-1]["content"]) <= 2 else 0.0

    return vf.Rubric(funcs=[correct, brief, *extra], weights=[1.0, 0.5] + [1.0] * len(extra),
                     parser=parser)

def single(n=20, with_eval=False):
    parser = vf.Parser()
    kw = {"eval_dataset": Dataset.from_list(ROWS[:3])} if with_eval else {}
    return vf.SingleTurnEnv(dataset=Dataset.from_list(ROWS[:n]), system_prompt="Sum.",
                            parser=parser, rubric=_rubric(parser), **kw)

def failing():
    parser = vf.Parser()
    def broken(completion, **kwargs):
        raise RuntimeError("no luck")
    return vf.SingleTurnEnv(dataset=Dataset.from_list(ROWS), parser=parser,
                            rubric=_rubric(parser, extra=[broken]))

def grouped():
    parser = vf.Parser()
    def ranked(completions, answers, **kwargs):
        return [0.0 for _ in completions]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(ROWS), parser=parser,
                            rubric=_rubric(parser, extra=[ranked]))

class Talk(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [], state

def multi():
    return Talk(dataset=Dataset.from_list(ROWS), max_turns=3)

def broken_loader():
    raise OSError("the data is gone")

NOT_AN_ENV = 3
"""


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "user_envs.py"
    path.write_text(textwrap.dedent(ENV))
    return path


def _cfg(env_file, attr, **kw):
    return TypeAdapter(TaskConfig).validate_python(
        {"kind": "verifiers", "env": f"{env_file}:{attr}", "test_size": 4, **kw}
    )


def test_the_rubric_becomes_weighted_terms_and_rows_become_problems(env_file):
    cfg = _cfg(env_file, "single")
    names = [(t.function, t.weight) for t in cfg.reward]
    # verifiers' own turn counter (weight 0) is left out
    assert names == [("verifiers-rubric:correct", 1.0), ("verifiers-rubric:brief", 0.5)]
    task = build_task(cfg)
    train, test = task.split("train"), task.split("test")
    assert (len(train), len(test)) == (16, 4)
    assert not {p.question for p in train} & {p.question for p in test}  # held out
    p = test[0]
    assert p.question.startswith("system: Sum.\nuser: ")
    # the rubric's parser parses the chat completion; weights sum the terms
    assert task_rewards(task, [p, p, p], [p.answer, "99", p.answer + "000"]) == [1.5, 0.5, 0.0]


def test_an_eval_dataset_is_the_test_split(env_file):
    task = build_task(_cfg(env_file, "single", args={"with_eval": True}))
    assert [p.question.split("user: ")[1] for p in task.split("test")] == ["0+0=", "0+1=", "0+2="]
    assert len(task.split("train")) == 20


def test_prompts_go_through_the_template_or_as_plain_lines(env_file):
    from ftis.config import ModelConfig
    from ftis.models.loading import load_tokenizer

    task = build_task(_cfg(env_file, "single"))
    tok = load_tokenizer(ModelConfig(preset="llama-xs"))  # no chat template: plain lines
    p = task.split("test")[0]
    ids = task.prompt_ids(p, tok)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids[1:]) == p.question + "\nassistant: "
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    )
    assert tok.decode(task.prompt_ids(p, tok)) == (
        "<system>Sum.<user>" + p.question.split("user: ")[1] + "<assistant>"
    )


def test_a_failing_rubric_function_is_counted_by_ftis(env_file):
    task = build_task(_cfg(env_file, "failing", reward_max_error_share=1.0))
    p = task.split("test")[0]
    assert task_rewards(task, [p], [p.answer]) == [1.5]  # `broken` scores 0, counted
    assert dict(task.reward_fn.errors) == {"verifiers-rubric:broken": 1}
    assert "RuntimeError: no luck" in task.reward_fn.first_errors["verifiers-rubric:broken"]


def test_a_trl_batched_reward_gets_the_environment_s_chat(env_file, tmp_path):
    mod = tmp_path / "trl_rewards.py"
    mod.write_text(
        "def seen(prompts, completions, answer, **kw):\n"
        "    assert prompts[0][0] == {'role': 'system', 'content': 'Sum.'}, prompts[0]\n"
        "    return [1.0 if c[-1]['content'] == a else None for c, a in zip(completions, answer)]\n"
    )
    cfg = _cfg(env_file, "single", reward=[f"{mod}:seen"])
    task = build_task(cfg)
    p = task.split("test")[0]
    assert task.rewards_masked([p, p], [p.answer, "x"])[1] == [False, True]  # None: excluded


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        ("multi", "multi-turn or tool environment"),
        ("grouped", "scores a whole group"),
        ("broken_loader", "broken_loader(**task.args) raised OSError: the data is gone"),
        ("NOT_AN_ENV", "not a verifiers Environment"),
        ("nothing", "has no 'nothing'"),
    ],
)
def test_what_ftis_cannot_run_is_one_clear_error(env_file, attr, message):
    with pytest.raises(ValueError, match="task.env") as got:
        _cfg(env_file, attr)
    assert message in str(got.value)


def test_a_warm_start_needs_a_target_column(env_file):
    assert "warmstart_field" in _cfg(env_file, "single").warm_start_refusal()
    assert _cfg(env_file, "single", warmstart_field="answer").warm_start_refusal() is None


def test_building_an_environment_leaves_ftis_s_signal_handlers(env_file):
    import signal

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    _cfg(env_file, "single", args={"n": 12})  # verifiers' Environment sets handlers of its own
    assert {s: signal.getsignal(s) for s in before} == before
