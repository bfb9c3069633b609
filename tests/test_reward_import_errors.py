"""Import errors that say what happened (issue 36, item 7): a reward module with a syntax error
is named with the error's file:line, a module whose own import fails with where it failed (not
"put it on PYTHONPATH"), a name that exists but is not a function as such; and README's sample
config error is the real one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ftis.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def _error(tmp_path, monkeypatch, source: str, name: str = "score") -> str:
    (tmp_path / "bad_reward_mod.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"task.reward=bad_reward_mod.py:{name}"])
    return str(err.value)


def test_a_syntax_error_is_named_with_its_file_and_line(tmp_path, monkeypatch):
    msg = _error(
        tmp_path, monkeypatch, "x = 1\ndef score(prompt, completion, fields)\n    return 1\n"
    )
    assert f"syntax error at {tmp_path / 'bad_reward_mod.py'}:2" in msg
    assert "PYTHONPATH" not in msg


def test_an_error_while_importing_is_named_with_where(tmp_path, monkeypatch):
    msg = _error(tmp_path, monkeypatch, "import json\n\nCONFIG = json.loads('{')\n")
    assert "importing" in msg and "raised JSONDecodeError" in msg
    assert f"{tmp_path / 'bad_reward_mod.py'}:3" in msg and "PYTHONPATH" not in msg


def test_a_module_whose_dependency_is_missing_is_not_told_to_go_on_pythonpath(
    tmp_path, monkeypatch
):
    (tmp_path / "dep_missing_mod.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        load_config(None, ["task.reward=dep_missing_mod:score"])
    msg = str(err.value)
    assert "importing 'dep_missing_mod' raised ModuleNotFoundError" in msg
    assert "no_such_dependency_xyz" in msg and f"{tmp_path / 'dep_missing_mod.py'}:1" in msg
    assert "PYTHONPATH" not in msg
    with pytest.raises(ConfigError, match="put the module on PYTHONPATH"):  # really missing
        load_config(None, ["task.reward=no_such_reward_module_xyz:score"])


@pytest.mark.parametrize("value, kind", [("3", "int"), ("None", "NoneType"), ("'x'", "str")])
def test_a_name_that_is_not_a_function_says_so(tmp_path, monkeypatch, value, kind):
    msg = _error(tmp_path, monkeypatch, f"score = {value}\n")
    assert f"'score' exists but is a {kind}" in msg and "not a function" in msg
    assert "has no" not in msg


def test_a_missing_name_lists_the_modules_functions(tmp_path, monkeypatch):
    msg = _error(tmp_path, monkeypatch, "def correct(p, c, f):\n    return 1.0\n", "score")
    assert "has no 'score'; its functions: ['correct']" in msg


def test_readme_sample_config_error_is_the_real_one():
    """README's sample error lists the loss methods; it is checked against the real message,
    so a new method cannot leave it stale."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(
        r"```\n\$ ftis run --set (nodes\.0\.loss\.method=ppo)\n(.*?)```", readme, re.S
    )
    assert block is not None, "README's sample config error is gone"
    with pytest.raises(ConfigError) as err:
        load_config(None, [block.group(1)])
    assert block.group(2) == f"error: {err.value}\n"
