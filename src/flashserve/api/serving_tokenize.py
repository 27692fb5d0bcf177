"""vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`: the server's own tokenizer over HTTP,
for clients that count or build token ids without the model's files (evaluation harnesses, prompt
budgeting).

`/tokenize` takes a `prompt` (text, special tokens added by default) or chat `messages` (rendered
by the chat template exactly as `/v1/chat/completions` renders them, tools included) and answers
`{"count", "max_model_len", "tokens", "token_strs"}`; `/detokenize` takes `tokens` and answers
`{"prompt"}`; `/tokenizer_info` gives the special tokens and the chat template (vLLM serves it behind
`--enable-tokenizer-info-endpoint`; here it is always on, so that lm-evaluation-harness's default,
remote tokenizer finds it). All sit behind the same API key as every other endpoint.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import Field, model_validator

from flashserve.api import protocol as p
from flashserve.api.chat_input import as_ids, chat_conversation, tool_mode
from flashserve.api.errors import APIError, invalid


class TokenizeRequest(p._Request):
    """One of `prompt` (vLLM's TokenizeCompletionRequest) or `messages` (its TokenizeChatRequest)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[p.ChatMessage] | None = Field(None, min_length=1)
    # None: True for a prompt (a BOS where the model has one), False for messages, whose template
    # writes its own special tokens (vLLM's defaults).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[p.Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give one of prompt (a text) or messages (a chat), not both")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        return self


class DetokenizeRequest(p._Request):
    model: str | None = None
    tokens: list[int]


class TokenizeServing:
    def __init__(self, serving: Any) -> None:
        self.serving = serving  # the app's `OpenAIServing`: tokenizer, names, chat template

    def _tokenizer(self, model: str | None, param: str | None) -> Any:
        if model is not None and not self.serving.is_model(model):
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        if self.serving.tokenizer is None:
            raise invalid("this server runs without a tokenizer: it takes and gives token ids only", param)
        return self.serving.tokenizer

    async def tokenize(self, body: TokenizeRequest) -> JSONResponse:
        tokenizer = self._tokenizer(body.model, "prompt" if body.prompt is not None else "messages")
        if body.prompt is not None:
            add_special = body.add_special_tokens is not False
            ids = await self.serving.off_loop(len(body.prompt), tokenizer.encode, body.prompt,
                                               add_special_tokens=add_special)
        else:
            ids = await self._chat_ids(tokenizer, body)
        tokens = as_ids(ids)
        return JSONResponse({
            "count": len(tokens), "max_model_len": self.serving.max_model_len, "tokens": tokens,
            "token_strs": tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None,
        })

    async def _chat_ids(self, tokenizer: Any, body: TokenizeRequest) -> list[int]:
        """The messages rendered as the chat endpoint renders them (its tool handling included)."""
        chat = p.ChatCompletionRequest.model_construct(messages=body.messages, tools=body.tools,
                                                       tool_choice=body.tool_choice)
        support = self.serving.template_support
        tools = tool_mode(chat, self.serving.options.tool_call_parser, tokenizer, support)
        conversation, kwargs = chat_conversation(chat, tools, support)
        size = sum(len(str(m.get("content") or "")) for m in conversation)
        try:
            text = await self.serving.off_loop(
                size, tokenizer.apply_chat_template, conversation, tokenize=False,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message, **kwargs)
        except Exception as exc:  # templates raise on shapes they refuse (roles out of order, ...)
            raise invalid(f"the chat template rejected these messages: {exc}", "messages") from exc
        return await self.serving.off_loop(len(text), tokenizer.encode, text,
                                            add_special_tokens=bool(body.add_special_tokens))

    async def tokenizer_info(self) -> JSONResponse:
        """vLLM's /tokenizer_info, from the tokenizer's attributes rather than its init arguments
        (which hold local file paths): what a client needs to rebuild prompts as this server does."""
        tokenizer = self._tokenizer(None, None)
        info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            token = getattr(tokenizer, name, None)
            if token is not None:
                info[name] = str(token)
        for name in ("add_bos_token", "add_eos_token"):
            flag = getattr(tokenizer, name, None)
            if isinstance(flag, bool):
                info[name] = flag
        if getattr(tokenizer, "chat_template", None):
            info["chat_template"] = tokenizer.chat_template
        return JSONResponse(info)

    async def detokenize(self, body: DetokenizeRequest) -> JSONResponse:
        tokenizer = self._tokenizer(body.model, "tokens")
        size = len(tokenizer)
        for i, token in enumerate(body.tokens):
            if not 0 <= token < size:
                raise invalid(f"token id {token} at index {i} of tokens is out of range: this tokenizer has "
                              f"{size} tokens (ids 0 to {size - 1})", "tokens")
        text = await self.serving.off_loop(len(body.tokens), tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})
