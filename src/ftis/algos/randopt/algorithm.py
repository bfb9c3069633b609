"""RandOpt and CoRP: gradient-free post-training where only seeds and rewards move
(methods-wave2.md §4, docs/randopt.md, docs/math.md §10).

    stage 0, steps 1 .. ceil(N / per_step), each step:
        score       members lo..hi: theta_0 + sigma_i * eps(s_i), greedy, on this node's
                    private support set (mean reward per member)
        exchange    the reward vector of those members, nothing else
        pool        every party's rewards, weighted by its number of problems
    corp, one more step (stage 1):
        merge       per (q, beta): elite tail, two-pass weights, a direction [(s, sigma, w)]
        probe       theta_0 + alpha * mu for every (q, beta, alpha), on the private probe split
        exchange    probe rewards and the candidate directions
        choose      the best pooled probe reward; the lowest live rank's directions are adopted
                    by every party, so all rebuild the same weights (checked by a sha256)
        apply       theta_1 = theta_0 + alpha * mu: an ordinary checkpoint, plus its direction
                    as a (seed, sigma, weight) list in nodes/<name>/corp-direction.json
    evaluate    randopt: the top-K majority vote; corp: the model (and, at the end, the
                population's RandOpt figures)

Deviations and choices where the spec is silent are listed in docs/randopt.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

from ftis.algos.randopt.config import CoRPConfig, RandOptConfig
from ftis.algos.randopt.perturb import Perturber, save_direction, weights_sha256
from ftis.algos.randopt.scoring import (
    ProblemSet,
    answers_of,
    greedy_completions,
    private_sets,
    problem_set,
    rewards_of,
)
from ftis.core.population import (
    Triple,
    corp_weights,
    draw_population,
    elite,
    majority_vote,
    pool,
    rank_members,
)
from ftis.exchange.population import (
    KIND_PROBE,
    KIND_REWARDS,
    PopulationCodec,
    PopulationPayload,
    payload_size,
)
from ftis.exchange.wire import PayloadError
from ftis.tasks import build_task
from ftis.train.context import NodeContext
from ftis.train.evaluate import evaluate
from ftis.train.seeds import eval_seed

log = logging.getLogger(__name__)


def _scaled(direction: tuple[Triple, ...] | list[Triple], alpha: float) -> list[Triple]:
    return [(int(s), float(sg), float(alpha) * float(w)) for s, sg, w in direction]


class PopulationAlgorithm:
    """One node of a RandOpt (`kind: randopt`) or CoRP (`kind: corp`) run.

    State (checkpointed): every party's reward of every member it reported, CoRP's chosen
    direction and choice, and running counters. The weights are the shell's: theta_0 during
    stage 0 (every candidate is undone from a stored copy), theta_1 after consolidation.
    """

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.acfg: RandOptConfig = ctx.cfg.algorithm  # type: ignore[assignment]
        self.corp = isinstance(self.acfg, CoRPConfig)
        self.node = ctx.node
        self.task = ctx.task
        self.timer = ctx.timer
        self.rank = ctx.rank
        self.transport = ctx.transport
        a = self.acfg
        self.seeds, self.sigmas = draw_population(a.seed, a.population, a.sigmas)
        # Stage 0's center theta_0, and the current center (theta_1 once consolidated).
        self.stage0 = Perturber(ctx.node.model, stream=a.noise)
        self.current = self.stage0
        self.stage0_known = True  # False after a resume past consolidation (theta_0 not kept)
        self.base_sha = weights_sha256(ctx.node.model)
        # The digest on every payload: the base weights and the weights this party rebuilds
        # from a check direction of two members (docs/math.md §10.1). A party that rebuilds
        # other bits from the same seeds (another noise kernel) is refused by every other one.
        check = [(self.seeds[0], self.sigmas[0], 1.0)]
        if a.population > 1:
            check.append((self.seeds[1], self.sigmas[1], -0.5))
        self.rebuild_sha = self.stage0.rebuilt_sha256(check)
        self.base_digest = hashlib.sha256(f"{self.base_sha}|{self.rebuild_sha}".encode()).digest()[
            :16
        ]
        own_task = build_task(a.node_task(ctx.cfg, ctx.node.name), reward=ctx.node.cfg.reward)
        self.own_task = own_task
        corp = isinstance(a, CoRPConfig)
        self.gate = corp and a.validation_gate  # type: ignore[union-attr]
        self.support, self.probe, self.validation = private_sets(
            own_task,
            ctx.node,
            seed=a.seed,
            name=ctx.node.name,
            support=a.support_size,
            probe=a.probe_size if corp else 0,  # type: ignore[union-attr]
            validation=a.probe_size if self.gate else 0,  # type: ignore[union-attr]
        )
        self.codec = PopulationCodec()
        # rank -> member -> [mean reward, problems] (None: not received from that rank)
        self.scores: dict[int, list[list[float] | None]] = {}
        self.stages: list[list[Triple]] = []
        self.choice: dict[str, Any] = {}
        self.counters = {
            "forward_tokens_total": 0.0,
            "scored_total": 0.0,
            "rejected_total": 0.0,
        }
        log.info(
            "node %s: %s population of %d over %d perturbed parameters (%s noise), base %s",
            ctx.node.name,
            a.kind,
            a.population,
            self.stage0.numel,
            a.noise,
            self.base_sha[:16],
        )

    # ------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        return {
            "scores": {r: list(v) for r, v in self.scores.items()},
            "stages": [[list(t) for t in stage] for stage in self.stages],
            "choice": dict(self.choice),
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scores = {int(r): list(v) for r, v in state.get("scores", {}).items()}
        self.stages = [
            [(int(s), float(sg), float(w)) for s, sg, w in stage]
            for stage in state.get("stages", [])
        ]
        self.choice = dict(state.get("choice", {}))
        self.counters.update(state.get("counters", {}))
        if self.stages:
            # The shell restored theta_1: it is the current center; theta_0 is not kept.
            self.stage0_known = False
            self.current = self.stage0

    # ------------------------------------------------------------------------------- steps

    def step(self, step: int) -> dict[str, float]:
        if step <= self.acfg.stage0_steps():
            return self._score_step(step)
        return self._consolidate(step)

    def _score_step(self, step: int) -> dict[str, float]:
        a = self.acfg
        lo = (step - 1) * a.per_step
        hi = min(lo + a.per_step, a.population)
        metrics: dict[str, float] = {}
        tokens = non_finite = 0
        with self.timer("score"):
            if step == 1:  # the unperturbed model on the support set, for reference
                metrics["reward/base"], tok, bad = self._mean_reward(self.support)
                tokens += tok
            t0 = time.perf_counter()
            own = []
            for i in range(lo, hi):
                self.stage0.apply([(self.seeds[i], self.sigmas[i], 1.0)])
                r, tok, bad = self._mean_reward(self.support)
                own.append(r)
                tokens += tok
                non_finite += bad
            self.stage0.restore()
            seconds = time.perf_counter() - t0
        payload = PopulationPayload(
            kind=KIND_REWARDS,
            round=step,
            offset=lo,
            problems=len(self.support),
            base=self.base_digest,
            values=tuple(own),
        )
        with self.timer("exchange"):
            got, rejected = self._trade(step, payload)
        for rank, p in {self.rank: payload, **got}.items():
            row = self.scores.setdefault(rank, [None] * a.population)
            for i, v in enumerate(p.values):
                row[lo + i] = [float(v), float(p.problems)]
        pooled = [self._pooled(i) for i in range(lo, hi)]
        everyone = [r for r in (self._pooled(i) for i in range(a.population)) if r is not None]
        self.counters["scored_total"] += hi - lo
        metrics.update(
            {
                "reward/mean": sum(own) / len(own),
                "reward/pooled_mean": sum(pooled) / len(pooled),  # type: ignore[arg-type]
                "reward/best": max(everyone),
                "reward/non_finite": float(non_finite),
                "population/scored": float(hi - lo),
                "population/scored_total": self.counters["scored_total"],
                "population/perturbations_per_second": (hi - lo) / max(seconds, 1e-9),
            }
        )
        metrics.update(self._exchange_metrics(got, rejected))
        metrics.update(self._tokens(tokens))
        if step == a.stage0_steps():
            self._write_population()
            if not self.corp:
                metrics["population/ensemble_sha256"] = self._ensemble_sha()  # type: ignore[assignment]
        return metrics

    def _consolidate(self, step: int) -> dict[str, float]:
        a: CoRPConfig = self.acfg  # type: ignore[assignment]
        rewards = [self._pooled(i) for i in range(a.population)]
        scored = [i for i, r in enumerate(rewards) if r is not None]
        nb = len(a.betas)
        dirs: list[tuple[Triple, ...]] = []
        stats: list[dict[str, float]] = []
        elites: list[int] = []
        with self.timer("merge"):
            for q in a.quantiles:
                members = [scored[j] for j in elite([rewards[i] for i in scored], q)]  # type: ignore[misc]
                elites.append(len(members))
                for beta in a.betas:
                    _, w2, st = corp_weights(
                        [rewards[i] for i in members],  # type: ignore[misc]
                        [self.seeds[i] for i in members],
                        [self.sigmas[i] for i in members],
                        self.stage0.shapes,
                        beta=beta,
                        compatibility=a.compatibility,
                        leave_one_out=a.leave_one_out,
                        stream=a.noise,
                    )
                    dirs.append(
                        tuple(
                            (self.seeds[i], self.sigmas[i], w)
                            for i, w in zip(members, w2, strict=True)
                        )
                    )
                    stats.append(st)
        grid = a.candidates()
        tokens = 0
        # The base and every candidate on the probe split (and, with the gate, on the
        # validation split: values = probe values, then validation values, both base first).
        splits = [self.probe, self.validation] if self.gate else [self.probe]
        with self.timer("probe"):
            per_split: list[list[float]] = [[] for _ in splits]
            for k, ps in enumerate(splits):
                r, tok, _ = self._mean_reward(ps)
                per_split[k].append(r)
                tokens += tok
            for qi, bi, alpha in grid:
                self.stage0.apply(_scaled(dirs[qi * nb + bi], alpha))
                for k, ps in enumerate(splits):
                    r, tok, _ = self._mean_reward(ps)
                    per_split[k].append(r)
                    tokens += tok
            values = [v for vs in per_split for v in vs]
            self.stage0.restore()
        payload = PopulationPayload(
            kind=KIND_PROBE,
            round=step,
            offset=0,
            problems=len(self.probe),
            base=self.base_digest,
            values=tuple(values),
            directions=tuple(dirs),
        )
        with self.timer("exchange"):
            got, rejected = self._trade(step, payload, max_triples=a.population)
        parties = {self.rank: payload, **got}
        ranks = sorted(parties)
        everything = pool([parties[r].values for r in ranks], [parties[r].problems for r in ranks])
        n = 1 + len(grid)  # base + candidates, per split
        pooled, validated = everything[:n], everything[n:]
        leader = ranks[0]
        best = max(range(len(grid)), key=lambda c: (pooled[1 + c], -c))
        qi, bi, alpha = grid[best]
        chosen = _scaled(parties[leader].directions[qi * nb + bi], alpha)
        own_choice = _scaled(dirs[qi * nb + bi], alpha)
        # The gate (docs/math.md §10.4): the chosen candidate must beat the base on the pooled
        # held-out validation split, else the base model is kept (an empty stage).
        applied = not self.gate or validated[1 + best] > validated[0]
        with self.timer("apply"):
            if applied:
                self.stage0.apply(chosen)
            else:
                self.stage0.restore()
            self.current = Perturber(self.node.model, stream=a.noise)
        stage = list(chosen) if applied else []
        self.stages.append(stage)
        sha = weights_sha256(self.node.model)
        self.choice = {
            "q": a.quantiles[qi],
            "beta": a.betas[bi],
            "alpha": alpha,
            "probe_base": pooled[0],
            "probe_reward": pooled[1 + best],
            "applied": applied,
            "leader": leader,
            "weights_sha256": sha,
        }
        if self.gate:
            self.choice["validation_base"] = validated[0]
            self.choice["validation_reward"] = validated[1 + best]
        self._write_direction(sha)
        self._write_population()
        log.info(
            "node %s: consolidated q=%g beta=%g alpha=%g (%d terms, probe %.3f vs base %.3f%s): "
            "%s, weights sha256 %s",
            self.node.name,
            a.quantiles[qi],
            a.betas[bi],
            alpha,
            len(chosen),
            pooled[1 + best],
            pooled[0],
            f", validation {validated[1 + best]:.3f} vs base {validated[0]:.3f}"
            if self.gate
            else "",
            "applied" if applied else "kept the base model (the gate)",
            sha,
        )
        st = stats[qi * nb + bi]
        metrics: dict[str, Any] = {
            "corp/q": a.quantiles[qi],
            "corp/beta": a.betas[bi],
            "corp/alpha": alpha,
            "corp/elite_size": float(elites[qi]),
            "corp/probe_base": pooled[0],
            "corp/probe_reward": pooled[1 + best],
            "corp/probe_best_own": max(values[1:n]),
            "corp/applied": float(applied),
            "corp/candidates": float(len(grid)),
            "corp/alignment": st["alignment"],
            "corp/dispersion": st["dispersion"],
            "corp/mean_norm": st["mean_norm"],
            "corp/leader": float(leader),
            "corp/own_direction": float(chosen == own_choice),
            **(
                {
                    "corp/validation_base": validated[0],
                    "corp/validation_reward": validated[1 + best],
                }
                if self.gate
                else {}
            ),
            "population/weights_sha256": sha,
        }
        metrics.update(self._exchange_metrics(got, rejected))
        metrics.update(self._tokens(tokens))
        return metrics

    # ---------------------------------------------------------------------------- evaluate

    def evaluate(self, step: int) -> dict[str, float]:
        tc = self.cfg.train
        ranked = rank_members([self._pooled(i) for i in range(self.acfg.population)])
        if not self.corp and ranked:
            return self._vote_eval(ranked[: self.acfg.top_k], prefix=None)
        out = evaluate(self.node, self.task, self.cfg.eval, tc, seed=eval_seed(tc.seed, step))
        a = self.acfg
        if self.corp and self.stages and a.report_randopt and step == tc.steps:  # type: ignore[attr-defined]
            if self.stage0_known:
                out.update(self._vote_eval(ranked[: a.top_k], prefix="eval/randopt"))
            else:
                log.info(
                    "node %s: theta_0 is not kept across a resume: no RandOpt figures",
                    self.node.name,
                )
        return out

    def _vote_eval(self, members: list[int], *, prefix: str | None) -> dict[str, float]:
        """Top-K majority vote of `members` (best first) on the eval splits: with prefix None
        the ensemble's own eval/<split>/accuracy (randopt); else `<prefix>/vote_accuracy` and
        `<prefix>/best_accuracy` on the first split (corp's report)."""
        ev = self.cfg.eval
        splits = self.task.eval_splits if prefix is None else self.task.eval_splits[:1]
        out: dict[str, float] = {}
        try:
            for n, split in enumerate(splits):
                ds = self.task.split(split)
                ps = problem_set(
                    self.task, self.node, [ds[j] for j in range(min(ev.size, len(ds)))]
                )
                texts = []
                for i in members:
                    self.stage0.apply([(self.seeds[i], self.sigmas[i], 1.0)])
                    t, _ = self._completions(ps)
                    texts.append(t)
                winners = majority_vote([answers_of(self.task, t) for t in texts])
                vote = [
                    0.0 if w is None else float(self.task.reward(p, texts[w][j]))
                    for j, (p, w) in enumerate(zip(ps.problems, winners, strict=True))
                ]
                vote_acc = sum(vote) / len(vote)
                best_acc = sum(rewards_of(self.task, ps, texts[0])[0]) / len(ps)
                if prefix is None:
                    out[f"eval/{split}/accuracy"] = vote_acc
                    if n == 0:
                        out["eval/accuracy"] = vote_acc
                        out["eval/randopt/best_accuracy"] = best_acc
                        out["eval/randopt/k"] = float(len(members))
                else:
                    out[f"{prefix}/vote_accuracy"] = vote_acc
                    out[f"{prefix}/best_accuracy"] = best_acc
                    out[f"{prefix}/k"] = float(len(members))
        finally:
            self.current.restore()
        return out

    # ---------------------------------------------------------------------------- helpers

    def _completions(self, ps: ProblemSet) -> tuple[list[str], int]:
        return greedy_completions(
            self.node,
            ps,
            max_new_tokens=self.cfg.train.max_new_tokens,
            batch_size=self.acfg.batch_size,
        )

    def _mean_reward(self, ps: ProblemSet) -> tuple[float, int, int]:
        """(mean greedy reward of the model as it is on `ps`, forward tokens, non-finite)."""
        texts, tokens = self._completions(ps)
        rewards, bad = rewards_of(self.own_task, ps, texts)
        return sum(rewards) / len(rewards), tokens, bad

    def _pooled(self, i: int) -> float | None:
        """Member i's pooled reward over every party that reported it (rank order)."""
        rows = [self.scores[r][i] for r in sorted(self.scores)]
        have = [v for v in rows if v is not None]
        if not have:
            return None
        return pool([[v] for v, _ in have], [int(n) for _, n in have])[0]

    def _trade(
        self, step: int, payload: PopulationPayload, *, max_triples: int = 0
    ) -> tuple[dict[int, PopulationPayload], int]:
        """Send this node's payload of `step`; every peer's that passes validation, and how
        many were rejected (malformed, non-finite, another round or base, over the limit)."""
        if self.transport.world_size == 1:
            return {}, 0
        try:
            data = self.codec.encode(payload)
        except ValueError as e:  # never expected (rewards are sanitised): peers reject b""
            log.error("node %s: own payload cannot be encoded: %s", self.node.name, e)
            data = b""
        n_dirs = len(payload.directions)
        limit = payload_size(len(payload.values), [max_triples] * n_dirs)
        raw = self.transport.exchange(step, data, max_bytes=limit)
        got: dict[int, PopulationPayload] = {}
        rejected = 0
        for peer, blob in sorted(raw.items()):
            try:
                if blob is None:
                    raise PayloadError(f"over the limit of {limit} bytes")
                got[peer] = self.codec.decode(
                    blob,
                    kind=payload.kind,
                    round_=step,
                    offset=payload.offset,
                    n_values=len(payload.values),
                    base=self.base_digest,
                    n_directions=n_dirs,
                    max_triples=max_triples,
                )
            except PayloadError as e:
                rejected += 1
                if "digest" in str(e):  # another model or other noise: never a transient fault
                    log.error(
                        "node %s step %d: refused rank %d: it rebuilds other weights from the "
                        "same seeds (its digest of the base weights and of a check direction "
                        "rebuilt on them differs: other base weights, or a torch whose noise "
                        "differs); its rewards are left out of every pool. %s",
                        self.node.name,
                        step,
                        peer,
                        e,
                    )
                else:
                    log.warning(
                        "node %s step %d: rejected rank %d's rewards: %s",
                        self.node.name,
                        step,
                        peer,
                        e,
                    )
        self.counters["rejected_total"] += rejected
        return got, rejected

    def _exchange_metrics(self, got: dict[int, PopulationPayload], rejected: int) -> dict:
        if self.transport.world_size == 1:
            return {}
        return {
            "population/contributors": float(1 + len(got)),
            "population/rejected": float(rejected),
            "population/rejected_total": self.counters["rejected_total"],
            "exchange/lost_peers": float(len(self.transport.stats.lost)),
            # a party skipped for a round (late, or its record overwritten): issue 37
            "exchange/missed_payloads": float(self.transport.stats.missed),
        }

    def _tokens(self, tokens: int) -> dict[str, float]:
        self.counters["forward_tokens_total"] += tokens
        return {
            "train/forward_tokens": float(tokens),
            "train/forward_tokens_total": self.counters["forward_tokens_total"],
        }

    def _ensemble_sha(self) -> str:
        """Digest of what a RandOpt node answers with: the base weights and the top-K members."""
        top = rank_members([self._pooled(i) for i in range(self.acfg.population)])
        top = top[: self.acfg.top_k]
        text = json.dumps(
            [self.base_sha, self.acfg.noise, [[self.seeds[i], self.sigmas[i]] for i in top]]
        )
        return hashlib.sha256(text.encode()).hexdigest()

    def _node_dir(self):
        if self.ctx.run_dir is None:
            return None
        return self.ctx.run_dir / "nodes" / self.node.name

    def _write_direction(self, sha: str) -> None:
        node_dir = self._node_dir()
        if node_dir is None:
            return
        a = self.acfg
        save_direction(
            node_dir / "corp-direction.json",
            self.stages,
            stream=a.noise,
            base_sha256=self.base_sha,
            weights_sha256=sha,
            choice={k: v for k, v in self.choice.items() if k != "weights_sha256"},
            population={"seed": a.seed, "size": a.population, "sigmas": list(a.sigmas)},
        )

    def _write_population(self) -> None:
        """Every member's seed, sigma, pooled reward and each party's reward, for analysis."""
        node_dir = self._node_dir()
        if node_dir is None:
            return
        a = self.acfg
        doc = {
            "kind": a.kind,
            "noise": a.noise,
            "base_sha256": self.base_sha,
            "members": [
                {
                    "seed": self.seeds[i],
                    "sigma": self.sigmas[i],
                    "pooled": self._pooled(i),
                    "by_rank": {
                        str(r): (None if self.scores[r][i] is None else self.scores[r][i][0])
                        for r in sorted(self.scores)
                    },
                }
                for i in range(a.population)
            ],
        }
        node_dir.mkdir(parents=True, exist_ok=True)
        tmp = node_dir / "population.json.tmp"
        tmp.write_text(json.dumps(doc))
        tmp.replace(node_dir / "population.json")
