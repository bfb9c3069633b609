"""The swarm's churn schedule: every peer's `ChurnConfig`, explicit entries plus a generated part.

    resolve_churn(cfg)      node name -> ChurnConfig for every node (explicit entries as given,
                            the others from `algorithm.churn.random`, or always present)
    presence(churn, steps)  node name -> [present at round 1, ..., round steps]

Round r is "present" when the schedule has the peer train round r: a late joiner (`join_at`
a) trains from round a + 1, a leaver (`leave_at` b) through round b, a rejoin (`rejoin_at` c)
again from round c + 1.
"""

from __future__ import annotations

import logging
import random

from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger(__name__)


class ChurnConfig(BaseModel):
    """When `ftis run` starts, stops and restarts one peer (steps are the swarm's rounds).

    join_at: start the peer once the swarm has reached this round (0: at once, with the
        initial peers); its first round is the swarm's next one.
    leave_at: the peer leaves after this step (a checkpoint, then it announces it is gone).
    crash: leave by SIGKILL instead (no goodbye, no checkpoint beyond its last regular one: the
        others stop waiting once its heartbeat expires).
    rejoin_at: restart the peer from its checkpoint once the swarm has reached this round.
    slow_s: a slow peer: it publishes each round's payload this many seconds late (virtual
        seconds in the simulator); beyond `deadline_s` the others count its payloads as late.
    """

    model_config = ConfigDict(extra="forbid")
    join_at: int = Field(0, ge=0)
    leave_at: int | None = Field(None, ge=1)
    crash: bool = False
    rejoin_at: int | None = Field(None, ge=1)
    slow_s: float = Field(0.0, ge=0)

    def present(self, round_: int) -> bool:
        """Whether the schedule has the peer train round `round_` (1-based)."""
        if round_ <= self.join_at:
            return False
        if self.leave_at is not None and round_ > self.leave_at:
            return self.rejoin_at is not None and round_ > self.rejoin_at
        return True

    @model_validator(mode="after")
    def _order(self) -> ChurnConfig:
        if self.rejoin_at is not None and (
            self.leave_at is None or self.rejoin_at <= self.leave_at
        ):
            raise ValueError("churn.rejoin_at needs a leave_at before it (rejoin_at > leave_at)")
        if self.leave_at is not None and self.leave_at <= self.join_at:
            raise ValueError("churn.leave_at must come after join_at")
        return self


class RandomChurn(BaseModel):
    """A generated churn schedule (`algorithm.churn.random`) for the peers without an entry of
    their own: at every round about `absent_fraction` of all peers are away. Each of
    round(absent_fraction * peers) "absence slots" is tiled from round 1 to the last by
    absences of `min_absence`..`max_absence` rounds, each a different peer's: the first is a
    late join, the middle ones leaves with a rejoin (a crash with probability
    `crash_fraction`), the last a leave for good. Every peer is present at least half the run
    (max_absence defaults to half of train.steps). `slow_fraction` of them are slow (`slow_s`,
    default twice deadline_s). The schedule is a function of the seed and the config only
    (`ftis.algos.swarm.schedule`; written to RUN_DIR/swarm-schedule.json)."""

    model_config = ConfigDict(extra="forbid")
    absent_fraction: float = Field(0.25, ge=0, lt=1)
    seed: int = 0
    min_absence: int = Field(2, ge=1)
    max_absence: int | None = Field(None, ge=1)
    crash_fraction: float = Field(0.5, ge=0, le=1)
    slow_fraction: float = Field(0.0, ge=0, le=1)
    slow_s: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> RandomChurn:
        if self.max_absence is not None and self.max_absence < self.min_absence:
            raise ValueError("churn.random.max_absence must be >= min_absence")
        return self


def resolve_churn(cfg) -> dict[str, ChurnConfig]:
    """Every node's churn entry, in node order (a function of the config only)."""
    a = cfg.algorithm
    names = [n.name for n in cfg.nodes]
    out = {n: a.churn.get(n, ChurnConfig()) for n in names}
    if a.random_churn is not None:
        free = [n for n in names if n not in a.churn]
        out.update(
            generate_churn(
                free,
                total=len(names),
                steps=cfg.train.steps,
                spec=a.random_churn,
                deadline_s=a.deadline_s,
            )
        )
    return out


def generate_churn(
    names: list[str], *, total: int, steps: int, spec: RandomChurn, deadline_s: float
) -> dict[str, ChurnConfig]:
    """Churn entries for `names` such that about `spec.absent_fraction * total` peers are away at
    every round 1..steps (as many "absence slots", each tiled by absences of different peers;
    fewer when there are too few peers to tile them). The rest are always present."""
    rng = random.Random(spec.seed)
    pool = list(names)
    rng.shuffle(pool)
    lo = spec.min_absence
    hi = spec.max_absence or max(lo, steps // 2)
    hi = min(hi, max(1, steps // 2))  # nobody is away more than half the run
    lo = min(lo, hi)
    out: dict[str, ChurnConfig] = {}
    slots = round(spec.absent_fraction * total)
    for slot in range(slots):
        intervals = _tile(steps, lo, hi, rng)
        if len(intervals) > len(pool) - 1:  # keep one peer that is always there
            log.warning(
                "churn.random: %d peers are too few for %d absence slots over %d rounds; "
                "%d slot(s) left out",
                total,
                slots,
                steps,
                slots - slot,
            )
            break
        for first, last in intervals:
            name = pool.pop()
            if first == 1:  # away from the start: a late joiner
                out[name] = ChurnConfig(join_at=last)
            elif last == steps:  # away to the end: leaves for good
                out[name] = ChurnConfig(
                    leave_at=first - 1, crash=rng.random() < spec.crash_fraction
                )
            else:
                out[name] = ChurnConfig(
                    leave_at=first - 1,
                    rejoin_at=last,
                    crash=rng.random() < spec.crash_fraction,
                )
    if spec.slow_fraction > 0:
        slow_s = spec.slow_s if spec.slow_s is not None else 2 * deadline_s
        everyone = sorted(names)
        for name in rng.sample(everyone, round(spec.slow_fraction * len(everyone))):
            out[name] = out.get(name, ChurnConfig()).model_copy(update={"slow_s": slow_s})
    return out


def _tile(steps: int, lo: int, hi: int, rng: random.Random) -> list[tuple[int, int]]:
    """Consecutive absences (first round, last round) covering rounds 1..steps, each of lo..hi
    rounds (the last one may be shorter, never below 1)."""
    out, first = [], 1
    while first <= steps:
        length = rng.randint(lo, hi)
        last = min(steps, first + length - 1)
        if steps - last < lo and last < steps:  # no stub at the end: stretch or split evenly
            last = steps if steps - first + 1 <= hi else (first + steps) // 2
        out.append((first, last))
        first = last + 1
    return out


def presence(churn: dict[str, ChurnConfig], steps: int) -> dict[str, list[bool]]:
    """Node name -> whether the schedule has it train each round 1..steps."""
    return {n: [c.present(r) for r in range(1, steps + 1)] for n, c in churn.items()}
