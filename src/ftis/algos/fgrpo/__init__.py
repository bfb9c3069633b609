"""FGRPO: federated GRPO across data owners with relative-gain aggregation, on Flower
(docs/fgrpo.md; the math in docs/math.md §9; methods-wave2.md §1).

Modules: `config` (the `algorithm:` section; pydantic only), `client` (a client's local GRPO
rounds and evaluation, ftis building blocks only), `aggregator` (the server's state and one
round of aggregation, pure torch), `strategy` (FGRPO's part of the Flower strategy), `apps`
(Flower's ServerApp and ClientApp), `launch` (`run_federated`: the run through Flower's
simulation engine), `deploy` (the same apps for a SuperLink and SuperNodes: `flwr run
deploy/fgrpo`). What any federated algorithm shares (sampling, reply validation, rows,
checkpoints, the run loop, identity, fault injection, the in-process engine) is in
`ftis.algos.federated`.

Importing this package imports `ftis.algos.federated` first, which switches off Flower's
telemetry and update check and Ray's usage stats before anything imports flwr or ray: no
traffic may leave the machine.
"""

from __future__ import annotations

import ftis.algos.federated  # noqa: F401  (telemetry off before anything imports flwr)
