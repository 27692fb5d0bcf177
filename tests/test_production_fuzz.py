"""Requests generated from the app's own OpenAPI schema (schemathesis, driven by hypothesis here:
its pytest plugin does not load under this pytest): bodies that fit the schema and bodies that
break it all get an answer below 500, every error in OpenAI's shape."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from fake_engine import MODEL, FakeEngine
from flashserve.api.server import build_app


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_generated_requests_get_no_server_error_and_openai_shaped_errors(
    smollm2_tokenizer: Any, path: str, mode: GenerationMode
) -> None:
    app = build_app(FakeEngine(), smollm2_tokenizer, [MODEL], 2048)
    operation = schemathesis.openapi.from_asgi("/openapi.json", app)[path]["POST"]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def check(case: Any) -> None:
        response = case.call()
        assert response.status_code < 500, response.text
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]

    check()
