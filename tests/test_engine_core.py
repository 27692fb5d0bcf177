"""The engine core and its front ends' client, in one process: the engine core's loop in a thread,
each front end an `EngineCoreClient` on this event loop, a pipe between each (the same pipes and
messages as `flashserve serve`'s processes), and the codec's messages round-tripping."""

from __future__ import annotations

import asyncio
import threading
import time
from multiprocessing import Pipe
from typing import Any, Callable

import pytest

from test_engine import VOCAB, make_engine

from flashserve.client.core_client import EngineCoreClient
from flashserve.client.inproc import InprocClient
from flashserve.engine.engine_core import EngineCore
from flashserve.engine.llm_engine import LLMEngine
from flashserve.message.codec import (
    PROTOCOL_VERSION, AddRequest, Dead, EngineSetup, FrameWriter, Hello, StepOutputs, decode, encode, recv, send,
)
from flashserve.message.errors import EngineDead, EngineOverloaded
from flashserve.message.grammar_spec import GrammarSpec
from flashserve.message.outputs import RequestOutput, TokenLogprob
from flashserve.message.requests import Abort, Add
from flashserve.message.sampling_params import InvalidParameter, SamplingParams
from flashserve.metrics import Metrics, StepStats


def test_a_steps_messages_round_trip_through_the_codec():
    params = SamplingParams(max_tokens=7, temperature=0.5, stop=("\n",), stop_token_ids=(2,), logit_bias=((5, 1.0),),
                            logprobs=2, seed=3)
    output = RequestOutput("r-0", [11, 12], "", False, None, 4, 2, arrival_time=1.5, num_cached_tokens=16,
                           logprobs=[TokenLogprob(11, -0.1, ((11, -0.1), (9, -2.5))), TokenLogprob(12, -0.2)],
                           prompt_logprobs=[None, TokenLogprob(3, -1.0)])
    messages = [
        Hello(PROTOCOL_VERSION, 1),
        EngineSetup(PROTOCOL_VERSION, None, "m", 512, (2,), VOCAB),
        AddRequest(Add("r-0", [1, 2, 3], params, group="g", cache_salt="s", stream=False),
                   GrammarSpec("json", '{"type": "object"}', "response_format")),
        Abort("r-0", "the server is shutting down"),
        StepOutputs([output, RequestOutput("r-1", [], "", True, "length", 3, 9)], num_waiting=4),
        Dead("engine loop died"),
    ]
    for message in messages:
        assert decode(encode(message)) == message


class CoreThread:
    """An EngineCore serving `n` front-end pipes from a thread; `clients` made on the running loop."""

    def __init__(self, engine: LLMEngine, n: int = 1, tokenizer: Any = None, metrics: Metrics | None = None) -> None:
        self.engine = engine
        pairs = [Pipe(duplex=True) for _ in range(n)]
        self.setup = EngineSetup(PROTOCOL_VERSION, tokenizer, "m", 512, (), VOCAB)
        self.core = EngineCore(engine, self.setup, metrics=metrics)
        self.front_conns = [b for _, b in pairs]
        self.result: list[str | None] = []
        for _, b in pairs:
            send(b, Hello(PROTOCOL_VERSION, 0))

        def run() -> None:
            for a, _ in pairs:
                assert self.core.connect(a)
            self.result.append(self.core.run())

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        for b in self.front_conns:
            assert isinstance(recv(b), EngineSetup)
        # The core sends the setup, then registers the pipe: tests that look at its pipes wait for that.
        deadline = time.monotonic() + 5
        while len(self.core.front_ends.conns) < n and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(self.core.front_ends.conns) == n

    def clients(self, **kw: Any) -> list[EngineCoreClient]:
        made = [EngineCoreClient(conn, self.setup, **kw) for conn in self.front_conns]
        for client in made:
            client.start()
        return made


async def soon(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    """Whether `condition` holds within `seconds` (it depends on the core thread's next turns)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def _collect(client: EngineCoreClient, rid: str, prompt: list[int], params: SamplingParams) -> list:
    return [out async for out in client.generate(rid, prompt, params)]


def test_two_front_ends_get_their_own_requests_tokens_each_step():
    async def main() -> None:
        core = CoreThread(make_engine([3, 4, 5]), n=2)
        first, second = core.clients()
        a, b = await asyncio.gather(_collect(first, "a", [1, 2], SamplingParams(max_tokens=3)),
                                    _collect(second, "b", [7], SamplingParams(max_tokens=2)))
        assert [t for o in a for t in o.new_token_ids] == [3, 4, 5] and a[-1].finish_reason == "length"
        assert [t for o in b for t in o.new_token_ids] == [3, 4] and b[-1].finish_reason == "length"
        for client in (first, second):
            client.shutdown()
        core.thread.join(5)
        assert core.result == [None]  # every front end gone: the core ends normally

    asyncio.run(main())


def test_a_stop_string_found_by_the_front_end_ends_the_request_and_frees_its_pages(smollm2_tokenizer):
    script = smollm2_tokenizer.encode(" Hello world. More text here.", add_special_tokens=False)

    async def main() -> None:
        core = CoreThread(make_engine(script), tokenizer=smollm2_tokenizer)
        (client,) = core.clients()
        outs = await _collect(client, "r", [1, 2, 3], SamplingParams(max_tokens=len(script), stop=(".",)))
        assert "".join(o.new_text for o in outs) == " Hello world"
        assert outs[-1].finish_reason == "stop"
        # The abort reaches the core at its next loop turn.
        assert await soon(lambda: core.engine.scheduler.kv_cache.num_used_pages == 0)
        client.shutdown()
        core.thread.join(5)

    asyncio.run(main())


def test_a_front_end_that_goes_away_loses_its_requests_and_the_other_is_served():
    async def main() -> None:
        core = CoreThread(make_engine([3] * 50, num_pages=64), n=2)
        gone, staying = core.clients()
        abandoned = gone.generate("gone", [1, 2], SamplingParams(max_tokens=500, ignore_eos=True))
        await abandoned.__anext__()
        gone._stop_reading()
        gone._conn.close()  # as a killed process's pipe closes
        outs = await _collect(staying, "stays", [5], SamplingParams(max_tokens=4))
        assert outs[-1].finish_reason == "length"
        assert await soon(lambda: not core.engine.has_unfinished)
        assert core.engine.scheduler.kv_cache.num_used_pages == 0
        staying.shutdown()
        core.thread.join(5)

    asyncio.run(main())


def test_an_engine_core_whose_step_fails_fails_every_stream_and_reports_dead():
    async def main() -> None:
        engine = make_engine([3], fail_with=RuntimeError("device lost"))
        core = CoreThread(engine)
        reasons: list[str] = []
        (client,) = core.clients(on_dead=reasons.append)
        outs = await _collect(client, "r", [1], SamplingParams(max_tokens=2))
        assert outs[-1].finish_reason == "error" and "device lost" in (outs[-1].error or "")
        assert reasons and not client.is_healthy()
        try:
            await client.generate("later", [1], SamplingParams()).__anext__()
        except EngineDead:
            pass
        else:
            raise AssertionError("a dead engine core took a request")
        core.thread.join(5)
        assert core.result and "device lost" in (core.result[0] or "")

    asyncio.run(main())


def test_a_front_end_refuses_requests_past_max_waiting_as_the_engine_core_reported_it():
    async def main() -> None:
        core_end, front_end = Pipe(duplex=True)
        client = EngineCoreClient(front_end, EngineSetup(PROTOCOL_VERSION, None, "m", 512, (), VOCAB), max_waiting=2)
        client.start()
        send(core_end, StepOutputs([], num_waiting=2))
        await asyncio.sleep(0.05)  # the reader takes it
        try:
            await client.generate("r", [1], SamplingParams()).__anext__()
        except EngineOverloaded:
            pass
        else:
            raise AssertionError("max_waiting was not enforced")
        assert not core_end.poll()  # nothing was sent
        client.shutdown()

    asyncio.run(main())


class RecordingPins:
    """Stands in for run-batch's `GroupPins`: records what the engine core tells it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def submitted(self, group: int, member: int) -> None:
        self.calls.append(("submitted", group, member))

    def finished(self, group: int) -> None:
        self.calls.append(("finished", group))

    def release_all(self) -> None:
        self.calls.append(("release_all",))


def test_an_engine_core_pins_a_batch_group_from_its_first_request_until_its_requests_end():
    pins = RecordingPins()
    ours, theirs = Pipe(duplex=True)
    core = EngineCore(make_engine([3, 4]), EngineSetup(PROTOCOL_VERSION, None, "m", 512, (), VOCAB), pins=pins)  # type: ignore[arg-type]
    send(theirs, Hello(PROTOCOL_VERSION, 0))
    for rid, member in (("r0", (0, 0)), ("r1", (0, 1)), ("lone", None)):  # all read by the core's first turn
        send(theirs, AddRequest(Add(rid, [1, 2], SamplingParams(max_tokens=2)), None, member))
    thread = threading.Thread(target=lambda: core.connect(ours) and core.run(), daemon=True)
    thread.start()
    assert isinstance(recv(theirs), EngineSetup)
    finished: set[str] = set()
    while len(finished) < 3:
        message = recv(theirs)
        assert isinstance(message, StepOutputs)
        finished |= {out.request_id for out in message.outputs if out.finished}
    theirs.close()  # the front end is done: the run ends and every pin goes
    thread.join(5)
    assert pins.calls == [("submitted", 0, 0), ("submitted", 0, 1), ("finished", 0), ("finished", 0), ("release_all",)]


def _pipe_pair(kind: str) -> tuple[Any, Any]:
    """(front end's end, engine core's end): a duplex socket pair, or run-batch's two one-way pipes."""
    if kind == "socket pair":
        return Pipe(duplex=True)
    import multiprocessing

    from flashserve.entrypoints.run_batch.pipes import Duplex, pipe

    context = multiprocessing.get_context("spawn")
    to_core_rx, to_core_tx = pipe(context)
    to_front_rx, to_front_tx = pipe(context)
    return Duplex(to_front_rx, to_core_tx), Duplex(to_core_rx, to_front_tx)


@pytest.mark.parametrize("kind", ["socket pair", "one-way pipes"])
def test_a_frame_writer_queues_what_the_pipe_cannot_take_and_the_far_end_reads_every_message_in_order(kind):
    """A burst of long-prompt requests larger than the pipe: writing never blocks the event loop
    (the engine core may be blocked writing its outputs to this front end meanwhile), and once the
    far end reads, every message arrives whole and in order."""
    front, core = _pipe_pair(kind)
    messages = [AddRequest(Add(f"r-{i}", list(range(i, i + 3000)), SamplingParams(max_tokens=4)), None)
                for i in range(300)]  # about 2 MB of frames

    async def main() -> None:
        writer = FrameWriter(front, asyncio.get_running_loop())
        for message in messages:
            writer.write(message)  # returns at once: nobody reads yet
        assert writer.backlog > 0
        received: list[Any] = []
        reader = threading.Thread(target=lambda: received.extend(recv(core) for _ in messages), daemon=True)
        reader.start()
        assert await soon(lambda: writer.backlog == 0 and not reader.is_alive(), 10)
        writer.close()
        assert received == messages

    asyncio.run(main())


def _long_scheduler_engine() -> LLMEngine:
    from test_engine import ScriptedExecutor

    from flashserve.config import SchedulerConfig
    from flashserve.engine.scheduler import Scheduler
    from flashserve.kv_cache.manager import KVCacheManager

    scheduler = Scheduler(SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=8192), KVCacheManager(4096, 16),
                          max_model_len=4096)
    return LLMEngine(scheduler, ScriptedExecutor([3] * 50), None, vocab_size=VOCAB)


def _stall_first_of_two(core: CoreThread) -> tuple[EngineCoreClient, EngineCoreClient, list[asyncio.Task]]:
    """Two front ends; the first stops reading (its event loop busy elsewhere) while 64 streams of
    2,000 tokens of its own run. Returns (stalled, other, the stalled one's streams)."""
    stalled, other = core.clients()
    stalled._stop_reading()
    held = [asyncio.create_task(_collect(stalled, f"h{i}", [1, 2], SamplingParams(max_tokens=2000, ignore_eos=True)))
            for i in range(64)]
    return stalled, other, held


def _read_again(client: EngineCoreClient) -> None:
    asyncio.get_running_loop().add_reader(client._conn.fileno(), client._read)


@pytest.mark.timeout(120)
def test_a_burst_of_long_prompts_from_a_front_end_that_is_not_reading_ends_every_request():
    """A front end stops reading (its event loop busy elsewhere) while its streams run, so the
    engine core's outputs fill the pipe; then it submits more than its own pipe holds. When both
    sides blocked on their writes, each waited for the other forever: now the outputs wait in the
    engine core, which goes on reading, and every request ends once the front end reads again."""

    async def main() -> None:
        core = CoreThread(_long_scheduler_engine())
        (client,) = core.clients()
        client._stop_reading()
        streams = [asyncio.create_task(_collect(client, f"s{i}", [1, 2], SamplingParams(max_tokens=600, ignore_eos=True)))
                   for i in range(32)]
        assert await soon(lambda: core.core.front_ends.pending(core.core.front_ends.conns[0]), 30)
        burst = [asyncio.create_task(_collect(client, f"b{i}", [5 + i % 50] * 3000, SamplingParams(max_tokens=1)))
                 for i in range(64)]  # about 1 MB of requests
        await asyncio.sleep(0.2)  # the loop turns: nothing blocked it
        _read_again(client)
        done = await asyncio.wait_for(asyncio.gather(*streams, *burst), 60)
        assert all(outs[-1].finish_reason == "length" for outs in done)
        assert sum(len(o.new_token_ids) for outs in done[:32] for o in outs) == 32 * 600
        assert await soon(lambda: core.engine.scheduler.kv_cache.num_used_pages == 0)
        client.shutdown()
        core.thread.join(5)

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_front_end_that_stops_reading_holds_back_neither_the_engine_core_nor_the_other_front_end():
    """One front end's event loop stalls while its streams run: the engine core keeps what it has
    for it, in order, and goes on stepping; the other front end's request runs to its end
    meanwhile; the stalled one gets every token once it reads again."""

    async def main() -> None:
        core = CoreThread(_long_scheduler_engine(), n=2)
        stalled, served, held = _stall_first_of_two(core)
        assert await soon(lambda: core.core.front_ends.pending(core.core.front_ends.conns[0]), 30)
        outs = await asyncio.wait_for(
            _collect(served, "other", [5], SamplingParams(max_tokens=300, ignore_eos=True)), 30)
        assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 300
        assert core.core.front_ends.pending(core.core.front_ends.conns[0])  # the stalled one's outputs still wait
        _read_again(stalled)
        done = await asyncio.wait_for(asyncio.gather(*held), 60)
        assert [sum(len(o.new_token_ids) for o in outs) for outs in done] == [2000] * 64
        assert all(outs[-1].finish_reason == "length" for outs in done)
        assert await soon(lambda: core.engine.scheduler.kv_cache.num_used_pages == 0)
        for client in (stalled, served):
            client.shutdown()
        core.thread.join(5)

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_front_end_that_leaves_too_much_unread_is_dropped_its_requests_freed_and_the_other_served(monkeypatch):
    """Past `MAX_UNREAD_BYTES` of outputs unread, the engine core takes the front end for stuck:
    its requests are aborted and free their pages, its pipe closes (when it reads again it finds
    the engine core gone and ends its streams with an error), and the other front end goes on."""
    from flashserve.engine import front_ends as front_ends_module

    async def main() -> None:
        core = CoreThread(_long_scheduler_engine(), n=2)
        stuck, served, held = _stall_first_of_two(core)
        # The bound falls once every stream is submitted: the engine core steps in its own thread
        # meanwhile, and a front end dropped before its last submissions would see those refused.
        assert await soon(lambda: stuck.num_streams == len(held), 30)
        monkeypatch.setattr(front_ends_module, "MAX_UNREAD_BYTES", 64 << 10)
        assert await soon(lambda: len(core.core.front_ends.conns) == 1, 60)  # dropped
        assert await soon(lambda: core.engine.scheduler.kv_cache.num_used_pages == 0)
        outs = await asyncio.wait_for(_collect(served, "other", [5], SamplingParams(max_tokens=50)), 30)
        assert outs[-1].finish_reason == "length"
        _read_again(stuck)
        done = await asyncio.wait_for(asyncio.gather(*held), 30)
        assert all(outs[-1].finish_reason == "error" for outs in done)
        for client in (stuck, served):
            client.shutdown()
        core.thread.join(5)

    asyncio.run(main())


# ---- queue times: arrival to the first step that schedules the request, never negative -----------
class QueueTimes(Metrics):
    """Metrics that keep every queue time the engine core records, besides the histogram's sum."""

    def __init__(self) -> None:
        super().__init__()
        self.queue_times: list[float] = []

    def record_step(self, stats: StepStats) -> None:
        self.queue_times.extend(stats.queue_times)
        super().record_step(stats)


def _slow_engine(step_seconds: float) -> LLMEngine:
    from test_engine import ScriptedExecutor

    class SlowExecutor(ScriptedExecutor):
        def launch(self, out, previous=None):  # noqa: ANN001, ANN202
            time.sleep(step_seconds)
            return super().launch(out, previous)

    engine = make_engine([3])
    engine.executor = SlowExecutor([3])
    return engine


def test_a_request_that_wakes_an_idle_engine_core_has_a_queue_time_of_its_short_wait_not_below_zero():
    async def main() -> None:
        metrics = QueueTimes()
        core = CoreThread(make_engine([3]), metrics=metrics)
        (client,) = core.clients()
        await asyncio.sleep(0.3)  # the engine core waits for messages, idle
        await _collect(client, "r", [1, 2], SamplingParams(max_tokens=2))
        client.shutdown()
        core.thread.join(5)
        assert len(metrics.queue_times) == 1 and 0 <= metrics.queue_times[0] < 0.1, metrics.queue_times

    asyncio.run(main())


def test_requests_that_arrive_mid_step_have_queue_times_not_below_zero():
    async def main() -> None:
        metrics = QueueTimes()
        core = CoreThread(_slow_engine(0.02), metrics=metrics)
        (client,) = core.clients()
        running = asyncio.create_task(_collect(client, "long", [1], SamplingParams(max_tokens=40, ignore_eos=True)))
        later = []
        for i in range(6):  # while steps run, at times that fall inside them
            await asyncio.sleep(0.013)
            later.append(asyncio.create_task(_collect(client, f"r{i}", [2, i], SamplingParams(max_tokens=2))))
        await asyncio.gather(running, *later)
        client.shutdown()
        core.thread.join(5)
        assert len(metrics.queue_times) == 7 and min(metrics.queue_times) >= 0, metrics.queue_times

    asyncio.run(main())


def test_concurrent_requests_of_several_front_ends_have_queue_times_not_below_zero():
    async def main() -> None:
        metrics = QueueTimes()
        core = CoreThread(_slow_engine(0.01), n=2, metrics=metrics)
        clients = core.clients()
        await asyncio.sleep(0.2)  # idle, as a fresh server is
        await asyncio.gather(*[_collect(client, f"f{f}-{i}", [1, i], SamplingParams(max_tokens=3))
                               for f, client in enumerate(clients) for i in range(4)])
        for client in clients:
            client.shutdown()
        core.thread.join(5)
        assert len(metrics.queue_times) == 8 and min(metrics.queue_times) >= 0, metrics.queue_times
        assert metrics.registry.get_sample_value("flashserve_request_queue_time_seconds_sum") >= 0

    asyncio.run(main())


def test_a_client_in_the_callers_thread_submits_to_the_engine_core_and_runs_its_turns():
    client = InprocClient(EngineCore(make_engine([3, 4])))
    try:
        assert client.add(AddRequest(Add("a", [1, 2], SamplingParams(max_tokens=4)))) is None
        outputs = []
        while client.has_unfinished:
            outputs += client.outputs()
    finally:
        client.close()
    assert [t for out in outputs for t in out.new_token_ids] == [3, 4, 3, 4]
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"


def test_a_request_the_model_cannot_take_is_refused_at_add_as_every_core_client_refuses_it():
    client = InprocClient(EngineCore(make_engine([3])))
    try:
        with pytest.raises(InvalidParameter, match="out of range"):
            client.add(AddRequest(Add("a", [VOCAB], SamplingParams())))
    finally:
        client.close()
    assert not client.has_unfinished


def test_a_request_the_engine_core_refuses_comes_back_from_add_as_its_error_output():
    client = InprocClient(EngineCore(make_engine([3])))  # no grammar compiler
    try:
        refused = client.add(AddRequest(Add("a", [1], SamplingParams()), grammar_spec=GrammarSpec("regex", "a", "x")))
    finally:
        client.close()
    assert refused is not None and refused.finish_reason == "error" and "compiles no grammars" in (refused.error or "")
    assert not client.has_unfinished


def test_a_core_client_past_its_waiting_bound_refuses_with_engine_overloaded():
    client = InprocClient(EngineCore(make_engine([3])), max_waiting=1)
    try:
        client.add(AddRequest(Add("a", [1], SamplingParams(max_tokens=1))))
        with pytest.raises(EngineOverloaded):
            client.add(AddRequest(Add("b", [1], SamplingParams(max_tokens=1))))
    finally:
        client.close()


def test_after_a_turn_that_raised_the_core_client_is_unhealthy_and_admits_nothing():
    client = InprocClient(EngineCore(make_engine([3])))
    client.add(AddRequest(Add("a", [1], SamplingParams(max_tokens=2))))
    client.core.engine.step = lambda: 1 / 0  # type: ignore[method-assign]  # the device failed
    try:
        with pytest.raises(ZeroDivisionError):
            client.outputs()
        assert not client.is_healthy() and "ZeroDivisionError" in (client.dead_reason or "")
        with pytest.raises(EngineDead):
            client.add(AddRequest(Add("b", [1], SamplingParams())))
    finally:
        client.close()
