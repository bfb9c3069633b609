"""A swarm board on hivemind's DHT (optional extra `ftis[swarm]`), loopback by default.

Each peer runs one `DHTNode` (and its libp2p daemon, `p2pd`) in a background thread with its
own event loop; the swarm transport calls `publish` / `read` from the training thread. (The
`hivemind.DHT` wrapper runs the node in a child process behind a pipe that fails on values
above a few tens of KB, which rollout payloads exceed.)

Nothing leaves the machine unless told to: the node listens on 127.0.0.1 only, bootstraps only
from the `initial_peers` it is given (no IPFS bootstrap), and runs no relay, AutoNAT or
UPnP/NAT-PMP port mapping (`LOOPBACK_P2P`). To take part from another machine, pass
`host_maddrs=["/ip4/0.0.0.0/tcp/PORT"]` and the other peers' multiaddrs as initial peers.

Memory: every record this node stores for others goes through `SizeValidator` (values over
`max_value_bytes`, expiries beyond `max_ttl_s`, or subkeys that are not peer ids in
[0, max_peers) are refused), so a flooding peer is bounded per record; keys are hashed by the
DHT, so the number of keys is bounded only by expiry.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

log = logging.getLogger(__name__)

LOOPBACK_P2P: dict[str, Any] = {
    "host_maddrs": ["/ip4/127.0.0.1/tcp/0"],
    "use_ipfs": False,  # no bootstrap to public IPFS nodes
    "use_relay": False,  # no circuit relay
    "use_auto_relay": False,  # no search for public relays
    "auto_nat": False,  # no AutoNAT reachability probes
    "nat_port_map": False,  # no UPnP / NAT-PMP requests to the router
}


def _require_hivemind():
    try:
        import hivemind  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the swarm's DHT needs hivemind: pip install 'ftis[swarm]' (hivemind==1.1.12)"
        ) from e


def size_validator(*, max_value_bytes: int, max_ttl_s: float, max_peers: int):
    """A hivemind record validator that refuses oversized values, far expiries and subkeys
    that are not peer ids."""
    import msgpack
    from hivemind.dht.validation import DHTRecord, RecordValidatorBase
    from hivemind.utils import get_dht_time

    class SizeValidator(RecordValidatorBase):
        def validate(self, record: DHTRecord) -> bool:
            if len(record.value) > max_value_bytes:
                return False
            if record.expiration_time > get_dht_time() + max_ttl_s:
                return False
            if record.subkey:  # b"" = a plain key (none are used by the swarm)
                try:
                    sub = msgpack.unpackb(record.subkey)
                except Exception:
                    return False
                if not (isinstance(sub, int) and 0 <= sub < max_peers):
                    return False
            return True

    return SizeValidator()


def hmac_validator(secret: bytes):
    """A hivemind record validator that owns every record with the swarm's secret (issue 57):
    a record is stored with an HMAC-SHA256 tag over its DHT key, subkey, expiry and value
    (`sign_value`), and a node accepts, serves or reads only records whose tag verifies. An
    outsider without the secret cannot occupy a peer's subkey: the DHT keeps, per subkey, the
    record that expires last, so an unsigned record with a later expiry under an honest peer's
    subkey would otherwise replace the peer's own (honest nodes refuse to store it, and a
    response holding one is discarded whole by the reader's hivemind, which validates what it
    finds). The expiry is in the tag, so a captured record cannot be re-stored to live longer."""
    import hashlib
    import hmac
    import struct

    from hivemind.dht.validation import DHTRecord, RecordValidatorBase

    tag_bytes = 32

    class HMACValidator(RecordValidatorBase):
        def _tag(self, record: DHTRecord, value: bytes) -> bytes:
            msg = b"\0".join(
                (
                    b"ftis-dht",
                    record.key,
                    record.subkey,
                    struct.pack(">d", record.expiration_time),
                    value,
                )
            )
            return hmac.new(secret, msg, hashlib.sha256).digest()

        def validate(self, record: DHTRecord) -> bool:
            if len(record.value) < tag_bytes:
                return False
            value, tag = record.value[:-tag_bytes], record.value[-tag_bytes:]
            return hmac.compare_digest(tag, self._tag(record, value))

        def sign_value(self, record: DHTRecord) -> bytes:
            return record.value + self._tag(record, record.value)

        def strip_value(self, record: DHTRecord) -> bytes:
            return record.value[:-tag_bytes]

        @property
        def priority(self) -> int:
            return 10  # signs last, validates first: the size rule sees the bare value

        def merge_with(self, other: RecordValidatorBase) -> bool:
            return False

    return HMACValidator()


class DHTBoard:
    """A `Board` (ftis.exchange.swarm) on one hivemind DHT node of this process.

    initial_peers: multiaddrs of peers already in the swarm (none: this node starts one).
    secret: the swarm's shared secret: every record this node stores carries its HMAC tag and
        only tagged records are accepted (`hmac_validator`); None: records are not owned.
    p2p: options for hivemind's P2P daemon, over `LOOPBACK_P2P`.
    """

    def __init__(
        self,
        initial_peers: Sequence[str] = (),
        *,
        max_value_bytes: int = 16 * 2**20,
        max_ttl_s: float = 3600.0,
        max_peers: int = 1024,
        timeout_s: float = 60.0,
        secret: bytes | None = None,
        **p2p: Any,
    ) -> None:
        _require_hivemind()
        from hivemind.dht.node import DHTNode

        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ftis-dht", daemon=True)
        self._thread.start()
        opts = {**LOOPBACK_P2P, **p2p}
        validator = size_validator(
            max_value_bytes=max_value_bytes, max_ttl_s=max_ttl_s, max_peers=max_peers
        )
        if secret:
            from hivemind.dht.validation import CompositeValidator

            validator = CompositeValidator([validator, hmac_validator(secret)])
        self.node = self._call(
            DHTNode.create(
                initial_peers=list(initial_peers),
                record_validator=validator,
                client_mode=False,
                **opts,
            )
        )
        self._closed = False

    def _call(self, coro, timeout: float | None = None):
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout or self.timeout_s)

    def maddrs(self) -> list[str]:
        """This node's multiaddrs, for other peers' `initial_peers`."""
        return [str(m) for m in self._call(self.node.get_visible_maddrs())]

    def now(self) -> float:
        from hivemind.utils import get_dht_time

        return get_dht_time()

    def publish(self, key: str, subkey: int, value: Any, expires: float) -> bool:
        return bool(self._call(self.node.store(key, value, expires, subkey=subkey)))

    def read(self, key: str) -> dict[Any, Any]:
        found = self._call(self.node.get(key, latest=True))
        if found is None or not isinstance(found.value, dict):
            return {}
        now = self.now()
        return {k: v.value for k, v in found.value.items() if v.expiration_time > now}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self.node.shutdown(), timeout=10)
        except Exception as e:  # shutting down is best effort
            log.warning("DHT node shutdown: %s", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
