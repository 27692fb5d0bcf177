"""Building the engine stack, and the offline Python API (`LLM`) over it."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Sequence

from flashserve.client.inproc import InprocClient
from flashserve.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig
from flashserve.engine.engine_core import EngineCore
from flashserve.engine.heap import existing_objects_frozen
from flashserve.engine.llm_engine import LLMEngine
from flashserve.engine.lora_registry import LoRARegistry
from flashserve.engine.prefix_groups import GroupPlan, plan_prefix_groups
from flashserve.engine.prefix_pins import GroupPins
from flashserve.engine.scheduler import Scheduler
from flashserve.kv_cache.manager import KVCacheManager
from flashserve.message.codec import AddRequest
from flashserve.message.lora import LoRARequest
from flashserve.message.outputs import RequestOutput, merge_outputs
from flashserve.message.requests import Add
from flashserve.message.sampling_params import SamplingParams
from flashserve.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass
class EngineStack:
    engine: LLMEngine
    loaded: Any  # model.loader.LoadedModel
    num_pages: int
    page_size: int
    max_num_batched_tokens: int  # the step budget, resolved from the device when not given

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len

    @property
    def tokenizer(self) -> Any | None:
        return self.loaded.tokenizer

    def close(self) -> None:
        """Stops what the executor started (the worker ranks of tensor parallelism); else nothing."""
        close = getattr(self.engine.executor, "close", None)
        if close is not None:
            close()


def build_engine(
    model: ModelConfig,
    cache: CacheConfig = CacheConfig(),
    scheduler: SchedulerConfig = SchedulerConfig(),
    cuda_graph: bool = True,
    detokenize: bool = True,
) -> EngineStack:
    """detokenize=False: the engine sees token ids only and leaves text and stop strings to its
    caller (the server's front ends)."""
    from flashserve.executor.build import build_runner  # torch is imported here, not at package import
    from flashserve.worker.step_budget import default_max_num_seqs, large_gpu

    if scheduler.speculative is not None:
        from flashserve.entrypoints.speculative import check_speculative

        check_speculative(scheduler.speculative, model)  # before anything loads
    large = large_gpu(model.device)
    if scheduler.max_num_seqs is None:
        scheduler = replace(scheduler, max_num_seqs=default_max_num_seqs(large))
    if model.tensor_parallel_size > 1:  # this process is rank 0; the workers start here
        from flashserve.executor.tensor_parallel import start_tensor_parallel

        runner, loaded, num_pages = start_tensor_parallel(model, cache, cuda_graph=cuda_graph,
                                                          max_batch_size=scheduler.max_num_seqs,
                                                          speculative=scheduler.speculative)
    else:
        # With a draft model, the runner's builder loads it too (its weights and KV count in the sizing).
        runner, loaded, num_pages = build_runner(model, cache, cuda_graph=cuda_graph,
                                                 max_batch_size=scheduler.max_num_seqs,
                                                 speculative=scheduler.speculative)
    budget = scheduler.max_num_batched_tokens
    if budget is None:
        from flashserve.worker.step_budget import default_prefill_only_budget, default_step_budget

        budget = default_step_budget(runner, loaded.device.type, num_pages, cache.page_size, large)
        prefill_only = scheduler.prefill_only_budget or default_prefill_only_budget(loaded.device.type, budget)
        scheduler = replace(scheduler, max_num_batched_tokens=budget, prefill_only_budget=prefill_only)
    if scheduler.max_prefill_tokens is None:
        from flashserve.worker.step_budget import default_max_prefill_tokens

        scheduler = replace(scheduler, max_prefill_tokens=default_max_prefill_tokens(loaded.device.type))
    # loaded.max_model_len is already capped by what the KV cache holds.
    kv_cache = KVCacheManager(num_pages, cache.page_size, cache.enable_prefix_caching, cache.prefix_caching_hash_seed)
    sched = Scheduler(scheduler, kv_cache, loaded.max_model_len, vocab_size=loaded.vocab_size)
    if model.lora is not None:
        sched.max_loras = model.lora.max_loras  # a step never uses more adapters than the runner's slots
    overlap = scheduler.overlap_scheduling and runner.overlap_capable
    if scheduler.speculative is not None and scheduler.speculative.method == "draft_model":
        # The draft reads each step's tokens on the host: a token still in flight has none there.
        overlap = False
    tokenizer = loaded.tokenizer if detokenize else None
    engine = LLMEngine(sched, runner, tokenizer, vocab_size=loaded.vocab_size, overlap=overlap,
                       loras=LoRARegistry(runner, model.lora), late_launch=scheduler.late_launch)
    return EngineStack(engine, loaded, num_pages, cache.page_size, budget)


def _speculative_config(value: Any) -> SpeculativeConfig:
    if isinstance(value, SpeculativeConfig):
        return value
    return SpeculativeConfig.from_json(value) if isinstance(value, str) else SpeculativeConfig.from_dict(value)


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


@dataclass(frozen=True)
class GenerateStats:
    """What the last `LLM.generate` did, for a summary: prompt tokens as sent (logical) against
    those computed, the rest coming from the prefix cache."""

    num_requests: int = 0
    num_groups: int = 0  # groups of two or more prompts sharing a prefix
    num_pinned_groups: int = 0  # of those, the ones whose prefix was pinned while they ran
    num_prompt_tokens: int = 0  # every prompt's length
    num_cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    num_output_tokens: int = 0
    elapsed_s: float = 0.0

    @property
    def num_computed_prompt_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_cached_prompt_tokens


# LLM's keyword arguments for LoRA, as vLLM's LLM takes them: enable_lora turns the others into the
# model config's LoRAConfig.
_LORA_KWARGS = ("max_loras", "max_lora_rank", "max_cpu_loras")


class LLM:
    """Offline generation without HTTP: `LLM(model).generate(prompts, params)`. With
    `enable_lora=True` (and `max_loras`, `max_lora_rank`, `max_cpu_loras` as the server's options),
    `generate(..., lora_request=LoRARequest(name, id, path))` runs prompts with an adapter."""

    def __init__(self, model: str = "", **kwargs: Any) -> None:
        if kwargs.pop("data_parallel_size", 1) != 1:
            # One engine in this process steps one batch at a time; several engine cores are
            # processes of `flashserve serve`, behind its front ends' router.
            raise ValueError("LLM runs one engine in this process: for data parallelism serve the model with "
                             "`flashserve serve --data-parallel-size N` (or run one LLM per GPU)")
        cache_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in CacheConfig.__dataclass_fields__}
        sched_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in SchedulerConfig.__dataclass_fields__}
        # Late launches hold a launch while the loop driving the engine receives requests; here the
        # caller's generate() drives it and nothing arrives meanwhile, so steps go untimed by default.
        sched_kw.setdefault("late_launch", False)
        speculative = kwargs.pop("speculative_config", None)  # vLLM's name: a dict, JSON or SpeculativeConfig
        if speculative is not None:
            sched_kw["speculative"] = _speculative_config(speculative)
        cuda_graph = kwargs.pop("cuda_graph", True)
        lora_kw = {k: kwargs.pop(k) for k in _LORA_KWARGS if k in kwargs}
        if kwargs.pop("enable_lora", False):
            kwargs["lora"] = LoRAConfig(**lora_kw)
        elif lora_kw:
            raise ValueError(f"{', '.join(sorted(lora_kw))} need enable_lora=True")
        self.stack = build_engine(ModelConfig(model=model, **kwargs), CacheConfig(**cache_kw),
                                  SchedulerConfig(**sched_kw), cuda_graph=cuda_graph)
        self.last_stats = GenerateStats()

    @property
    def engine(self) -> LLMEngine:
        return self.stack.engine

    def close(self) -> None:
        """Stops the worker ranks of tensor_parallel_size > 1 (no step after it); does nothing on one rank."""
        self.stack.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
        prefix_grouping: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[Completion]:
        """Run every prompt to completion (text prompts need a tokenizer); results in prompt order.

        With `prefix_grouping` (and prefix caching on), prompts that share a page-aligned prefix
        are submitted together, each group's prefix pinned in the KV cache until its last request
        ends, groups decode-heavy first (`engine/prefix_groups.py`); without it, in input order.
        Either way the engine is fed as it drains (`_Feeder`), so a batch far larger than the KV
        cache runs too. Raises InvalidParameter, before anything runs, for ids the model cannot take.

        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base model),
        as vLLM's `LLM.generate` takes it; each adapter loads before anything runs (LoRAAdapterError
        when it cannot) and stays loaded for later calls.
        """
        start = time.perf_counter()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        eos = tuple(self.stack.loaded.eos_token_ids)
        params_list = [replace(p, eos_token_ids=eos) if not p.eos_token_ids and eos else p for p in params_list]
        tokens = [self._tokenize(prompt) for prompt in prompts]
        for prompt_ids, p in zip(tokens, params_list):
            self.engine.check_request(prompt_ids, p)
        loras = self._loras(lora_request, len(prompts))
        lora_keys = [str(lora.lora_int_id) if lora is not None else None for lora in loras]
        kv_cache = self.engine.scheduler.kv_cache
        if prefix_grouping and kv_cache.enable_caching:
            plan = plan_prefix_groups(tokens, kv_cache.page_size, [p.max_tokens for p in params_list],
                                      keys=lora_keys if any(lora_keys) else None)
        else:
            plan = GroupPlan.in_order(len(tokens))
        ids = [uuid.uuid4().hex for _ in tokens]
        feeder = _Feeder(self.engine, plan, ids, tokens, params_list, self.stack.max_model_len, loras)
        outputs = feeder.run()
        results = [_collect(rid, prompt_ids, outputs[rid]) for rid, prompt_ids in zip(ids, tokens)]
        self.last_stats = GenerateStats(
            num_requests=len(results),
            num_groups=sum(len(g.members) > 1 for g in plan.groups),
            num_pinned_groups=feeder.num_pinned_groups,
            num_prompt_tokens=sum(len(t) for t in tokens),
            num_cached_prompt_tokens=sum(r.num_cached_tokens for r in results),
            num_output_tokens=sum(len(r.token_ids) for r in results),
            elapsed_s=time.perf_counter() - start,
        )
        return results

    def _loras(self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
               n: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each loaded, with the id the engine knows it by."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            per_prompt = [lora_request] * n
        else:
            per_prompt = list(lora_request)
            if len(per_prompt) != n:
                raise ValueError(f"{len(per_prompt)} lora requests for {n} prompts")
        loaded: dict[LoRARequest, LoRARequest] = {}
        for lora in dict.fromkeys(x for x in per_prompt if x is not None):
            lora_id = self.engine.loras.for_request(lora)
            loaded[lora] = replace(lora, lora_int_id=lora_id)
        return [loaded[x] if x is not None else None for x in per_prompt]

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.stack.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        return list(self.stack.tokenizer.encode(prompt))


class _Feeder:
    """Feeds an offline batch to the engine core in plan order while stepping it (`InprocClient`).

    The engine holds at most `2 * max_num_seqs` unfinished requests: enough that every slot the
    scheduler frees is refilled at once, few enough that its waiting queue (which it scans every
    step for requests whose prefix another request is still computing) stays short and that pins
    are taken only as their groups start. Each group's prefix is pinned while the group runs
    (`GroupPins`, which the core keeps as the requests come and go).
    """

    def __init__(self, engine: LLMEngine, plan: GroupPlan, ids: list[str], tokens: list[list[int]],
                 params: list[SamplingParams], max_model_len: int, loras: list[LoRARequest | None]) -> None:
        self.engine = engine
        self.plan = plan
        self.ids, self.tokens, self.params, self.loras = ids, tokens, params, loras
        scheduler = engine.scheduler
        self.max_live = 2 * scheduler.config.max_num_seqs
        largest = max((min(len(t) + p.max_tokens, max_model_len) for t, p in zip(tokens, params)), default=0)
        lora_keys = [str(lora.lora_int_id) if lora is not None else None for lora in loras]
        self.pins = GroupPins(scheduler.kv_cache, scheduler.prefix_cache.hasher, plan, tokens, largest,
                              lora_keys=lora_keys if any(lora_keys) else None)

    @property
    def num_pinned_groups(self) -> int:
        return self.pins.num_pinned_groups

    def run(self) -> dict[str, list[RequestOutput]]:
        client = InprocClient(EngineCore(self.engine, pins=self.pins))
        with existing_objects_frozen():
            try:
                return self._feed(client)
            finally:  # interrupted: leave the engine and the cache as they were
                for rid in self.ids:
                    client.abort(rid)
                self.pins.release_all()
                client.close()

    def _feed(self, client: InprocClient) -> dict[str, list[RequestOutput]]:
        outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in self.ids}
        queue = [(g, i) for g, group in enumerate(self.plan.groups) for i in group.members]
        next_up = 0
        while next_up < len(queue) or client.has_unfinished:
            while next_up < len(queue) and client.num_live < self.max_live:
                g, i = queue[next_up]
                next_up += 1
                add = Add(self.ids[i], self.tokens[i], self.params[i], stream=False, lora_request=self.loras[i])
                if (refused := client.add(AddRequest(add, prefix_member=(g, i)))) is not None:
                    outputs[refused.request_id].append(refused)
            for out in client.outputs():
                outputs[out.request_id].append(out)
        return outputs


def _collect(request_id: str, prompt: list[int], outs: list[RequestOutput]) -> Completion:
    if not outs:
        return Completion(request_id, prompt, [], "", None, None)
    whole = merge_outputs(outs)
    return Completion(
        request_id=request_id,
        prompt_token_ids=prompt,
        token_ids=whole.new_token_ids,
        text=whole.new_text,
        finish_reason=whole.finish_reason,
        error=whole.error,
        num_cached_tokens=whole.num_cached_tokens,
    )
