"""What plugs into ftis: the algorithm registry and the plugin loader (docs/design.md, "One
shell, many algorithms"; "Layers").

An algorithm is registered once with its config class (a pydantic model with a `kind`) and a
factory that builds it for one node. `config.algorithm.kind` picks one; the node shell
(`ftis.train.loop`) never learns its name. This module sits at the bottom of the package's
layers and imports nothing of ftis: the config schema, the node shell, the launcher, the study
engine and the report ask it for a kind, and it loads the systems that register kinds — ftis's
own (`ftis.algos`, `ftis.tasks`) and the modules named in $FTIS_PLUGINS — by name, once, on
the first lookup that misses (:func:`load_plugins`, the one place plugins are loaded).
Factories may be given as "module:attr" strings, imported on first use, so that configs are
read without importing model code.

    from ftis.plugins import AlgorithmConfig, register_algorithm   # or from ftis.algos

    class MyConfig(AlgorithmConfig):
        kind: Literal["mine"] = "mine"
        lr_scale: float = 1.0

    register_algorithm("mine", MyConfig, "my_package.my_algo:MyAlgorithm")

A module outside ftis that registers algorithms (or tasks, or study renderers) is named in
$FTIS_PLUGINS (comma-separated module names), so that `ftis run` and its worker processes
import it before reading a config.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

# The modules that register ftis's own systems and tasks when imported, loaded by name like any
# plugin: the registry never imports the layers above it.
BUILTIN_PLUGINS: tuple[str, ...] = ("ftis.tasks", "ftis.algos")
PLUGINS_ENV = "FTIS_PLUGINS"  # comma-separated modules that register algorithms when imported


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

    def busy_processes(self, run: Any) -> int:
        """How many processes of this run compute at once (what `ftis sweep --jobs` counts
        against the cores): one per training node by default."""
        return len(run.nodes)

    def required_packages(self) -> list[tuple[str, str]]:
        """(module, extra) pairs this configuration needs beyond ftis's own dependencies; the
        launcher checks them before the run starts and names the extra to install."""
        return []


class Algorithm(Protocol):
    """What a registered factory builds for one node; the node shell (`ftis.train.loop`) drives
    it, a step at a time."""

    def step(self, step: int) -> dict[str, float]:
        """Run step `step` (1-based) and return its metrics (namespaced: `loss/...`,
        `reward/...`). May raise ExchangeAborted: the step is dropped and the node stops."""
        ...

    def evaluate(self, step: int) -> dict[str, float]:
        """Metrics of an evaluation after `step` (0 = before training); must include
        `eval/accuracy`."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly after the last completed step, as plain data
        (the node's weights, optimizer and RNGs are saved by the shell)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# A factory takes the node's `ftis.train.context.NodeContext`, a service its `ServiceContext`:
# the node layer's classes, above this registry, so named here and not imported.
_NodeContext = Any
_ServiceContext = Any
Factory = Callable[[_NodeContext], Algorithm]
Serve = Callable[[_ServiceContext], None]
# launcher(cfg, run_dir, *, console, resume) -> MultiResult: runs the whole run itself (e.g.
# through Flower's simulation engine) instead of ftis's own launcher.
Launcher = Callable[..., Any]


def resolve(target: str | Callable) -> Callable:
    """A "module:attr" string imported now (registrations name targets that way so that reading
    a config imports no model code), or the callable itself."""
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)
    return target


@dataclass(frozen=True)
class AlgorithmSpec:
    """A registered algorithm: its config class, the factory of its per-node object, (for
    algorithms with service ranks) the function a service rank runs until the run ends, and
    (optionally) a launcher that starts the whole run itself instead of ftis's own launcher
    (`ftis.launch.run_local` hands it the run), and (optionally) a report section:
    `report(rows, run_dir) -> list[str]`, markdown lines that `ftis report` appends to
    report.md (it may also write its own PNGs into run_dir)."""

    kind: str
    config: type[AlgorithmConfig]
    factory: str | Factory
    service: str | Serve | None = None
    launcher: str | Launcher | None = None
    report: str | Callable[..., list[str]] | None = None

    def build(self, ctx: _NodeContext) -> Algorithm:
        """The algorithm for the node that `ctx` describes."""
        return resolve(self.factory)(ctx)

    def serve(self, ctx: _ServiceContext) -> None:
        """Run service rank `ctx.rank` (e.g. a server) to the end of the run."""
        if self.service is None:
            raise ValueError(
                f"algorithm {self.kind!r} declares service ranks but registered no service"
            )
        resolve(self.service)(ctx)

    def launch(self, cfg: Any, run_dir: Any, **kwargs: Any) -> Any:
        """Run `cfg` with this algorithm's own launcher (`launcher` must be set)."""
        if self.launcher is None:
            raise ValueError(f"algorithm {self.kind!r} registered no launcher")
        return resolve(self.launcher)(cfg, run_dir, **kwargs)

    def report_section(self, rows: list[dict], run_dir: Any) -> list[str]:
        """This algorithm's own lines for report.md (none unless it registered a report)."""
        return [] if self.report is None else list(resolve(self.report)(rows, run_dir))


def check_one_shared_model(run: Any, why: str) -> None:
    """Raise ValueError unless every node of `run` has the same model (device aside) and
    warm_start as the first: for algorithms whose nodes all train or perturb one model. `why`
    ends the message's first clause, e.g. "federated clients train one shared model"."""
    first = run.nodes[0]
    for node in run.nodes[1:]:
        if (
            node.model.model_dump(exclude={"device"}) != first.model.model_dump(exclude={"device"})
            or node.warm_start != first.warm_start
        ):
            raise ValueError(
                f"node {node.name!r} has another model or warm_start than {first.name!r}: "
                f"{why}; give every node the same model and warm_start sections"
            )


def check_sampler_dtype_unused(run: Any, kind: str, what: str) -> None:
    """Raise ValueError when `run` sets train.sampler_dtype or train.rollout_engine for an
    algorithm whose own loop samples or scores without them (`what`: what that loop does), so the setting never
    silently does nothing."""
    if run.train.sampler_dtype != "float32":
        raise ValueError(
            f"train.sampler_dtype {run.train.sampler_dtype} applies to the GRPO-family rollouts "
            f"(algorithm.kind ftis, swarm, fgrpo); {kind} {what} on the trained weights; "
            "remove train.sampler_dtype"
        )
    if run.train.rollout_engine != "ftis":
        raise ValueError(
            f"train.rollout_engine {run.train.rollout_engine} serves the GRPO-family rollouts "
            f"(algorithm.kind ftis, swarm, fgrpo); {kind} {what} with ftis's own sampler; "
            "remove train.rollout_engine"
        )


ALGORITHMS: dict[str, AlgorithmSpec] = {}


def register_algorithm(
    kind: str,
    config: type[AlgorithmConfig],
    factory: str | Factory,
    *,
    service: str | Serve | None = None,
    launcher: str | Launcher | None = None,
    report: str | Callable[..., list[str]] | None = None,
) -> AlgorithmSpec:
    """Make `kind` available to `config.algorithm.kind` (replacing an earlier registration)."""
    spec = AlgorithmSpec(kind, config, factory, service, launcher, report)
    ALGORITHMS[kind] = spec
    return spec


def load_plugins() -> None:
    """Import ftis's own systems (BUILTIN_PLUGINS) and the modules named in $FTIS_PLUGINS
    (comma-separated), which register algorithms, tasks and study renderers of their own;
    worker processes inherit the variable, so they know the same kinds. Importing a module
    twice is a no-op, so this is cheap to call on every lookup that misses."""
    extra = (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))
    for name in (*BUILTIN_PLUGINS, *filter(None, extra)):
        importlib.import_module(name)


T = TypeVar("T")


def registered(table: Mapping[str, T], name: str, unknown: Callable[[str], str]) -> T:
    """`table[name]` of a registry, the plugins loaded first when it is not there (a system
    registers its kinds when imported); ValueError(`unknown(known names, sorted)`) when it is
    not registered at all."""
    if name not in table:
        load_plugins()
    if name not in table:
        raise ValueError(unknown(", ".join(sorted(table))))
    return table[name]


def get_algorithm(kind: str) -> AlgorithmSpec:
    """The registered algorithm `kind`, or a ValueError listing the known ones."""
    return registered(
        ALGORITHMS, kind, lambda known: f"unknown algorithm kind {kind!r}; choose one of: {known}"
    )
