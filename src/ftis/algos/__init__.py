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

A module outside ftis that registers algorithms is named in $FTIS_PLUGINS (comma-separated
module names), so that `ftis run` and its worker processes import it before reading a config.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from ftis.study.registry import register_study_kind, register_study_renderer

if TYPE_CHECKING:
    from ftis.algos.base import Algorithm, NodeContext, ServiceContext

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

    def required_packages(self) -> list[tuple[str, str]]:
        """(module, extra) pairs this configuration needs beyond ftis's own dependencies; the
        launcher checks them before the run starts and names the extra to install."""
        return []


class FTISConfig(AlgorithmConfig):
    """Sample exchange with F-TIS (docs/math.md): every node samples its share of the step's
    prompts, the nodes exchange tokens + sampler log-probs, each trains on all of them with its
    own loss (`nodes[i].loss`). The sharing scheme is `sharing.scheme`."""

    kind: Literal["ftis"] = "ftis"

    def check_run(self, run) -> None:
        hacpo = [n.name for n in run.nodes if n.loss.method == "hacpo"]
        if hacpo and run.sharing.scheme != "joint":
            raise ValueError(
                f"loss.method hacpo (nodes {', '.join(hacpo)}) trains on joint groups: every "
                f"node answers every prompt with G completions; set sharing.scheme: joint "
                f"(it is {run.sharing.scheme!r})"
            )
        if hacpo and len(run.nodes) < 2:
            raise ValueError(
                "loss.method hacpo needs at least 2 nodes to form joint groups; for one node "
                "alone use loss.method gspo (HACPO's baseline)"
            )


Factory = Callable[["NodeContext"], "Algorithm"]
Serve = Callable[["ServiceContext"], None]
# launcher(cfg, run_dir, *, console, resume) -> MultiResult: runs the whole run itself (e.g.
# through Flower's simulation engine) instead of ftis's own launcher.
Launcher = Callable[..., Any]


def _resolve(target: str | Callable) -> Callable:
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

    def build(self, ctx: NodeContext) -> Algorithm:
        """The algorithm for the node that `ctx` describes."""
        return _resolve(self.factory)(ctx)

    def serve(self, ctx: ServiceContext) -> None:
        """Run service rank `ctx.rank` (e.g. a server) to the end of the run."""
        if self.service is None:
            raise ValueError(
                f"algorithm {self.kind!r} declares service ranks but registered no service"
            )
        _resolve(self.service)(ctx)

    def launch(self, cfg: Any, run_dir: Any, **kwargs: Any) -> Any:
        """Run `cfg` with this algorithm's own launcher (`launcher` must be set)."""
        if self.launcher is None:
            raise ValueError(f"algorithm {self.kind!r} registered no launcher")
        return _resolve(self.launcher)(cfg, run_dir, **kwargs)

    def report_section(self, rows: list[dict], run_dir: Any) -> list[str]:
        """This algorithm's own lines for report.md (none unless it registered a report)."""
        return [] if self.report is None else list(_resolve(self.report)(rows, run_dir))


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
    """Import the modules named in $FTIS_PLUGINS (comma-separated), which register algorithms
    of their own; worker processes inherit the variable, so they know the same algorithms."""
    for name in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        importlib.import_module(name)


def get_algorithm(kind: str) -> AlgorithmSpec:
    """The registered algorithm `kind`, or a ValueError listing the known ones."""
    if kind not in ALGORITHMS:
        load_plugins()
    if kind not in ALGORITHMS:
        raise ValueError(
            f"unknown algorithm kind {kind!r}; choose one of: {', '.join(sorted(ALGORITHMS))}"
        )
    return ALGORITHMS[kind]


register_algorithm("ftis", FTISConfig, "ftis.algos.ftis.algorithm:FTISAlgorithm")


# The F-TIS family's document of a grid study (docs/RESULTS.md, docs/results/reco.md).
register_study_renderer(
    "ftis",
    "ftis.algos.ftis.study_results:render",
    collect="ftis.algos.ftis.study_results:collect",
    kinds=("grid",),
)
# The collaboration study's document (studies/collab.yaml -> docs/results/collab.md): every
# sharing method against training alone, with paired intervals over seeds and problems.
register_study_renderer(
    "collab",
    "ftis.algos.ftis.collab:render",
    collect="ftis.algos.ftis.collab:collect",
    kinds=("grid",),
)


# The poisoning study's document (studies/poisoning.yaml -> docs/results/poisoning.md): attack
# success and the honest nodes' accuracy per loss and defence, with paired intervals.
register_study_renderer("poisoning", "ftis.algos.ftis.poisoning:render", kinds=("arms",))


def _register_fgrpo() -> None:
    # Imported here: its config module subclasses AlgorithmConfig, defined above.
    from ftis.algos.fgrpo.config import FGRPOConfig

    register_algorithm(
        "fgrpo",
        FGRPOConfig,
        "ftis.algos.fgrpo.launch:not_a_node",
        launcher="ftis.algos.fgrpo.launch:run_federated",
        report="ftis.algos.fgrpo.report:report_section",
    )
    # The FGRPO study (studies/fgrpo.yaml, `kind: fgrpo`): aggregation rules against centralized
    # GRPO and each client alone, derived from the federation; its document.
    study, results = "ftis.algos.fgrpo.study", "ftis.algos.fgrpo.study_results"
    register_study_kind(
        "fgrpo",
        f"{study}:load_fgrpo_study",
        status=f"{study}:run_state",
        execute=f"{study}:run_one",
        plan=f"{study}:plan_table",
        results="fgrpo",
    )
    register_study_renderer(
        "fgrpo", f"{results}:render", collect=f"{results}:collect", kinds=("fgrpo",)
    )


_register_fgrpo()


def _register_dpo() -> None:
    # DPO alone; DecDPO: the same local DPO steps, then gossip with the graph's neighbours.
    from ftis.algos.dpo.config import DPOConfig, FedDPOConfig, GossipDPOConfig

    register_algorithm(
        "dpo", DPOConfig, "ftis.algos.dpo.algorithm:DPOAlgorithm", report=_DPO_REPORT
    )
    register_algorithm(
        "gossip-dpo",
        GossipDPOConfig,
        "ftis.algos.dpo.algorithm:GossipDPOAlgorithm",
        report=_DPO_REPORT,
    )
    # FedDPO: the same local steps on Flower clients, averaged by a server (and its
    # centralized baseline); it runs the whole run itself.
    register_algorithm(
        "fed-dpo",
        FedDPOConfig,
        "ftis.algos.federated.launch:not_a_node",
        launcher="ftis.algos.dpo.fed:run_fed_dpo",
        report=_DPO_REPORT,
    )
    # The distributed-DPO study's document (studies/dpo.yaml, `results: dpo`).
    register_study_renderer("dpo", "ftis.algos.dpo.study_results:render", kinds=("arms",))


_DPO_REPORT = "ftis.algos.dpo.report:report_section"
_register_dpo()


def _register_population() -> None:
    # RandOpt and CoRP: score seeded perturbations, trade reward vectors (docs/randopt.md).
    from ftis.algos.randopt.config import CoRPConfig, RandOptConfig

    factory = "ftis.algos.randopt.algorithm:PopulationAlgorithm"
    report = "ftis.algos.randopt.report:report_section"
    register_algorithm("randopt", RandOptConfig, factory, report=report)
    register_algorithm("corp", CoRPConfig, factory, report=report)
    # The population study's document (studies/population.yaml, `results: population`).
    register_study_renderer(
        "population", "ftis.algos.randopt.study_results:render", kinds=("arms",)
    )


_register_population()


def _register_swarm() -> None:
    # F-TIS among peers that come and go, on hivemind's DHT (docs/swarm.md).
    from ftis.algos.swarm.config import SwarmConfig

    register_algorithm(
        "swarm",
        SwarmConfig,
        "ftis.algos.swarm.algorithm:SwarmAlgorithm",
        launcher="ftis.algos.swarm.launch:run_swarm",
        report="ftis.algos.swarm.report:report_section",
    )
    # The swarm study's document (studies/swarm.yaml, `results: swarm`).
    register_study_renderer("swarm", "ftis.algos.swarm.study_results:render", kinds=("arms",))


_register_swarm()
