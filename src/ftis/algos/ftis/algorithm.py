"""F-TIS sample exchange: the whole recipe of one step, top to bottom (ftis-method.md).

    sample      this node's share of the step's prompts, G completions each (or G/n: horizontal)
    exchange    every node's rollouts, tokens + sampler log-probs only
    validate    a peer's batch may only answer the prompts it was given, within its share
    bridge      a peer on another tokenizer sent text: re-tokenize it (docs/math.md §16)
    score       rewards from this node's own verifier
    advantages  per group (= per prompt), before any filtering
    update      receiver log-probs, the node's loss (F-TIS by default), one optimizer step
                (or train.update_epochs x train.mini_batches steps reusing the round's samples)

Deviations from the paper are listed in docs/design.md.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ftis.algos.ftis import sharing
from ftis.algos.ftis.adversary import adversarial
from ftis.algos.ftis.bridge import attach_text, bridge_blocker, retokenize
from ftis.algos.ftis.defence import Screen, same_model_caveat, same_model_ranks
from ftis.algos.ftis.hacpo import Capabilities, hacpo_max_reward, joint_advantages
from ftis.algos.ftis.poison import forge_margin, poison
from ftis.config import PoisonAttack
from ftis.exchange.codec import RolloutCodec, RolloutExchange, to_device
from ftis.exchange.group import BRIDGE_BLOCKERS, GroupMismatchError
from ftis.exchange.wire import TEXT_BYTES_PER_TOKEN
from ftis.models.loading import load_tokenizer, tokenizer_fingerprint
from ftis.models.presets import PRESETS
from ftis.rollout.types import RolloutBatch
from ftis.train import scoring
from ftis.train.context import NodeContext
from ftis.train.evaluate import evaluate
from ftis.train.sampling import generate
from ftis.train.seeds import adversary_seed, eval_seed
from ftis.train.update import train_on_round

log = logging.getLogger(__name__)


class FTISAlgorithm:
    """One node of a sample-exchange run. State: the counters it reports as running totals."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.node = ctx.node
        self.task = ctx.task
        self.timer = ctx.timer
        self.rank = ctx.rank
        self.train_split = ctx.task.split("train")
        self.vocab_size = int(ctx.node.model.get_input_embeddings().num_embeddings)
        self.paths = peer_paths(ctx)
        self.bridged_peers = frozenset(j for j, p in enumerate(self.paths) if p == "bridged")
        # a re-tokenized completion may have more tokens than the sender's (a character
        # tokenizer spells a BPE token's digits one by one); its text is bounded by the wire
        self.bridge_max_tokens = TEXT_BYTES_PER_TOKEN * ctx.cfg.train.max_new_tokens + 1
        self.exchange = RolloutExchange(
            ctx.transport,
            RolloutCodec(
                vocab_size=self.vocab_size,
                max_tokens=ctx.cfg.train.max_new_tokens,
                pad_id=ctx.node.tokenizer.pad_token_id,
                logprob_format=ctx.cfg.exchange.logprob_format,
                bridged_peers=self.bridged_peers,
            ),
            first_round=ctx.first_step,
        )
        if ctx.transport.world_size > 1:
            log.info("rank %d: log-probs travel as %s", self.rank, self.exchange.codec.describe())
        attack = ctx.cfg.testing.adversary.get(ctx.node.name)
        self.adversary = attack if isinstance(attack, str) else None
        self.poison = attack if isinstance(attack, PoisonAttack) else None
        self.poisoned = 0  # sequences poisoned in the last outgoing batch
        self.screen = Screen(
            ctx.cfg.defence, rank=self.rank, same_model=same_model_ranks(ctx.cfg, self.rank)
        )
        caveat = same_model_caveat(ctx.cfg, self.rank)
        if caveat:
            log.warning("rank %d: %s", self.rank, caveat)
        self.counters = {
            "generated_tokens_total": 0.0,
            "skipped_updates_total": 0.0,
            "forward_tokens_total": 0.0,
        }
        self._prompt_len: dict[int, int] = {}  # train-split index -> prompt tokens
        loss = ctx.node.cfg.loss
        self.hacpo = Capabilities(loss.hacpo_window) if loss.method == "hacpo" else None
        # success-gated sharing (sharing.share successes): the step's withheld completions,
        # (prompt, peer rank) -> count, and its exchange/gated_* rows
        self.withheld: dict[tuple[int, int], int] | None = None
        self.gate_metrics: dict[str, float] = {}
        self.hacpo_max_reward = hacpo_max_reward(loss, self.task) if self.hacpo else 1.0

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"counters": dict(self.counters)}
        if self.hacpo is not None:
            state["hacpo"] = self.hacpo.state_dict()
        if self.cfg.defence.trust:
            state["defence"] = self.screen.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters.update(state.get("counters", {}))
        if self.hacpo is not None and "hacpo" in state:
            self.hacpo.load_state_dict(state["hacpo"])
        if "defence" in state:
            self.screen.load_state_dict(state["defence"])

    def evaluate(self, step: int) -> dict[str, float]:
        tc = self.cfg.train
        return evaluate(
            self.node,
            self.task,
            self.cfg.eval,
            tc,
            seed=eval_seed(tc.seed, step),
            watch=self.cfg.testing.injections(),
        )

    def step(self, step: int) -> dict[str, float]:
        tc, scheme = self.cfg.train, self.cfg.sharing.scheme
        world = self.exchange.world_size
        with self.timer("sample"):
            indices = sharing.step_prompts(
                tc.seed, step, tc.prompts_per_step, len(self.train_split)
            )
            mine = sharing.assign_prompts(indices, rank=self.rank, world_size=world, scheme=scheme)
            slots = sharing.sample_slots(
                rank=self.rank, world_size=world, scheme=scheme, group_size=tc.group_size
            )
            own = generate(
                self.node,
                self.task,
                [self.train_split[i] for i in mine],
                slots=slots,
                cfg=tc,
                step=step,
            )
        gate = self.cfg.sharing.share == "successes" and world > 1
        sent = own
        if gate:  # success-gated sharing: peers get only what this node's verifier rewards
            with self.timer("gate"):
                sent = self._successes(own)
        with self.timer("exchange"):
            received = self.exchange.all_gather(self._outgoing(sent, step))
            received[self.rank] = own  # a node trains on its own honest samples
        with self.timer("validate"):
            rejected = self._validate(received, indices, step)
        # each peer that sent a batch answered every prompt with G: what it did not send it
        # withheld as a failure (docs/math.md §17)
        self.withheld = self._withheld(received, indices) if gate else None
        self.gate_metrics = {"exchange/gated_sent": float(sent.num_sequences)} if gate else {}
        bridge_metrics = {}
        if self.bridged_peers:
            with self.timer("bridge"):
                bridge_metrics = self._bridge(received, step)
        metrics, batch = self.learn(received, own, step)
        if self.poison is not None:
            metrics["attack/poisoned_sent"] = float(self.poisoned)
        if world > 1:
            metrics.update(
                self._exchange_metrics(own, batch, rejected, sent_tokens=sent.num_tokens)
            )
            metrics.update(self.gate_metrics)
        if self.bridged_peers:
            metrics.update(bridge_metrics)
            # over the bridged sequences the update ran (non-zero advantage): counts are 0 when
            # none did; their mean weight is then not computed and left out
            metrics["bridge/weighted"] = metrics.get("loss/bridge_sequences", 0.0)
            metrics["bridge/filtered"] = metrics.get("loss/bridge_filtered", 0.0)
            if "loss/bridge_weight_mean" in metrics:
                metrics["bridge/mean_weight"] = metrics["loss/bridge_weight_mean"]
        return metrics

    def _successes(self, own: RolloutBatch) -> RolloutBatch:
        """This node's own completions that its verifier rewards above 0."""
        rewards, _ = scoring.finite_rewards(scoring.score(self.task, self.node.tokenizer, own))
        keep = (rewards > 0) & ~scoring.excluded_rows(own).to(rewards.device)
        return own.select(keep.cpu())

    def _withheld(
        self, received: list[RolloutBatch | None], indices: list[int]
    ) -> dict[tuple[int, int], int]:
        """(prompt, peer rank) -> completions the peer answered but did not send: G less what
        arrived, for every prompt of the step and every peer whose batch arrived (a lost
        peer's prompts have no group to fill)."""
        g = self.cfg.train.group_size
        out: dict[tuple[int, int], int] = {}
        for peer, b in enumerate(received):
            if peer == self.rank or b is None:
                continue
            counts: dict[int, int] = {}
            for p in b.prompt_index.tolist():
                counts[p] = counts.get(p, 0) + 1
            for p in indices:
                out[(p, peer)] = max(g - counts.get(p, 0), 0)
        return out

    def _bridge(self, received: list[RolloutBatch | None], step: int) -> dict[str, float]:
        """Re-tokenize every bridged peer's batch in place (docs/math.md §16); a sequence whose
        text this node cannot spell, or that re-tokenizes past the limit, is dropped and
        counted."""
        samples = dropped = 0
        for peer in sorted(self.bridged_peers):
            b = received[peer]
            if b is None:
                continue
            out, reasons = retokenize(b, self.node.tokenizer, max_tokens=self.bridge_max_tokens)
            for why in reasons:
                log.warning(
                    "node %s step %d: dropped rank %d's %s", self.node.name, step, peer, why
                )
            received[peer] = to_device(out, b.completion_ids.device)
            samples += out.num_sequences
            dropped += len(reasons)
        return {"bridge/samples": float(samples), "bridge/rejected": float(dropped)}

    def learn(
        self,
        received: list[RolloutBatch | None],
        own: RolloutBatch,
        step: int,
        *,
        groups: str = "prompt",
    ) -> tuple[dict[str, float], RolloutBatch]:
        """Score, advantages and update on the validated batches of a step (None: nothing from
        that rank); returns the step's metrics and the batch it trained on. Also used by the
        swarm algorithm (ftis.algos.swarm), whose peers come and go. groups: what an advantage
        group is, "prompt" (every rank's completions of a prompt: F-TIS's shared groups) or
        "generator" (one rank's completions of a prompt: `scoring.group_ids`)."""
        pad_id = self.node.tokenizer.pad_token_id
        batch = RolloutBatch.concat([b for b in received if b is not None], pad_id)
        with self.timer("score"):
            rewards, bad_rewards = scoring.finite_rewards(
                scoring.score(self.task, self.node.tokenizer, batch)
            )
        if bad_rewards:
            log.warning(
                "node %s step %d: the verifier returned %d non-finite rewards; counted as 0",
                self.node.name,
                step,
                bad_rewards,
            )
        withheld = self.withheld if groups == "prompt" else None
        if withheld is not None:
            # a peer sends only its successes: what this node's verifier does not reward is
            # dropped, counted, and kept in the group as a withheld failure
            failed = (batch.generator != self.rank) & (rewards <= 0).cpu()
            self.gate_metrics["exchange/gated_failures_dropped"] = float(failed.sum())
            if bool(failed.any()):
                log.warning(
                    "node %s step %d: dropped %d peer completion(s) sent as successes that "
                    "this node's verifier does not reward",
                    self.node.name,
                    step,
                    int(failed.sum()),
                )
                for p, j in zip(
                    batch.prompt_index[failed].tolist(),
                    batch.generator[failed].tolist(),
                    strict=True,
                ):
                    withheld[(p, j)] = withheld.get((p, j), 0) + 1
                batch, rewards = batch.select(~failed), rewards[~failed.to(rewards.device)]
        screened: dict[str, float] = {}
        trust_scale = None
        if self.cfg.defence.active and bool((batch.generator != self.rank).any()):
            with self.timer("screen"):
                keep, trust_scale, screened = self.screen.apply(
                    batch,
                    node=self.node,
                    task=self.task,
                    temperature=self.cfg.train.temperature,
                    micro_batch_size=self.cfg.train.micro_batch_size,
                )
                if not bool(keep.all()):
                    if withheld is not None:
                        # a screened peer's completions are out of the step's groups: so are the
                        # failures it withheld (its remaining rows join as under full sharing)
                        for j in set(batch.generator[~keep].tolist()):
                            for key in [k for k in withheld if k[1] == j]:
                                withheld[key] = 0
                    batch, rewards, trust_scale = (
                        batch.select(keep),
                        rewards[keep],
                        trust_scale[keep],
                    )
        if withheld is not None and self.cfg.defence.trust:
            # a quarantined peer shapes no group, even through the failures it withheld (it may
            # have sent no row at all for the screens to drop)
            for key in withheld:
                if self.screen.trust(key[1]) < self.cfg.defence.quarantine_below:
                    withheld[key] = 0
        if self.cfg.defence.trust:
            names = self.cfg.rank_names
            for peer in range(self.exchange.world_size):
                if peer != self.rank and peer < len(self.cfg.nodes):
                    screened[f"trust/{names[peer]}"] = self.screen.trust(peer)
        with self.timer("advantages"):
            lonely = scoring.lonely_groups(batch, by=groups)
            skipped_groups = len(set(scoring.group_ids(batch, groups)[lonely].tolist()))
            if skipped_groups:
                log.warning(
                    "node %s step %d: skipped %d group(s) with a single completion (a peer's "
                    "share was lost or rejected)",
                    self.node.name,
                    step,
                    skipped_groups,
                )
                batch, rewards = batch.select(~lonely), rewards[~lonely]
                if trust_scale is not None:
                    trust_scale = trust_scale[~lonely]
            peer_scale = None
            metrics: dict[str, float] = {"train/skipped_groups": float(skipped_groups)}
            scale = self.node.cfg.loss.advantage_scale
            if self.hacpo is None and withheld is None:
                adv = scoring.advantages_for(batch, rewards, scale, by=groups)
            elif self.hacpo is None:
                per_prompt: dict[int, int] = {}
                for (p, _), c in withheld.items():
                    per_prompt[p] = per_prompt.get(p, 0) + c
                adv = scoring.advantages_with_withheld(batch, rewards, scale, per_prompt)
            else:
                per_agent: dict[int, int] = {}
                for (_, j), c in (withheld or {}).items():
                    per_agent[j] = per_agent.get(j, 0) + c
                self.hacpo.record(batch, rewards, withheld=per_agent, step=step)
                adv, peer_scale, hacpo_metrics = joint_advantages(
                    batch,
                    rewards,
                    self.hacpo,
                    learner=self.rank,
                    max_reward=self.hacpo_max_reward,
                    names=dict(enumerate(n.name for n in self.cfg.nodes)),
                    withheld=withheld,
                )
                metrics.update(hacpo_metrics)
            if trust_scale is not None:
                adv = adv * trust_scale.to(adv.device, adv.dtype)
        metrics.update(screened)
        with self.timer("update"):
            # the withheld failures of the groups that train count in N (docs/math.md §17)
            present = set(batch.prompt_index.tolist())
            held = sum(c for (p, _), c in (withheld or {}).items() if p in present)
            metrics.update(self._update(batch, adv, step, peer_scale=peer_scale, withheld=held))
        if withheld is not None:
            metrics["exchange/withheld_counted"] = float(held)
        if self.hacpo is not None and metrics.get("loss/peer_frac", 0.0) > 0:
            # the fraction of peers' (active) samples whose ratio fell outside the clip window
            metrics["hacpo/clipped_fraction"] = (
                metrics["loss/peer_clipped_frac"] / metrics["loss/peer_frac"]
            )
        metrics["reward/non_finite"] = float(bad_rewards)
        metrics.update(_reward_metrics(batch, rewards, self.rank))
        self.counters["generated_tokens_total"] += own.num_tokens
        metrics["train/generated_tokens"] = float(own.num_tokens)
        metrics["train/generated_tokens_total"] = self.counters["generated_tokens_total"]
        updates = self.cfg.train.update_epochs
        tokens = self._forward_tokens(own) + 3 * updates * self._forward_tokens(batch)
        self.counters["forward_tokens_total"] += tokens
        metrics["train/forward_tokens"] = float(tokens)
        metrics["train/forward_tokens_total"] = self.counters["forward_tokens_total"]
        return metrics, batch

    def _forward_tokens(self, batch: RolloutBatch) -> int:
        """Prompt + completion tokens of every sequence of `batch`: the tokens one forward pass
        over it processes. A step's compute is its sampling pass over its own samples plus
        3 x update_epochs such passes over the training batch (forward and backward), the
        accounting RandOpt/CoRP use too (docs/randopt.md, "Compute accounting")."""
        total = int(batch.lengths.sum())
        for i in batch.prompt_index.tolist():
            if i not in self._prompt_len:
                ids = self.task.prompt_ids(self.train_split[i], self.node.tokenizer)
                self._prompt_len[i] = len(ids)
            total += self._prompt_len[i]
        return total

    def _outgoing(self, own: RolloutBatch, step: int) -> RolloutBatch:
        """What this node sends: its samples, or (testing.adversary) a corrupted or poisoned
        copy; with the text section when a peer is on another tokenizer."""
        out = own
        if self.poison is not None:
            margin = forge_margin(self.node.cfg.loss) if self.poison.logprobs == "forged" else 0.0
            out, self.poisoned = poison(
                own,
                self.poison,
                node=self.node,
                task=self.task,
                max_new_tokens=self.cfg.train.max_new_tokens,
                temperature=self.cfg.train.temperature,
                margin=margin,
            )
        elif self.adversary is not None:
            gen = torch.Generator().manual_seed(
                adversary_seed(self.cfg.train.seed, step, self.rank)
            )
            out = adversarial(own, self.adversary, vocab_size=self.vocab_size, generator=gen)
        if self.bridged_peers:
            out = attach_text(out, self.node.tokenizer)
        return out

    def _validate(self, received: list[RolloutBatch | None], indices: list[int], step: int) -> int:
        """Drop (set to None) every peer batch that answers prompts it was not given or sends
        more than its share; return how many were dropped."""
        tc = self.cfg.train
        rejected = 0
        for peer, b in enumerate(received):
            if peer == self.rank or b is None:
                continue
            quota = sharing.peer_prompt_quota(
                indices,
                peer=peer,
                world_size=self.exchange.world_size,
                scheme=self.cfg.sharing.scheme,
                group_size=tc.group_size,
            )
            why = sharing.check_peer_batch(b, quota, train_size=len(self.train_split))
            if why is not None:
                log.warning(
                    "node %s step %d: rejected rank %d's batch: %s", self.node.name, step, peer, why
                )
                received[peer] = None
                rejected += 1
        return rejected

    def _update(
        self,
        batch: RolloutBatch,
        adv: torch.Tensor,
        step: int,
        *,
        peer_scale: torch.Tensor | None = None,
        withheld: int = 0,
    ) -> dict[str, float]:
        out, skipped = train_on_round(
            self.node,
            self.task,
            batch,
            adv,
            train=self.cfg.train,
            step=step,
            own=batch.generator == self.rank,
            peer_scale=peer_scale,
            withheld=withheld,
        )
        out["train/skipped_update"] = skipped
        self.counters["skipped_updates_total"] += skipped
        out["train/skipped_updates_total"] = self.counters["skipped_updates_total"]
        # Consecutive steps without a usable group; the shell stops the node at
        # train.max_steps_without_signal. Checkpointed, so a resume continues the count.
        streak = self.counters.get("no_signal_streak", 0.0)
        self.counters["no_signal_streak"] = streak + 1 if out["train/no_signal"] else 0.0
        out["train/no_signal_streak"] = self.counters["no_signal_streak"]
        return out

    def _exchange_metrics(
        self,
        own: RolloutBatch,
        batch: RolloutBatch,
        rejected: int,
        *,
        sent_tokens: int | None = None,
    ) -> dict[str, float]:
        """Rollout-specific exchange figures; the shell adds the transport's bytes. Bytes per
        token are over the tokens sent (`sent_tokens`, all own ones by default)."""
        s = self.exchange.last_stats
        out = {
            "exchange/seconds": s.seconds,
            "exchange/rejected": float(s.rejected + rejected),
            "exchange/sequences_received": float(batch.num_sequences - own.num_sequences),
            # encode_seconds, comm_seconds (includes waiting for slower peers), decode_seconds,
            # peers (payloads received) and lost_peers (so far)
            **{f"exchange/{k}": float(v) for k, v in s.extra.items()},
        }
        tokens = own.num_tokens if sent_tokens is None else sent_tokens
        if tokens:
            out["exchange/bytes_per_token"] = s.bytes_sent / tokens
        return out


def peer_paths(ctx: NodeContext) -> list[str]:
    """Per rank: "self", "exact" (one tokenizer: ids and per-token log-probs) or "bridged"
    (another tokenizer: text and sequence-level weights, docs/math.md §16), from the
    fingerprints the launcher's handshake gathered (which has already refused a pair that
    cannot be bridged). Without a handshake (in-process runs) every node builds the same table
    from the run config, loading each peer's tokenizer (presets, local paths; a peer with this
    node's own preset tokenizer or path is not loaded), and raises GroupMismatchError for a pair
    that cannot be bridged."""
    world = ctx.transport.world_size
    if world == 1:
        return ["self"]
    if ctx.peer_tokenizers is not None:
        prints = ctx.peer_tokenizers
        return [
            "self" if j == ctx.rank else "exact" if p == prints[ctx.rank] else "bridged"
            for j, p in enumerate(prints)
        ]
    nodes = ctx.cfg.nodes[:world]
    me = nodes[ctx.rank].model
    mine = ctx.node.tokenizer

    def same_source(m) -> bool:
        if m.preset is not None and me.preset is not None:
            return PRESETS[m.preset].tokenizer == PRESETS[me.preset].tokenizer
        return m.path is not None and m.path == me.path

    toks = [mine if same_source(n.model) else load_tokenizer(n.model) for n in nodes]
    prints = [tokenizer_fingerprint(t) for t in toks]
    paths = [
        "self" if j == ctx.rank else "exact" if p == prints[ctx.rank] else "bridged"
        for j, p in enumerate(prints)
    ]
    if "bridged" in paths:
        for j in [ctx.rank, *(j for j, p in enumerate(paths) if p == "bridged")]:
            why = bridge_blocker(ctx.cfg, j, toks[j])
            if why is not None:
                raise GroupMismatchError(
                    f"node {nodes[j].name} is on another tokenizer than a peer but cannot take "
                    f"the bridged path: {BRIDGE_BLOCKERS[why]}"
                )
    return paths


def _reward_metrics(batch: RolloutBatch, rewards: torch.Tensor, rank: int) -> dict[str, float]:
    own = batch.generator == rank
    out = {"reward/mean": float(rewards.mean()) if rewards.numel() else 0.0}
    if own.any():
        out["reward/own"] = float(rewards[own].mean())
    if (~own).any():
        out["reward/peers"] = float(rewards[~own].mean())
    out["train/completion_tokens"] = (
        float(batch.lengths.float().mean()) if batch.num_sequences else 0.0
    )
    return out
