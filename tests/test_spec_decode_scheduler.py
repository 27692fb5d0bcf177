"""Speculative decoding without a model: the n-gram proposer, the scheduler's verify rows and its
rollback of rejected drafts, and the verifier's acceptance rule on hand-made logits."""

from __future__ import annotations

import torch

from flashserve.config import SchedulerConfig
from flashserve.engine.outputs import SampledTokens
from flashserve.engine.request import Request
from flashserve.engine.scheduler import Scheduler
from flashserve.kv_cache.manager import KVCacheManager
from flashserve.message.sampling_params import SamplingParams
from flashserve.sample.rejection import verify
from flashserve.sample.sampler import Sampler
from flashserve.spec_decode.config import SpeculativeConfig
from flashserve.spec_decode.ngram import NgramProposer
from flashserve.worker.input_batch import InputBatch

PAGE = 4
# A prompt that repeats itself: its end "7 8" occurred before, followed by "9 10 11 12".
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 7, 8]


def make(k: int = 3, caching: bool = False, **spec: object) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                             speculative=SpeculativeConfig("ngram", k, prompt_lookup_min=2, prompt_lookup_max=3,
                                                           **spec))  # type: ignore[arg-type]
    return Scheduler(config, KVCacheManager(64, PAGE, caching), max_model_len=256)


def test_ngram_proposes_the_tokens_that_followed_the_longest_earlier_match():
    assert NgramProposer(2, 3).propose([1, 2, 3, 4, 9, 1, 2, 3], 2) == [4, 9]


def test_ngram_prefers_the_latest_occurrence():
    assert NgramProposer(1, 1).propose([4, 1, 4, 2, 4], 1) == [2]


def test_ngram_proposes_nothing_without_an_earlier_match():
    assert NgramProposer(2, 3).propose([1, 2, 3, 4], 3) == []


def test_a_decoding_request_gets_its_drafts_as_extra_tokens_of_its_row():
    sched = make()
    sched.add_request(Request("a", PROMPT[:-1], SamplingParams(temperature=0.0, max_tokens=50)))
    sched.update(sched.schedule(), [SampledTokens([8])])  # the prompt, then the first output: 8
    row = sched.schedule().requests[0]
    assert row.new_token_ids == [8, 9, 10, 11]
    assert row.num_draft_tokens == 3 and row.sample
    assert len(sched.kv_cache.pages("a")) == sched.kv_cache.num_pages_needed(row.kv_len)


def test_rejected_drafts_roll_back_the_computed_tokens():
    sched = make()
    request = Request("a", PROMPT[:-1], SamplingParams(temperature=0.0, max_tokens=50))
    sched.add_request(request)
    sched.update(sched.schedule(), [SampledTokens([8])])  # the prompt, then the first output: 8
    out = sched.schedule()
    assert out.requests[0].new_token_ids == [8, 9, 10, 11]
    # The target accepts 9, rejects 10, and adds 4 of its own.
    sched.update(out, [SampledTokens([9, 4])])
    assert request.output_token_ids == [8, 9, 4]
    assert request.num_computed_tokens == len(PROMPT) + 1  # ... 8 9 computed; 4 is the next to compute
    assert sched.spec_stats is not None
    assert (sched.spec_stats.num_drafts, sched.spec_stats.num_draft_tokens,
            sched.spec_stats.num_accepted_tokens, sched.spec_stats.accepted_per_pos) == (1, 3, 1, [1, 0, 0])


def test_the_next_row_starts_where_the_accepted_tokens_end():
    sched = make()
    request = Request("a", PROMPT[:-1], SamplingParams(temperature=0.0, max_tokens=50))
    sched.add_request(request)
    sched.update(sched.schedule(), [SampledTokens([8])])
    sched.update(sched.schedule(), [SampledTokens([9, 4])])
    row = sched.schedule().requests[0]
    assert row.num_computed_tokens == len(PROMPT) + 1 and row.new_token_ids[0] == 4


def test_rejected_drafts_never_enter_the_prefix_cache():
    sched = make(caching=True)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 7]  # 11 tokens; page size 4
    request = Request("a", prompt, SamplingParams(temperature=0.0, max_tokens=50))
    sched.add_request(request)
    sched.update(sched.schedule(), [SampledTokens([8])])
    out = sched.schedule()  # computes 8 + drafts 9 10 11: fills page 3 (positions 12..15) with drafts
    assert out.requests[0].new_token_ids == [8, 9, 10, 11]
    sched.update(out, [SampledTokens([3])])  # every draft rejected
    sched.update(sched.schedule(), [SampledTokens([3])])
    # Page 3 would hold "8 9 10 11" had the drafts been kept; the request's tokens there are "8 3 3".
    hashes = sched.prefix_cache.hasher
    kept: list[bytes] = []
    hashes.extend(kept, prompt + [8, 9, 10, 11], None)
    assert sched.kv_cache.match(kept) == sched.kv_cache.match(kept[:3])


def test_a_step_with_speculation_is_not_scheduled_ahead():
    sched = make()
    request = Request("a", PROMPT[:-1], SamplingParams(temperature=0.0, max_tokens=50))
    sched.add_request(request)
    assert not sched.schedule().schedules_ahead


def test_speculation_steps_aside_above_disable_by_batch_size():
    sched = make(disable_by_batch_size=1)
    for rid in "ab":
        sched.add_request(Request(rid, PROMPT[:-1], SamplingParams(temperature=0.0, max_tokens=50)))
    first = sched.schedule()
    assert first.schedules_ahead
    sched.update(first, [SampledTokens([8]), SampledTokens([8])])
    assert all(r.num_draft_tokens == 0 for r in sched.schedule().requests)


def test_a_request_whose_acceptance_stays_low_stops_proposing():
    sched = make(min_acceptance_rate=0.5, acceptance_window=6)
    request = Request("a", PROMPT[:-1], SamplingParams(temperature=0.0, max_tokens=50))
    sched.add_request(request)
    sched.update(sched.schedule(), [SampledTokens([8])])
    for _ in range(10):  # the target rejects every draft (its token comes first, alone)
        out = sched.schedule()
        sched.update(out, [SampledTokens([3])])
        if request.spec_disabled:
            break
    assert request.num_spec_draft_tokens >= 6 and request.num_spec_accepted_tokens == 0
    assert request.spec_disabled
    assert sched.schedule().requests[0].num_draft_tokens == 0


def test_drafts_stop_before_max_tokens():
    sched = make()
    request = Request("a", PROMPT[:-1], SamplingParams(temperature=0.0, max_tokens=3))
    sched.add_request(request)
    sched.update(sched.schedule(), [SampledTokens([8])])
    assert sched.schedule().requests[0].num_draft_tokens == 1  # 1 known output + 1 draft + the bonus token


def verify_rows(drafts: list[int], params: SamplingParams):
    batch = InputBatch()
    from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput

    row = ScheduledRequest("a", [0, *drafts], 4, [0, 1], True, params, [1, 2, 3, 4], [], num_draft_tokens=len(drafts))
    return batch.update(SchedulerOutput([row]))


def test_greedy_verify_accepts_the_drafts_equal_to_the_argmax_then_adds_the_argmax():
    logits = torch.full((4, 8), -10.0)
    for pos, token in enumerate([3, 5, 6, 7]):  # the target's argmax at each position
        logits[pos, token] = 10.0
    rows = verify_rows([3, 5, 2], SamplingParams(temperature=0.0))
    assert verify(Sampler(), logits, rows) == [[3, 5, 6]]


def test_sampled_verify_accepts_a_draft_the_target_is_sure_of_and_never_one_it_excludes():
    logits = torch.full((3, 8), -1e9)
    logits[0, 3] = 0.0  # certain of 3
    logits[1, 4] = logits[1, 5] = 0.0  # 4 or 5; never the draft 6
    logits[2, 1] = 0.0
    rows = verify_rows([3, 6], SamplingParams(temperature=1.0, seed=7))
    (tokens,) = verify(Sampler(), logits, rows)
    assert tokens[0] == 3 and tokens[1] in (4, 5) and len(tokens) == 2


def periodic_target(period: list[int]):
    """A fake target whose token at position q is period[q % len(period)]: it verifies a row's
    drafts as a runner would (accept while equal, then its own token)."""

    def run(row) -> SampledTokens:
        if not row.sample:
            return SampledTokens()
        d = row.num_draft_tokens
        next_pos = row.num_computed_tokens + len(row.new_token_ids) - d
        drafts = row.new_token_ids[len(row.new_token_ids) - d :]
        out = []
        for j in range(d + 1):
            token = period[(next_pos + j) % len(period)]
            out.append(token)
            if j == d or drafts[j] != token:
                break
        return SampledTokens(out)

    return run


def run_to_end(sched: Scheduler, target) -> None:
    for _ in range(200):
        out = sched.schedule()
        sched.update(out, [target(r) for r in out.requests])
        if not sched.has_unfinished:
            return
    raise AssertionError("did not finish")


def test_a_preempted_speculative_request_recomputes_and_ends_with_the_same_output():
    period = [20, 21, 22, 23, 24, 25]
    outputs = []
    for num_pages in (64, 8):  # 8 pages of 4 tokens: the newer request is preempted on the way
        config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                 speculative=SpeculativeConfig("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=2))
        sched = Scheduler(config, KVCacheManager(num_pages, PAGE, False), max_model_len=256)
        older = Request("old", [30, 31, 32, 33, 34, 35, 36, 37], SamplingParams(temperature=0.0, max_tokens=6))
        newer = Request("new", period * 2, SamplingParams(temperature=0.0, max_tokens=12))
        sched.add_request(older)
        sched.add_request(newer)
        run_to_end(sched, periodic_target(period))
        outputs.append((newer.output_token_ids, newer.num_preemptions))
    (roomy, no_preemption), (tight, preemptions) = outputs
    assert no_preemption == 0 and preemptions >= 1
    assert tight == roomy == (period * 3)[:12]


def test_a_grammars_drafts_get_a_mask_per_position_and_its_matcher_is_left_as_it_was(smollm2_tokenizer):
    from flashserve.engine.speculative import speculative_bitmask
    from flashserve.message.grammar_spec import GrammarSpec
    from flashserve.structured.compiler import GrammarCompiler

    tokenizer = smollm2_tokenizer
    grammar = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id]).compile_sync(
        GrammarSpec("choice", '["hello world, hello world"]', "structured_outputs"))
    request = Request("g", [1, 2], SamplingParams(temperature=0.0, grammar=grammar))
    request.matcher = grammar.new_matcher()
    drafts = tokenizer.encode("hello world", add_special_tokens=False)
    mask = speculative_bitmask([(request, drafts)], 49152)
    assert mask is not None and mask.rows == list(range(len(drafts) + 1))
    words = mask.array()
    allowed = [bool(words[j, t // 32] >> (t % 32) & 1) for j, t in enumerate(drafts)]
    assert all(allowed)  # each draft is allowed at its own position
    assert grammar.advance([request.matcher], [drafts[0]]) == [(True, False)]  # the matcher is back at the start


def test_the_proposer_sees_the_requests_tokens_as_they_grow():
    sched = make()
    request = Request("a", PROMPT[:-1], SamplingParams(temperature=0.0, max_tokens=50))
    sched.add_request(request)
    sched.update(sched.schedule(), [SampledTokens([8])])
    sched.update(sched.schedule(), [SampledTokens([9, 4])])
    assert sched.speculator is not None
    assert sched.speculator._tokens(request).tolist() == request.all_token_ids
