"""The chat page in headless Chromium (Debian's, `make browser`), driven by Playwright, against one
real server with --api-key serving the embedded model.

Screenshots are saved under test-artifacts/ui/ (git-ignored): chat.png (a finished reply) and
error.png (a request without the key).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from live_server import live_server

from playwright.sync_api import Browser, Page, expect, sync_playwright

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CHROMIUM = "/usr/bin/chromium"
# Headless, and nothing that reaches outside this machine.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY = "sk-ui-test"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts" / "ui"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    # An explicit step budget skips its measurement at start-up; a small KV cache is plenty here.
    with live_server(["--api-key", KEY, "--max-num-batched-tokens", "256", "--num-pages", "256"]) as (base, _):
        yield base


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert Path(CHROMIUM).exists(), "Chromium is missing: `make browser` installs Debian's"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser, server: str) -> Iterator[Page]:
    context = browser.new_context(base_url=server, viewport={"width": 1100, "height": 720})
    page = context.new_page()
    page.goto("/")
    yield page
    context.close()


def use_key(page: Page, max_tokens: int) -> None:
    page.get_by_label("API key").fill(KEY)
    page.get_by_label("API key").press("Tab")  # `change` fires: the page lists the models with the key
    page.get_by_label("Max tokens").fill(str(max_tokens))
    page.get_by_label("Temperature").fill("0")
    expect(page.get_by_label("Model")).to_have_value(re.compile(".+"))


def send(page: Page, text: str) -> None:
    page.get_by_label("Message").fill(text)
    page.get_by_label("Message").press("Enter")


def running_requests(server: str) -> float:
    text = httpx.get(f"{server}/metrics", timeout=5).text
    # One sample per engine core (`engine="i"`): the server's running requests are their sum.
    values = [float(v) for v in re.findall(r"^flashserve_num_requests_running(?:\{[^}]*\})? (\S+)$", text, re.M)]
    assert values, "no flashserve_num_requests_running in /metrics"
    return sum(values)


def wait_for_no_running_request(server: str) -> None:
    deadline = time.monotonic() + 10
    while running_requests(server) != 0:
        assert time.monotonic() < deadline, "the server still runs the stopped request"
        time.sleep(0.1)


def test_without_the_key_the_servers_error_is_shown(page: Page) -> None:
    expect(page.locator("#status")).to_contain_text("You didn't provide an API key")
    send(page, "Hello")
    expect(page.get_by_role("alert")).to_contain_text("You didn't provide an API key")
    expect(page.get_by_label("Message")).to_have_value("Hello")  # back in the box, to send again
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "error.png"))


def test_tab_reaches_every_control_in_reading_order(page: Page) -> None:
    expect(page.get_by_label("Message")).to_be_focused()  # ready to type on load
    page.get_by_role("button", name="New chat").focus()
    seen = []
    for _ in range(8):
        page.keyboard.press("Tab")
        seen.append(page.evaluate("document.activeElement.id"))
    # Stop is disabled while nothing streams, so Tab passes over it.
    assert seen == ["model", "system", "temperature", "max-tokens", "api-key", "log", "message", "send"]


def test_shift_enter_adds_a_line_and_does_not_send(page: Page) -> None:
    box = page.get_by_label("Message")
    box.fill("one")
    box.press("Shift+Enter")
    box.press_sequentially("two")
    expect(box).to_have_value("one\ntwo")
    expect(page.locator(".msg")).to_have_count(0)


def test_with_the_key_a_reply_streams_in_and_completes(page: Page) -> None:
    use_key(page, max_tokens=24)
    # Every length the reply's text takes in the page, as it changes.
    page.evaluate("""() => {
        window.lengths = [];
        new MutationObserver(() => {
            const reply = document.querySelector('.msg.assistant .content');
            if (reply) window.lengths.push(reply.textContent.length);
        }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
    }""")
    send(page, "What is the capital of France?")
    reply = page.locator(".msg.assistant")
    expect(reply).to_have_class(re.compile(r"\bdone\b"), timeout=60_000)
    expect(reply.locator(".content")).not_to_be_empty()
    expect(reply.locator(".stats")).to_have_text(re.compile(r"^TTFT \d+ ms · [\d.]+ tok/s · \d+ tokens"))
    lengths = [n for n in page.evaluate("window.lengths") if n > 0]
    assert len(set(lengths)) > 1, lengths  # the text grew piece by piece, not all at once
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat.png"))


def test_escape_stops_a_long_reply_and_the_server_ends_it(page: Page, server: str) -> None:
    use_key(page, max_tokens=1000)
    send(page, "Write a very long story about a dragon who learns to cook.")
    expect(page.locator(".msg.assistant .content")).not_to_be_empty(timeout=60_000)
    assert running_requests(server) == 1
    page.keyboard.press("Escape")
    expect(page.locator(".msg.assistant .stats")).to_contain_text("stopped")
    expect(page.get_by_role("button", name="Stop")).to_be_disabled()
    wait_for_no_running_request(server)


def test_new_chat_during_a_reply_stops_it_and_clears_the_conversation(page: Page, server: str) -> None:
    use_key(page, max_tokens=1000)
    send(page, "Write a very long story about a dragon who learns to cook.")
    expect(page.locator(".msg.assistant .content")).not_to_be_empty(timeout=60_000)
    page.get_by_role("button", name="New chat").click()
    expect(page.locator(".msg")).to_have_count(0)
    expect(page.get_by_label("Message")).to_be_focused()
    wait_for_no_running_request(server)
    expect(page.locator(".msg")).to_have_count(0)  # the stopped reply does not come back
