"""The swarm algorithm's config (`algorithm.kind: swarm`, docs/swarm.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from ftis.algos.swarm.schedule import ChurnConfig, RandomChurn, resolve_churn
from ftis.plugins import AlgorithmConfig

# The swarm's shared secret (hex), in the environment of every peer process: `ftis run` draws one
# per run (or passes on the one given) and hands it to its peers here, never on a command line.
SWARM_SECRET_ENV = "FTIS_SWARM_SECRET"
MIN_SECRET_BYTES = 16


class SwarmConfig(AlgorithmConfig):
    """F-TIS in a swarm: every peer samples G completions of every prompt of the round, publishes
    them, trains on its own and whatever its peers published before the deadline.

    max_peers: the largest peer id + 1 (a peer's id is its index in `nodes`).
    deadline_s: the longest a peer waits for the live members' payloads of a round.
    member_ttl_s: a peer silent this long (crashed) is no longer waited for; longer than a step.
    payload_ttl_s: how long a round's payloads stay readable for slow and late peers.
    start_timeout_s: the longest the initial peers (those without a churn `join_at`) wait for
        each other at the start barrier before round 1; one slower than that joins late.
    max_payload_mb: the DHT refuses records larger than this (at most 4: hivemind's p2p
        daemon caps a message at 4 MiB).
    max_peers_used: train on at most this many peers' batches per round besides one's own
        (drawn at random per round, as SAPO mixes a few external rollouts with its own); None:
        all that arrived. Bounds a round's update in a large swarm.
    peer_groups: train on at most this many peer groups per round (a group: one peer's G
        completions of one prompt), drawn at random by (seed, round, peer) from those that
        passed the checks and `max_peers_used`: SAPO's J external rollouts next to its
        I = train.prompts_per_step own groups (I=4, J=4 is SAPO's best mix). None: all; 0:
        train on one's own samples only, while still publishing them for the others.
    groups: what an advantage group is. generator (default): one peer's G completions of a
        prompt, each model's samples measured against its own baseline (the F-TIS paper's
        per-generator groups); prompt: every present peer's completions of the prompt, up to
        (1 + peers) x G samples of different models sharing one baseline (the "horizontal"
        variant, which the paper reports as worse; ftis's behaviour before issue 21).
    initial_peers: multiaddrs of a running swarm to join (empty: `ftis run` starts a bootstrap
        DHT node on 127.0.0.1 and the peers join it).
    backend: `sim` runs every peer in this one process, on an in-memory board with virtual
        time (a deterministic scheduler: many peers on few cores); `hivemind` runs one process
        per peer on hivemind's DHT on loopback (the `swarm` extra).
    churn: node name -> when it joins, leaves, crashes, rejoins, or is slow (`ftis run`
        carries it out); `churn.random` generates a schedule for the other peers (RandomChurn).
    candidate_grace_s: the longest a round waits for a candidate: a peer whose signed heartbeat
        says live but whose payload has not arrived yet (a member, proven by a payload, is
        waited for up to deadline_s).
    silent_rounds: a peer waited for in this many consecutive rounds without a valid payload
        is dropped (`swarm/dropped_silent`) until a payload of it arrives.
    max_round_skew: a round claim more than this beyond the rounds the members' payloads prove
        is not believed (rejected and counted), unless a payload of that peer proves it.
    max_staleness: a peer's samples from a policy more than this many steps behind this peer's
        (the sender's last trained round, which every payload carries: ftis.algos.swarm.meta)
        are dropped and counted (`swarm/stale_samples`); None keeps them all.
    accept_truncated: train on peers' samples drawn with top-k / top-p truncation (their
        recorded log-probs are those of the truncated distribution, which gives the tokens the
        sender could not draw no weight in a ratio); false (default): drop and count them
        (`swarm/truncated_samples`).
    secret_file: a file holding the swarm's shared secret (hex, at least 16 bytes), with which
        every record is signed. Needed when the swarm spans machines or peers are started by
        hand (every peer must have the same); FTIS_SWARM_SECRET in the environment wins over
        it. Without either, `ftis run` draws a secret per run for the peers it starts.
    """

    kind: Literal["swarm"] = "swarm"

    def required_packages(self) -> list[tuple[str, str]]:
        return [("hivemind", "swarm")] if self.backend == "hivemind" else []

    backend: Literal["sim", "hivemind"] = "sim"
    max_peers: int = Field(64, ge=2, le=1024)
    deadline_s: float = Field(20.0, gt=0)
    member_ttl_s: float = Field(60.0, gt=0)
    payload_ttl_s: float = Field(600.0, gt=0)
    start_timeout_s: float = Field(600.0, gt=0)
    max_payload_mb: float = Field(4.0, gt=0)
    max_peers_used: int | None = Field(None, ge=0)
    peer_groups: int | None = Field(None, ge=0)
    groups: Literal["generator", "prompt"] = "generator"
    initial_peers: list[str] = Field(default_factory=list)
    churn: dict[str, ChurnConfig] = Field(default_factory=dict)
    random_churn: RandomChurn | None = None
    candidate_grace_s: float = Field(5.0, gt=0)
    silent_rounds: int = Field(3, ge=1)
    max_round_skew: int = Field(4, ge=1)
    max_staleness: int | None = Field(4, ge=0)
    accept_truncated: bool = False
    secret_file: str | None = None

    def shared_secret(self) -> bytes | None:
        """The swarm's shared secret: FTIS_SWARM_SECRET, else `secret_file`'s (hex); None
        when neither is given."""
        from ftis.config import ConfigError

        raw, source = os.environ.get(SWARM_SECRET_ENV, "").strip(), SWARM_SECRET_ENV
        if not raw and self.secret_file:
            source = f"algorithm.secret_file ({self.secret_file})"
            try:
                raw = Path(self.secret_file).expanduser().read_text().strip()
            except OSError as e:
                raise ConfigError(f"cannot read the swarm secret: {source}: {e}") from None
        if not raw:
            return None
        try:
            secret = bytes.fromhex(raw)
        except ValueError:
            secret = b""
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"the swarm secret in {source} must be hex, at least {MIN_SECRET_BYTES} bytes: "
                "e.g. python -c 'import secrets; print(secrets.token_hex(32))'"
            )
        return secret

    @model_validator(mode="before")
    @classmethod
    def _random_key(cls, data: Any) -> Any:
        # `churn: {random: {...}, <node>: {...}}` reads as churn + random_churn
        if isinstance(data, dict) and isinstance(data.get("churn"), dict):
            churn = dict(data["churn"])
            if "random" in churn:
                if data.get("random_churn") is not None:
                    raise ValueError("give algorithm.churn.random or random_churn, not both")
                data = {**data, "churn": churn, "random_churn": churn.pop("random")}
        return data

    def busy_processes(self, run: Any) -> int:
        """The simulator runs every peer in one process, one at a time; hivemind one per peer."""
        return 1 if self.backend == "sim" else len(run.nodes)

    def start_peers(self, run: Any) -> frozenset[int]:
        """Ids of the initial peers: the nodes without a `join_at` (explicit or generated), who
        start together."""
        churn = resolve_churn(run)
        return frozenset(i for i, n in enumerate(run.nodes) if churn[n.name].join_at == 0)

    def check_run(self, run: Any) -> None:
        names = [n.name for n in run.nodes]
        if run.sharing.share != "all":
            raise ValueError(
                "sharing.share successes is not supported in a swarm yet (a swarm's peers "
                "answer their own prompts); remove it or run algorithm.kind ftis with "
                "sharing.scheme joint"
            )
        unknown = sorted(set(self.churn) - set(names))
        if unknown:
            raise ValueError(
                f"algorithm.churn names {', '.join(unknown)}, not nodes of this run "
                f"({', '.join(names)})"
            )
        if len(names) > self.max_peers:
            raise ValueError(
                f"{len(names)} nodes but algorithm.max_peers={self.max_peers}: raise max_peers"
            )
        if all(c.join_at > 0 for c in (self.churn.get(n, ChurnConfig()) for n in names)):
            raise ValueError("every peer joins late: let at least one start at once (join_at: 0)")
        steps = run.train.steps
        for n, c in self.churn.items():
            for f in ("join_at", "leave_at", "rejoin_at"):
                v = getattr(c, f)
                if v is not None and v >= steps and not (f == "join_at" and v == 0):
                    raise ValueError(
                        f"algorithm.churn.{n}.{f}={v} is not before the last round "
                        f"(train.steps={steps}): choose a round below {steps}"
                    )


def membership_settings(a: SwarmConfig) -> dict[str, Any]:
    """The `SwarmSettings` fields of the membership rules (docs/swarm.md), from the config."""
    return {
        "candidate_grace_s": a.candidate_grace_s,
        "silent_rounds": a.silent_rounds,
        "max_round_skew": a.max_round_skew,
    }
