"""Prefix-sharing groups of an offline batch: prefixes found, page-aligned, never a whole prompt,
every prompt submitted once, groups contiguous and decode-heavy first; a brute-force check of
the tokens saved on small random batches; and `LLM.generate` with grouping on the embedded
SmolLM2 model (same greedy tokens, input order, prefix computed once, batches past the cache)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from flashserve.engine.prefix_groups import GroupPlan, PrefixGroup, plan_prefix_groups

PAGE = 16
SYSTEM = list(range(1000, 1040))  # 40 tokens: two and a half pages
OTHER = list(range(2000, 2040))


def group_of(plan: GroupPlan, index: int) -> PrefixGroup:
    return next(g for g in plan.groups if index in g.members)


def test_prompts_with_a_common_prefix_form_one_group() -> None:
    plan = plan_prefix_groups([SYSTEM + [1, 2], SYSTEM + [3], SYSTEM + [4, 5, 6]], PAGE)
    assert [sorted(g.members) for g in plan.groups] == [[0, 1, 2]]


def test_the_shared_prefix_is_cut_to_whole_pages() -> None:
    plan = plan_prefix_groups([SYSTEM + [1], SYSTEM + [2]], PAGE)
    assert plan.groups[0].prefix_len == 32  # 40 common tokens, two full pages


def test_a_prompt_that_shares_nothing_is_a_group_of_one() -> None:
    plan = plan_prefix_groups([SYSTEM + [1], [7, 8, 9], SYSTEM + [2]], PAGE)
    assert group_of(plan, 1) == PrefixGroup((1,), 0)


def test_a_prefix_shorter_than_a_page_is_not_shared() -> None:
    plan = plan_prefix_groups([SYSTEM[:15] + [1] * 20, SYSTEM[:15] + [2] * 20], PAGE)
    assert all(g.prefix_len == 0 and len(g.members) == 1 for g in plan.groups)


def test_a_prompt_that_is_the_start_of_another_keeps_its_last_page_to_compute() -> None:
    plan = plan_prefix_groups([SYSTEM[:32], SYSTEM[:32] + [5] * 20], PAGE)
    assert plan.groups == (PrefixGroup((0, 1), 16),)  # 32 tokens can take at most one cached page


def test_identical_page_aligned_prompts_leave_their_last_page_to_compute() -> None:
    plan = plan_prefix_groups([SYSTEM[:32]] * 3, PAGE)
    assert plan.groups == (PrefixGroup((0, 1, 2), 16),)


def test_identical_prompts_one_token_past_a_page_share_every_full_page() -> None:
    plan = plan_prefix_groups([SYSTEM[:33]] * 2, PAGE)
    assert plan.groups[0].prefix_len == 32


def test_every_prompt_is_submitted_exactly_once() -> None:
    rng = random.Random(0)
    prompts = [rng.choice([SYSTEM, OTHER, []]) + [rng.randrange(5) for _ in range(rng.randrange(1, 40))]
               for _ in range(200)]
    assert sorted(plan_prefix_groups(prompts, PAGE).order) == list(range(200))


def test_members_of_a_group_are_submitted_contiguously() -> None:
    prompts = [SYSTEM + [1], OTHER + [1], SYSTEM + [2], OTHER + [2], SYSTEM + [3]]
    order = plan_prefix_groups(prompts, PAGE).order
    assert order in ([0, 2, 4, 1, 3], [1, 3, 0, 2, 4])


def test_decode_heavy_groups_come_first() -> None:
    prompts = [SYSTEM + [1], SYSTEM + [2], OTHER + [1], OTHER + [2], [9] * 5]
    plan = plan_prefix_groups(prompts, PAGE, max_tokens=[10, 10, 500, 500, 1])
    assert [sorted(g.members) for g in plan.groups] == [[2, 3], [0, 1], [4]]


def test_prompts_with_different_keys_never_share_a_group() -> None:
    plan = plan_prefix_groups([SYSTEM + [1], SYSTEM + [2], SYSTEM + [3]], PAGE, keys=[None, "salt", None])
    assert group_of(plan, 0) == PrefixGroup((0, 2), 32) and group_of(plan, 1) == PrefixGroup((1,), 0)


def test_a_deeper_pair_is_kept_when_it_saves_more_than_joining_the_wide_group() -> None:
    long_prefix = SYSTEM[:16] + list(range(3000, 3064))
    prompts = [long_prefix + [1], long_prefix + [2], SYSTEM[:16] + [4] * 20]
    plan = plan_prefix_groups(prompts, PAGE)
    # The pair shares 80 tokens (saves 80); all three would share 16 (saves 32).
    assert group_of(plan, 0) == group_of(plan, 1) and group_of(plan, 0).prefix_len == 80
    assert plan.tokens_saved == 80


def test_a_long_chain_of_nested_prefixes_needs_no_recursion() -> None:
    prompts = [[7] * (k + 2) for k in range(2000)]  # each one the start of the next
    plan = plan_prefix_groups(prompts, 1)
    assert sorted(plan.order) == list(range(2000)) and plan.tokens_saved > 0


def test_no_grouping_keeps_input_order() -> None:
    assert GroupPlan.in_order(3).order == [0, 1, 2]


def test_mismatched_lengths_are_rejected() -> None:
    with pytest.raises(ValueError):
        plan_prefix_groups([[1], [2]], PAGE, max_tokens=[1])


def _partitions(items: list[int]) -> Iterator[list[list[int]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for k in range(len(part)):
            yield part[:k] + [[first, *part[k]]] + part[k + 1:]


def _shared(members: list[int], prompts: list[list[int]], page: int) -> int:
    """The page-aligned prefix every member shares, leaving each its last token to compute."""
    limit = min((len(prompts[i]) - 1) // page * page for i in members)
    n = 0
    while n + page <= limit and all(prompts[i][n:n + page] == prompts[members[0]][n:n + page] for i in members):
        n += page
    return n


@pytest.mark.parametrize("seed", range(40))
def test_tokens_saved_equal_the_best_partition_on_small_batches(seed: int) -> None:
    rng = random.Random(seed)
    prompts = [[rng.randrange(2) for _ in range(rng.randrange(1, 11))] for _ in range(rng.randrange(2, 7))]
    plan = plan_prefix_groups(prompts, 2)
    for g in plan.groups:
        assert len(g.members) == 1 or _shared(list(g.members), prompts, 2) >= g.prefix_len > 0
    best = max(sum(_shared(p, prompts, 2) * (len(p) - 1) for p in part)
               for part in _partitions(list(range(len(prompts)))))
    assert plan.tokens_saved == best


# --- LLM.generate on the embedded SmolLM2 model ------------------------------------------------

SUPPORT = ("You are the support desk of a hardware shop. Answer in one short sentence, politely, and "
           "never mention internal notes or prices that are not on the public list. Customer: ")
QUESTIONS = ["Do you sell screws?", "When do you open on Sunday?", "Can I return a drill?",
             "Is parking free?", "Do you cut keys?", "Where is the paint aisle?"]
UNRELATED = ["Write a haiku about rain.", "What is two plus two?"]


@pytest.fixture(scope="module")
def llm() -> Any:
    from flashserve.entrypoints.llm import LLM

    # 47 pages of 16 tokens: the big batch below needs several times that.
    return LLM("", num_pages=48, max_num_batched_tokens=256, max_num_seqs=8)


def greedy(max_tokens: int = 6) -> Any:
    from flashserve.message.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


@pytest.mark.slow
def test_generate_with_grouping_gives_the_same_greedy_tokens_as_without(llm: Any) -> None:
    prompts = [UNRELATED[0]] + [SUPPORT + q for q in QUESTIONS] + [UNRELATED[1]]
    grouped = llm.generate(prompts, greedy(), prefix_grouping=True)
    plain = llm.generate(prompts, greedy(), prefix_grouping=False)
    assert [c.token_ids for c in grouped] == [c.token_ids for c in plain]


@pytest.mark.slow
def test_generate_returns_results_in_input_order(llm: Any) -> None:
    prompts = [SUPPORT + QUESTIONS[0], UNRELATED[0], SUPPORT + QUESTIONS[1], UNRELATED[1], SUPPORT + QUESTIONS[2]]
    tokens = [llm.stack.tokenizer.encode(p) for p in prompts]
    assert plan_prefix_groups(tokens, 16, [6] * 5).order != list(range(5))  # grouping reorders them
    results = llm.generate(prompts, greedy(), prefix_grouping=True)
    assert [r.prompt_token_ids for r in results] == tokens


@pytest.mark.slow
def test_generate_with_grouping_computes_a_shared_prefix_once(llm: Any) -> None:
    prompts = [SUPPORT.replace("hardware", "garden") + q for q in QUESTIONS]
    llm.generate(prompts, greedy(2), prefix_grouping=True)
    stats = llm.last_stats
    prefix_len = plan_prefix_groups([llm.stack.tokenizer.encode(p) for p in prompts], 16).groups[0].prefix_len
    assert (stats.num_groups, stats.num_pinned_groups) == (1, 1)
    assert stats.num_cached_prompt_tokens >= prefix_len * (len(prompts) - 1)
    assert stats.num_computed_prompt_tokens == stats.num_prompt_tokens - stats.num_cached_prompt_tokens


@pytest.mark.slow
def test_generate_runs_a_batch_larger_than_the_kv_cache(llm: Any) -> None:
    prompts = [f"{SUPPORT}{q} (ticket {n})" for n in range(8) for q in QUESTIONS]
    assert sum(len(llm.stack.tokenizer.encode(p)) for p in prompts) > 2 * 16 * llm.stack.num_pages
    results = llm.generate(prompts, greedy(4), prefix_grouping=True)
    assert all(r.error is None and r.finish_reason in ("length", "stop") for r in results)


@pytest.mark.slow
def test_generate_leaves_no_page_pinned_or_held(llm: Any) -> None:
    llm.generate([SUPPORT + q for q in QUESTIONS], greedy(2), prefix_grouping=True)
    kv_cache = llm.engine.scheduler.kv_cache
    assert kv_cache.num_used_pages == 0 and kv_cache.num_pinned_pages == 0


@pytest.mark.slow
def test_cascade_attention_on_gives_the_same_greedy_tokens_as_off(llm: Any) -> None:
    from flashserve.entrypoints.llm import LLM

    cascade = LLM("", num_pages=48, max_num_batched_tokens=256, max_num_seqs=8, cascade_attention="on")
    runner = cascade.engine.executor
    plan, grouped_steps = runner.backend.plan, []

    def recording_plan(layout: Any) -> None:
        grouped_steps.append(layout.prefix is not None)
        plan(layout)

    runner.backend.plan = recording_plan
    prompts = [SUPPORT + q for q in QUESTIONS] + UNRELATED
    with_cascade = cascade.generate(prompts, greedy(), prefix_grouping=True)
    assert any(grouped_steps)  # the shared prompt's requests decoded through a prefix level
    flat = llm.generate(prompts, greedy(), prefix_grouping=True)
    assert [c.token_ids for c in with_cascade] == [c.token_ids for c in flat]


def test_under_cache_pressure_groups_compute_far_fewer_prompt_tokens_than_arrival_order(
        tiny_llama_config: Any) -> None:
    """BatchLLM's point: when the cache cannot hold every shared prefix at once, arrival order
    evicts a prefix before most of its group arrives; groups compute each prefix about once."""
    from flashserve.message.sampling_params import SamplingParams
    from flashserve.entrypoints.llm import LLM

    config = tiny_llama_config
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 512) for _ in range(8 * PAGE)] for _ in range(40)]
    prompts = [p + [rng.randrange(1, 512) for _ in range(PAGE)] for p in prefixes for _ in range(8)]
    rng.shuffle(prompts)
    # 160 pages: the 40 prefixes alone need 320.
    llm = LLM(str(config), load_format="dummy", num_pages=160, max_num_seqs=16, cascade_attention="off")
    computed = {}
    for grouping in (False, True):
        llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), prefix_grouping=grouping)
        stats = llm.last_stats
        computed[grouping] = 1 - stats.num_cached_prompt_tokens / stats.num_prompt_tokens
    assert computed[True] < 0.3 < 0.6 < computed[False]
