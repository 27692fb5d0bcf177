"""The OpenAI-compatible app: validate, tokenize, hand token ids to the engine, shape the answer.

Handlers never touch scheduling: they build SamplingParams, open one engine request per choice
(`EngineStreams`) and either collect the outputs or stream them as SSE chunks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import time
import uuid
from typing import Any, Callable, Coroutine, Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from flashserve.api import protocol as p
from flashserve.api.chat_input import Grammars, as_ids, chat_conversation, tool_grammar, tool_mode
from flashserve.api.chat_plan import ChatPlan
from flashserve.api.choices import (
    ChatChoiceStream,
    CompletionChoiceStream,
    ToolMode,
    chat_choices,
    completion_choices,
)
from flashserve.api.errors import APIError, engine_dead, install_error_handlers, invalid, overloaded
from flashserve.api.json_body import LoneSurrogate, loads
from flashserve.api.logprobs import TokenTexts
from flashserve.api.middleware import GuardMiddleware, RequestIdMiddleware
from flashserve.api.options import APIOptions, ServerState
from flashserve.api.response_store import ResponseStore, SharedResponseStore
from flashserve.api.sampling import for_choice, to_sampling_params
from flashserve.api.serving_messages import AnthropicErrors, MessagesServing
from flashserve.api.serving_responses import ResponsesServing
from flashserve.api.serving_tokenize import TokenizeServing
from flashserve.api.streaming import (
    CLIENT_CLOSED,
    ClientGone,
    EngineStreams,
    SSEResponse,
    chat_opening,
    sse_chunks,
    unless_disconnected,
    usage,
)
from flashserve.api.tools.render import TemplateSupport, template_support
from flashserve.api.ui import add_ui
from flashserve.client.protocol import EngineClient
from flashserve.message.sampling_params import SamplingParams
from flashserve.metrics import CONTENT_TYPE, Metrics, RequestRecord, request_logger
from flashserve.structured.compiler import spec_from_request
from flashserve.tracing import RequestTracer, build_tracer


def _model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


# Inputs up to this many characters are tokenized on the event loop (faster than a thread hop);
# longer ones in the tokenizer thread.
TOKENIZE_INLINE_CHARS = 4096


class _OpenAIServing:
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
        # One thread tokenizes long inputs, in arrival order, off the event loop (see `_off_loop`).
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

    # ---- endpoints -----------------------------------------------------------------------------
    async def chat(self, body: p.ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        plan = await self.plan_chat(body)
        return await self._generate(raw, body, plan.request_id, plan.model, [plan.prompt], chat=True,
                                    arrival=arrival, grammar=plan.grammar, tools=plan.tools)

    async def plan_chat(self, body: p.ChatCompletionRequest) -> ChatPlan:
        """A chat request checked, rendered by the chat template and its grammar compiled: what the
        chat endpoint and the endpoints translated onto it (Responses, Messages) hand the engine."""
        model = self._check(body)
        if self.tokenizer is None:
            raise invalid("chat completions need a tokenizer; this server runs without one", "messages")
        support = self.template_support
        tools = tool_mode(body, self.options.tool_call_parser, self.tokenizer, support)
        conversation, kwargs = chat_conversation(body, tools, support)
        size = sum(len(str(m.get("content") or "")) for m in conversation)
        try:
            encoded = await self._off_loop(size, self.tokenizer.apply_chat_template, conversation,
                                           add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)
        except Exception as exc:  # templates raise on shapes they refuse (roles out of order, ...)
            raise invalid(f"the chat template rejected these messages: {exc}", "messages") from exc
        prompt = as_ids(encoded)
        self._check_fan_out(1, body.n, "messages")
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

    async def completions(self, body: p.CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        model = self._check(body)
        items = self._prompt_items(body.prompt)
        self._check_fan_out(len(items), body.n, "prompt")
        prompts = [await self._off_loop(len(item) if isinstance(item, str) else 0, self._tokenize, item) for item in items]
        grammar = await self.grammars.compile(spec_from_request(None, body.structured_outputs))
        echo = None
        if body.echo:
            echo = [item if isinstance(item, str) else self._decode(item) for item in items]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if self.options.log_requests:
            request_logger.info("request %s: prompt=%r", request_id, body.prompt)
        return await self._generate(raw, body, request_id, model, prompts, chat=False, arrival=arrival,
                                    grammar=grammar, echo=echo)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    async def models(self) -> JSONResponse:
        cards = [self._card(n) for n in self.names]
        return JSONResponse(p.ModelList(data=cards).model_dump())

    async def model(self, model_id: str) -> JSONResponse:
        if model_id not in self.names:
            raise _model_not_found(model_id)
        return JSONResponse(self._card(model_id).model_dump())

    def _card(self, name: str) -> p.ModelCard:
        return p.ModelCard(id=name, created=self.created, max_model_len=self.max_model_len)

    async def health(self) -> JSONResponse:
        if not self.engine.is_healthy():
            raise engine_dead()
        if self.state.draining:  # take this server out of a load balancer's rotation
            raise overloaded("the server is shutting down", code="shutting_down")
        return JSONResponse({})

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # ---- validation ----------------------------------------------------------------------------
    def _check(self, body: p.GenerationRequest) -> str:
        model = body.model if body.model is not None else self.names[0]
        if model not in self.names:
            raise _model_not_found(model)
        field = p.unsupported_field(body)
        if field == "stream_options":
            raise invalid("stream_options is only allowed when stream is true", field)
        if field is not None:
            raise invalid(f"{field} is not supported by this server", field, code="unsupported_parameter")
        return model

    def _check_fan_out(self, num_prompts: int, n: int, param: str) -> None:
        """Each prompt x choice is a sequence in the engine; one request may not flood the queue."""
        limit = self.options.max_sequences_per_request
        if num_prompts * n > limit:
            raise invalid(
                f"this request asks for {num_prompts * n} sequences ({num_prompts} prompts x n={n}); "
                f"the limit per request is {limit}", "n" if n > 1 else param, code="too_many_sequences")

    @staticmethod
    def _prompt_items(prompt: p.Prompt) -> list[str | list[int]]:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]

    async def _off_loop(self, size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs), in the tokenizer thread when its input is longer than
        `TOKENIZE_INLINE_CHARS`, else here. Tokenizing a 2,000-token prompt takes milliseconds: a
        burst of them on the event loop held every stream and /metrics for seconds."""
        if size <= TOKENIZE_INLINE_CHARS:
            return fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool,
                                                                functools.partial(fn, *args, **kwargs))

    def _tokenize(self, item: str | list[int]) -> list[int]:
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

    # ---- generation ----------------------------------------------------------------------------
    async def _generate(
        self, raw: Request, body: p.GenerationRequest, request_id: str, model: str,
        prompts: list[list[int]], chat: bool, arrival: float, grammar: Any = None, tools: ToolMode | None = None,
        echo: list[str] | None = None,
    ) -> Response:
        streams = self.open_streams(body, request_id, prompts, param="messages" if chat else "prompt", arrival=arrival,
                             x_request_id=raw.state.request_id, grammar=grammar, headers=raw.headers)
        try:
            await unless_disconnected(raw, streams.start())
        except ClientGone:
            streams.close()
            return Response(status_code=CLIENT_CLOSED)
        except BaseException:
            streams.close()
            raise

        created = int(time.time())
        num_prompt_tokens = sum(len(prompt) for prompt in prompts)
        prompt_of = [i // body.n for i in range(streams.num_choices)]  # choice -> its prompt
        # Without a tokenizer the text is empty: the ids are the output.
        token_ids = bool(body.return_token_ids) or self.tokenizer is None
        if body.stream:
            kind = "chat.completion.chunk" if chat else "text_completion"
            choices: list[Any] = [
                ChatChoiceStream(i, self.text_of, tools, token_ids) if chat else
                CompletionChoiceStream(i, self.text_of, prompts[prompt_of[i]], echo[prompt_of[i]] if echo else None,
                                       token_ids)
                for i in range(streams.num_choices)
            ]
            chunks = sse_chunks(
                streams,
                head={"id": request_id, "object": kind, "created": created, "model": model},
                choices=choices,
                opening=[chat_opening(i) for i in range(streams.num_choices)] if chat else [],
                num_prompt_tokens=num_prompt_tokens,
                include_usage=body.include_usage,
                first={"prompt_token_ids": prompts[0]} if chat and token_ids else None,
                on_error=lambda err: self.metrics.record_error(err.type, err.code),
            )
            # The background close covers a client that leaves before the body iterator starts.
            return SSEResponse(chunks, ping=0, sep="\n", background=BackgroundTask(streams.aclose))

        try:
            results = await unless_disconnected(raw, streams.collect())
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            streams.close()
        info = p.UsageInfo(**usage(num_prompt_tokens, [r.num_output_tokens for r in results],
                                   streams.num_cached_prompt_tokens))
        response: p.ChatCompletionResponse | p.CompletionResponse
        if chat:
            response = p.ChatCompletionResponse(
                id=request_id, created=created, model=model, usage=info,
                prompt_token_ids=prompts[0] if token_ids else None,
                choices=[p.ChatChoice(**c) for c in chat_choices(results, tools, self.text_of, token_ids)])
        else:
            choices = completion_choices(results, self.text_of, [prompts[i] for i in prompt_of],
                                         [echo[i] for i in prompt_of] if echo else None, token_ids)
            response = p.CompletionResponse(id=request_id, created=created, model=model, usage=info,
                                            choices=[p.CompletionChoice(**c) for c in choices])
        return JSONResponse(response.model_dump(exclude_none=False))

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
        return EngineStreams(self.engine, ids, choice_prompts, params, record, group=request_id,
                             cache_salt=body.cache_salt, choices_per_prompt=body.n, stream=bool(body.stream))


class _JSONRequest(Request):
    """A request whose JSON body is parsed by `json_body.loads` (orjson first); a body neither
    parser reads raises json.JSONDecodeError, which FastAPI answers as before."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = loads(await self.body())
            except LoneSurrogate as exc:  # FastAPI passes an HTTPException on as it is
                raise StarletteHTTPException(400, str(exc)) from None
        return self._json


class _JSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_JSONRequest(request.scope, request.receive))

        return route


def _add_translated_routes(app: FastAPI, serving: _OpenAIServing, options: APIOptions) -> None:
    """The APIs translated onto the chat endpoint: OpenAI's Responses, Anthropic's Messages."""
    bounds = (options.responses_store_max_entries, options.responses_store_max_age_s)
    path = options.responses_store_path
    store = SharedResponseStore(path, *bounds) if path is not None else ResponseStore(*bounds)
    responses, messages = ResponsesServing(serving, store), MessagesServing(serving)
    for prefix in ("/v1", ""):
        app.add_api_route(f"{prefix}/responses", responses.create, methods=["POST"], response_model=None)
        app.add_api_route(f"{prefix}/responses/{{response_id}}", responses.retrieve, methods=["GET"],
                          response_model=None)
        app.add_api_route(f"{prefix}/responses/{{response_id}}", responses.delete, methods=["DELETE"],
                          response_model=None)
        app.add_api_route(f"{prefix}/messages", messages.create, methods=["POST"], response_model=None)


def build_app(
    engine: EngineClient,
    tokenizer: Any,
    served_model_names: Sequence[str],
    max_model_len: int,
    eos_token_ids: Sequence[int] = (),
    *,
    options: APIOptions = APIOptions(),
    metrics: Metrics | None = None,
    state: ServerState | None = None,
    vocab_size: int | None = None,
) -> FastAPI:
    """The OpenAI-compatible app. `tokenizer` is an HF tokenizer, or None for token-id prompts
    only; `eos_token_ids` end generation unless a request sets ignore_eos (empty: the tokenizer's
    eos_token_id). `max_model_len` bounds prompt + max_tokens. `metrics` is shared with the engine
    loop (a fresh registry if None); `state` is shared with whoever drains the server at shutdown.
    `vocab_size`: the model's logit width, for grammar masks (default: the tokenizer's length)."""
    metrics = metrics if metrics is not None else Metrics(model_name=served_model_names[0] if served_model_names else None)
    state = state if state is not None else ServerState()
    tracer = build_tracer(options.otlp_traces_endpoint, os.environ)
    serving = _OpenAIServing(engine, tokenizer, served_model_names, max_model_len, eos_token_ids,
                             options, metrics, state, vocab_size, tracer)
    app = FastAPI(title="flashserve", version="0.1.0")
    app.router.route_class = _JSONRoute
    install_error_handlers(app, metrics)
    for prefix in ("/v1", ""):
        app.add_api_route(f"{prefix}/chat/completions", serving.chat, methods=["POST"], response_model=None)
        app.add_api_route(f"{prefix}/completions", serving.completions, methods=["POST"], response_model=None)
        app.add_api_route(f"{prefix}/models", serving.models, methods=["GET"], response_model=None)
        # `path`: model ids such as meta-llama/Llama-3.1-8B-Instruct hold slashes.
        app.add_api_route(f"{prefix}/models/{{model_id:path}}", serving.model, methods=["GET"], response_model=None)
    _add_translated_routes(app, serving, options)
    tokenize = TokenizeServing(serving)  # at the root, as vLLM serves them
    app.add_api_route("/tokenize", tokenize.tokenize, methods=["POST"], response_model=None)
    app.add_api_route("/detokenize", tokenize.detokenize, methods=["POST"], response_model=None)
    app.add_api_route("/tokenizer_info", tokenize.tokenizer_info, methods=["GET"], response_model=None)
    app.add_api_route("/health", serving.health, methods=["GET"], response_model=None)
    app.add_api_route("/metrics", serving.prometheus, methods=["GET"], response_model=None, include_in_schema=False)
    if options.ui:
        add_ui(app)
    # Added last, so outermost: the guard sees requests before routing, CORS answers preflights
    # (which carry no API key) before the guard.
    app.add_middleware(GuardMiddleware, options=options, state=state, metrics=metrics)
    app.add_middleware(AnthropicErrors)  # outside the guard: its refusals on /v1/messages too
    if options.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(options.allowed_origins), allow_methods=list(options.allowed_methods),
            allow_headers=list(options.allowed_headers), allow_credentials=options.allow_credentials,
            expose_headers=["x-request-id"],  # browsers hide response headers CORS does not list
        )
    # Outside even Starlette's error middleware, which add_middleware cannot reach: the 500 for an
    # unexpected exception carries the request id too.
    build_stack = app.build_middleware_stack
    app.build_middleware_stack = lambda: RequestIdMiddleware(build_stack())  # type: ignore[method-assign]
    app.state.metrics = metrics
    app.state.server_state = state
    app.state.tracer = tracer  # the server shuts it down at exit (`RequestTracer.shutdown`)
    return app
