"""The Responses API's stores (in memory, and the SQLite file the front ends of one server share) and
the Responses/Messages input translations, without a server."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

import pytest

from flashserve.api import messages_protocol as mp
from flashserve.api import responses_protocol as rp
from flashserve.api.errors import APIError
from flashserve.api.response_store import MissingResponse, ResponseStore, SharedResponseStore, StoredResponse
from flashserve.cli import build_parser
from flashserve.serve_args import to_configs


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stored(response_id: str, previous: str | None = None, said: str = "hi") -> StoredResponse:
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"re {said}"}]}]
    return StoredResponse({"id": response_id, "output": output}, [{"role": "user", "content": said}], previous)


@pytest.fixture(params=["memory", "shared"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., Any]:
    """A factory of one kind of store; every shared store it makes opens the same file."""
    if request.param == "memory":
        return ResponseStore
    return functools.partial(SharedResponseStore, str(tmp_path / "responses.sqlite3"))


def test_a_full_store_drops_the_least_recently_used(make_store: Callable[..., Any]) -> None:
    store = make_store(max_entries=2, max_age_s=60)
    store.put(stored("a"))
    store.put(stored("b"))
    store.get("a")  # now b is the least recently used
    store.put(stored("c"))
    assert store.get("a") and store.get("c")
    with pytest.raises(MissingResponse):
        store.get("b")


def test_a_response_expires_its_max_age_after_its_last_use(make_store: Callable[..., Any]) -> None:
    clock = Clock()
    store = make_store(max_entries=10, max_age_s=60, clock=clock)
    store.put(stored("a"))
    clock.now = 50
    store.get("a")
    clock.now = 100  # 50 s after the last use: kept
    store.get("a")
    clock.now = 161
    with pytest.raises(MissingResponse):
        store.get("a")


def test_a_conversation_is_every_turn_in_order(make_store: Callable[..., Any]) -> None:
    store = make_store(max_entries=10, max_age_s=60)
    store.put(stored("a", said="one"))
    store.put(stored("b", previous="a", said="two"))
    texts = [i["content"] if i["role"] == "user" else i["content"][0]["text"] for i in store.conversation("b")]
    assert texts == ["one", "re one", "two", "re two"]


def test_a_conversation_with_a_lost_turn_names_that_turn(make_store: Callable[..., Any]) -> None:
    store = make_store(max_entries=10, max_age_s=60)
    store.put(stored("a"))
    store.put(stored("b", previous="a"))
    store.delete("a")
    with pytest.raises(MissingResponse) as err:
        store.conversation("b")
    assert err.value.response_id == "a"


def test_a_store_of_size_zero_keeps_nothing(make_store: Callable[..., Any]) -> None:
    store = make_store(max_entries=0, max_age_s=60)
    store.put(stored("a"))
    assert len(store) == 0 and not store.enabled


def test_front_ends_sharing_a_store_file_see_each_others_responses(tmp_path: Path) -> None:
    path = str(tmp_path / "responses.sqlite3")
    first, second = SharedResponseStore(path, 10, 60), SharedResponseStore(path, 10, 60)
    first.put(stored("a"))
    second.put(stored("b", previous="a", said="more"))
    assert [item["content"] for item in first.conversation("b")][::2] == ["hi", "more"]
    second.delete("a")
    with pytest.raises(MissingResponse):
        first.get("a")


def _open_store_when_released(path: str, barrier: Any, results: Any) -> None:
    barrier.wait()
    try:
        SharedResponseStore(path, 10, 60)
        results.put("opened")
    except Exception as exc:  # noqa: BLE001  (the test reports it)
        results.put(repr(exc))


def test_front_ends_starting_at_the_same_moment_all_open_the_store_the_supervisor_created(tmp_path: Path) -> None:
    """Three processes that open one new file at once lost one of them to "database is locked" in
    about one start in three; `create` first, as `flashserve serve` does, and none fails."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    for start in range(12):
        path = str(tmp_path / f"responses-{start}.sqlite3")
        SharedResponseStore.create(path)
        barrier, results = context.Barrier(3), context.Queue()
        opening = [context.Process(target=_open_store_when_released, args=(path, barrier, results)) for _ in range(3)]
        for process in opening:
            process.start()
        outcomes = [results.get(timeout=60) for _ in opening]
        for process in opening:
            process.join(10)
        assert outcomes == ["opened"] * 3, f"start {start}: {outcomes}"


def test_store_limits_are_flags_with_environment_twins() -> None:
    env = {"FLASHSERVE_RESPONSES_STORE_MAX_ENTRIES": "5", "FLASHSERVE_RESPONSES_STORE_MAX_AGE": "30"}
    api = to_configs(build_parser(env).parse_args(["serve"])).api
    assert (api.responses_store_max_entries, api.responses_store_max_age_s) == (5, 30.0)
    api = to_configs(build_parser({}).parse_args(["serve", "--responses-store-max-entries", "0"])).api
    assert api.responses_store_max_entries == 0


def test_function_calls_join_the_assistant_message_and_outputs_become_tool_messages() -> None:
    items = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
    ]
    messages = rp.chat_messages(items, "Be brief.")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["call_1", "call_2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "rain"}


def test_an_unknown_input_item_type_is_a_400_naming_it() -> None:
    with pytest.raises(APIError) as err:
        rp.chat_messages([{"type": "computer_call", "call_id": "x"}], None)
    assert err.value.status_code == 400 and err.value.param == "input" and "computer_call" in err.value.message


def test_tool_results_come_before_the_users_text_and_tool_uses_become_calls() -> None:
    req = mp.MessagesRequest(model="m", max_tokens=8, system="Be brief.", messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "rain"},
                                     {"type": "text", "text": "And tomorrow?"}]},
    ])
    messages = mp.chat_messages(req)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert messages[2]["content"] == "Let me look."
    assert messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert messages[3] == {"role": "tool", "tool_call_id": "t1", "content": "rain"}


def test_an_image_block_is_a_400_naming_the_message() -> None:
    req = mp.MessagesRequest(model="m", max_tokens=8, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}])
    with pytest.raises(APIError) as err:
        mp.chat_messages(req)
    assert err.value.param == "messages" and "messages[0].content[0]" in err.value.message
