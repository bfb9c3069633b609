"""The study engine: one way to read, list, run (with resume) and render any study.

    study = load_study("studies/population.yaml")   # by the file's `kind:` (grid when absent)
    header, rows = dry_run(study)                    # `ftis sweep --dry-run`
    run_study(study)                                 # every run not done yet, one at a time
    write_results(study)                             # the document, by the study's renderer

What a kind reads and runs, and which renderer writes a study's document, are looked up in
ftis.study.registry, where each system registers its own; nothing here knows an algorithm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

import ftis.study.runner as runner
from ftis.study.document import write_document
from ftis.study.registry import StudyKind, get_study_kind, get_study_renderer, resolve
from ftis.study.runner import SweepOutcome
from ftis.study.spec import StudyError


def kind_name(path: str | Path) -> str:
    """The `kind:` of a study file, "grid" when absent (or unreadable: its loader says why)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return "grid"
    kind = data.get("kind", "grid") if isinstance(data, dict) else "grid"
    return kind if isinstance(kind, str) else repr(kind)


def study_kind(study_or_path: Any) -> StudyKind:
    """The registered kind of a loaded study or of a study file (StudyError when unknown)."""
    if isinstance(study_or_path, str | Path):
        where, name = study_or_path, kind_name(study_or_path)
    else:
        where, name = study_or_path.path, getattr(study_or_path.spec, "kind", "grid")
    try:
        return get_study_kind(name)
    except ValueError as e:
        raise StudyError(f"study {where}: {e}") from None


def load_study(path: str | Path) -> Any:
    """Read, validate and expand a study file of any registered kind (no training)."""
    return resolve(study_kind(path).load)(path)


def _hooks(kind: StudyKind) -> dict[str, Any]:
    return {
        "status": None if kind.status is None else resolve(kind.status),
        "execute": None if kind.execute is None else resolve(kind.execute),
    }


def run_study(
    study: Any,
    *,
    out_dir: Path | None = None,
    only: str | None = None,
    console: Any = None,
    jobs: int = 1,
) -> SweepOutcome:
    """Run every selected run of `study` that is not done (ftis.study.runner.run_study, with
    its kind's hooks), `jobs` at a time."""
    hooks = _hooks(study_kind(study))
    return runner.run_study(study, out_dir=out_dir, only=only, console=console, jobs=jobs, **hooks)


def plan(study: Any, *, out_dir: Path | None = None, only: str | None = None) -> list[tuple]:
    """(run, status) for every selected run, by its kind's status (nothing is run)."""
    status = _hooks(study_kind(study))["status"]
    return runner.plan(study, out_dir=out_dir, only=only, status=status)


def plan_table(
    study: Any, *, out_dir: Path | None = None, only: str | None = None, variant: str = "variant"
) -> tuple[list[str], list[list[str]]]:
    """The default `--dry-run` table: run id, variant (headed `variant`), seed, status."""
    rows = [[r.id, r.variant, str(r.seed), s] for r, s in plan(study, out_dir=out_dir, only=only)]
    return ["run", variant, "seed", "status"], rows


def estimate(study: Any, *, out_dir: Path | None = None, only: str | None = None) -> str:
    """One line for `--dry-run`: the time the selected runs not yet done would take on this
    machine, from the seconds the done runs of the same variant took (their study-run.json);
    a variant with no done run is counted at the mean of all done runs, and said so."""
    rows = plan(study, out_dir=out_dir, only=only)
    base = Path(out_dir) if out_dir else study.out_dir
    done: dict[str, list[float]] = {}
    left = []
    for run, status in rows:
        key = str(getattr(run, "variant", ""))
        if status == "done":
            meta = runner.read_meta(base / run.id)
            if isinstance(meta.get("seconds"), (int, float)):
                done.setdefault(key, []).append(float(meta["seconds"]))
        else:
            left.append(key)
    if not left:
        return "estimate: every selected run is done"
    if not done:
        return (
            f"estimate: {len(left)} run(s) to do; no run is done yet, so no time estimate "
            "(the first runs' times give one)"
        )
    every = [x for xs in done.values() for x in xs]
    overall = sum(every) / len(every)
    guessed = sum(1 for k in left if k not in done)
    total = sum(sum(done[k]) / len(done[k]) if k in done else overall for k in left)
    line = (
        f"estimate: {len(left)} run(s) to do, about {total / 3600:.1f} h one at a time on this "
        f"machine (each at the mean time of the done runs of its variant, from {len(every)} "
        "done run(s)"
    )
    if guessed:
        line += f"; {guessed} of a variant with no done run, at the mean of all done runs"
    return line + ")"


def dry_run(
    study: Any, *, out_dir: Path | None = None, only: str | None = None
) -> tuple[list[str], list[list[str]]]:
    """The `--dry-run` table of any study, by its kind."""
    return resolve(study_kind(study).plan)(study, out_dir=out_dir, only=only)


def renderer_of(study: Any):
    """The registered renderer that writes `study`'s document: its spec's `results`, else its
    kind's default (StudyError when neither names a registered renderer)."""
    kind = study_kind(study)
    name = getattr(study.spec, "results", None) or kind.results
    if name is None:
        raise StudyError(
            f"study {study.path}: name the renderer of its document with `results:` "
            "(a study renderer registered by a system, e.g. population)"
        )
    try:
        return get_study_renderer(name, kind.name)
    except ValueError as e:
        raise StudyError(f"study {study.path}: {e}") from None


def write_results(
    study: Any, *, out_dir: Path | None = None, report_path: Path | None = None
) -> Path:
    """Regenerate `study`'s document (and its plots) from its run directories, with its
    renderer; the hand-written reading of the existing document is kept."""
    renderer = renderer_of(study)
    collect = renderer.collect_fn() or resolve(study_kind(study).collect)
    return write_document(study, out_dir, report_path, collect=collect, render=renderer.render_fn())
