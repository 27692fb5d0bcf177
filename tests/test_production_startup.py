"""`flashserve serve` while the model loads: the port answers at once, `/health` with 503 and the
reason, every other endpoint with 503 in OpenAI's error shape, until the engine is ready; then 200.
Kubernetes' probes and routers see "starting" instead of a connection nobody serves.

One server whose engine core waits for a file before it loads (slow_start_server), watched while it
waits; then a second that is told to stop meanwhile, and a third whose model does not load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from live_server import free_port, live_server
from production_helpers import assert_openai_error
from slow_start_server import GATE_ENV
from test_production_one_request import dummy_args, model_config  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def wait_for_503(url: str, timeout: float = 120.0) -> httpx.Response:
    """The first answer of /health once the port is served; fails if it is not a 503."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=2)
        except httpx.HTTPError:  # not listening yet (the supervisor binds the port first thing)
            time.sleep(0.05)
            continue
        return r
    raise AssertionError("the port never answered")


@pytest.fixture(scope="module")
def during_start_up(model_config: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:  # noqa: F811
    """What the server answered while its engine core waited, then the server, ready."""
    gate = tmp_path_factory.mktemp("gate") / "load"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    seen: dict = {}

    def watch_then_let_it_load() -> None:
        try:
            seen["health"] = wait_for_503(url)
            seen["completions"] = httpx.post(f"{url}/v1/completions", timeout=5,
                                             json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
            seen["models"] = httpx.get(f"{url}/v1/models", timeout=5)
            seen["health_again"] = httpx.get(f"{url}/health", timeout=5)
        finally:
            gate.touch()

    watcher = threading.Thread(target=watch_then_let_it_load, daemon=True)
    watcher.start()
    with live_server(dummy_args(model_config), env={GATE_ENV: str(gate)},
                     module="slow_start_server", port=port) as (base, _):
        watcher.join(60)
        seen["url"] = base
        yield seen


def test_health_answers_503_with_the_reason_while_the_model_loads(during_start_up: dict) -> None:
    for r in (during_start_up["health"], during_start_up["health_again"]):
        assert r.status_code == 503
        assert r.json() == {"status": "starting", "reason": "loading model"}


def test_api_requests_while_the_model_loads_get_503_in_openai_error_shape(during_start_up: dict) -> None:
    for r in (during_start_up["completions"], during_start_up["models"]):
        assert_openai_error(r, 503, "starting")
        assert int(r.headers["retry-after"]) > 0


def test_once_the_engine_is_ready_health_answers_200_and_requests_are_served(during_start_up: dict) -> None:
    url = during_start_up["url"]
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def start(args: list[str], module: str, env: dict[str, str]) -> tuple[str, subprocess.Popen]:
    port = free_port()
    full_env = dict(os.environ, FLASHSERVE_PORT=str(port), FLASHSERVE_LOG_LEVEL="warning",
                    PYTHONPATH=os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p), **env)
    proc = subprocess.Popen([sys.executable, "-m", module, "serve", *args], env=full_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return f"http://127.0.0.1:{port}", proc


def test_sigterm_while_the_model_loads_stops_the_server_with_exit_code_0(model_config: str) -> None:  # noqa: F811
    with tempfile.TemporaryDirectory() as never_opened:
        url, proc = start(dummy_args(model_config), "slow_start_server", {GATE_ENV: str(Path(never_opened, "load"))})
        try:
            assert wait_for_503(url).status_code == 503
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
        finally:
            proc.kill()
            proc.wait()


def test_a_model_that_does_not_load_ends_the_server_with_exit_code_1(tmp_path: Path) -> None:
    url, proc = start(["--model", str(tmp_path / "no-such-model")], "flashserve", {})
    try:
        assert proc.wait(120) == 1
    finally:
        proc.kill()
        proc.wait()


def test_a_built_app_has_loaded_what_its_first_request_would_wait_for() -> None:
    """In a fresh interpreter: anyio's asyncio backend imported, the middleware stack built, and every
    endpoint's source context read, so that the first streamed request costs what later ones do."""
    code = (
        "import sys, fastapi.routing as r\n"
        "from fake_engine import FakeEngine\n"
        "from flashserve.api.server import build_app\n"
        "from fastapi.routing import APIRoute\n"
        "assert 'anyio._backends._asyncio' not in sys.modules\n"
        "app = build_app(FakeEngine(), None, ['m'], 2048)\n"
        "cache = getattr(r, '_endpoint_context_cache', {})\n"
        "routes = [x for x in app.routes if isinstance(x, APIRoute)]\n"
        "print('anyio._backends._asyncio' in sys.modules, app.middleware_stack is not None,\n"
        "      not hasattr(r, '_endpoint_context_cache') or all(id(x.dependant.call) in cache for x in routes))\n"
    )
    tests = str(Path(__file__).resolve().parent)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "True"]


def test_a_built_app_has_compiled_its_chat_template(smollm2_tokenizer, monkeypatch) -> None:
    """transformers compiles a chat template on its first render: the app renders one conversation at
    build, so that the first chat request does not wait for it."""
    from fake_engine import FakeEngine

    from flashserve.api.server import build_app

    rendered: list[object] = []
    render = smollm2_tokenizer.apply_chat_template

    def recording(conversation, *args, **kwargs):  # noqa: ANN001, ANN202
        rendered.append(conversation)
        return render(conversation, *args, **kwargs)

    monkeypatch.setattr(smollm2_tokenizer, "apply_chat_template", recording)
    build_app(FakeEngine(), smollm2_tokenizer, ["m"], 2048)
    assert [{"role": "user", "content": "hi"}] in rendered
