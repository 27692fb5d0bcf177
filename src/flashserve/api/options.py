"""What the HTTP front end is told at start (`APIOptions`) and what it knows while it runs
(`ServerState`: draining for shutdown, requests in flight)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

# Paths that answer without an API key and while draining: probes and scrapers must reach them.
OPEN_PATHS = frozenset({"/health", "/metrics", "/"})
# The chat page's assets (api/ui.py) are open too: the page loads without a key, its API calls need one.
OPEN_PREFIX = "/ui/"


@dataclass(frozen=True)
class APIOptions:
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    allowed_origins: tuple[str, ...] = ()  # empty: no CORS headers at all
    allowed_methods: tuple[str, ...] = ("GET", "POST", "OPTIONS")
    # Any: the OpenAI SDKs send headers of their own (x-stainless-*) that a fixed list would refuse.
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    max_body_bytes: int = 8 << 20
    # prompts x n of one request: each is a sequence in the engine's queue.
    max_sequences_per_request: int = 256
    log_requests: bool = False  # log prompts (text or token ids) as they arrive
    # The model's tool-call format for tool_choice "auto" (api/tools/parsers.py); "auto": detected
    # from the chat template where that is unambiguous; "generic" or None: the generic format of
    # api/tools/render.py, which is also used where no format is known or the template shows no tools.
    tool_call_parser: str | None = "auto"
    ui: bool = True  # the chat page at / (api/ui.py)
    # The Responses API's stored responses (previous_response_id, GET /v1/responses/{id}): at most
    # this many (0: none stored), each dropped this long after its last use.
    responses_store_max_entries: int = 1000
    responses_store_max_age_s: float = 3600.0
    # A SQLite file that every front end of one `flashserve serve` shares for them (set by the
    # supervisor, in its temporary directory); None: this process's memory.
    responses_store_path: str | None = None
    # OTLP endpoint that each front end sends a span per request to (flashserve/tracing.py); None:
    # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT if set, else no tracing.
    otlp_traces_endpoint: str | None = None
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (--allow-runtime-lora-updating).
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if self.max_sequences_per_request < 1:
            raise ValueError(f"max_sequences_per_request must be positive, got {self.max_sequences_per_request}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if self.responses_store_max_entries < 0:
            raise ValueError(f"responses_store_max_entries must be zero or more, got {self.responses_store_max_entries}")
        if not self.responses_store_max_age_s > 0:
            raise ValueError(f"responses_store_max_age_s must be positive, got {self.responses_store_max_age_s}")
        if any(not key for key in self.api_keys):
            raise ValueError("API keys must not be empty")


class ServerState:
    """Event-loop only. `in_flight` counts requests past the guard that have not finished sending
    their response, streams included; shutdown waits for it to reach zero."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is in flight, False if `timeout` seconds pass first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True
