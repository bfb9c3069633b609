"""The swarm algorithm's config (`algorithm.kind: swarm`, docs/swarm.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ftis.algos import AlgorithmConfig


class ChurnConfig(BaseModel):
    """When `ftis run` starts, stops and restarts one peer (steps are the swarm's rounds).

    join_at: start the peer once the swarm has reached this round (0: at once).
    leave_at: the peer leaves after this step (a checkpoint, then it announces it is gone).
    crash: leave by SIGKILL instead (no goodbye: the others stop waiting once its heartbeat
        expires).
    rejoin_at: restart the peer from its checkpoint once the swarm has reached this round.
    """

    model_config = ConfigDict(extra="forbid")
    join_at: int = Field(0, ge=0)
    leave_at: int | None = Field(None, ge=1)
    crash: bool = False
    rejoin_at: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _order(self) -> ChurnConfig:
        if self.rejoin_at is not None and (
            self.leave_at is None or self.rejoin_at <= self.leave_at
        ):
            raise ValueError("churn.rejoin_at needs a leave_at before it (rejoin_at > leave_at)")
        if self.leave_at is not None and self.leave_at <= self.join_at:
            raise ValueError("churn.leave_at must come after join_at")
        return self


class SwarmConfig(AlgorithmConfig):
    """F-TIS in a swarm: every peer samples G completions of every prompt of the round, publishes
    them, trains on its own and whatever its peers published before the deadline.

    max_peers: the largest peer id + 1 (a peer's id is its index in `nodes`).
    deadline_s: the longest a peer waits for the live members' payloads of a round.
    member_ttl_s: a peer silent this long (crashed) is no longer waited for; longer than a step.
    payload_ttl_s: how long a round's payloads stay readable for slow and late peers.
    max_payload_mb: the DHT refuses records larger than this (at most 4: hivemind's p2p
        daemon caps a message at 4 MiB).
    initial_peers: multiaddrs of a running swarm to join (empty: `ftis run` starts a bootstrap
        DHT node on 127.0.0.1 and the peers join it).
    churn: node name -> when it joins, leaves and rejoins (`ftis run` carries it out).
    """

    kind: Literal["swarm"] = "swarm"
    max_peers: int = Field(64, ge=2, le=1024)
    deadline_s: float = Field(20.0, gt=0)
    member_ttl_s: float = Field(60.0, gt=0)
    payload_ttl_s: float = Field(600.0, gt=0)
    max_payload_mb: float = Field(4.0, gt=0)
    initial_peers: list[str] = Field(default_factory=list)
    churn: dict[str, ChurnConfig] = Field(default_factory=dict)

    def check_run(self, run: Any) -> None:
        names = [n.name for n in run.nodes]
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
