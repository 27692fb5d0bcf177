"""What every endpoint of the app shares: `OpenAIServing` holds the engine client, the tokenizer, the
served names and the limits; it checks a request (model, fields not implemented, fan-out, context
length), tokenizes off the event loop when an input is long, renders a chat into a `ChatPlan` and
opens the engine streams of a request's choices. The models, health and metrics endpoints are its
own; chat and text completions are `api/serving_completions.py`'s, and the Responses and Messages
APIs translate onto `plan_chat` and `open_streams`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
import uuid
from typing import Any, Callable, Mapping, Sequence

from fastapi.responses import JSONResponse, Response

from flashserve.api import protocol as p
from flashserve.api.chat_input import Grammars, as_ids, chat_conversation, tool_grammar, tool_mode
from flashserve.api.chat_plan import ChatPlan
from flashserve.api.errors import APIError, engine_dead, invalid, overloaded
from flashserve.api.logprobs import TokenTexts
from flashserve.api.options import APIOptions, ServerState
from flashserve.api.sampling import for_choice, to_sampling_params
from flashserve.api.serving_lora import adapter_cards, lora_adapters, model_not_found, resolve_model
from flashserve.api.streaming import EngineStreams
from flashserve.api.tools.render import TemplateSupport, template_support
from flashserve.client.protocol import EngineClient
from flashserve.message.sampling_params import SamplingParams
from flashserve.metrics import CONTENT_TYPE, Metrics, RequestRecord, request_logger
from flashserve.structured.specs import spec_from_request
from flashserve.tracing import RequestTracer


_model_not_found = model_not_found

# Inputs up to this many characters are tokenized on the event loop (faster than a thread hop);
# longer ones in the tokenizer thread.
TOKENIZE_INLINE_CHARS = 4096


class OpenAIServing:
    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Any,
        served_model_names: Sequence[str],
        max_model_len: int,
        eos_token_ids: Sequence[int],
        options: APIOptions,
        metrics: Metrics,
        state: ServerState,
        vocab_size: int | None = None,
        tracer: RequestTracer | None = None,
    ) -> None:
        if not served_model_names:
            raise ValueError("at least one served model name is needed")
        self.engine = engine
        self.options = options
        self.metrics = metrics
        self.state = state
        self.tokenizer = tokenizer
        self.names = list(served_model_names)
        self.max_model_len = max_model_len
        # Without explicit ids, fall back to the tokenizer's so that generation still ends at EOS.
        fallback = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(eos_token_ids) or ((fallback,) if isinstance(fallback, int) else ())
        self.created = int(time.time())
        self.vocab_size = vocab_size
        self.tracer = tracer  # None: tracing is off
        # One thread tokenizes long inputs, in arrival order, off the event loop (see `off_loop`).
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flashserve-tokenize")
        self.text_of = TokenTexts(tokenizer)
        self.grammars = Grammars(tokenizer, vocab_size, self.eos_token_ids)
        self._template_support: TemplateSupport | None = None

    @property
    def template_support(self) -> TemplateSupport:
        """What the chat template renders, probed on the first chat request."""
        if self._template_support is None:
            self._template_support = template_support(self.tokenizer)
        return self._template_support

    # ---- chat rendering ------------------------------------------------------------------------
    async def plan_chat(self, body: p.ChatCompletionRequest) -> ChatPlan:
        """A chat request checked, rendered by the chat template and its grammar compiled: what the
        chat endpoint and the endpoints translated onto it (Responses, Messages) hand the engine."""
        model = self.check_request(body)
        if self.tokenizer is None:
            raise invalid("chat completions need a tokenizer; this server runs without one", "messages")
        support = self.template_support
        tools = tool_mode(body, self.options.tool_call_parser, self.tokenizer, support)
        conversation, kwargs = chat_conversation(body, tools, support)
        size = sum(len(str(m.get("content") or "")) for m in conversation)
        try:
            encoded = await self.off_loop(size, self.tokenizer.apply_chat_template, conversation,
                                           add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)
        except Exception as exc:  # templates raise on shapes they refuse (roles out of order, ...)
            raise invalid(f"the chat template rejected these messages: {exc}", "messages") from exc
        prompt = as_ids(encoded)
        self.check_fan_out(1, body.n, "messages")
        tool_spec = tool_grammar(body, tools)
        spec = spec_from_request(body.response_format, body.structured_outputs)
        if tool_spec is not None and spec is not None:
            if tools is None or tools.kind != "auto":
                raise invalid("tool_choice 'required' or a named function cannot be combined with "
                              "response_format or structured_outputs", "tool_choice")
            tool_spec = None  # auto: the answer follows the requested format
        grammar = await self.grammars.compile(tool_spec or spec)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if self.options.log_requests:
            request_logger.info("request %s: messages=%r", request_id, conversation)
        return ChatPlan(request_id, model, prompt, grammar, tools)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # ---- the server's own endpoints ----------------------------------------------------------
    async def models(self) -> JSONResponse:
        cards = [self._card(n) for n in self.names] + self._adapter_cards()
        return JSONResponse(p.ModelList(data=cards).model_dump())

    async def model(self, model_id: str) -> JSONResponse:
        if model_id in self.names:
            return JSONResponse(self._card(model_id).model_dump())
        card = next((c for c in self._adapter_cards() if c.id == model_id), None)
        if card is None:
            raise _model_not_found(model_id)
        return JSONResponse(card.model_dump())

    def _card(self, name: str) -> p.ModelCard:
        # A base model's card, as vLLM's: its root names the model itself, it has no parent.
        return p.ModelCard(id=name, created=self.created, max_model_len=self.max_model_len, root=name)

    def _adapter_cards(self) -> list[p.ModelCard]:
        """The LoRA adapters' cards: `root` their path, `parent` their base model."""
        return [p.ModelCard(**fields, created=self.created, max_model_len=self.max_model_len)
                for fields in adapter_cards(self.engine, self.names[0])]

    def is_model(self, model: str) -> bool:
        """Whether `model` is a served name or a LoRA adapter's."""
        return model in self.names or model in lora_adapters(self.engine)

    async def health(self) -> JSONResponse:
        if not self.engine.is_healthy():
            raise engine_dead()
        if self.state.draining:  # take this server out of a load balancer's rotation
            raise overloaded("the server is shutting down", code="shutting_down")
        return JSONResponse({})

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # ---- validation ----------------------------------------------------------------------------
    def check_request(self, body: p.GenerationRequest) -> str:
        """The model the request names (a served name or a LoRA adapter's); raises its 404, or the
        400 of a field this server does not implement."""
        model, _ = resolve_model(self.engine, self.names, body.model)
        field = p.unsupported_field(body)
        if field == "stream_options":
            raise invalid("stream_options is only allowed when stream is true", field)
        if field is not None:
            raise invalid(f"{field} is not supported by this server", field, code="unsupported_parameter")
        return model

    def check_fan_out(self, num_prompts: int, n: int, param: str) -> None:
        """Each prompt x choice is a sequence in the engine; one request may not flood the queue."""
        limit = self.options.max_sequences_per_request
        if num_prompts * n > limit:
            raise invalid(
                f"this request asks for {num_prompts * n} sequences ({num_prompts} prompts x n={n}); "
                f"the limit per request is {limit}", "n" if n > 1 else param, code="too_many_sequences")

    async def off_loop(self, size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs), in the tokenizer thread when its input is longer than
        `TOKENIZE_INLINE_CHARS`, else here. Tokenizing a 2,000-token prompt takes milliseconds: a
        burst of them on the event loop held every stream and /metrics for seconds."""
        if size <= TOKENIZE_INLINE_CHARS:
            return fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool,
                                                                functools.partial(fn, *args, **kwargs))

    def tokenize(self, item: str | list[int]) -> list[int]:
        if isinstance(item, str):
            if self.tokenizer is None:
                raise invalid("text prompts need a tokenizer; send token ids instead", "prompt")
            ids = as_ids(self.tokenizer.encode(item))
        else:
            ids = list(item)
        if not ids:
            raise invalid("prompt must not be empty", "prompt")
        # Ids are checked against the model's embedding by the engine, not against the tokenizer,
        # which may know more ids than the model has rows.
        return ids

    def _max_tokens(self, prompt_len: int, requested: int | None, param: str, default: int | None = None) -> int:
        """The request's max_tokens, defaulting to `default` (as far as the context allows) or else
        the rest of the context; rejects overflow. A requested value below 1 is passed on for
        SamplingParams to reject."""
        limit = self.max_model_len
        if requested is None:
            if prompt_len >= limit:
                raise invalid(
                    f"This model's maximum context length is {limit} tokens. However, your {param} "
                    f"has {prompt_len} tokens, which leaves no room for a completion.",
                    param, code="context_length_exceeded",
                )
            return limit - prompt_len if default is None else min(default, limit - prompt_len)
        if requested >= 1 and prompt_len + requested > limit:
            raise invalid(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the {param}, {requested} in the "
                "completion). Please reduce the length of the prompt or of the completion.",
                param, code="context_length_exceeded",
            )
        return requested

    # ---- the engine's streams ------------------------------------------------------------------
    def open_streams(
        self, body: p.GenerationRequest, request_id: str, prompts: list[list[int]], param: str, arrival: float,
        x_request_id: str | None = None, grammar: Any = None, headers: Mapping[str, str] | None = None,
    ) -> EngineStreams:
        """One engine request per choice: n per prompt, numbered across prompts. `headers`: the HTTP
        request's, for its trace context."""
        ids: list[str] = []
        choice_prompts: list[list[int]] = []
        params: list[SamplingParams] = []
        for prompt in prompts:
            max_tokens = self._max_tokens(len(prompt), body.requested_max_tokens, param, body.default_max_tokens)
            base = to_sampling_params(body, max_tokens, self.eos_token_ids, grammar)
            for _ in range(body.n):
                index = len(ids)
                ids.append(f"{request_id}-{index}")
                choice_prompts.append(prompt)
                params.append(for_choice(base, index))
        if not self.engine.is_healthy():
            raise engine_dead()
        record = RequestRecord(self.metrics, request_id, sum(len(x) for x in prompts), len(ids), arrival,
                               x_request_id)
        if self.tracer is not None:
            record.span = self.tracer.span(headers or {}, request_id, body.model or self.names[0], params[0], body.n)
        _, lora = resolve_model(self.engine, self.names, body.model)
        return EngineStreams(self.engine, ids, choice_prompts, params, record, group=request_id,
                             cache_salt=body.cache_salt, choices_per_prompt=body.n, stream=bool(body.stream),
                             lora_request=lora)
