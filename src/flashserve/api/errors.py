"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `APIError` (or let `InvalidParameter` / `EngineDead` escape); the exception handlers
registered by `install_error_handlers` turn every failure, FastAPI's own included, into that body.
"""

from __future__ import annotations

from typing import Any, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashserve.message.errors import EngineDead
from flashserve.message.sampling_params import InvalidParameter
from flashserve.metrics import Metrics

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable"
AUTHENTICATION = "invalid_request_error"  # what OpenAI answers for a missing or wrong key

# Seconds a client should wait before retrying a request refused because the server is busy.
RETRY_AFTER_SECONDS = 1

# Endpoints of OpenAI's API and vLLM's pooling models that a text-generation server does not serve
# (first path segment after an optional /v1 or /v2 -> what they do): their 404 says so, where a bare
# "Not Found" left clients wondering whether the path was mistyped.
UNSERVED_ENDPOINTS = {
    "embeddings": "embeddings", "audio": "audio (speech, transcriptions, translations)",
    "images": "images", "moderations": "moderations", "pooling": "pooling", "classify": "classification",
    "score": "scores", "rerank": "reranking",
}


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def unsupported(field: str, why: str = "") -> APIError:
    """A 400 for a field this server knows but does not implement, naming it."""
    return invalid(f"{field} is not supported by this server{why}", field, code="unsupported_parameter")


def engine_dead(message: str = "the engine is not running") -> APIError:
    return APIError(503, message, UNAVAILABLE, code="engine_dead")


def overloaded(message: str, code: str = "overloaded") -> APIError:
    """503 that a client should retry: a full queue, a queue timeout, a server going down."""
    return APIError(503, message, UNAVAILABLE, code=code, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def _validation_message(exc: RequestValidationError, body_model: Any = None) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, and the offending field for `param`.
    `body_model`: the route's request model, whose required fields an empty body lacks."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return "We could not parse the JSON body of your request: it is not valid JSON.", None
    if [(e.get("type"), tuple(e.get("loc", ()))) for e in errors] == [("missing", ("body",))]:
        return _empty_body(body_model)
    parts: list[str] = []
    first_param: str | None = None
    for e in errors:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        if not loc and e.get("type") in ("model_attributes_type", "dict_type"):
            return "The request body must be a JSON object, sent as Content-Type: application/json.", None
        where = ".".join(loc)
        first_param = first_param or where or None
        parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return "; ".join(parts) or "invalid request", first_param


def _empty_body(body_model: Any) -> tuple[str, str | None]:
    """The message for a request sent without a body, naming the fields it needs."""
    fields = getattr(body_model, "model_fields", {})
    required = [name for name, field in fields.items() if field.is_required()]
    if not required:
        return "The request body is empty: it must be a JSON object (Content-Type: application/json).", None
    names = f" {required[0]}" if len(required) == 1 else f"s {', '.join(required[:-1])} and {required[-1]}"
    return (f"The request body is empty: it must be a JSON object with the required field{names} "
            "(Content-Type: application/json)."), required[0]


def _not_found(path: str, detail: str) -> APIError:
    """The 404 for a path no route serves: for an endpoint of UNSERVED_ENDPOINTS, one saying so."""
    parts = path.strip("/").split("/")
    if parts[0] in ("v1", "v2"):
        parts = parts[1:]
    what = UNSERVED_ENDPOINTS.get(parts[0]) if parts else None
    if what is None:
        return APIError(404, detail, NOT_FOUND)
    return APIError(404, f"This server does not serve {what} ({path}): it runs a text-generation model, served "
                         "at /v1/chat/completions, /v1/completions, /v1/responses and /v1/messages.",
                    NOT_FOUND, code="unsupported_endpoint")


def _body_model(request: Request) -> Any:
    """The request model of the route that refused the request, or None."""
    body_field = getattr(request.scope.get("route"), "body_field", None)
    return getattr(getattr(body_field, "field_info", None), "annotation", None)


def install_error_handlers(app: FastAPI, metrics: Metrics | None = None) -> None:
    def respond(err: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
        if metrics is not None:
            metrics.record_error(err.type, err.code)
        return JSONResponse(err.body(), status_code=err.status_code, headers={**(headers or {}), **(err.headers or {})})

    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    async def on_invalid_parameter(_: Request, exc: InvalidParameter) -> JSONResponse:
        return respond(invalid(str(exc), exc.param))

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers 400 where FastAPI would answer 422.
        message, param = _validation_message(exc, _body_model(request))
        return respond(invalid(message, param))

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return respond(_not_found(request.url.path, str(exc.detail)), exc.headers)
        return respond(APIError(exc.status_code, str(exc.detail), INVALID_REQUEST), exc.headers)

    async def on_engine_dead(_: Request, exc: EngineDead) -> JSONResponse:
        return respond(engine_dead(str(exc) or "the engine is not running"))

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises the exception after this response, so the server logs it once.
        return respond(APIError(500, "internal server error", SERVER_ERROR))

    app.add_exception_handler(APIError, on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(InvalidParameter, on_invalid_parameter)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]
    app.add_exception_handler(EngineDead, on_engine_dead)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_unexpected)
