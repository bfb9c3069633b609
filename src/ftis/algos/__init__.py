"""The systems shipped with ftis, registered behind one shell (docs/design.md, "One shell, many
algorithms"): F-TIS (with HACPO and every loss of ftis.core.losses), FGRPO, DPO alone, gossip
DPO, FedDPO, RandOpt, CoRP and the swarm, each in its own folder, with the study kinds and
renderers of their documents.

The registry itself lives below every layer, in ftis.plugins (this package re-exports its
names, so `from ftis.algos import AlgorithmConfig, register_algorithm` keeps working); it loads
this package by name on the first lookup, as it loads any plugin named in $FTIS_PLUGINS.
"""

from __future__ import annotations

from typing import Literal

from ftis.plugins import (
    ALGORITHMS,
    PLUGINS_ENV,
    AlgorithmConfig,
    AlgorithmSpec,
    check_one_shared_model,
    get_algorithm,
    load_plugins,
    register_algorithm,
)
from ftis.study.registry import register_study_kind, register_study_renderer

__all__ = [
    "ALGORITHMS",
    "PLUGINS_ENV",
    "AlgorithmConfig",
    "AlgorithmSpec",
    "FTISConfig",
    "check_one_shared_model",
    "get_algorithm",
    "load_plugins",
    "register_algorithm",
]


class FTISConfig(AlgorithmConfig):
    """Sample exchange with F-TIS (docs/math.md): every node samples its share of the step's
    prompts, the nodes exchange tokens + sampler log-probs, each trains on all of them with its
    own loss (`nodes[i].loss`). The sharing scheme is `sharing.scheme`."""

    kind: Literal["ftis"] = "ftis"

    def check_run(self, run) -> None:
        if run.sharing.share == "successes" and run.sharing.scheme != "joint":
            raise ValueError(
                "sharing.share successes sends a peer only a node's successes, which have no "
                "baseline of their own unless every node answers every prompt; set "
                f"sharing.scheme: joint (it is {run.sharing.scheme!r})"
            )
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


register_algorithm("ftis", FTISConfig, "ftis.algos.ftis.algorithm:FTISAlgorithm")


# The F-TIS family's document of a grid study (docs/RESULTS.md, docs/results/reco.md).
register_study_renderer(
    "ftis",
    "ftis.results.grid:render",
    collect="ftis.results.grid:collect",
    kinds=("grid",),
)
# The collaboration study's document (studies/collab.yaml -> docs/results/collab.md): every
# sharing method against training alone, with paired intervals over seeds and problems.
register_study_renderer(
    "collab",
    "ftis.results.collab:render",
    collect="ftis.results.collab:collect",
    kinds=("grid",),
)

# The groups study's document (studies/groups.yaml -> docs/results/groups.md): experts in groups
# of 2, 3 and 4 against each expert alone and against itself in a smaller group.
register_study_renderer(
    "groups",
    "ftis.results.groups:render",
    collect="ftis.results.groups:collect",
    kinds=("grid",),
)

# The poisoning study's document (studies/poisoning.yaml -> docs/results/poisoning.md): attack
# success and the honest nodes' accuracy per loss and defence, with paired intervals.
register_study_renderer("poisoning", "ftis.results.poisoning:render", kinds=("arms",))
# The bf16-sampler study's document (studies/bf16-sampler.yaml -> docs/results/bf16-learning.md):
# learning with `train.sampler_dtype: bfloat16` against float32, corrected and uncorrected.
register_study_renderer("sampler-dtype", "ftis.results.sampler_dtype:render", kinds=("arms",))


def _register_fgrpo() -> None:
    # Imported here: its config module subclasses AlgorithmConfig, defined above.
    from ftis.algos.fgrpo.config import FGRPOConfig

    register_algorithm(
        "fgrpo",
        FGRPOConfig,
        "ftis.algos.fgrpo.launch:not_a_node",
        launcher="ftis.algos.fgrpo.launch:run_federated",
        report="ftis.results.sections.fgrpo:report_section",
    )
    # The FGRPO study (studies/fgrpo.yaml, `kind: fgrpo`): aggregation rules against centralized
    # GRPO and each client alone, derived from the federation; its document.
    study, results = "ftis.algos.fgrpo.study", "ftis.results.fgrpo"
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
    register_study_renderer("dpo", "ftis.results.dpo:render", kinds=("arms",))


_DPO_REPORT = "ftis.results.sections.dpo:report_section"
_register_dpo()


def _register_population() -> None:
    # RandOpt and CoRP: score seeded perturbations, trade reward vectors (docs/randopt.md).
    from ftis.algos.randopt.config import CoRPConfig, RandOptConfig

    factory = "ftis.algos.randopt.algorithm:PopulationAlgorithm"
    report = "ftis.results.sections.randopt:report_section"
    register_algorithm("randopt", RandOptConfig, factory, report=report)
    register_algorithm("corp", CoRPConfig, factory, report=report)
    # The population study's document (studies/population.yaml, `results: population`).
    register_study_renderer("population", "ftis.results.population:render", kinds=("arms",))


_register_population()


def _register_swarm() -> None:
    # F-TIS among peers that come and go, on hivemind's DHT (docs/swarm.md).
    from ftis.algos.swarm.config import SwarmConfig

    register_algorithm(
        "swarm",
        SwarmConfig,
        "ftis.algos.swarm.algorithm:SwarmAlgorithm",
        launcher="ftis.algos.swarm.launch:run_swarm",
        report="ftis.results.sections.swarm:report_section",
    )
    # The swarm study's document (studies/swarm.yaml, `results: swarm`).
    register_study_renderer("swarm", "ftis.results.swarm:render", kinds=("arms",))


_register_swarm()
