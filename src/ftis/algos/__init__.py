"""The algorithms a node can run, behind one shell (docs/design.md, "One shell, many algorithms").

An algorithm is registered once with its config class (a pydantic model with a `kind`) and a
factory that builds it for one node. `config.algorithm.kind` picks one; the node shell
(`ftis.train.loop`) never learns its name. This module imports no model code (configs are read
by light tools): factories may be given as "module:attr" strings, imported on first use.

    from ftis.algos import AlgorithmConfig, register_algorithm

    class MyConfig(AlgorithmConfig):
        kind: Literal["mine"] = "mine"
        lr_scale: float = 1.0

    register_algorithm("mine", MyConfig, "my_package.my_algo:MyAlgorithm")
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from ftis.algos.base import Algorithm, NodeContext


class AlgorithmConfig(BaseModel):
    """Base of every algorithm's config: `kind` names the algorithm; subclasses add fields."""

    model_config = ConfigDict(extra="forbid")
    kind: str

    def service_ranks(self, run: Any) -> list[str]:
        """Names of the extra ranks this algorithm runs besides the training nodes (a federated
        server, an aggregator), in rank order after the nodes; none by default."""
        return []

    def check_run(self, run: Any) -> None:
        """Cross-field checks against the whole run config; raise ValueError with a fix."""


class FTISConfig(AlgorithmConfig):
    """Sample exchange with F-TIS (docs/math.md): every node samples its share of the step's
    prompts, the nodes exchange tokens + sampler log-probs, each trains on all of them with its
    own loss (`nodes[i].loss`). The sharing scheme is `sharing.scheme`."""

    kind: Literal["ftis"] = "ftis"


Factory = Callable[["NodeContext"], "Algorithm"]


@dataclass(frozen=True)
class AlgorithmSpec:
    kind: str
    config: type[AlgorithmConfig]
    factory: str | Factory

    def build(self, ctx: NodeContext) -> Algorithm:
        """The algorithm for the node that `ctx` describes."""
        factory = self.factory
        if isinstance(factory, str):
            module, _, attr = factory.partition(":")
            factory = getattr(importlib.import_module(module), attr)
        return factory(ctx)


ALGORITHMS: dict[str, AlgorithmSpec] = {}


def register_algorithm(
    kind: str, config: type[AlgorithmConfig], factory: str | Factory
) -> AlgorithmSpec:
    """Make `kind` available to `config.algorithm.kind` (replacing an earlier registration)."""
    spec = AlgorithmSpec(kind, config, factory)
    ALGORITHMS[kind] = spec
    return spec


def get_algorithm(kind: str) -> AlgorithmSpec:
    """The registered algorithm `kind`, or a ValueError listing the known ones."""
    if kind not in ALGORITHMS:
        raise ValueError(
            f"unknown algorithm kind {kind!r}; choose one of: {', '.join(sorted(ALGORITHMS))}"
        )
    return ALGORITHMS[kind]


register_algorithm("ftis", FTISConfig, "ftis.algos.ftis.algorithm:FTISAlgorithm")
