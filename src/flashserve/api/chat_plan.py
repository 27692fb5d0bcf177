"""What the endpoints translated onto chat (Responses, Messages) need of the chat endpoint: one
request's `ChatPlan`, and the `ChatEndpoint` that plans it and opens its engine streams.

It sits below `server.py` (which implements `ChatEndpoint`), `chat_bridge.py` and the translated
endpoints, so that they import it and never each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from flashserve.api import protocol as p
from flashserve.api.choices import ToolMode
from flashserve.api.logprobs import TokenTexts
from flashserve.api.streaming import EngineStreams
from flashserve.metrics import Metrics


@dataclass(frozen=True)
class ChatPlan:
    """What one chat request hands the engine: its prompt ids, grammar and tool mode."""

    request_id: str
    model: str
    prompt: list[int]
    grammar: Any
    tools: ToolMode | None


class ChatEndpoint(Protocol):
    """The chat endpoint as the translated endpoints use it (`serving.OpenAIServing`)."""

    metrics: Metrics
    tokenizer: Any
    text_of: TokenTexts

    async def plan_chat(self, body: p.ChatCompletionRequest) -> ChatPlan:
        """The request's prompt ids, grammar and tool mode; raises APIError for a bad request."""
        ...

    def open_streams(
        self, body: p.GenerationRequest, request_id: str, prompts: list[list[int]], param: str, arrival: float,
        x_request_id: str | None = None, grammar: Any = None, headers: Mapping[str, str] | None = None,
    ) -> EngineStreams:
        """One engine request per choice: n per prompt, numbered across prompts."""
        ...
