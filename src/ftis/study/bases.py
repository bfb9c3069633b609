"""`ftis basemodels build`: train the warm starts that configs and studies use, and ship them.

Every (model, warm_start, task) that a node of the given configs and studies warm-starts is
trained here with the ordinary warm-start code (`ftis.warmstart.warm_start`, shipped bases
ignored, the local cache reused where it holds an entry trained here), then copied into
`<out>/<preset>-<base key>/` and recorded in `<out>/manifest.json` with each file's sha256, the
configs that use it and what it was built with (torch, CPU capability, device).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import platform
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ftis.basemodels import MANIFEST_FORMAT, MANIFEST_NAME, ROOT, read_manifest, sha256_file
from ftis.config import RunConfig, load_config
from ftis.models.config import ModelConfig
from ftis.warmstart_config import WarmStartConfig

log = logging.getLogger(__name__)

DEFAULT_NAME = "src/ftis/configs/default.yaml"


@dataclass
class WarmStartUse:
    """One distinct warm start and the configs/studies whose nodes ask for it."""

    model: ModelConfig
    warm_start: WarmStartConfig
    task: BaseModel
    sources: set[str] = field(default_factory=set)


def default_sources(repo: Path) -> list[Path]:
    """The committed configs and studies of a checkout: configs/**/*.yaml, studies/*.yaml."""
    return sorted((repo / "configs").rglob("*.yaml")) + sorted((repo / "studies").glob("*.yaml"))


def _study_configs(path: Path) -> list[RunConfig]:
    """Every run config of a study file (every kind), the FGRPO federations included."""
    from ftis.study.engine import load_study

    out = []
    for r in load_study(path).runs:  # any kind, by the file's `kind:`
        out.append(r.config)
        federation = getattr(r, "federation", None)  # FGRPO's centralized runs
        if federation is not None:
            out.append(federation)
    return out


def _configs(path: Path) -> list[RunConfig]:
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    is_study = isinstance(data, dict) and (
        "pairings" in data or "arms" in data or data.get("kind") in {"fgrpo", "arms"}
    )
    return _study_configs(path) if is_study else [load_config(path)]


def referenced_warm_starts(
    paths: Iterable[Path], *, embedded_default: bool = True, relative_to: Path | None = None
) -> dict[str, WarmStartUse]:
    """base key -> the warm start that the nodes of these configs/studies ask for."""
    from ftis.warmstart import base_key

    uses: dict[str, WarmStartUse] = {}

    def add(cfg: RunConfig, source: str) -> None:
        for node in cfg.nodes:
            if node.warm_start is None or node.model.preset is None:
                continue
            key = base_key(node.model, node.warm_start, cfg.task)
            use = uses.setdefault(key, WarmStartUse(node.model, node.warm_start, cfg.task))
            use.sources.add(source)

    if embedded_default:
        add(load_config(None), DEFAULT_NAME)
    for p in paths:
        p = Path(p)
        name = str(p)
        if relative_to is not None and p.resolve().is_relative_to(relative_to.resolve()):
            name = str(p.resolve().relative_to(relative_to.resolve()))
        for cfg in _configs(p):
            add(cfg, name)
    return uses


def build(
    uses: dict[str, WarmStartUse],
    *,
    out: Path = ROOT,
    only: str | None = None,
    rebuild: bool = False,
    progress: Callable[[str, int, int, float], None] | None = None,
    every_source: bool = False,
) -> list[str]:
    """Train (or take from the local cache) each warm start, copy it under `out` and record it in
    `out`/manifest.json; returns the names built. `only`: a glob on the entry names.

    An entry already shipped and intact keeps its bits (training is not bit-reproducible across
    thread counts and CPUs, and runs were committed against those bits); only its `used_by` list
    changes: with `every_source` (`uses` read from every committed config and study) it becomes
    exactly the sources that use it now, else it gains the new ones. `rebuild=True` trains it
    again."""
    import torch
    import transformers

    from ftis.basemodels import ShippedBase, ShippedBaseError, verify
    from ftis.warmstart import WARMSTART_VERSION, entry_name, warm_start

    manifest = read_manifest(out)
    entries: dict[str, Any] = manifest.setdefault("entries", {})
    built = []
    for key, use in sorted(uses.items(), key=lambda kv: entry_name(kv[1].model, kv[0])):
        name = entry_name(use.model, key)
        if only and not fnmatch.fnmatchcase(name, only):
            continue
        old = entries.get(name)
        if old is not None and not rebuild:
            shipped = ShippedBase(
                name=name, key=old["key"], files=dict(old["files"]), info=old, root=out
            )
            try:
                verify(shipped)
            except ShippedBaseError as e:
                log.info("base %s: rebuilding, the shipped copy is not intact (%s)", name, e)
            else:
                kept = set() if every_source else set(old.get("used_by", []))
                old["used_by"] = sorted(kept | use.sources)
                log.info("base %s: already shipped and intact, kept", name)
                continue
        log.info("base %s: warm start used by %s", name, ", ".join(sorted(use.sources)))

        def step(i: int, n: int, loss: float, name: str = name) -> None:
            if progress is not None:
                progress(name, i, n, loss)

        src = warm_start(use.model, use.warm_start, use.task, progress=step, use_shipped=False)
        meta = json.loads((src / "meta.json").read_text())
        dest = out / name
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        files = {}
        for f in sorted(src.iterdir()):
            if f.is_file() and f.name != "meta.json":
                shutil.copyfile(f, dest / f.name)
                files[f.name] = sha256_file(dest / f.name)
        entries[name] = {
            "key": key,
            "warmstart_version": WARMSTART_VERSION,
            "model": use.model.model_dump(mode="json", exclude={"lora", "device"}),
            "warm_start": use.warm_start.model_dump(mode="json"),
            "task": use.task.model_dump(mode="json", exclude={"reward"}),
            "used_by": sorted(use.sources),
            "files": files,
            "built_with": {
                "torch": meta.get("torch", torch.__version__),
                "transformers": transformers.__version__,
                "cpu_capability": meta.get(
                    "cpu_capability", torch.backends.cpu.get_cpu_capability()
                ),
                "device": meta.get("device", "cpu"),
                "machine": platform.machine(),
                "final_loss": meta.get("final_loss"),
            },
        }
        built.append(name)
    manifest["format"] = MANIFEST_FORMAT
    manifest["entries"] = dict(sorted(entries.items()))
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return built
