"""Exchange of rollout batches between nodes: the wire format and the transports.

Public contract (spec: architecture section 5)::

    from ftis.exchange import encode_rollouts, decode_rollouts, PayloadError
    data = encode_rollouts(batch)
    batch = decode_rollouts(data, vocab_size=V, max_tokens=T_max)  # PayloadError on bad input

All collectives of the project live in `ftis.exchange.distributed`.
"""

from ftis.exchange.base import Exchange, ExchangeStats, LocalExchange
from ftis.exchange.distributed import (
    DistributedExchange,
    gather_strings,
    init_process_group_from_env,
    require_agreement,
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
    "ExchangeStats",
    "LocalExchange",
    "PayloadError",
    "bytes_per_token",
    "decode_rollouts",
    "describe_logprob_format",
    "encode_rollouts",
    "gather_strings",
    "init_process_group_from_env",
    "logprob_max_error",
    "require_agreement",
    "resolve_logprob_format",
]
