"""The README's lists of kinds, methods and presets match the registries they describe, and its
sample config error is what the code prints (issue 36, item 7): a new kind, method or preset
fails here until the README names it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ftis.algos import ALGORITHMS
from ftis.cli import app
from ftis.core.losses import LOSS_TERMS, loss_methods
from ftis.models.presets import PRESETS
from ftis.tasks import TASKS

README = Path(__file__).resolve().parents[1] / "README.md"


def _cell(field: str) -> str:
    """The meaning cell of the README's config-table row for `field`."""
    for line in README.read_text().splitlines():
        if line.startswith(f"| `{field}`"):
            return line.split(" | ")[1]
    raise AssertionError(f"README has no config-table row for {field}")


def _ours(module: str) -> bool:
    """Registered by ftis itself (tests and plugins register kinds of their own)."""
    return module.startswith("ftis.")


def _algorithm_kinds() -> set[str]:
    return {k for k, s in ALGORITHMS.items() if _ours(s.config.__module__)}


def _task_kinds() -> set[str]:
    return {k for k, s in TASKS.items() if _ours(s.config.__module__)}


def _methods() -> set[str]:
    theirs = {n for n, t in LOSS_TERMS.items() if not _ours(t.fn.__module__)}
    return {m for m in loss_methods() if m.removeprefix("f-") not in theirs}


def _names(text: str) -> set[str]:
    return set(re.findall(r"`([a-z0-9][a-z0-9.-]*)`", text))


@pytest.mark.parametrize(
    "field, registry",
    [
        ("algorithm.kind", _algorithm_kinds),
        ("task.kind", _task_kinds),
        ("nodes[i].loss.method", _methods),
    ],
)
def test_each_registered_name_is_in_the_readme(field, registry):
    missing = registry() - _names(_cell(field))
    assert not missing, f"README's {field} row does not name {sorted(missing)}"


def test_the_readme_lists_exactly_the_loss_methods():
    assert _names(_cell("nodes[i].loss.method")) == _methods()


def test_the_readme_lists_every_preset():
    cell = _cell("nodes[i].model.preset` / `.path` / `.gguf` / `.name")
    listed = _names(cell[cell.index("tiny preset") : cell.index("`ftis presets`")])
    assert listed == set(PRESETS)


def test_the_readme_sample_error_is_what_ftis_prints():
    text = README.read_text()
    block = text[text.index("$ ftis run --set nodes.0.loss.method=ppo") :].split("```")[0]
    expected = [line.strip() for line in block.splitlines()[1:] if line.strip()]
    res = CliRunner().invoke(app, ["run", "--set", "nodes.0.loss.method=ppo"])
    assert res.exit_code != 0
    printed = [line.strip() for line in res.output.splitlines() if line.strip()]
    assert printed == expected
