"""An arms study's document as its renderer declares it: a title, a note, and a body of sections
(ftis.study.tables formats their cells). `arms_renderer` gives the function the registry calls
(ftis.study.registry: `render(study, results, missing, out_dir, report_path, reading)`), with
the opening (ftis.study.arms.document_head: provenance, code, set-up) and the close (runs table,
hand-written reading) every arms document shares; the body sees one `Page`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftis.report import save_figure
from ftis.study.arms import ArmResult, document_head, document_tail, image
from ftis.study.spec import Study


@dataclass(frozen=True)
class Page:
    """What a document's body is drawn from: the study, its complete runs, where they are and
    where the document goes."""

    study: Study
    results: list[ArmResult]
    missing: list[str]
    out_dir: Path
    report_path: Path
    reading: str

    @property
    def assets(self) -> Path:
        """The folder of the document's plots: results/<document name>/ next to it."""
        return self.report_path.parent / "results" / self.report_path.stem

    def figure(self, name: str, alt: str, draw: Callable[[Study, list, Path], bool]) -> list[str]:
        """The Markdown image of the plot `draw(study, results, path)` writes to `name` in
        `assets`, and a blank line; nothing where it drew nothing."""
        path = self.assets / name
        return figure_lines(draw(self.study, self.results, path), path, self.report_path, alt)


def figure_lines(drawn: bool, path: Path, report: Path, alt: str, *intro: str) -> list[str]:
    """Where a plot was `drawn` at `path`: its intro paragraphs and its Markdown image (relative
    to the document `report`), each followed by a blank line; nothing otherwise."""
    if not drawn:
        return []
    lines = []
    for paragraph in intro:
        lines += [paragraph, ""]
    return [*lines, image(path, report, alt), ""]


def section(title: str, lines: list[str], *intro: str, end: bool = True) -> list[str]:
    """'## title', its intro paragraphs, `lines` (and a blank line unless `end` is False: a
    table of paired differences ends with its own summary); nothing where `lines` is empty."""
    if not lines:
        return []
    head = [f"## {title}", ""]
    for paragraph in intro:
        head += [paragraph, ""]
    return [*head, *lines, *([""] if end else [])]


def arms_renderer(
    *, title: str, note: str, body: Callable[[Page], list[str]]
) -> Callable[..., str]:
    """The renderer of an arms study's document: `title` after the study's name, `note` after
    the provenance line, then `body(page)`, the runs table and the reading."""

    def render(
        study: Study,
        results: list[ArmResult],
        missing: list[str],
        out_dir: Path,
        report_path: Path,
        reading: str,
    ) -> str:
        page = Page(study, results, missing, out_dir, report_path, reading)
        head = document_head(study, results, missing, out_dir, title=title, note=note)
        return "\n".join([*head, *body(page), *document_tail(results, out_dir, reading)])

    return render


def finish_axes(
    ax: Any, *, xlabel: str, ylabel: str, legend: float = 7, fontsize: float | None = None
) -> None:
    """The axes' labels (font size `fontsize`, else matplotlib's), a light grid and the legend
    (font size `legend`)."""
    size = {} if fontsize is None else {"fontsize": fontsize}
    ax.set_xlabel(xlabel, **size)
    ax.set_ylabel(ylabel, **size)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend)


def save(fig: Any, path: Path, *, dpi: int = 100) -> bool:
    """Write the figure at a results document's resolution (ftis.report.save_figure); True,
    the plot was drawn."""
    return save_figure(fig, path, dpi=dpi)


__all__ = ["Page", "arms_renderer", "figure_lines", "finish_axes", "save", "section"]
