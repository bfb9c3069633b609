"""Exchange of rollout batches between nodes: the wire format and the transports.

Public contract (spec: architecture section 5)::

    from ftis.exchange import encode_rollouts, decode_rollouts, PayloadError
    data = encode_rollouts(batch)
    batch = decode_rollouts(data, vocab_size=V, max_tokens=T_max)  # PayloadError on bad input

All collectives and store traffic of the project live in `ftis.exchange.distributed` and
`ftis.exchange.store` (the transport `ftis run` uses: tolerant of lost peers).
"""

from ftis.exchange.base import Exchange, ExchangeAborted, ExchangeStats, LocalExchange
from ftis.exchange.distributed import (
    DistributedExchange,
    gather_strings,
    init_process_group_from_env,
    require_agreement,
)
from ftis.exchange.store import (
    Membership,
    PeerGroupError,
    StoreExchange,
    connect_store,
    host_store,
    mark_left,
)
from ftis.exchange.wire import (
    DEFAULT_LOGPROB_FORMAT,
    PayloadError,
    bytes_per_token,
    decode_rollouts,
    describe_logprob_format,
    encode_rollouts,
    logprob_max_error,
    resolve_logprob_format,
)

__all__ = [
    "DEFAULT_LOGPROB_FORMAT",
    "DistributedExchange",
    "Exchange",
    "ExchangeAborted",
    "ExchangeStats",
    "LocalExchange",
    "Membership",
    "PayloadError",
    "PeerGroupError",
    "StoreExchange",
    "bytes_per_token",
    "connect_store",
    "decode_rollouts",
    "describe_logprob_format",
    "encode_rollouts",
    "gather_strings",
    "host_store",
    "init_process_group_from_env",
    "logprob_max_error",
    "mark_left",
    "require_agreement",
    "resolve_logprob_format",
]
