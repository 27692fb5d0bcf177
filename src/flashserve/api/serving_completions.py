"""The chat and text completion endpoints: a request checked and tokenized (`OpenAIServing`), one
engine stream per choice, and the outputs either streamed as SSE chunks or collected into one
OpenAI-shaped answer.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask

from flashserve.api import protocol as p
from flashserve.api.choices import (
    ChatChoiceStream,
    CompletionChoiceStream,
    ToolMode,
    chat_choices,
    completion_choices,
)
from flashserve.api.errors import invalid
from flashserve.api.serving import OpenAIServing
from flashserve.api.streaming import (
    CLIENT_CLOSED,
    ClientGone,
    SSEResponse,
    chat_opening,
    sse_chunks,
    unless_disconnected,
    usage,
)
from flashserve.metrics import request_logger
from flashserve.structured.specs import spec_from_request


class CompletionsServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def chat(self, body: p.ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        plan = await self.serving.plan_chat(body)
        return await self._generate(raw, body, plan.request_id, plan.model, [plan.prompt], chat=True,
                                    arrival=arrival, grammar=plan.grammar, tools=plan.tools)

    async def completions(self, body: p.CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        s = self.serving
        model = s.check_request(body)
        items = _prompt_items(body.prompt)
        s.check_fan_out(len(items), body.n, "prompt")
        prompts = [await s.off_loop(len(item) if isinstance(item, str) else 0, s.tokenize, item) for item in items]
        grammar = await s.grammars.compile(spec_from_request(None, body.structured_outputs))
        echo = None
        if body.echo:
            echo = [item if isinstance(item, str) else s.decode(item) for item in items]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if s.options.log_requests:
            request_logger.info("request %s: prompt=%r", request_id, body.prompt)
        return await self._generate(raw, body, request_id, model, prompts, chat=False, arrival=arrival,
                                    grammar=grammar, echo=echo)

    # ---- generation ----------------------------------------------------------------------------
    async def _generate(
        self, raw: Request, body: p.GenerationRequest, request_id: str, model: str,
        prompts: list[list[int]], chat: bool, arrival: float, grammar: Any = None, tools: ToolMode | None = None,
        echo: list[str] | None = None,
    ) -> Response:
        s = self.serving
        streams = s.open_streams(body, request_id, prompts, param="messages" if chat else "prompt", arrival=arrival,
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
        token_ids = bool(body.return_token_ids) or s.tokenizer is None
        if body.stream:
            kind = "chat.completion.chunk" if chat else "text_completion"
            choices: list[Any] = [
                ChatChoiceStream(i, s.text_of, tools, token_ids) if chat else
                CompletionChoiceStream(i, s.text_of, prompts[prompt_of[i]], echo[prompt_of[i]] if echo else None,
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
                on_error=lambda err: s.metrics.record_error(err.type, err.code),
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
                choices=[p.ChatChoice(**c) for c in chat_choices(results, tools, s.text_of, token_ids)])
        else:
            choices = completion_choices(results, s.text_of, [prompts[i] for i in prompt_of],
                                         [echo[i] for i in prompt_of] if echo else None, token_ids)
            response = p.CompletionResponse(id=request_id, created=created, model=model, usage=info,
                                            choices=[p.CompletionChoice(**c) for c in choices])
        return JSONResponse(response.model_dump(exclude_none=False))


def _prompt_items(prompt: p.Prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]
