"""Base models shipped with the package: warm starts that are the same bytes on every machine.

A warm start trained on the user's CPU in float32 depends on the CPU's instruction set (the
kernels that draw the initial weights and run the training differ by a rounding error, and a
few hundred optimizer steps turn that into different models). So the warm starts of the
configs the documentation quotes (the embedded default, the committed configs/ and studies/)
are trained once, by `ftis basemodels build`, and shipped here as package data:

    src/ftis/basemodels/manifest.json          one entry per shipped base, with each file's sha256
    src/ftis/basemodels/<preset>-<key>/        save_pretrained weights + the character tokenizer

`<key>` is `ftis.warmstart.base_key`: the digest of what decides the weights (the warm-start
procedure's version, the model config without `lora` and `device`, the `warm_start` section
and the task config). Unlike the local cache key it leaves out the torch version and the
device, which decide how a local warm start comes out but not what a shipped one holds.

`ftis.warmstart.warm_start` looks here first; an entry whose bytes do not match the manifest is
refused (ShippedBaseError), never silently retrained, since a retrained base would no longer be
the one whose numbers the documentation prints.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftis.models.loading import ModelLoadError

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1


class ShippedBaseError(ModelLoadError):
    """A shipped base model is damaged or missing files; the message says which and what to do."""


@dataclass(frozen=True)
class ShippedBase:
    """One manifest entry: `name` is its directory under `root`, `files` maps file -> sha256."""

    name: str
    key: str
    files: dict[str, str]
    info: dict[str, Any]
    root: Path

    @property
    def path(self) -> Path:
        return self.root / self.name


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(root: Path | None = None) -> dict[str, Any]:
    """The manifest under `root` (default: the package's; an empty one when there is none)."""
    path = (root or ROOT) / MANIFEST_NAME
    if not path.exists():
        return {"format": MANIFEST_FORMAT, "entries": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ShippedBaseError(
            f"the shipped base models' manifest {path} cannot be read ({e}); reinstall ftis, or "
            "rebuild it with `ftis basemodels build`"
        ) from e
    if data.get("format") != MANIFEST_FORMAT:
        raise ShippedBaseError(
            f"the shipped base models' manifest {path} has format {data.get('format')!r}, this "
            f"ftis reads format {MANIFEST_FORMAT}; rebuild it with `ftis basemodels build`"
        )
    return data


def shipped_bases(root: Path | None = None) -> list[ShippedBase]:
    root = root or ROOT
    entries = read_manifest(root).get("entries", {})
    return [
        ShippedBase(name=name, key=e["key"], files=dict(e["files"]), info=e, root=root)
        for name, e in sorted(entries.items())
    ]


def find_shipped(key: str, root: Path | None = None) -> ShippedBase | None:
    """The shipped base with this base key, or None."""
    for entry in shipped_bases(root):
        if entry.key == key:
            return entry
    return None


def verify(entry: ShippedBase) -> None:
    """Raise ShippedBaseError unless every file of `entry` is there with its recorded sha256."""
    fix = (
        "the installed package is damaged or was edited: reinstall ftis, or rebuild the shipped "
        "bases with `ftis basemodels build`"
    )
    for fname, expected in sorted(entry.files.items()):
        path = entry.path / fname
        if not path.is_file():
            raise ShippedBaseError(f"shipped base model {entry.name}: {path} is missing; {fix}")
        actual = sha256_file(path)
        if actual != expected:
            raise ShippedBaseError(
                f"shipped base model {entry.name}: {fname} has sha256 {actual[:16]}..., the "
                f"manifest records {expected[:16]}...; {fix}"
            )
