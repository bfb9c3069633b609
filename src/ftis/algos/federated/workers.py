"""Client workers that come back: Flower's Ray backend with lost workers restarted.

Flower 1.42's simulation runs each ClientApp call on an actor of a pool (one per
`client_cpus`). When an actor's process dies mid-call (killed, out of memory), Flower replies
an error for that message and puts the dead actor back into its pool as it is: every later
message routed to it fails too, so its clients drop out of every later round.

Here the actors are created with a restart policy (`max_restarts` in the backend's
`client_resources`, which Flower passes to the actor's options), and `RestartingRayBackend`
takes an actor whose call failed because its process died out of the pool until Ray has
restarted it and it answers again; only then does it serve messages again. The message that
was lost is still an error reply: the server counts the client as dropped from that round and
the loss as `server/workers_lost` (ftis.algos.federated.strategy.worker_lost).

`restarting_workers()` installs the backend for the duration of a simulation: Flower's
simulation engine builds its backend from the name `RayBackend` in its raybackend module.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

# How many times Ray restarts one client worker whose process died.
MAX_WORKER_RESTARTS = 100
READY_TIMEOUT_S = 600.0  # how long a restarted worker may take to answer before it is dropped


def _backend_class() -> type:
    import ray
    from flwr.common.constant import PARTITION_ID_KEY
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    lost = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)

    class RestartingRayBackend(RayBackend):
        """Flower's Ray backend; an actor whose process died is back in the pool only once
        Ray has restarted it (module docstring)."""

        def process_message(self, message: Any, context: Any) -> tuple[Any, Any]:
            if self.pool is None or self.app_fn is None:
                return super().process_message(message, context)
            pool = self.pool
            future = pool.submit(
                lambda actor, app_fn, msg, cid, ctx: actor.run.remote(app_fn, msg, cid, ctx),
                (self.app_fn, message, str(context.node_config[PARTITION_ID_KEY]), context),
            )
            try:
                _, out, updated = ray.get(future)
            except lost:
                # Flower 1.42's BasicActorPool: `_future_to_actor` maps a call to its actor,
                # `pool` lists the idle actors
                actor = pool._future_to_actor.pop(future)
                if _wait_until_ready(actor):
                    pool.pool.append(actor)
                raise
            except BaseException:
                pool.add_actor_back_to_pool(future)
                raise
            pool.add_actor_back_to_pool(future)
            return out, updated

    return RestartingRayBackend


def _wait_until_ready(actor: Any) -> bool:
    """Wait until Ray has restarted `actor` and it answers; False if it never does."""
    import ray

    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(1.0, deadline - time.monotonic()))
            log.info("a client worker was restarted after its process died")
            return True
        except ray.exceptions.ActorUnavailableError:
            time.sleep(0.5)  # still restarting
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            break  # out of restarts, or never back: the pool goes on without it
    log.warning("a client worker that died could not be restarted; the pool has one fewer")
    return False


@contextlib.contextmanager
def restarting_workers() -> Iterator[None]:
    """Flower's simulation engine uses RestartingRayBackend while inside."""
    from flwr.server.superlink.fleet.vce.backend import raybackend

    original = raybackend.RayBackend
    raybackend.RayBackend = _backend_class()
    try:
        yield
    finally:
        raybackend.RayBackend = original
