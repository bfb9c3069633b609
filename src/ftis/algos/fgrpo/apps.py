"""Flower's two apps for FGRPO: the shared federated apps (`ftis.algos.federated.apps`) with
FGRPO's client (`LocalClient`: a client's local GRPO round on the global parameters it is
sent). See that module for how the simulation engine and a deployment run them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftis.algos.federated.apps import make_client_app as federated_client_app
from ftis.algos.federated.apps import make_server_app  # noqa: F401  (re-exported)
from ftis.algos.fgrpo.client import LocalClient
from ftis.config import RunConfig


def build_client(cfg: RunConfig, rank: int, base_dir: Path | None) -> LocalClient:
    """FGRPO's client object of node cfg.nodes[rank] (`apps.BuildClient`)."""
    return LocalClient(cfg, rank, base_dir=base_dir)


def make_client_app(
    cfg: RunConfig,
    run_dir: Path,
    *,
    base_dir: Path | Callable[[], Path | None] | None = None,
    **options: Any,
) -> Any:
    """The ClientApp of FGRPO run `cfg`: `ftis.algos.federated.apps.make_client_app` with
    FGRPO's client (`options`: that function's faults and threads)."""
    return federated_client_app(
        cfg, run_dir, build_client=build_client, base_dir=base_dir, **options
    )
