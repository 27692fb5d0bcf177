"""LLMEngine and AsyncEngine with a fake executor: lifecycle, stop strings, aborts, failures."""

from __future__ import annotations

import asyncio

import pytest

from flashserve.client.async_engine import AsyncEngine
from flashserve.config import SchedulerConfig
from flashserve.engine.llm_engine import LLMEngine
from flashserve.engine.outputs import NOTHING, SampledTokens, SchedulerOutput, sampled
from flashserve.engine.scheduler import Scheduler
from flashserve.kv_cache.manager import KVCacheManager
from flashserve.message.errors import EngineDead
from flashserve.message.sampling_params import SamplingParams
from flashserve.worker.input_batch import InputBatch


class ScriptedExecutor:
    """Emits the i-th token of `script` as a request's i-th output token. Keeps a runner's rows
    (`InputBatch`): a row's outputs are the tokens sampled for it, the one in flight included."""

    def __init__(self, script: list[int], fail_with: BaseException | None = None) -> None:
        self.script = script
        self.fail_with = fail_with
        self.batch = InputBatch()
        self.steps = 0

    def launch(self, out: SchedulerOutput, previous: list[SampledTokens] | None = None) -> list[SampledTokens]:
        self.steps += 1
        if self.fail_with is not None:
            raise self.fail_with
        results = []
        for r in self.batch.update(out):
            if r.sample:
                r.output_token_ids.append(self.script[len(r.output_token_ids) % len(self.script)])
            results.append(sampled(r.output_token_ids[-1]) if r.sample else NOTHING)
        return results

    def collect(self, handle: list[SampledTokens]) -> list[SampledTokens]:
        return handle


VOCAB = 50_000  # above every id the scripts and tokenizers here use


def make_engine(script: list[int], num_pages: int = 64, tokenizer=None, overlap: bool = False, **kw) -> LLMEngine:
    bm = KVCacheManager(num_pages, 16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), bm, max_model_len=512)
    return LLMEngine(sched, ScriptedExecutor(script, **kw), tokenizer, vocab_size=VOCAB, overlap=overlap)


def run_to_end(engine: LLMEngine, max_steps: int = 1000) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished:
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert not engine.has_unfinished
    return outs


def test_every_request_finishes_with_its_tokens_and_all_pages_return():
    engine = make_engine([5, 6, 7], num_pages=12)
    for i in range(10):
        engine.add_request(f"r{i}", list(range(1, 40 + i)), SamplingParams(max_tokens=20))
    outs = run_to_end(engine)
    assert len(outs) == 10
    for rid, seq in outs.items():
        assert [t for o in seq for t in o.new_token_ids] == ([5, 6, 7] * 7)[:20], rid
        assert seq[-1].finished and seq[-1].finish_reason == "length"
        assert seq[-1].num_output_tokens == 20
    assert engine.scheduler.kv_cache.num_used_pages == 0


def test_stop_string_ends_request_and_is_never_emitted(smollm2_tokenizer):
    tok = smollm2_tokenizer
    script = tok.encode("The answer is 42. END of story, more text follows here")
    engine = make_engine(script, tokenizer=tok)
    engine.add_request("a", tok.encode("Q"), SamplingParams(max_tokens=50, stop=("END",)))
    outs = run_to_end(engine)["a"]
    text = "".join(o.new_text for o in outs)
    assert text == "The answer is 42. "
    assert outs[-1].finish_reason == "stop"
    assert engine.scheduler.kv_cache.num_used_pages == 0


def test_token_of_the_step_in_flight_at_a_stop_string_is_dropped(smollm2_tokenizer):
    # The step after the one that completes "END" is already launched when the text shows it.
    tok = smollm2_tokenizer
    script = tok.encode("The answer is 42. END of story, more text follows here")
    k = next(i for i in range(len(script)) if "END" in tok.decode(script[: i + 1]))
    engine = make_engine(script, tokenizer=tok)
    engine.add_request("a", tok.encode("Q"), SamplingParams(max_tokens=50, stop=("END",)))
    outs = run_to_end(engine)["a"]
    assert [t for o in outs for t in o.new_token_ids] == script[: k + 1]
    assert outs[-1].num_output_tokens == k + 1 and outs[-1].finish_reason == "stop"
    assert engine.executor.steps == k + 2  # the prefill step, k more, and the dropped one
    assert engine.scheduler.kv_cache.num_used_pages == 0


def test_next_step_is_launched_before_this_steps_text_is_made(smollm2_tokenizer):
    events: list[str] = []

    class RecordingTokenizer:
        def decode(self, ids, skip_special_tokens=False):
            events.append("decode")
            return smollm2_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    engine = make_engine([5, 6, 7], tokenizer=RecordingTokenizer())
    launch = engine.executor.launch
    engine.executor.launch = lambda out, previous=None: (events.append("launch"), launch(out, previous))[1]
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
    engine.step()
    assert events[:2] == ["launch", "launch"] and "decode" in events[2:]


def test_text_of_a_length_finished_request_equals_full_decode(smollm2_tokenizer):
    tok = smollm2_tokenizer
    script = tok.encode("Zürich — 東京 🙂 café")
    engine = make_engine(script, tokenizer=tok)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=len(script)))
    outs = run_to_end(engine)["a"]
    assert "".join(o.new_text for o in outs) == tok.decode(script, skip_special_tokens=True)


def test_abort_frees_pages_now_and_reports_abort():
    engine = make_engine([9])
    engine.add_request("a", list(range(100)), SamplingParams(max_tokens=100))
    engine.step()
    assert engine.scheduler.kv_cache.num_used_pages > 0
    out = engine.abort("a")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert engine.scheduler.kv_cache.num_used_pages == 0
    assert not engine.has_unfinished


def test_a_request_not_streamed_gets_an_output_for_its_first_token_and_one_at_the_end(smollm2_tokenizer):
    tok = smollm2_tokenizer
    script = tok.encode("The answer is 42. END of story")
    engine = make_engine(script, tokenizer=tok)
    engine.add_request("m", [1, 2, 3], SamplingParams(max_tokens=len(script)), stream=False)
    outs = run_to_end(engine)["m"]
    assert [len(o.new_token_ids) for o in outs] == [1, len(script) - 1]
    assert [t for o in outs for t in o.new_token_ids] == script
    assert "".join(o.new_text for o in outs) == tok.decode(script, skip_special_tokens=True)
    assert outs[-1].finished and outs[-1].num_output_tokens == len(script)


def test_a_request_not_streamed_stops_at_a_stop_string_like_a_streamed_one(smollm2_tokenizer):
    tok = smollm2_tokenizer
    script = tok.encode("The answer is 42. END of story, more text follows here")
    results = {}
    for stream in (True, False):
        engine = make_engine(script, tokenizer=tok)
        engine.add_request("a", tok.encode("Q"), SamplingParams(max_tokens=50, stop=("END",)), stream=stream)
        outs = run_to_end(engine)["a"]
        results[stream] = ([t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs),
                           outs[-1].finish_reason)
    assert results[False] == results[True]


def test_aborting_a_request_not_streamed_returns_the_tokens_it_held():
    engine = make_engine([9, 8])
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=100), stream=False)
    sent = [t for _ in range(5) for o in engine.step() for t in o.new_token_ids]
    out = engine.abort("a")
    assert out is not None and out.finish_reason == "abort"
    assert sent + out.new_token_ids == ([9, 8] * 50)[: out.num_output_tokens]
    assert len(sent) == 1


def test_a_step_counts_the_tokens_it_made_for_requests_not_streamed():
    engine = make_engine([4])
    engine.add_request("s", [1, 2, 3], SamplingParams(max_tokens=6))
    engine.add_request("m", [1, 2, 3], SamplingParams(max_tokens=6), stream=False)
    counts = []
    while engine.has_unfinished:
        engine.step()
        counts.append(engine.num_step_tokens)
    assert sum(counts) == 12 and max(counts) == 2


def test_duplicate_request_id_is_rejected():
    engine = make_engine([9])
    engine.add_request("a", [1], SamplingParams())
    with pytest.raises(ValueError):
        engine.add_request("a", [1], SamplingParams())


# ---- AsyncEngine -----------------------------------------------------------------------------

async def _collect(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams, stream: bool = True) -> list:
    return [o async for o in engine.generate(rid, prompt, params, stream=stream)]


def test_async_engine_serves_concurrent_streams_in_order():
    async def main():
        engine = AsyncEngine(make_engine([3, 4]), max_model_len=512)
        engine.start()
        try:
            results = await asyncio.gather(
                *[_collect(engine, f"r{i}", [1] * (5 + i), SamplingParams(max_tokens=6)) for i in range(16)]
            )
        finally:
            engine.shutdown()
        return results

    for outs in asyncio.run(main()):
        assert [t for o in outs for t in o.new_token_ids] == [3, 4, 3, 4, 3, 4]
        assert outs[-1].finish_reason == "length"


def test_a_request_not_streamed_gets_its_first_output_at_once_and_the_rest_merged_at_the_end():
    async def main():
        engine = AsyncEngine(make_engine([3, 4, 5]), max_model_len=512)
        engine.start()
        try:
            streamed, merged = await asyncio.gather(
                _collect(engine, "s", [1] * 5, SamplingParams(max_tokens=9)),
                _collect(engine, "m", [1] * 5, SamplingParams(max_tokens=9), stream=False))
        finally:
            engine.shutdown()
        return streamed, merged

    streamed, merged = asyncio.run(main())
    assert len(streamed) == 9
    assert [len(o.new_token_ids) for o in merged] == [1, 8]
    assert [t for o in merged for t in o.new_token_ids] == [t for o in streamed for t in o.new_token_ids]
    assert merged[-1].finished and merged[-1].finish_reason == "length" and merged[-1].num_output_tokens == 9


def test_closing_a_stream_early_aborts_its_request_and_frees_pages():
    async def main():
        llm = make_engine([3])
        engine = AsyncEngine(llm, max_model_len=512)
        engine.start()
        try:
            stream = engine.generate("a", [1] * 40, SamplingParams(max_tokens=400))
            await stream.__anext__()
            await stream.aclose()
            for _ in range(200):
                if not llm.has_unfinished:
                    break
                await asyncio.sleep(0.01)
            return llm
        finally:
            engine.shutdown()

    llm = asyncio.run(main())
    assert not llm.has_unfinished
    assert llm.scheduler.kv_cache.num_used_pages == 0


def test_engine_loop_failure_fails_streams_and_reports_unhealthy():
    async def main():
        engine = AsyncEngine(make_engine([3], fail_with=RuntimeError("device lost")), max_model_len=512)
        engine.start()
        try:
            outs = await asyncio.wait_for(_collect(engine, "a", [1, 2], SamplingParams()), 5)
            healthy = engine.is_healthy()
            with pytest.raises(EngineDead):
                await _collect(engine, "b", [1], SamplingParams())
            return outs, healthy
        finally:
            engine.shutdown()

    outs, healthy = asyncio.run(main())
    assert outs[-1].finish_reason == "error" and "device lost" in outs[-1].error
    assert not healthy


# ---- overlap scheduling: step N+1 scheduled and launched before step N's results are applied


class InFlightExecutor(ScriptedExecutor):
    """Records, per launch, the rows whose token was in flight and the step they came from."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(script)
        self.in_flight_rows: list[int] = []
        self.previous_given: list[bool] = []

    def launch(self, out: SchedulerOutput, previous: list[SampledTokens] | None = None) -> list[SampledTokens]:
        self.in_flight_rows.append(sum(r.last_token_in_flight for r in out.requests))
        self.previous_given.append(previous is not None)
        return super().launch(out, previous)


def overlap_engine(script: list[int], num_pages: int = 64, tokenizer=None) -> LLMEngine:
    engine = make_engine(script, num_pages, tokenizer, overlap=True)
    engine.executor = InFlightExecutor(script)
    return engine


def test_overlap_gives_every_request_the_tokens_and_finish_of_stepping_in_turn():
    script = [5, 6, 7, 9, 11, 13]
    results = {}
    for overlap in (False, True):
        engine = make_engine(script, num_pages=24, overlap=overlap)
        for i in range(10):
            params = SamplingParams(max_tokens=3 + 2 * i, stop_token_ids=(11,) if i % 3 == 0 else ())
            engine.add_request(f"r{i}", list(range(1, 30 + 3 * i)), params)
        outs = run_to_end(engine)
        results[overlap] = {rid: ([t for o in seq for t in o.new_token_ids], seq[-1].finish_reason)
                            for rid, seq in outs.items()}
        assert engine.scheduler.kv_cache.num_used_pages == 0
    assert results[True] == results[False]


def test_overlap_launches_decode_steps_behind_the_step_that_samples_their_tokens():
    engine = overlap_engine([5, 6, 7])
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5))
    run_to_end(engine)
    # The prefill, then each decode step launched before the last one's token reached the host.
    assert engine.executor.in_flight_rows == [0, 1, 1, 1, 1]
    assert engine.executor.previous_given == [False, True, True, True, True]


def test_a_request_that_its_token_in_flight_ends_by_length_gets_no_further_row():
    engine = overlap_engine([5, 6, 7])
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
    outs = run_to_end(engine)["a"]
    assert [t for o in outs for t in o.new_token_ids] == [5, 6, 7]
    assert engine.executor.steps == 3  # no row computed past max_tokens


def test_a_request_stopped_by_eos_in_flight_drops_its_extra_row_and_returns_its_pages():
    engine = overlap_engine([5, 6, 2, 8])
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=20, eos_token_ids=(2,)))
    engine.add_request("b", [4] * 40, SamplingParams(max_tokens=6))
    outs = run_to_end(engine)
    assert [t for o in outs["a"] for t in o.new_token_ids] == [5, 6, 2]
    assert outs["a"][-1].finish_reason == "stop"
    assert [t for o in outs["b"] for t in o.new_token_ids] == [5, 6, 2, 8, 5, 6]
    assert engine.scheduler.kv_cache.num_used_pages == 0


def test_a_request_with_penalties_waits_for_its_token_before_the_next_step_is_scheduled():
    engine = overlap_engine([5, 6, 7])
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, repetition_penalty=1.2))
    outs = run_to_end(engine)["a"]
    assert [t for o in outs for t in o.new_token_ids] == [5, 6, 7, 5]
    assert not any(engine.executor.in_flight_rows)


def test_an_abort_while_a_step_is_scheduled_ahead_returns_every_page():
    engine = overlap_engine([5, 6, 7])
    engine.add_request("a", [1] * 35, SamplingParams(max_tokens=50))
    engine.add_request("b", [2] * 20, SamplingParams(max_tokens=50))
    for _ in range(4):
        engine.step()
    out = engine.abort("a")
    assert out is not None and out.finished and out.finish_reason == "abort"
    outs = run_to_end(engine)
    assert outs["b"][-1].num_output_tokens == 50
    assert engine.scheduler.kv_cache.num_used_pages == 0


def test_overlap_preempting_a_request_whose_token_is_in_flight_loses_no_token():
    # 6 pages of 16 tokens: two requests growing past 48 tokens each cannot both stay.
    script = [5, 6, 7, 9]
    results = {}
    for overlap in (False, True):
        engine = make_engine(script, num_pages=7, overlap=overlap)
        engine.add_request("a", [1] * 30, SamplingParams(max_tokens=40))
        engine.add_request("b", [2] * 30, SamplingParams(max_tokens=40))
        outs = run_to_end(engine)
        results[overlap] = {rid: [t for o in seq for t in o.new_token_ids] for rid, seq in outs.items()}
        assert engine.scheduler.num_preemptions > 0
        assert engine.scheduler.kv_cache.num_used_pages == 0
    assert results[True] == results[False] == {r: (script * 10)[:40] for r in "ab"}
