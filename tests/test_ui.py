"""The chat page at /: its assets' content types and cache headers, --no-ui, the page with --api-key.
The page itself, in a browser: tests/test_ui_browser.py."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest

from fake_engine import MODEL, FakeEngine
from flashserve.api.options import APIOptions
from flashserve.api.server import build_app

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "src" / "flashserve" / "api" / "static"


def client(**options: Any) -> httpx.AsyncClient:
    app = build_app(FakeEngine(), None, [MODEL], 2048, options=APIOptions(**options))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def page_and_assets(c: httpx.AsyncClient) -> tuple[httpx.Response, list[str]]:
    page = await c.get("/")
    return page, re.findall(r'(?:src|href)="(/ui/[^"]+)"', page.text)


async def test_the_page_is_html_revalidated_on_every_load() -> None:
    async with client() as c:
        page = await c.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["cache-control"] == "no-cache"
    assert "connect-src 'self'" in page.headers["content-security-policy"]


async def test_the_page_names_only_its_own_versioned_assets() -> None:
    async with client() as c:
        page, assets = await page_and_assets(c)
    assert sorted(a.split("?")[0] for a in set(assets)) == ["/ui/app.js", "/ui/icon.svg", "/ui/style.css"]
    assert all(re.search(r"\?v=[0-9a-f]{16}$", a) for a in assets)
    assert "http://" not in page.text and "https://" not in page.text  # no CDN: works offline


async def test_versioned_assets_have_their_content_type_and_are_cached_for_a_year() -> None:
    types = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
    async with client() as c:
        _, assets = await page_and_assets(c)
        for url in set(assets):
            r = await c.get(url)
            assert r.status_code == 200
            assert r.headers["content-type"] == types[Path(url.split("?")[0]).suffix]
            assert r.headers["cache-control"] == "public, max-age=31536000, immutable"
            assert r.headers["x-content-type-options"] == "nosniff"
            assert r.content == (STATIC / Path(url.split("?")[0]).name).read_bytes()


async def test_an_asset_without_its_current_version_is_revalidated_not_cached() -> None:
    async with client() as c:
        for url in ("/ui/app.js", "/ui/app.js?v=0000000000000000"):
            assert (await c.get(url)).headers["cache-control"] == "no-cache"


async def test_a_revalidation_with_the_current_etag_is_304_without_a_body() -> None:
    async with client() as c:
        first = await c.get("/")
        again = await c.get("/", headers={"If-None-Match": first.headers["etag"]})
    assert again.status_code == 304
    assert again.content == b""


async def test_an_unknown_asset_is_404_in_openai_shape() -> None:
    async with client() as c:
        r = await c.get("/ui/nope.js")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"


async def test_no_ui_turns_the_page_and_its_assets_off() -> None:
    async with client(ui=False) as c:
        assert (await c.get("/")).status_code == 404
        assert (await c.get("/ui/app.js")).status_code == 404
        assert (await c.get("/v1/models")).status_code == 200


async def test_with_an_api_key_the_page_loads_but_the_api_it_calls_needs_the_key() -> None:
    async with client(api_keys=("sk-ui",)) as c:
        page, assets = await page_and_assets(c)
        assert page.status_code == 200
        assert [(await c.get(url)).status_code for url in assets] == [200] * len(assets)
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer sk-ui"})).status_code == 200


def test_the_pages_files_are_package_data() -> None:
    """A wheel carries static/ only if pyproject names it (setuptools takes .py files alone)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["flashserve.api"]
    shipped = {p.name for pattern in patterns for p in (ROOT / "src" / "flashserve" / "api").glob(pattern)}
    assert shipped == {p.name for p in STATIC.iterdir()}
