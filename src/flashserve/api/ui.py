"""The chat page at `/`: static files shipped in the package (api/static/), no build step, no CDN.

The page is a client of the public API only (`/v1/models`, `/v1/chat/completions` with streaming),
so it is served open, like /health: with --api-key the page loads and its API requests need the key.

Caching: the page itself is `no-cache` (revalidated by ETag on every load), so a new version of
the server is picked up at once; it names its assets with a `?v=<content hash>` that changes with
their content, so the assets themselves can be cached for a year.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import Response

from flashserve.api.errors import NOT_FOUND, APIError
from flashserve.api.options import OPEN_PREFIX as UI_PREFIX  # the guard lets these through without a key

PAGE = "index.html"
ASSET_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
PAGE_CACHE = "no-cache"
ASSET_CACHE = "public, max-age=31536000, immutable"
# The page talks to its own origin only and loads nothing from elsewhere.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


@dataclass(frozen=True)
class _File:
    body: bytes
    media_type: str
    version: str  # a hash of the body: the asset's `?v=` and the ETag

    @property
    def etag(self) -> str:
        return f'"{self.version}"'


def _version(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()[:16]


def _load() -> tuple[_File, dict[str, _File]]:
    """The page, with each asset reference `name` rewritten to `/ui/name?v=hash`, and the assets."""
    folder = resources.files("flashserve.api") / "static"
    assets: dict[str, _File] = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if suffix in ASSET_TYPES:
            body = entry.read_bytes()
            assets[entry.name] = _File(body, ASSET_TYPES[suffix], _version(body))
    html = (folder / PAGE).read_text(encoding="utf-8")
    for name, asset in assets.items():
        html = html.replace(f'"{name}"', f'"{UI_PREFIX}{name}?v={asset.version}"')
    body = html.encode()
    return _File(body, "text/html; charset=utf-8", _version(body)), assets


def _answer(request: Request, file: _File, cache: str, extra: dict[str, str] | None = None) -> Response:
    headers = {"Cache-Control": cache, "ETag": file.etag, "X-Content-Type-Options": "nosniff", **(extra or {})}
    if file.etag in request.headers.get("if-none-match", ""):
        return Response(status_code=304, headers=headers)
    return Response(file.body, media_type=file.media_type, headers=headers)


def add_ui(app: FastAPI) -> None:
    """GET / (the page) and GET /ui/{name} (its scripts, styles and icon)."""
    page, assets = _load()

    async def index(request: Request) -> Response:
        return _answer(request, page, PAGE_CACHE, {"Content-Security-Policy": CSP})

    async def asset(name: str, request: Request) -> Response:
        file = assets.get(name)
        if file is None:
            raise APIError(404, f"No such file: {UI_PREFIX}{name}", NOT_FOUND)
        # Only the current version's URL is immutable: an old or missing `v` must not pin stale content.
        cache = ASSET_CACHE if request.query_params.get("v") == file.version else PAGE_CACHE
        return _answer(request, file, cache)

    app.add_api_route("/", index, methods=["GET"], response_model=None, include_in_schema=False)
    app.add_api_route(UI_PREFIX + "{name}", asset, methods=["GET"], response_model=None, include_in_schema=False)
