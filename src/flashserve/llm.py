"""Building the engine stack, and the offline Python API (`LLM`) over it."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, replace
from typing import Any, Sequence

from flashserve.config import CacheConfig, ModelConfig, SchedulerConfig
from flashserve.engine.kv_cache_manager import KVCacheManager
from flashserve.engine.engine import LLMEngine
from flashserve.engine.outputs import RequestOutput
from flashserve.engine.scheduler import Scheduler
from flashserve.sampling_params import SamplingParams

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


def build_engine(
    model: ModelConfig,
    cache: CacheConfig = CacheConfig(),
    scheduler: SchedulerConfig = SchedulerConfig(),
    cuda_graph: bool = True,
) -> EngineStack:
    from flashserve.model.runner import build_runner  # torch is imported here, not at package import

    runner, loaded, num_pages = build_runner(model, cache, cuda_graph=cuda_graph, max_batch_size=scheduler.max_num_seqs)
    budget = scheduler.max_num_batched_tokens
    if budget is None:
        from flashserve.model.step_budget import default_step_budget

        budget = default_step_budget(runner, loaded.device.type, num_pages, cache.page_size)
        scheduler = replace(scheduler, max_num_batched_tokens=budget)
    # loaded.max_model_len is already capped by what the KV cache holds.
    sched = Scheduler(scheduler, KVCacheManager(num_pages, cache.page_size, cache.enable_prefix_caching), loaded.max_model_len)
    engine = LLMEngine(sched, runner, loaded.tokenizer, vocab_size=loaded.vocab_size)
    return EngineStack(engine, loaded, num_pages, cache.page_size, budget)


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


class LLM:
    """Offline generation without HTTP: `LLM(model).generate(prompts, params)`."""

    def __init__(self, model: str = "", **kwargs: Any) -> None:
        cache_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in CacheConfig.__dataclass_fields__}
        sched_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in SchedulerConfig.__dataclass_fields__}
        cuda_graph = kwargs.pop("cuda_graph", True)
        self.stack = build_engine(ModelConfig(model=model, **kwargs), CacheConfig(**cache_kw),
                                  SchedulerConfig(**sched_kw), cuda_graph=cuda_graph)

    @property
    def engine(self) -> LLMEngine:
        return self.stack.engine

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """Run every prompt to completion (text prompts need a tokenizer); results in prompt order."""
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        eos = tuple(self.stack.loaded.eos_token_ids)
        ids: list[str] = []
        prompt_ids: dict[str, list[int]] = {}
        for prompt, p in zip(prompts, params_list):
            if isinstance(prompt, str):
                if self.stack.tokenizer is None:
                    raise ValueError("this model has no tokenizer: pass token ids")
                tokens = self.stack.tokenizer.encode(prompt)
            else:
                tokens = list(prompt)
            if not p.eos_token_ids and eos:
                p = replace(p, eos_token_ids=eos)
            rid = uuid.uuid4().hex
            ids.append(rid)
            prompt_ids[rid] = tokens
            self.engine.add_request(rid, tokens, p)
        results: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
        while self.engine.has_unfinished:
            for out in self.engine.step():
                results[out.request_id].append(out)
        return [_collect(rid, prompt_ids[rid], results[rid]) for rid in ids]


def _collect(request_id: str, prompt: list[int], outs: list[RequestOutput]) -> Completion:
    last = outs[-1] if outs else None
    return Completion(
        request_id=request_id,
        prompt_token_ids=prompt,
        token_ids=[t for o in outs for t in o.new_token_ids],
        text="".join(o.new_text for o in outs),
        finish_reason=last.finish_reason if last else None,
        error=last.error if last else None,
        num_cached_tokens=last.num_cached_tokens if last else 0,
    )
