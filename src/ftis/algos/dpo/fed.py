"""FedDPO (kind `fed-dpo`): federated DPO on Flower, and its centralized baseline
(docs/dpo.md, "FedDPO").

The shared federated machinery (`ftis.algos.federated`: Flower's FedAvg subclass, sampling,
reply validation, rows, checkpoints, the simulation engine) with FedDPO's parts:

    FedDPOServer    theta, the buffer of the last q_max + 1 global models, who saw what
                    (`ftis.algos.dpo.fed_server`, pure torch)
    FedDPOStrategy  round r: sample S clients (seeded), assign each a starting model from the
                    buffer (its delay), send it; check the replies (names, shapes, finite
                    values, a positive pair count, the sender); average the accepted ones
    DPOClient       E local DPO steps from the model sent (`ftis.algos.dpo.fed_client`)

Rows (`step` = round): one per client (train/* and loss/* of its local steps when it took
part, fed/participated, fed/staleness, fed/accepted, fed/rejected, fed/dropped, fed/weight;
eval/* on its held-out pairs and own task at each evaluation) and one `server` row (fed/sampled,
fed/participants, fed/staleness_mean, fed/rejected(_total), fed/dropped(_total),
fed/lost_clients, fed/update_norm, eval/* over the union of the clients' held-out pairs).

`centralized: true` (`run_centralized`): one model in this process trained on the union of the
clients' pairs, N x batch_size pairs per step, E steps per round, one optimizer for the run;
each evaluation scores every client's held-out pairs and task (rows under the client's name)
and the server row holds the training figures. Same run directory, checkpoints and resume.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from rich.console import Console

import ftis.algos.federated  # noqa: F401  (telemetry off before anything imports flwr)
from ftis.algos.dpo.config import FedDPOConfig
from ftis.algos.dpo.fed_server import FedDPOServer
from ftis.algos.federated.config import SERVER_NAME
from ftis.algos.federated.faults import FaultPlan
from ftis.config import RunConfig
from ftis.launch.multi import MultiResult

log = logging.getLogger(__name__)


def make_server(params: dict[str, Any], algo: FedDPOConfig, seed: int) -> FedDPOServer:
    return FedDPOServer(
        params,
        max_staleness=algo.max_staleness,
        staleness=algo.staleness,
        weighting=algo.weighting,
        server_update=algo.server_update,
        seed=seed,
    )


def _build_client(cfg: RunConfig, rank: int, base_dir: Path | None) -> Any:
    from ftis.algos.dpo.fed_client import DPOClient

    return DPOClient(cfg, rank, base_dir=base_dir)


def run_fed_dpo(
    cfg: RunConfig,
    run_dir: Path,
    *,
    console: Console | None = None,
    resume: bool = False,
    faults: FaultPlan | None = None,
    engine: Any = None,
) -> MultiResult:
    """Run FedDPO config `cfg` to the end (Flower's simulation engine; `centralized: true`:
    `run_centralized`), writing the run directory `run_dir`. resume: continue from the server's
    newest checkpoint. Seams for tests (never set by `ftis run`): faults
    (`ftis.algos.federated.faults`), engine (e.g. `ftis.algos.federated.inprocess.run_in_process`)."""
    from ftis.algos.federated.launch import run_flower

    algo: FedDPOConfig = cfg.algorithm  # type: ignore[assignment]
    run_dir = Path(run_dir)
    if algo.centralized:
        return run_centralized(cfg, run_dir, console=console, resume=resume)

    def make_strategy(server: FedDPOServer, **kwargs: Any) -> Any:
        from ftis.algos.dpo.fed_strategy import FedDPOStrategy

        return FedDPOStrategy(cfg=cfg, server=server, **kwargs)

    return run_flower(
        cfg,
        run_dir,
        label="fed-dpo",
        new_state=lambda params: make_server(params, algo, cfg.train.seed),
        make_strategy=make_strategy,
        build_client=_build_client,
        faults=faults,
        console=console,
        resume=resume,
        engine=engine,
        info_key="eval/preference_accuracy",
    )


# ---- the centralized baseline ----------------------------------------------------------------


def run_centralized(
    cfg: RunConfig, run_dir: Path, *, console: Console | None = None, resume: bool = False
) -> MultiResult:
    """Centralized DPO on the union of the clients' pairs (module docstring), in this process."""
    from ftis.algos.dpo.data import agent_task, tokenized_agent_pairs
    from ftis.algos.dpo.fed_client import dpo_learner, evaluate_client, reference_for
    from ftis.algos.federated.launch import server_node, server_setup
    from ftis.algos.federated.strategy import union_metrics
    from ftis.preferences.tokens import TokenizedPairs
    from ftis.train.checkpoint import CheckpointError
    from ftis.train.loop import StopFlag, peak_rss_mb

    algo: FedDPOConfig = cfg.algorithm  # type: ignore[assignment]
    names = [n.name for n in cfg.nodes]
    total = cfg.train.steps
    t0 = time.perf_counter()
    with server_setup(
        cfg,
        run_dir,
        label="fed-dpo (centralized)",
        console=console,
        resume=resume,
        info_key="eval/preference_accuracy",
    ) as setup:
        node = setup.server
        if resume and not hasattr(node.model, "disable_adapter"):
            reference = reference_for(server_node(cfg, setup.base_dir).model)  # the start
        else:
            reference = reference_for(node.model)
        digest = reference.digest()
        want = setup.state.get("reference_digest")
        if want is not None and want != digest:
            raise CheckpointError(
                f"the reference model rebuilt on resume (digest {digest}) is not the one the run "
                f"started from ({want}): the model, warm start or task config changed since; "
                "resume with the run's own config.yaml"
            )
        clients = []
        for rank in range(len(names)):
            task = agent_task(cfg, rank)
            train, heldout = tokenized_agent_pairs(
                cfg, rank, node.tokenizer, reference=reference, task=task
            )
            clients.append((names[rank], train, heldout, task))
        union = TokenizedPairs(
            prompts=[p for c in clients for p in c[1].prompts],
            chosen=[p for c in clients for p in c[1].chosen],
            rejected=[p for c in clients for p in c[1].rejected],
        )
        local = dpo_learner(
            cfg, node, reference, union, batch_size=algo.batch_size * len(names), salt="union"
        )
        counters = {"local_steps_total": 0.0, "skipped_steps_total": 0.0}
        counters.update({k: float(v) for k, v in setup.state.get("counters", {}).items()})
        log.info("fed-dpo (centralized): %d training pairs from %d clients", len(union), len(names))

        def eval_due(r: int) -> bool:
            every = cfg.eval.every
            return r == 0 or r == total or bool(every and r % every == 0)

        def state() -> dict[str, Any]:
            return {"counters": dict(counters), "reference_digest": digest}

        def finish(r: int, server_row: dict[str, Any], t_round: float) -> None:
            evals = {}
            if eval_due(r):
                for name, _, heldout, task in clients:
                    evals[name] = evaluate_client(cfg, node, local, heldout, task, r)
                    setup.loggers[name].log(r, evals[name])
            server_row.update(union_metrics(evals))
            server_row["fed/centralized"] = 1.0
            server_row["server/round_seconds"] = time.perf_counter() - t_round
            server_row["train/elapsed_seconds"] = time.perf_counter() - t0
            server_row["memory/peak_rss_mb"] = peak_rss_mb()
            setup.loggers[SERVER_NAME].log(r, server_row)
            setup.progress(r, total, server_row)

        stop = StopFlag()
        last = saved = setup.first_round - 1
        with stop.installed():
            if not resume:
                finish(0, {}, time.perf_counter())
            e = algo.local_steps
            for r in range(setup.first_round, total + 1):
                if stop():
                    break
                t_round = time.perf_counter()
                node.model.train()
                m: dict[str, Any] = local.train(e, first=(r - 1) * e)
                counters["local_steps_total"] += e - m["train/skipped_steps"]
                counters["skipped_steps_total"] += m["train/skipped_steps"]
                m["train/local_steps_total"] = counters["local_steps_total"]
                m["train/skipped_steps_total"] = counters["skipped_steps_total"]
                m["train/num_pairs"] = float(len(union))
                finish(r, m, t_round)
                last = r
                every = cfg.checkpoint.every
                if r == total or (every and r % every == 0):
                    setup.save(r, None, state())
                    saved = r
        if last < total:
            if last != saved:
                setup.save(last, None, state())
            log.warning("stop requested: checkpointed round %d", last)
    log.info("fed-dpo (centralized): %d rounds in %.1fs", total, time.perf_counter() - t0)
    if last < total:
        raise KeyboardInterrupt
    return MultiResult(exit_codes={n: 0 for n in [*names, SERVER_NAME]})
