"""The package's layers (ftis.layers, docs/design.md "Layers", issue 39 items 1 and 7, issue 54
item 1): no module imports one above it, no modules import each other in a loop, every module
has a layer, and design.md's picture is the one the code draws."""

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


def test_no_import_circles():
    """No modules import each other in a loop, not even through annotations."""
    assert layers.circles() == [], "\n".join(" -> ".join(c) for c in layers.circles())


def test_the_checker_catches_a_circle(tmp_path, monkeypatch):
    """The check can fail: a loop of three modules, one of its arrows type-only and one inside
    a function, is found; a module importing into the loop without being imported back is not
    in it."""
    pkg = tmp_path / "ftis"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from ftis import b\n")
    (pkg / "b.py").write_text("def f():\n    from ftis.c import x\n    return x\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ftis.a import y\nx = 1\n"
    )
    (pkg / "d.py").write_text("from ftis import a\n")
    monkeypatch.setattr(layers, "PACKAGE", pkg)
    assert layers.circles() == [["ftis.a", "ftis.b", "ftis.c"]]
    (pkg / "c.py").write_text("x = 1\n")
    assert layers.circles() == []


def test_design_md_opens_with_the_picture_the_code_draws():
    design = (ROOT / "docs" / "design.md").read_text()
    assert layers.diagram() in design, "redraw it: ftis layers --write docs/design.md"
    assert design.index(layers.diagram()) < design.index("## One shell, many algorithms")
