"""KV cache events (`--kv-events-config`) in vLLM 0.33.0's wire format: a subscriber written to that
format (`kv_event_subscriber.py`) rebuilds the engine's set of cached pages from the events alone,
after evictions, after a restart of the subscriber (replay), and with cache salts.

The workloads run a real scheduler and KV cache manager over a fake executor (`test_scheduler`);
the publisher is the one the engine core runs, on ipc:// sockets. The process-level test through
the engine core and the embedded model is in test_kv_events_server.py.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from flashserve.config import KVEventsConfig
from flashserve.engine.kv_events import KVEventPublisher
from flashserve.engine.request import Request
from flashserve.engine.scheduler import Scheduler
from flashserve.message.sampling_params import SamplingParams
from kv_event_subscriber import BlockRemoved, BlockStored, Subscriber, documented_hash
from live_server import free_port
from test_scheduler import make, step

PAGE = 16


@pytest.fixture
def endpoints(tmp_path) -> tuple[str, str]:
    return f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"


@pytest.fixture
def publisher(endpoints: tuple[str, str]) -> Iterator[KVEventPublisher]:
    pub = KVEventPublisher(KVEventsConfig(True, "zmq", endpoints[0], endpoints[1]), PAGE)
    yield pub
    pub.close()


def scheduler_publishing(publisher: KVEventPublisher, num_pages: int = 24) -> Scheduler:
    s = make(num_pages=num_pages, page_size=PAGE, max_tokens_per_step=256, caching=True)
    s.kv_cache.record_events()
    return s


def run_publishing(s: Scheduler, publisher: KVEventPublisher) -> None:
    """Steps until every request is done, publishing each step's events as the engine core does."""
    while s.has_unfinished:
        step(s)
        publisher.publish(s.kv_cache.take_events())


def add_random_requests(s: Scheduler, rng: random.Random, n: int, salts: tuple[str | None, ...] = (None,)) -> None:
    """Prompts that share one of a few prefixes (so pages are reused) and then diverge."""
    prefixes = [[rng.randrange(1000) for _ in range(PAGE * rng.randint(1, 3))] for _ in range(3)]
    for i in range(n):
        tail = [rng.randrange(1000) for _ in range(rng.randint(1, 2 * PAGE))]
        prompt = rng.choice(prefixes) + tail
        s.add_request(Request(f"r{rng.random()}", prompt, SamplingParams(max_tokens=rng.randint(1, 20)),
                              cache_salt=rng.choice(salts)))


def settle(sub: Subscriber, publisher: KVEventPublisher) -> None:
    """Until the subscriber has applied every batch the publisher sent."""
    for _ in range(50):
        sub.poll(quiet_s=0.05)
        if not publisher.num_pending:
            sub.poll(quiet_s=0.2)
            return
    raise AssertionError("the publisher never drained its queue")


def test_subscriber_rebuilds_the_cached_pages_after_evictions(endpoints, publisher) -> None:
    sub = Subscriber(*endpoints)
    s = scheduler_publishing(publisher)
    rng = random.Random(1)
    for _ in range(4):
        add_random_requests(s, rng, 8)
        run_publishing(s, publisher)
    settle(sub, publisher)
    sub.request_replay()  # whatever the live stream missed before the subscription took
    removed = [e for b in sub.batches for e in b.events if isinstance(e, BlockRemoved)]
    assert removed, "the workload should have evicted pages"
    assert sub.cached == s.kv_cache.registered_hashes()
    sub.close()


def test_a_restarted_subscriber_catches_up_by_replay(endpoints, publisher) -> None:
    s = scheduler_publishing(publisher)
    rng = random.Random(2)
    first = Subscriber(*endpoints)
    add_random_requests(s, rng, 8)
    run_publishing(s, publisher)
    settle(first, publisher)
    first.request_replay()
    saved, last_seq = dict(first.blocks), first.last_seq
    first.close()  # down while the engine goes on
    for _ in range(3):
        add_random_requests(s, rng, 8)
        run_publishing(s, publisher)
    restarted = Subscriber(*endpoints, blocks=saved, last_seq=last_seq)
    restarted.request_replay()
    assert restarted.num_replayed > 0
    assert restarted.cached == s.kv_cache.registered_hashes()
    restarted.close()


def test_salted_chains_never_share_pages_and_carry_their_salt(endpoints, publisher) -> None:
    sub = Subscriber(*endpoints)
    s = scheduler_publishing(publisher, num_pages=64)
    prompt = list(range(500, 500 + 3 * PAGE + 5))
    for i, salt in enumerate((None, "tenant-a", "tenant-b", "tenant-a")):
        s.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=1), cache_salt=salt))
        run_publishing(s, publisher)
    settle(sub, publisher)
    sub.request_replay()
    assert sub.cached == s.kv_cache.registered_hashes()
    by_salt: dict[str | None, list[bytes]] = {}
    for block_hash, (_, salt, _) in sub.blocks.items():
        by_salt.setdefault(salt, []).append(block_hash)
    assert sorted(by_salt, key=str) == [None, "tenant-a", "tenant-b"]  # "tenant-a" computed once
    assert all(len(hashes) == 3 for hashes in by_salt.values())
    # Each chain's hashes are the documented ones of its token ids and salt (a router may compute them).
    for block_hash, (parent, salt, tokens) in sub.blocks.items():
        assert documented_hash(parent, tokens, salt) == block_hash
    sub.close()


def test_events_follow_vllm_0_33_wire_format(endpoints, publisher) -> None:
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.SUB)
    raw.setsockopt_string(zmq.SUBSCRIBE, "")
    raw.connect(endpoints[0])
    s = scheduler_publishing(publisher)
    for i in range(50):  # a SUB socket hears only what is sent once it has joined: publish until it hears
        s.add_request(Request(f"r{i}", list(range(100 * i, 100 * i + 2 * PAGE + 3)), SamplingParams(max_tokens=1)))
        run_publishing(s, publisher)
        if raw.poll(100):
            break
    topic, seq, payload = raw.recv_multipart()
    assert topic == b"" and len(seq) == 8
    batch = msgspec.msgpack.decode(payload)
    assert isinstance(batch, list) and len(batch) == 3 and isinstance(batch[0], float) and batch[2] == 0
    event = batch[1][0]
    assert event["type"] in ("BlockStored", "BlockRemoved")
    if event["type"] == "BlockStored":
        assert list(event) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name", "extra_keys", "group_idx"]
        assert event["block_size"] == PAGE and event["medium"] == "GPU"
        assert all(isinstance(h, bytes) and len(h) == 32 for h in event["block_hashes"])
    raw.close(linger=0)


def test_a_stored_run_names_its_parent_and_salt_as_vllm() -> None:
    from flashserve.engine.kv_events import to_wire
    from flashserve.kv_cache.events import PagesStored

    root = PagesStored([b"a" * 32, b"b" * 32], None, list(range(2 * PAGE)), "salt")
    later = PagesStored([b"c" * 32], b"b" * 32, list(range(PAGE)), "salt")
    stored, continued = to_wire([root, later], PAGE)
    assert stored.parent_block_hash is None and stored.extra_keys == [("salt",), None]
    assert continued.parent_block_hash == b"b" * 32 and continued.extra_keys == [None]


def test_int_block_hashes_are_the_last_eight_bytes_as_vllm() -> None:
    from flashserve.engine.kv_events import to_wire
    from flashserve.kv_cache.events import PagesRemoved

    page_hash = bytes(range(32))
    (removed,) = to_wire([PagesRemoved([page_hash])], PAGE, int_hashes=True)
    assert removed.block_hashes == [int.from_bytes(page_hash[-8:], "big")]


def test_each_data_parallel_rank_publishes_on_the_base_port_plus_its_rank() -> None:
    port, replay = free_port(), free_port()
    config = KVEventsConfig(True, "zmq", f"tcp://*:{port}", f"tcp://*:{replay}")
    pub = KVEventPublisher(config, PAGE, data_parallel_rank=1)
    try:
        assert (pub.endpoint, pub.replay_endpoint) == (f"tcp://*:{port + 1}", f"tcp://*:{replay + 1}")
        s = scheduler_publishing(pub)
        s.add_request(Request("a", list(range(PAGE + 1)), SamplingParams(max_tokens=1)))
        run_publishing(s, pub)
        sub = Subscriber(f"tcp://127.0.0.1:{port + 1}", f"tcp://127.0.0.1:{replay + 1}")
        sub.request_replay()
        assert [b.data_parallel_rank for b in sub.batches] == [1] * len(sub.batches) and sub.batches
        assert sub.cached == s.kv_cache.registered_hashes()
        sub.close()
    finally:
        pub.close()


def test_kv_events_config_takes_vllms_json_and_rejects_unknown_fields() -> None:
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                      '"endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6001", "topic": "kv"}')
    assert config.enabled and config.endpoint == "tcp://*:6000" and config.topic == "kv"
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": true}').publisher == "zmq"  # vLLM's default
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').enabled
    with pytest.raises(ValueError, match="unknown field"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpont": "tcp://*:6000"}')
