"""The store transport: payloads through a TCPStore on loopback, with peers that die, stall or
lie. Ranks run as threads of this process (each with its own client connection), so a lost
peer costs a fraction of a second instead of a process start."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ftis.exchange.codec import RolloutCodec, RolloutExchange
from ftis.exchange.store import (
    Membership,
    PeerGroupError,
    Signer,
    StoreTransport,
    host_store,
    mark_left,
    new_secret,
)
from ftis.exchange.transport import TransportLost
from tests.exchange.test_distributed import MAX_TOKENS, VOCAB, flip_a_byte, peer_batch


@pytest.fixture
def store(monkeypatch):
    server, prefixed, port = host_store()
    members: list[Membership] = []
    init = Membership.__init__

    def tracked(self, *a, **k):
        init(self, *a, **k)
        members.append(self)

    monkeypatch.setattr(Membership, "__init__", tracked)

    def client(prefix="ftis"):
        c = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        return dist.PrefixStore(prefix, c)

    yield prefixed, client
    for m in members:  # stop the heartbeats before the server goes
        m._stop.set()
        m._thread.join()
    del server


def _group(client, world, timeout_s=0.6, first_steps=None, on_store_lost="stop", signer=None):
    ms = [Membership(client(), r, world, timeout_s=timeout_s, signer=signer) for r in range(world)]
    first_steps = first_steps or [0] * world
    exs = []
    for m in ms:
        transport = StoreTransport(m, first_steps=first_steps, on_store_lost=on_store_lost)
        transport.ready()
        codec = RolloutCodec(vocab_size=VOCAB, max_tokens=MAX_TOKENS, pad_id=3)
        exs.append(RolloutExchange(transport, codec, first_round=first_steps[m.rank]))
    return ms, exs


def _round(exs, step, skip=()):
    """Every rank not in `skip` exchanges its batch of `step` concurrently."""
    out = {}

    def go(r):
        out[r] = exs[r].all_gather(peer_batch(r, step))

    threads = [threading.Thread(target=go, args=(r,)) for r in range(len(exs)) if r not in skip]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "an exchange hung"
    return out


def test_payloads_arrive_intact(store):
    _, client = store
    _, exs = _group(client, 3)
    for step in (0, 1, 2, 3):
        got = _round(exs, step)
        for r in range(3):
            for p in range(3):
                want, b = peer_batch(p, step), got[r][p]
                assert torch.equal(b.prompt_index, want.prompt_index)
                assert torch.equal(b.sampler_logprobs, want.sampler_logprobs)
            assert exs[r].last_stats.rejected == 0 and exs[r].last_stats.extra["peers"] == 2
    # old payloads are deleted: a long run does not grow the store without bound
    assert not exs[0].transport.store.check(["x/0/0"]) and exs[0].transport.store.check(["x/3/0"])


@pytest.mark.chaos_case("F-TIS", "malformed payload")
def test_a_corrupted_payload_is_rejected_and_counted(store):
    _, client = store
    _, exs = _group(client, 3)
    exs[1].corrupt_for_test = flip_a_byte
    got = _round(exs, 0)
    for r in (0, 2):
        assert got[r][1] is None and exs[r].last_stats.rejected == 1
        assert got[r][2 - r] is not None  # the honest peer's batch


def test_a_peer_that_leaves_is_dropped_at_once(store):
    _, client = store
    ms, exs = _group(client, 3, timeout_s=60)
    _round(exs, 0)
    ms[2].leave("crashed: test")  # what the launcher writes when a process dies
    t0 = time.monotonic()
    got = _round(exs, 1, skip=(2,))
    assert time.monotonic() - t0 < 5  # long before the 60 s timeout
    for r in (0, 1):
        assert got[r][2] is None and got[r][1 - r] is not None
        assert 2 in ms[r].lost and "crashed: test" in ms[r].lost[2]
        assert exs[r].last_stats.extra["lost_peers"] == 1
    got = _round(exs, 2, skip=(2,))  # and it stays dropped, without waiting again
    assert got[0][1] is not None and got[0][2] is None


def test_a_silent_peer_is_dropped_after_the_timeout(store):
    """No `left` mark (a machine that vanished): the heartbeat stops, the others give up after
    timeout_s and carry on."""
    _, client = store
    ms, exs = _group(client, 2, timeout_s=0.5)
    _round(exs, 0)
    # Timed from the heartbeat's stop, as the timeout is (its last beat was at most heartbeat_s
    # = 0.05 s earlier): timed from the round's start, a busy machine could spend most of the
    # timeout before the round and the drop would look early.
    t0 = time.monotonic()
    ms[1]._stop.set()  # heartbeat thread stops, nothing is marked
    time.sleep(0.1)
    got = _round(exs, 1, skip=(1,))
    waited = time.monotonic() - t0
    assert got[0][1] is None and 1 in ms[0].lost
    assert 0.4 < waited < 5, waited


def test_a_stalled_peer_is_skipped_then_dropped(store):
    """Heartbeat alive but no payload (stuck in a step): skipped for each round after
    timeout_s, dropped after max_missed (3) rounds in a row."""
    _, client = store
    ms, exs = _group(client, 2, timeout_s=0.5)
    _round(exs, 0)
    for step in (1, 2):
        got = _round(exs, step, skip=(1,))
        assert got[0][1] is None and 1 not in ms[0].lost
        assert exs[0].last_stats.extra["missed_payloads"] == step
    got = _round(exs, 3, skip=(1,))
    assert got[0][1] is None and "no payload" in ms[0].lost[1] and "3 rounds" in ms[0].lost[1]


def test_a_lost_store_stops_the_node_with_a_resume_hint(store):
    """The store's host is gone: by default the node must not silently go on alone (that
    changes the experiment); the transport raises TransportLost, which says how to resume."""
    _, client = store
    _, exs = _group(client, 2, timeout_s=5)
    _round(exs, 0)
    exs[0].transport.store = _Broken()
    with pytest.raises(TransportLost, match="ftis run --resume"):
        exs[0].all_gather(peer_batch(0, 1))


def test_a_lost_store_leaves_the_node_alone_when_asked_to(store):
    """exchange.on_store_lost=continue: the node logs it and trains on its own samples."""
    _, client = store
    ms, exs = _group(client, 2, timeout_s=5, on_store_lost="continue")
    _round(exs, 0)
    exs[0].transport.store = _Broken()
    got = exs[0].all_gather(peer_batch(0, 1))
    assert got[0] is not None and got[1] is None and ms[0].is_broken


class _Broken:
    def __getattr__(self, name):
        def fail(*a, **k):
            raise dist.DistNetworkError("connection reset")

        return fail


def test_catching_up_after_a_resume(store):
    """Node 1 resumed from an older checkpoint: it trains alone until node 0's first step."""
    _, client = store
    ms, exs = _group(client, 2, first_steps=[5, 3])
    got = exs[1].all_gather(peer_batch(1, 3))  # steps 3 and 4: node 0 is not part of them
    assert got[0] is None and not ms[1].lost
    exs[1].all_gather(peer_batch(1, 4))
    got = _round(exs, 5)
    assert got[0][1] is not None and got[1][0] is not None


def test_the_group_forms_whole_or_not_at_all(store):
    _, client = store
    ms = [Membership(client(), r, 2, timeout_s=5) for r in range(2)]
    out = {}
    threads = [
        threading.Thread(target=lambda r=r: out.__setitem__(r, ms[r].gather(f"v{r}")))
        for r in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out[0] == out[1] == ["v0", "v1"]
    # a peer that died before saying hello: an error naming it, not a hang
    m = Membership(client("run2"), 0, 3, timeout_s=5)
    mark_left(client("run2"), 1, "its process exited with code 2")
    with pytest.raises(PeerGroupError, match="rank 1 exited before the group formed"):
        m.gather("v0")
    with pytest.raises(PeerGroupError, match=r"ranks \[1\] did not join within 0.3 s"):
        Membership(client("run3"), 0, 2, timeout_s=5).gather("other", timeout_s=0.3)


# ---- records in the store are untrusted input (issue 22, item 3) -------------------------------


@pytest.mark.chaos_case("F-TIS", "forged store records")
def test_writes_from_outside_the_run_are_ignored_and_counted(store):
    """Issue 22: a forged `left/1` made rank 0 drop a live peer. With the run's secret, a
    `left` mark, a payload and a `ready` mark written without it are ignored and counted; the
    honest payload still arrives."""
    _, client = store
    signer = Signer(bytes.fromhex(new_secret()))
    ms, exs = _group(client, 2, timeout_s=60, signer=signer)
    _round(exs, 0)
    outsider = client()  # reaches the port, does not know the secret
    outsider.set("left/1", "forged: drop rank 1")
    outsider.set("x/1/1", b"junk in place of rank 1's payload")
    mark_left(outsider, 1, "forged with another secret", signer=Signer(b"k" * 32))
    got = {}
    first = threading.Thread(target=lambda: got.__setitem__(0, exs[0].all_gather(peer_batch(0, 1))))
    first.start()
    time.sleep(0.5)  # rank 0 reads the forged values first; rank 1 posts later
    got[1] = exs[1].all_gather(peer_batch(1, 1))
    first.join(30)
    assert not first.is_alive()
    assert 1 not in ms[0].lost
    want = peer_batch(1, 1)  # rank 1's authentic payload, after the forged ones
    assert torch.equal(got[0][1].prompt_index, want.prompt_index)
    assert ms[0].forged == 2 and exs[0].last_stats.rejected == 0  # left/1 and x/1/1
    # the launcher's authentic mark still drops a peer at once
    mark_left(client(), 1, "its process exited with code 9", signer=signer)
    got = _round(exs, 2, skip=(1,))
    assert got[0][1] is None and "exited with code 9" in ms[0].lost[1]


def _ready_pair(client):
    """Two ranks on the store with a fresh run secret, each ready: (signer, memberships,
    transports)."""
    signer = Signer(bytes.fromhex(new_secret()))
    ms = [Membership(client(), r, 2, timeout_s=30, signer=signer) for r in range(2)]
    ts = [StoreTransport(m, first_steps=[0, 0]) for m in ms]
    for t in ts:
        t.ready()
    return signer, ms, ts


@pytest.mark.chaos_case("F-TIS", "a local client reads the store")
def test_a_local_client_without_the_secret_reads_nothing_in_clear(store):
    """Issue 57 item 3: a client that reaches the store's port read another node's payload in
    clear. Every value is now encrypted under the run's secret: the payload's bytes, a
    heartbeat's and a handshake's appear nowhere in what the outsider reads, and a value copied
    to another key (rank 0's payload of round 0 replayed as its round 1) does not open there."""
    _, client = store
    signer, ms, ts = _ready_pair(client)
    secret_samples = b"the completion 2+2=4 and its log-probs " * 8
    out = {}
    threads = [
        threading.Thread(
            target=lambda r=r: out.__setitem__(
                r, ts[r].exchange(0, secret_samples, max_bytes=2**20)
            )
        )
        for r in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out[0][1] == out[1][0] == secret_samples  # the run itself reads them
    outsider = client()
    seen = {}
    for key in ("x/0/0", "x/0/1", "hb/0", "hb/1", "ready/0", "hello/0"):
        if outsider.check([key]):
            seen[key] = outsider.get(key)
    assert "x/0/0" in seen and "hb/0" in seen
    for key, raw in seen.items():
        assert b"2+2=4" not in raw and b"completion" not in raw, key
        assert signer.open(key, raw) is not None  # sealed by the run, not garbage
    assert Signer(b"k" * 32).open("x/0/0", seen["x/0/0"]) is None  # another secret: nothing
    outsider.set("x/1/0", seen["x/0/0"])  # rank 0's round-0 payload moved to round 1
    assert ms[1].get("x/1/0") is None and ms[1].forged == 1


def test_a_payload_above_the_stores_value_limit_travels_in_chunks(store):
    """Issue 22: a payload above torch's 8 MiB value limit reset the sender's connection and
    was reported as a lost store host. It now travels in chunks, authenticated, and a reader
    does not read more chunks than its max_bytes allows."""
    _, client = store
    _, ms, ts = _ready_pair(client)
    big = bytes(range(256)) * (9 * 2**20 // 256) + b"tail"  # 9 MiB + 4 bytes
    out = {}

    def go(r, payload, max_bytes):
        out[r] = ts[r].exchange(0, payload, max_bytes=max_bytes)

    threads = [
        threading.Thread(target=go, args=(0, big, 16 * 2**20)),
        threading.Thread(target=go, args=(1, b"small", 2**20)),  # rank 1 accepts 1 MiB at most
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out[0][1] == b"small"
    assert out[1][0] is None and ts[1].stats.oversized == 1  # refused, not a lost host
    got = {}
    t = threading.Thread(
        target=lambda: got.__setitem__(1, ts[1].exchange(1, b"s", max_bytes=2**25))
    )
    t.start()
    got[0] = ts[0].exchange(1, big, max_bytes=2**25)
    t.join(60)
    assert got[1][0] == big and got[0][1] == b"s"
    assert ms[0].forged == ms[1].forged == 0


# ---- a store no stranger can break (issue 37) ---------------------------------------------------


def _listeners() -> dict[int, str]:
    """port -> local address of every listening TCP socket (IPv4 and IPv6) on this machine."""
    import ipaddress

    out = {}
    for name, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            if state != "0A":  # LISTEN
                continue
            addr, port = local.split(":")
            raw = bytes.fromhex(addr)
            if width == 8:
                ip = ipaddress.IPv4Address(raw[::-1])
            else:  # four little-endian 32-bit words
                ip = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
            out[int(port, 16)] = str(ip)
    return out


@pytest.mark.chaos_case("F-TIS", "the store's socket off loopback")
def test_the_store_listens_on_loopback_only():
    server, _, port = host_store()
    try:
        assert _listeners()[port] == "127.0.0.1"  # torch's own server would listen on 0.0.0.0
    finally:
        del server


def test_a_store_off_loopback_needs_a_secret(monkeypatch):
    from ftis.exchange.store import SECRET_ENV, connect_store

    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # TEST-NET: never reached, refused first
    monkeypatch.setenv("MASTER_PORT", "29999")
    with pytest.raises(PeerGroupError, match=f"needs a shared secret.*{SECRET_ENV}"):
        connect_store(5.0)


@pytest.mark.chaos_case("F-TIS", "hostile store write")
def test_a_hostile_heartbeat_write_is_counted_and_ignored(store):
    """Issue 37: `set('hb/1', 'abc')` from outside made the server fail every later `add` of
    rank 1's heartbeat; its thread died silently and both nodes stopped with 'the store's host
    is gone'. Heartbeats are signed values now: the junk is counted, the run goes on."""
    _, client = store
    signer = Signer(bytes.fromhex(new_secret()))
    ms, exs = _group(client, 2, timeout_s=20.0, signer=signer)  # a beat every 2 s
    _round(exs, 0)
    outsider = client()
    outsider.set("hb/1", "abc")
    outsider.set("hb/0", b"\xff" * 9)
    assert ms[0].why_gone(1) is None and ms[1].why_gone(0) is None  # junk is not a sign of death
    assert ms[0].forged == ms[1].forged == 1
    ms[0].beat()
    ms[1].beat()  # what the heartbeat threads do next: the junk is replaced
    for step in range(1, 4):
        got = _round(exs, step)
        assert got[0][1] is not None and got[1][0] is not None
    assert exs[0].last_stats.extra["forged_records"] == 1
    assert not ms[0].lost and not ms[1].lost
    assert ms[0]._thread.is_alive() and ms[1]._thread.is_alive()
    assert ms[0].heartbeat_errors == ms[1].heartbeat_errors == 0


@pytest.mark.chaos_case("F-TIS", "overwritten payload")
def test_an_overwritten_payload_skips_the_peer_for_one_round(store):
    """Issue 37: overwriting a posted payload left the genuine one gone; both nodes dropped
    each other after timeout_s and trained alone to the end. The heartbeat says the peer
    posted, so the reader skips that peer for this round at once, and collaborates next round."""
    _, client = store
    signer = Signer(bytes.fromhex(new_secret()))
    ms, exs = _group(client, 2, timeout_s=60, signer=signer)
    _round(exs, 0)
    got = {}
    t = threading.Thread(target=lambda: got.__setitem__(1, exs[1].all_gather(peer_batch(1, 1))))
    t.start()
    outsider = client()
    deadline = time.monotonic() + 10
    while ms[0].peer_posted(1) < 1 and time.monotonic() < deadline:  # rank 1 posted step 1
        time.sleep(0.005)
    outsider.set("x/1/1", b"junk over rank 1's payload")
    t0 = time.monotonic()
    got[0] = exs[0].all_gather(peer_batch(0, 1))
    t.join(30)
    assert time.monotonic() - t0 < 5  # not the 60 s timeout
    assert got[0][1] is None and got[1][0] is not None
    assert exs[0].last_stats.extra["missed_payloads"] == 1 and not ms[0].lost
    got = _round(exs, 2)  # collaborating again
    assert got[0][1] is not None and got[1][0] is not None


@pytest.mark.chaos_case("F-TIS", "replayed heartbeats and a deleted left mark")
def test_replayed_heartbeats_do_not_keep_a_dead_peer_alive(store):
    """Issue 57: with node 1 dead, its left mark deleted and two captured heartbeats replayed
    in turn, node 0 used to wait max_missed x timeout_s. Only a beat above every one seen is a
    sign of life now: the replays are counted and ignored, and node 1 is lost one timeout_s
    after its last real beat; a left mark once read counts even after it is deleted."""
    _, client = store
    signer = Signer(bytes.fromhex(new_secret()))
    ms = [Membership(client(), r, 3, timeout_s=0.6, signer=signer) for r in range(3)]
    outsider = client()
    ms[1].beat()
    old = outsider.get("hb/1")
    ms[1].beat()
    new = outsider.get("hb/1")
    assert ms[0].why_gone(1) is None  # the newest beat seen
    ms[1]._stop.set()
    ms[1]._thread.join()  # node 1 dies
    t0 = time.monotonic()
    gone = None
    while gone is None and time.monotonic() - t0 < 5:
        for captured in (old, new):  # a local client replays what it captured
            outsider.set("hb/1", captured)
            gone = gone or ms[0].why_gone(1)
            time.sleep(0.05)
    assert gone is not None and "no advancing heartbeat" in gone
    assert time.monotonic() - t0 < 0.6 + 0.5  # one timeout_s, not max_missed of them
    assert ms[0].stale_beats >= 1
    # a departure read once is not undone by deleting its mark
    ms[2].leave("done")
    assert "it left" in ms[0].why_gone(2)
    outsider.delete_key("left/2")
    assert "it left" in ms[0].why_gone(2)
