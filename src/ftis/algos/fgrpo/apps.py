"""Flower's two apps for FGRPO: the shared federated apps (`ftis.algos.federated.apps`) with
FGRPO's client (`LocalClient`: a client's local GRPO round on the global parameters it is
sent). See that module for how the simulation engine and a deployment run them."""

from __future__ import annotations

import functools
from pathlib import Path

from ftis.algos.federated.apps import make_client_app as federated_client_app
from ftis.algos.federated.apps import make_server_app  # noqa: F401  (re-exported)
from ftis.algos.fgrpo.client import LocalClient
from ftis.config import RunConfig


def build_client(cfg: RunConfig, rank: int, base_dir: Path | None) -> LocalClient:
    """FGRPO's client object of node cfg.nodes[rank] (`apps.BuildClient`)."""
    return LocalClient(cfg, rank, base_dir=base_dir)


# The ClientApp of FGRPO run `cfg`: `ftis.algos.federated.apps.make_client_app` (its arguments)
# with FGRPO's client.
make_client_app = functools.partial(federated_client_app, build_client=build_client)
