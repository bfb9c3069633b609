"""The package's layers, top to bottom (docs/design.md, "Layers").

A module may import modules of its own layer and of the layers below it, never above:
`tests/test_layers.py` reads every import in `src/ftis` (module level and inside functions;
imports under `if TYPE_CHECKING:` are annotations, not dependencies) and fails on any that
points up, and on any module that no layer claims. Kinds are looked up, never imported upward:
the registries live in the foundation (`ftis.plugins`, `ftis.tasks`' register_task,
`ftis.study.registry`), and `ftis.plugins.load_plugins` loads the systems by name, as it loads
any plugin.

    ftis layers        # the picture at the top of docs/design.md, from the code
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Layer:
    name: str
    what: str
    modules: tuple[str, ...]  # module prefixes; the longest matching prefix decides


LAYERS: tuple[Layer, ...] = (
    Layer(
        "entry points",
        "the command line, the Python API, the launcher's worker process",
        ("ftis.__main__", "ftis.cli", "ftis.api", "ftis.launch.worker"),
    ),
    Layer(
        "results",
        "each study's results document and each system's section of a run's report",
        ("ftis.results",),
    ),
    Layer(
        "systems",
        "one folder per system: its config, algorithm, launcher and study kind",
        ("ftis.algos",),
    ),
    Layer(
        "shell",
        "around a run: launcher, studies, report, preflight and check, export and eval",
        (
            "ftis.launch",
            "ftis.study",
            "ftis.report",
            "ftis.preflight",
            "ftis.check",
            "ftis.export",
            "ftis.offline_eval",
        ),
    ),
    Layer(
        "node",
        "one node: model, optimizer, sampling, scoring, updates, evaluation, warm start",
        ("ftis.train", "ftis.warmstart"),
    ),
    Layer("config", "the run config, assembled from what is registered", ("ftis.config",)),
    Layer(
        "parts",
        "tasks, rewards, models and tokenizers, the wire, rollouts, the run directory",
        (
            "ftis.tasks",
            "ftis.preferences",
            "ftis.rewards",
            "ftis.models",
            "ftis.exchange",
            "ftis.rollout",
            "ftis.rundir",
            "ftis.warmstart_config",
            "ftis.basemodels",
        ),
    ),
    Layer(
        "foundation",
        "pure tensor math; the registry and plugin loader; error formatting",
        ("ftis.core", "ftis.plugins", "ftis.validation", "ftis.layers"),
    ),
)


def module_name(path: Path) -> str:
    """`src/ftis/a/b.py` -> `ftis.a.b`; a package's `__init__.py` -> the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# The package itself (`ftis/__init__.py`: the version and a lazy `ftis.run`) is imported before
# any of its modules, whatever their layer: it belongs to no layer.
ROOT = "ftis"


def layer_of(module: str) -> int | None:
    """The index in LAYERS (0 = top) of the longest prefix that claims `module`, or None (the
    package root, or a module no layer claims)."""
    best, best_len = None, -1
    for i, layer in enumerate(LAYERS):
        for prefix in layer.modules:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(path: Path, *, types: bool = False) -> set[str]:
    """The ftis modules `path` imports anywhere (a `from X import y` counts X and, where it is
    a module, X.y), except under `if TYPE_CHECKING:` unless `types`."""
    me = module_name(path)
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking(node) and not types:
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = me.split(".") if is_pkg else me.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    return {m for m in out if m in modules and m not in (me, ROOT)}


def violations() -> list[tuple[str, str]]:
    """(importer, imported) for every import that points to a higher layer."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = module_name(path)
        mine = layer_of(me)
        for dep in sorted(imports_of(path)):
            theirs = layer_of(dep)
            if mine is not None and theirs is not None and theirs < mine:
                bad.append((me, dep))
    return bad


def circles() -> list[list[str]]:
    """Every import circle: the modules that import each other in a loop (each a strongly
    connected component of more than one module, sorted). Type-only imports count: a circle
    of annotations is still two modules that cannot be read, or moved, one without the other."""
    graph = {module_name(p): sorted(imports_of(p, types=True)) for p in PACKAGE.rglob("*.py")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm; the package is small enough to recurse
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def unclaimed() -> list[str]:
    """Modules no layer claims."""
    names = (module_name(p) for p in PACKAGE.rglob("*.py"))
    return sorted(m for m in names if m != ROOT and layer_of(m) is None)


def _systems() -> list[tuple[str, str]]:
    """(folder under ftis/algos, its registered kinds), from the registry."""
    from ftis.plugins import ALGORITHMS, load_plugins

    load_plugins()
    folders: dict[str, list[str]] = {}
    for kind, spec in ALGORITHMS.items():
        if not spec.config.__module__.startswith("ftis."):
            continue  # a plugin's (or a test's) kind: not part of the package's picture
        where = [spec.config.__module__]
        where += [t.partition(":")[0] for t in (spec.factory, spec.launcher) if isinstance(t, str)]
        folder = next(
            (m.split(".")[2] for m in where if m.startswith("ftis.algos.") and m.count(".") >= 3),
            "(outside ftis)",
        )
        folders.setdefault(folder, []).append(kind)
    return sorted(folders.items())


def diagram() -> str:
    """The layers, top to bottom, each with its packages, and where each system lives."""
    width = 92
    lines = ["```"]
    for i, layer in enumerate(LAYERS):
        title = f" {layer.name}: {layer.what} "
        lines.append("+" + title.center(width - 2, "-") + "+")
        mods = ", ".join(m.removeprefix("ftis.") or "ftis" for m in layer.modules)
        for chunk in _wrap(mods, width - 4):
            lines.append("| " + chunk.ljust(width - 4) + " |")
        if layer.name == "systems":
            for folder, kinds in _systems():
                row = f"  algos/{folder}/: {', '.join(kinds)}"
                lines.append("| " + row.ljust(width - 4) + " |")
        lines.append("+" + "-" * (width - 2) + "+")
        if i < len(LAYERS) - 1:
            lines.append(" " * (width // 2 - 1) + "|  imports only downward")
            lines.append(" " * (width // 2 - 1) + "v")
    lines.append("```")
    return "\n".join(lines) + "\n"


def write_diagram(path: Path) -> bool:
    """Replace the first fenced block of `path` (docs/design.md's picture) with `diagram()`;
    True when the file changed."""
    text = path.read_text()
    start = text.index("```\n")
    end = text.index("```\n", start + 4) + 4
    new = text[:start] + diagram() + text[end:]
    if new == text:
        return False
    path.write_text(new)
    return True


def _wrap(text: str, width: int) -> list[str]:
    out, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            out.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return [*out, line] if line else out
