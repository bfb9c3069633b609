"""The package's layers (ftis.layers, docs/design.md "Layers", issue 39 items 1 and 7): no
module imports one above it, every module has a layer, and design.md's picture is the one the
code draws."""

from __future__ import annotations

from pathlib import Path

from ftis import layers

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_has_a_layer():
    assert layers.unclaimed() == [], "add these modules to a layer in ftis/layers.py"


def test_no_module_imports_a_layer_above_it():
    bad = [
        f"{me} ({layers.LAYERS[layers.layer_of(me)].name}) imports {dep} "
        f"({layers.LAYERS[layers.layer_of(dep)].name})"
        for me, dep in layers.violations()
    ]
    assert bad == [], "\n".join(bad)


def test_the_checker_catches_an_upward_import(tmp_path, monkeypatch):
    """The check can fail: in a package laid out like ftis, core importing the command line is
    flagged (also from inside a function), a type-only import is not, nor is a downward one."""
    pkg = tmp_path / "ftis"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("from ftis.core import maths\n")
    (pkg / "config.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "maths.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ftis.config import X\n"
        "def f():\n    from ftis import cli\n    return cli\n"
    )
    monkeypatch.setattr(layers, "PACKAGE", pkg)
    assert layers.violations() == [("ftis.core.maths", "ftis.cli")]
    (pkg / "stray.py").write_text("")
    assert layers.unclaimed() == ["ftis.stray"]


def test_design_md_opens_with_the_picture_the_code_draws():
    design = (ROOT / "docs" / "design.md").read_text()
    assert layers.diagram() in design, "regenerate it: ftis layers"
    assert design.index(layers.diagram()) < design.index("## One shell, many algorithms")
