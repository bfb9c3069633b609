"""What every federated algorithm on Flower shares (FGRPO, FedDPO): docs/design.md, "One
shell, many algorithms".

Modules: `config` (the server's name, the simulation section, the checks every federated run
config gets), `records` (Flower records <-> tensors and metrics), `identity` (which client a
Flower node runs), `faults` (fault injection for tests), `strategy` (`FederatedStrategy`: a
FedAvg subclass with seeded client sampling, per-reply validation that rejects and counts bad
replies, dropouts, evaluation rounds, rows and server checkpoints), `apps` (the ClientApp around
an algorithm's client object, the ServerApp), `launch` (`run_flower`: warm start, the server's
model, resume, rows and Flower's simulation engine), `inprocess` (an in-process engine for
tests). An algorithm brings its config, its client (local training, evaluation) and its server
state (what aggregation does); see `ftis.algos.fgrpo` and `ftis.algos.dpo.fed`.

Importing this package switches off Flower's telemetry and update check and Ray's usage stats
before anything imports flwr or ray: no traffic may leave the machine. It also turns on Ray's
token authentication with a fresh token for this process and the Ray it starts (unless the user
chose RAY_AUTH_MODE): Ray 2.55's GCS, raylet and worker gRPC servers listen on every interface
with no option to bind them to loopback, and without a token anything that reaches the GCS port
can connect a driver and run code inside the run (issue 37). The token reaches Ray's processes
through the environment, never a command line or a file; Ray reads the mode once, when it is
imported, so this must happen first.
"""

from __future__ import annotations

import os
import secrets
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

if not os.environ.get("RAY_AUTH_MODE") and "ray" not in sys.modules:
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
