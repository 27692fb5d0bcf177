"""OpenAI request and response schemas (a request becomes SamplingParams in `api/sampling.py`).

Requests are validated strictly (no "5" for 5, no 1 for true) and unknown fields are ignored, the
way OpenAI treats them. Fields we know but do not implement (functions, best_of, suffix) are
declared loosely so that `unsupported_field` can answer them with a clear 400 instead of silently
ignoring something that changes the output.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from flashserve.api.request_checks import check_stop, prompt_validator
from flashserve.message.sampling_params import MAX_LOGPROBS

# Upper bound on choices per request; each choice is a full engine request.
MAX_N = 128

# max_tokens of a completion that gives none (OpenAI's and vLLM's default).
DEFAULT_COMPLETION_TOKENS = 16

TokenId = Annotated[int, Field(ge=0)]


def _one_of(expected: str) -> WrapValidator:
    """Replace a union's one-error-per-member list with a single readable message."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", "Input should be {expected}", {"expected": expected}) from None

    return WrapValidator(validate)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class GenerationRequest(_Request):
    """Fields shared by chat and text completions. None means "the default"."""

    model: str | None = None  # None: the first served name
    max_tokens: int | None = None  # None: the rest of the context
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: Annotated[str | list[str] | None, _one_of("a string or a list of strings"), AfterValidator(check_stop)] = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI has it) -> bias
    # Requests with different salts never share prefix-cached KV, so a tenant cannot time another's
    # prompts. An empty salt is refused, as vLLM refuses it: it would read as "salted" yet salt nothing.
    cache_salt: str | None = Field(None, min_length=1)
    # vLLM's extension: exactly one of {"json": schema, "regex": str, "choice": [str], "grammar": EBNF}.
    structured_outputs: dict[str, Any] | None = None
    # vLLM's extension: the prompt's and the output's token ids in the answer (always, on a server
    # without a tokenizer, whose text is empty).
    return_token_ids: bool | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def default_max_tokens(self) -> int | None:
        """max_tokens when the request gives none; None: the rest of the context."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


class TextPart(_Request):
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str  # a JSON object, serialized


class ToolCallMessage(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[
        str | list[TextPart] | None, _one_of('a string or a list of {"type": "text", "text": ...} parts')
    ] = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> "ChatMessage":
        # OpenAI refuses such a turn; a template would render it as an empty one.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the current name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # None: true; false: at most one call
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Prompt = Annotated[Union[str, list[TokenId], list[str], list[list[TokenId]]], prompt_validator()]


class CompletionRequest(GenerationRequest):
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @property
    def default_max_tokens(self) -> int | None:
        # OpenAI's and vLLM's default for completions; an explicit null asks for the rest of the
        # context, as in vLLM.
        return None if "max_tokens" in self.model_fields_set else DEFAULT_COMPLETION_TOKENS


def unsupported_field(req: GenerationRequest) -> str | None:
    """The first field set to something this server does not implement, or None."""
    checks: list[tuple[str, Any]] = [
        ("stream_options", req.stream_options is not None and not req.stream),
    ]
    if isinstance(req, ChatCompletionRequest):
        checks += [
            ("functions", bool(req.functions)),
            ("function_call", req.function_call not in (None, "none", "auto")),
        ]
    elif isinstance(req, CompletionRequest):
        checks += [
            ("best_of", req.best_of not in (None, req.n)),
            ("suffix", bool(req.suffix)),
        ]
    return next((name for name, bad in checks if bad), None)


# ---- responses ---------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Optional in OpenAI's schema; this server always fills it.
    prompt_tokens_details: PromptTokensDetails | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None  # left out of the JSON when None

    @model_serializer(mode="wrap")
    def _without_empty_tool_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


FinishReason = Literal["stop", "length", "tool_calls"]


class _TokenIds(BaseModel):
    """Leaves the token-id fields of `return_token_ids` out of the JSON when not asked for."""

    @model_serializer(mode="wrap")
    def _without_unasked_ids(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in ("prompt_token_ids", "token_ids"):
            if data.get(key, 0) is None:
                del data[key]
        return data


class ChatChoice(_TokenIds):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None  # {"content": [{token, logprob, bytes, top_logprobs}]}
    finish_reason: FinishReason
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(_TokenIds):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids, as vLLM places it for chat


class CompletionChoice(_TokenIds):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None  # {tokens, token_logprobs, top_logprobs, text_offset}
    finish_reason: FinishReason
    prompt_token_ids: list[int] | None = None  # return_token_ids
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flashserve"
    max_model_len: int
    root: str | None = None  # a LoRA adapter's path (vLLM's field)
    parent: str | None = None  # a LoRA adapter's base model; None for a base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
