"""Reward failures are loud (issue 36, item 2): past `task.reward_max_error_share` of a step's
completions the run stops with one line naming the function, the exception and its file:line;
below it, each function's first failure is named once (log, rows, report.md, the console
summary) and counted; a wrong return value is "returned ...", not "raised"."""

from __future__ import annotations

import json
import sys
import types

import pytest
import yaml
from typer.testing import CliRunner

from ftis.config import load_config
from ftis.rewards import RewardTerm
from ftis.rewards.runtime import MIN_CALLS_TO_STOP_EARLY, Reward, RewardFailure
from ftis.tasks import build_task
from ftis.tasks.base import Problem

MOD = types.ModuleType("failing_rewards")


def always(prompt, completion, fields):
    return {}["missing"]  # the KeyError's line is this one


def string(prompt, completion, fields):
    return "1.0"


def none(prompt, completion, fields):
    return None


def nan(prompt, completion, fields):
    return float("nan")


def odd(prompt, completion, fields):
    if int(fields["n"]) % 2:
        raise ValueError(f"odd {fields['n']}")
    return 1.0


for _f in (always, string, none, nan, odd):
    setattr(MOD, _f.__name__, _f)
sys.modules["failing_rewards"] = MOD
LINE = always.__code__.co_firstlineno + 1


def problems(n: int) -> list[Problem]:
    return [Problem(i, f"q{i}", str(i), fields={"n": i}) for i in range(n)]


def reward(name: str, **kw) -> Reward:
    return Reward([RewardTerm(function=f"failing_rewards:{name}")], **kw)


def test_an_always_failing_reward_stops_the_step_with_its_exception_and_line():
    r = reward("always")
    with pytest.raises(RewardFailure) as err:
        r.score(problems(MIN_CALLS_TO_STOP_EARLY), ["x"] * MIN_CALLS_TO_STOP_EARLY)
    msg = str(err.value)
    assert "\n" not in msg
    assert "failing_rewards:always" in msg and "KeyError: 'missing'" in msg
    assert f"{__file__}:{LINE} in always" in msg
    assert "task.reward_max_error_share = 0.5" in msg


def test_a_small_step_is_judged_at_its_row():
    r = reward("always")
    assert r.score(problems(2), ["x", "y"]) == [0.0, 0.0]  # too few calls to judge yet
    with pytest.raises(RewardFailure, match="failed on 2 of the 2 completions"):
        r.pop_stats()


def test_below_the_bound_failures_are_counted_and_named_once(caplog):
    r = reward("odd", max_error_share=0.6)
    with caplog.at_level("DEBUG", logger="ftis.rewards.runtime"):
        assert r.score(problems(4), ["x"] * 4) == [1.0, 0.0, 1.0, 0.0]
        row = r.pop_stats()
        r.score(problems(4), ["x"] * 4)
        second = r.pop_stats()
    assert row["reward/errors/failing_rewards:odd"] == 2.0
    first = row["reward/first_error/failing_rewards:odd"]
    assert first.startswith("raised ValueError: odd 1 at ") and " in odd" in first
    assert second["reward/errors/failing_rewards:odd"] == 2.0
    assert "reward/first_error/failing_rewards:odd" not in second  # once per run
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelname == "WARNING"]
    assert len(warnings) == 1 and "failing_rewards:odd raised ValueError: odd 1" in warnings[0]


@pytest.mark.parametrize(
    "name, what",
    [
        ("string", "returned str '1.0', not a number"),
        ("none", "returned None, not a number"),
        ("nan", "returned float nan, not a finite number"),
    ],
)
def test_a_wrong_value_is_named_as_returned(name, what, caplog):
    r = reward(name, max_error_share=1.0)
    with caplog.at_level("WARNING", logger="ftis.rewards.runtime"):
        assert r.score(problems(1), ["x"]) == [0.0]
    first = r.pop_stats()[f"reward/first_error/failing_rewards:{name}"]
    assert first.startswith(what) and "defined at " in first and "raised" not in first
    assert what in caplog.records[0].getMessage()
    assert "raised" not in caplog.records[0].getMessage()
    with pytest.raises(RewardFailure, match=what):  # with the default bound: a stop
        reward(name).score(problems(8), ["x"] * 8)


def test_the_bound_is_the_task_configs():
    cfg = load_config(None, ["task.reward=failing_rewards:odd", "task.reward_max_error_share=0.25"])
    task = build_task(cfg.task)
    assert task.reward_fn.max_error_share == 0.25
    assert build_task(load_config(None, []).task).reward_fn.max_error_share == 0.5
    with pytest.raises(Exception, match="reward_max_error_share"):
        load_config(None, ["task.reward_max_error_share=1.5"])


def test_report_lines_name_each_failing_function():
    from ftis.report import reward_failure_warnings, zero_reward_warnings

    rows = [
        {"step": 0, "node": "a", "reward/scored": 8, "reward/errors/f.py:g": 0},
        {
            "step": 1,
            "node": "a",
            "reward/scored": 16,
            "reward/errors/f.py:g": 3,
            "reward/first_error/f.py:g": "raised KeyError: 'x' at /u/f.py:4 in g",
            "reward/nonzero": 5,
        },
        {"step": 2, "node": "a", "reward/scored": 16, "reward/errors/f.py:g": 1},
    ]
    lines = reward_failure_warnings(rows)
    assert lines == [
        "node a: reward f.py:g failed on 4 of the 40 completions scored (each scored 0 from "
        "it); the first raised KeyError: 'x' at /u/f.py:4 in g."
    ]
    assert zero_reward_warnings(rows) == lines  # what the console summary prints


def _config(tmp_path, reward_file: str, **task) -> str:
    (tmp_path / "rw.py").write_text(reward_file)
    cfg = {
        "name": "rw",
        "task": {
            "kind": "arithmetic",
            "ops": {"+": 1.0},
            "max_digits": 2,
            "test_size": 8,
            "reward": f"{tmp_path / 'rw.py'}:score",
            **task,
        },
        "nodes": [{"name": "xs", "model": {"preset": "llama-xs"}}],
        "train": {"steps": 2, "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 3},
        "eval": {"every": 2, "size": 8, "pass_samples": 0},
        "log": {"progress": False},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


ALWAYS = "def score(prompt, completion, fields):\n    return 1 / 0\n"
SOMETIMES = (
    "calls = [0]\n"
    "def score(prompt, completion, fields):\n"
    "    calls[0] += 1\n"
    "    if calls[0] % 5 == 0:\n"
    "        raise RuntimeError('judge timed out')\n"
    "    return float(completion.strip() == fields['answer'])\n"
)


@pytest.mark.slow
def test_a_run_whose_reward_always_raises_stops_non_zero_with_its_exception(tmp_path):
    from ftis.cli import app

    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", _config(tmp_path, ALWAYS), "--out", str(out)])
    assert res.exit_code not in (0, None), res.output
    text = " ".join(res.output.split())
    assert "reward rw.py:score failed on" in text
    assert "ZeroDivisionError: division by zero" in text
    assert f"{tmp_path / 'rw.py'}:2 in score" in text


@pytest.mark.slow
def test_a_sometimes_failing_reward_is_counted_and_named_in_the_report(tmp_path):
    from ftis.cli import app

    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", _config(tmp_path, SOMETIMES), "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    failed = sum(r.get("reward/errors/rw.py:score", 0) for r in rows)
    scored = sum(r["reward/scored"] for r in rows)
    assert failed == scored // 5
    report = (out / "report.md").read_text()
    line = (
        f"node xs: reward rw.py:score failed on {int(failed)} of the {int(scored)} completions "
        "scored (each scored 0 from it); the first raised RuntimeError: judge timed out at "
        f"{tmp_path / 'rw.py'}:5 in score."
    )
    assert line in report
    assert "judge timed out" in res.output  # the console summary's warning
