"""FGRPO: federated GRPO across data owners with relative-gain aggregation, on Flower
(docs/fgrpo.md; the math in docs/math.md §9; methods-wave2.md §1).

Modules: `config` (the `algorithm:` section; pydantic only), `client` (a client's local GRPO
rounds and evaluation, ftis building blocks only), `aggregator` (the server's state and one
round of aggregation, pure torch), `strategy` (the Flower strategy), `apps` (Flower's ServerApp
and ClientApp), `launch` (`run_federated`: the run through Flower's simulation engine),
`identity` (which client a Flower node runs), `deploy` (the same apps for a SuperLink and
SuperNodes: `flwr run deploy/fgrpo`), `faults` (fault injection for tests).

Importing this package switches off Flower's telemetry and update check and Ray's usage stats
before anything imports flwr or ray: no traffic may leave the machine.
"""

from __future__ import annotations

import os
import sys

# Read by flwr and ray at import time; forced, not defaulted: nothing may leave the machine.
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
os.environ["FLWR_DISABLE_UPDATE_CHECK"] = "1"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
# A process that imported flwr before this package (a deployed app's flwr-serverapp or
# flwr-clientapp) read the variable already: switch its later events off too. The start-up
# events of such a process are the environment's business (docs/fgrpo.md, "Deployed").
_telemetry = sys.modules.get("flwr.supercore.telemetry")
if _telemetry is not None:
    _telemetry.FLWR_TELEMETRY_ENABLED = "0"
# Ray's FutureWarning about accelerator variables on CPU-only actors, printed per actor.
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
