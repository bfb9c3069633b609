"""Exchange between the ranks of a run: transports move bytes, codecs make payloads.

Public contract (spec: architecture section 5)::

    from ftis.exchange import encode_rollouts, decode_rollouts, PayloadError
    data = encode_rollouts(batch)
    batch = decode_rollouts(data, vocab_size=V, max_tokens=T_max)  # PayloadError on bad input

Transports (`Transport`): `LocalTransport` (a world of one), `StoreTransport` (a key-value
store, tolerant of lost peers; what `ftis run` uses), `DistributedTransport` (torch.distributed).
Codecs: `RolloutCodec` (token ids + sampler log-probs). `RolloutExchange(transport, codec)` gives
an algorithm every node's rollout batch. Group forming (tokenizer and settings handshake) lives
in `ftis.exchange.group`. All collectives and store traffic of the project live in this package.
"""

from ftis.exchange.codec import ExchangeStats, RolloutCodec, RolloutExchange
from ftis.exchange.distributed import (
    DistributedTransport,
    gather_strings,
    init_process_group_from_env,
    require_agreement,
)
from ftis.exchange.store import (
    Membership,
    PeerGroupError,
    StoreTransport,
    connect_store,
    host_store,
    mark_left,
)
from ftis.exchange.transport import (
    ExchangeAborted,
    LocalTransport,
    Transport,
    TransportLost,
    TransportStats,
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
    "DistributedTransport",
    "ExchangeAborted",
    "ExchangeStats",
    "LocalTransport",
    "Membership",
    "PayloadError",
    "PeerGroupError",
    "RolloutCodec",
    "RolloutExchange",
    "StoreTransport",
    "Transport",
    "TransportLost",
    "TransportStats",
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
