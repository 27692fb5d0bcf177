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

from flashserve.client.protocol import EngineDead
from flashserve.engine.sampling_params import InvalidParameter
from flashserve.metrics import Metrics

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable"
AUTHENTICATION = "invalid_request_error"  # what OpenAI answers for a missing or wrong key

# Seconds a client should wait before retrying a request refused because the server is busy.
RETRY_AFTER_SECONDS = 1


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


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, and the offending field for `param`."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return "We could not parse the JSON body of your request: it is not valid JSON.", None
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


def install_error_handlers(app: FastAPI, metrics: Metrics | None = None) -> None:
    def respond(err: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
        if metrics is not None:
            metrics.record_error(err.type, err.code)
        return JSONResponse(err.body(), status_code=err.status_code, headers={**(headers or {}), **(err.headers or {})})

    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    async def on_invalid_parameter(_: Request, exc: InvalidParameter) -> JSONResponse:
        return respond(invalid(str(exc), exc.param))

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers 400 where FastAPI would answer 422.
        message, param = _validation_message(exc)
        return respond(invalid(message, param))

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
        return respond(APIError(exc.status_code, str(exc.detail), kind), exc.headers)

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
