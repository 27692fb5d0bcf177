"""The app's routes read JSON bodies with `json_body.loads` (orjson first, the standard parser for
what orjson refuses), not Starlette's `json.loads`."""

from __future__ import annotations

from typing import Any, Callable, Coroutine

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashserve.api.json_body import LoneSurrogate, loads


class JSONRequest(Request):
    """A request whose JSON body is parsed by `json_body.loads` (orjson first); a body neither
    parser reads raises json.JSONDecodeError, which FastAPI answers as before."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = loads(await self.body())
            except LoneSurrogate as exc:  # FastAPI passes an HTTPException on as it is
                raise StarletteHTTPException(400, str(exc)) from None
        return self._json


class JSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(JSONRequest(request.scope, request.receive))

        return route
