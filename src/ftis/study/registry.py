"""What a study can be and who writes its document: two registries, filled by the systems.

A *study kind* says how a study file is read into runs, and (when an ordinary run from scratch
is not all) when a run is done and how one is brought there; `ftis sweep` picks it by the
file's `kind:` ("grid" when absent). ftis itself registers "grid" (loss methods x pairings x
seeds, ftis.study.spec) and "arms" (any run configs x seeds, ftis.study.arms); a system whose study needs more (FGRPO derives its centralized and alone
baselines from the federation and evaluates them on every client) registers its own kind.

A *study renderer* writes a study's document from its complete runs: `render(study, results,
missing, out_dir, report_path, reading) -> str` (it may draw its own PNGs next to the document),
with an optional `collect(study, out_dir) -> (results, missing)` when the rows the kind collects
are not what it wants. Each system registers its renderer next to its algorithm, with
"module:attr" strings imported on first use, as it registers its report section:

    from ftis.study.registry import register_study_renderer

    register_study_renderer("mine", "my_package.study_results:render")

and a study names it (`results: mine`). This module imports nothing of ftis at load time, so
that ftis.algos can register into it; the study package itself never imports an algorithm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftis.plugins import registered
from ftis.plugins import resolve as _resolve

Target = str | Callable[..., Any]


def resolve(target: Target) -> Callable[..., Any]:
    """A "module:attr" target imported now, or the callable itself (ftis.plugins.resolve)."""
    return _resolve(target)


@dataclass(frozen=True)
class StudyRenderer:
    """A registered study renderer (see the module docstring)."""

    name: str
    render: Target
    collect: Target | None = None
    kinds: tuple[str, ...] | None = None  # the study kinds it can render; None: any

    def render_fn(self) -> Callable[..., str]:
        return resolve(self.render)

    def collect_fn(self) -> Callable[..., Any] | None:
        return None if self.collect is None else resolve(self.collect)


@dataclass(frozen=True)
class StudyKind:
    """A registered study kind.

    load(path) -> study: reads and validates the file (raising StudyError with the fix) and
        expands it into runs; the study has `.spec` (with `.name`, `.report`, `.out` and, when
        the kind lets a file choose its renderer, `.results`), `.path`, `.runs` and `.out_dir`.
    status(run, run_dir) -> str: "done" when the run needs nothing more (default: every node
        logged its last step); anything else is handed to `execute`.
    execute(run, run_dir, status, *, console) -> seconds: brings one run to "done" (default:
        an ordinary run from scratch). The engine's one loop (ftis.study.runner.run_study)
        runs a study's runs seed by seed, skips the done ones and goes on past a failure.
    plan(study, *, out_dir, only) -> (header, rows): the `--dry-run` table, strings.
    collect(study, out_dir) -> (results, missing): the complete runs' results, for renderers
        that register no collect of their own.
    results: the renderer used when the study's spec names none.
    """

    name: str
    load: Target
    status: Target | None = None
    execute: Target | None = None
    plan: Target = "ftis.study.engine:plan_table"
    collect: Target = "ftis.study.arms:collect"
    results: str | None = None


STUDY_KINDS: dict[str, StudyKind] = {}
STUDY_RENDERERS: dict[str, StudyRenderer] = {}


def register_study_kind(
    name: str,
    load: Target,
    *,
    status: Target | None = None,
    execute: Target | None = None,
    plan: Target = "ftis.study.engine:plan_table",
    collect: Target = "ftis.study.arms:collect",
    results: str | None = None,
) -> StudyKind:
    """Make `kind: <name>` readable by `ftis sweep` (replacing an earlier registration)."""
    kind = StudyKind(name, load, status, execute, plan, collect, results)
    STUDY_KINDS[name] = kind
    return kind


def register_study_renderer(
    name: str,
    render: Target,
    *,
    collect: Target | None = None,
    kinds: tuple[str, ...] | None = None,
) -> StudyRenderer:
    """Make `results: <name>` available to studies of `kinds` (any kind when None), replacing
    an earlier registration."""
    r = StudyRenderer(name, render, collect, None if kinds is None else tuple(kinds))
    STUDY_RENDERERS[name] = r
    return r


def _load_systems() -> None:
    """Import the systems, which register their kinds and renderers (ftis.algos, $FTIS_PLUGINS)."""
    from ftis.plugins import load_plugins

    load_plugins()


def get_study_renderer(name: str, kind: str | None = None) -> StudyRenderer:
    """The registered renderer `name` (that renders studies of `kind`, when given), or a
    ValueError listing the ones that would do."""
    if name not in STUDY_RENDERERS:
        _load_systems()
    fits = sorted(
        n for n, r in STUDY_RENDERERS.items() if kind is None or r.kinds is None or kind in r.kinds
    )
    if name not in fits:
        if name in STUDY_RENDERERS:
            why = f"renders no study of kind {kind!r}"
        else:
            why = "is not a registered study renderer"
        raise ValueError(
            f"results: {name!r} {why}; choose one of: {', '.join(fits)} (a system registers "
            "its own with ftis.study.registry.register_study_renderer)"
        )
    return STUDY_RENDERERS[name]


def get_study_kind(name: str) -> StudyKind:
    """The registered study kind `name`, or a ValueError listing the known ones."""
    return registered(
        STUDY_KINDS,
        name,
        lambda known: (
            f"kind: {name!r} is not a study kind; choose one of: {known}"
            " (or leave `kind` out for a grid study)"
        ),
    )


register_study_kind("grid", "ftis.study.spec:load_study")  # renderer: its `results` (default ftis)
register_study_kind("arms", "ftis.study.arms:load_arms_study", plan="ftis.study.arms:plan_table")
