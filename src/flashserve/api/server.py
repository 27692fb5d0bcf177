"""The OpenAI-compatible app: its routes, middleware and error handlers over one `OpenAIServing`.

Handlers never touch scheduling: they build SamplingParams, open one engine request per choice
(`EngineStreams`) and either collect the outputs or stream them as SSE chunks
(`api/serving_completions.py`); Responses and Messages translate onto the chat path.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Sequence

import fastapi.routing
from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.middleware.cors import CORSMiddleware

from flashserve.api.errors import install_error_handlers
from flashserve.api.json_route import JSONRoute
from flashserve.api.middleware import GuardMiddleware, RequestIdMiddleware
from flashserve.api.options import APIOptions, ServerState
from flashserve.api.response_store import ResponseStore, SharedResponseStore
from flashserve.api.serving import OpenAIServing
from flashserve.api.serving_completions import CompletionsServing
from flashserve.api.serving_lora import LoRAServing
from flashserve.api.serving_messages import AnthropicErrors, MessagesServing
from flashserve.api.serving_responses import ResponsesServing
from flashserve.api.serving_tokenize import TokenizeServing
from flashserve.api.ui import add_ui
from flashserve.client.protocol import EngineClient
from flashserve.metrics import Metrics
from flashserve.tracing import build_tracer


def _add_translated_routes(app: FastAPI, serving: OpenAIServing, options: APIOptions) -> None:
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
    serving = OpenAIServing(engine, tokenizer, served_model_names, max_model_len, eos_token_ids,
                           options, metrics, state, vocab_size, tracer)
    completions = CompletionsServing(serving)
    app = FastAPI(title="flashserve", version="0.1.0")
    app.router.route_class = JSONRoute
    install_error_handlers(app, metrics)
    for prefix in ("/v1", ""):
        app.add_api_route(f"{prefix}/chat/completions", completions.chat, methods=["POST"], response_model=None)
        app.add_api_route(f"{prefix}/completions", completions.completions, methods=["POST"], response_model=None)
        app.add_api_route(f"{prefix}/models", serving.models, methods=["GET"], response_model=None)
        # `path`: model ids such as meta-llama/Llama-3.1-8B-Instruct hold slashes.
        app.add_api_route(f"{prefix}/models/{{model_id:path}}", serving.model, methods=["GET"], response_model=None)
    _add_translated_routes(app, serving, options)
    tokenize = TokenizeServing(serving)  # at the root, as vLLM serves them
    app.add_api_route("/tokenize", tokenize.tokenize, methods=["POST"], response_model=None)
    app.add_api_route("/detokenize", tokenize.detokenize, methods=["POST"], response_model=None)
    app.add_api_route("/tokenizer_info", tokenize.tokenizer_info, methods=["GET"], response_model=None)
    if options.allow_runtime_lora_updating:  # vLLM serves them at /v1 only
        lora = LoRAServing(engine, serving.names)
        app.add_api_route("/v1/load_lora_adapter", lora.load, methods=["POST"], response_model=None)
        app.add_api_route("/v1/unload_lora_adapter", lora.unload, methods=["POST"], response_model=None)
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
    prepare_first_requests(app, tokenizer)
    return app


def prepare_first_requests(app: FastAPI, tokenizer: Any) -> None:
    """Does now what the first requests would otherwise wait for (the first streamed completion
    took 21 ms against 8 for the next ones over an instant engine, `benchmark.api_host`): importing
    anyio's asyncio backend, which anyio does on its first use (sse-starlette's task group);
    building the middleware stack, which Starlette does on the first request; reading each
    endpoint's source file and line, which FastAPI does on the endpoint's first request (for its
    error messages) and then keeps; and compiling the chat template, which transformers does on
    its first render (5 ms for SmolLM2's) and then keeps."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                          tokenize=False)
        except Exception:  # noqa: BLE001 - a template that refuses this renders (or refuses) requests the same way
            pass
    importlib.import_module("anyio._backends._asyncio")
    if app.middleware_stack is None:
        app.middleware_stack = app.build_middleware_stack()
    endpoint_context = getattr(fastapi.routing, "_extract_endpoint_context", None)
    if endpoint_context is None:
        return  # a FastAPI that does not read it
    for route in app.routes:
        if isinstance(route, APIRoute) and route.dependant.call is not None:
            endpoint_context(route.dependant.call)
