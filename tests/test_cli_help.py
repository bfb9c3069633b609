"""The command line as a package (issue 54 item 4): every verb answers --help with its options,
the verbs are the ones ftis has always had, `python -m ftis.cli` runs, and no module of
ftis/cli holds more than 300 lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer
from typer.testing import CliRunner

from ftis.cli import app

CLI = Path(__file__).resolve().parents[1] / "src" / "ftis" / "cli"
VERBS = {
    "run", "report", "compare", "sweep", "bench", "export", "check", "eval", "layers",
    "presets", "basemodels list", "basemodels build", "models list", "models fetch",
}  # fmt: skip


def _commands(cmd: click.Command, path: tuple[str, ...] = ()) -> dict[str, click.Command]:
    out = {" ".join(path): cmd} if path else {}
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            out.update(_commands(sub, (*path, name)))
    return out


COMMANDS = _commands(typer.main.get_command(app))


def test_the_verbs_are_the_ones_ftis_has():
    leaves = {p for p, c in COMMANDS.items() if not isinstance(c, click.Group)}
    assert leaves == VERBS


@pytest.mark.parametrize("path", sorted(COMMANDS))
def test_every_verb_answers_help_with_its_options(path):
    r = CliRunner().invoke(app, [*path.split(), "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "Usage:" in r.output
    for param in COMMANDS[path].params:
        for opt in param.opts if isinstance(param, click.Option) else ():
            assert opt in r.output, f"ftis {path} --help does not show {opt}"


def test_python_dash_m_runs_the_command_line():
    proc = subprocess.run(
        [sys.executable, "-m", "ftis.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "sweep" in proc.stdout and "basemodels" in proc.stdout


def test_no_module_of_the_command_line_is_long():
    long = {p.name: n for p in CLI.glob("*.py") if (n := len(p.read_text().splitlines())) > 300}
    assert long == {}, f"split these verb groups further: {long}"
