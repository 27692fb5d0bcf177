"""`flashserve run-batch`: batch lines parsed, ordered by shared prefixes, sent through the server's
app in a process of its own beside the engine's; result lines for every input line, shaped like the
OpenAI Batch API's, with the server's own bodies. The end-to-end run uses the embedded SmolLM2
model once per module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flashserve.cli import RUN_BATCH_OPTIONS, SERVER_ONLY_FLAGS, build_parser
from flashserve.serve_args import to_batch_args
from flashserve.entrypoints.run_batch.lines import BatchRequest, LineError, parse_line, plan_requests
from flashserve.entrypoints.run_batch.main import main


def batch_args(*argv: str) -> Any:
    return to_batch_args(build_parser({}).parse_args(["run-batch", *argv]))


def line(custom_id: str, url: str, body: Any, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


# --- lines ------------------------------------------------------------------------------------


def test_a_valid_line_becomes_a_request() -> None:
    parsed = parse_line(line("a", "/v1/completions", {"prompt": "hi"}), 1)
    assert parsed == BatchRequest(1, "a", "/v1/completions", {"prompt": "hi"})


@pytest.mark.parametrize(("text", "code"), [
    ("{not json", "invalid_json"),
    ("[1, 2]", "invalid_request"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), "missing_custom_id"),
    (line("a", "/v1/completions", {}, method="GET"), "invalid_method"),
    (line("a", "/v1/embeddings", {}), "invalid_url"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions"}), "missing_body"),
    (line("a", "/v1/completions", {"prompt": "hi", "stream": True}), "invalid_request"),
])
def test_a_malformed_line_becomes_an_error_with_its_code(text: str, code: str) -> None:
    parsed = parse_line(text, 3)
    assert isinstance(parsed, LineError) and parsed.code == code and parsed.line_no == 3


def test_a_non_finite_value_in_a_line_is_sent_on_as_written() -> None:
    """NaN is no strict JSON, but the server, not the line parser, refuses it, naming the field."""
    text = '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "top_p": NaN}}'
    parsed = parse_line(text, 1)
    assert isinstance(parsed, BatchRequest)
    assert b'"top_p": NaN' in parsed.payload


def test_a_strict_line_is_sent_on_with_the_same_json_value() -> None:
    body = {"prompt": list(range(100)), "max_tokens": 7, "temperature": 0.5, "stop": ["\u00e9", "\n"]}
    parsed = parse_line(line("a", "/v1/completions", body), 1)
    assert isinstance(parsed, BatchRequest)
    assert json.loads(parsed.payload) == body


def test_requests_sharing_a_prompt_prefix_are_submitted_together(smollm2_tokenizer: Any) -> None:
    system = {"role": "system", "content": "You are a terse assistant for a library. " * 6}
    chat = [BatchRequest(n, f"c{n}", "/v1/chat/completions",
                         {"messages": [system, {"role": "user", "content": f"Question {n}?"}]}) for n in range(3)]
    other = [BatchRequest(10 + n, f"p{n}", "/v1/completions", {"prompt": f"Unrelated text number {n}"})
             for n in range(2)]
    requests = [chat[0], other[0], chat[1], other[1], chat[2]]
    ids = [r.custom_id for r in plan_requests(requests, smollm2_tokenizer, 16, 2048).requests]
    start = ids.index("c0")
    assert sorted(ids[start:start + 3]) == ["c0", "c1", "c2"]


def test_requests_of_different_lora_adapters_never_share_a_prefix_group(smollm2_tokenizer: Any) -> None:
    system = {"role": "system", "content": "You are a terse assistant for a library. " * 6}
    models = ["base", "sql-lora", "base", "sql-lora", "other-lora"]
    requests = [BatchRequest(n, f"c{n}", "/v1/chat/completions", {"model": model, "messages": [
        system, {"role": "user", "content": f"Question {n}?"}]}) for n, model in enumerate(models)]  # fmt: skip
    batch = plan_requests(requests, smollm2_tokenizer, 16, 2048, {"sql-lora": 1, "other-lora": 2})
    groups = [sorted(models[i] for i in group.members) for group in batch.plan.groups if len(group.members) > 1]
    assert sorted(groups) == [["base", "base"], ["sql-lora", "sql-lora"]]
    assert batch.lora_keys == [None, "1", None, "1", "2"]  # the keys its pages are hashed with


def test_run_batch_options_leave_out_the_listener_and_add_the_batch_ones() -> None:
    flags = {o.flag for o in RUN_BATCH_OPTIONS}
    assert not flags & SERVER_ONLY_FLAGS
    assert {"--model", "--max-concurrency", "--prefix-grouping"} <= flags


def test_run_batch_help_lists_its_options() -> None:
    out = subprocess.run([sys.executable, "-m", "flashserve", "run-batch", "--help"], capture_output=True,
                         text=True, env={"COLUMNS": "200", "PATH": ""}, check=True).stdout
    for flag in ("--input-file", "--output-file", "--model", "--max-concurrency", "--prefix-grouping"):
        assert flag in out


def test_an_unreadable_input_file_exits_non_zero(tmp_path: Path) -> None:
    args = batch_args("-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out.jsonl"))
    assert main(args) != 0


# --- a run on the embedded model ------------------------------------------------------------


INPUT = [
    line("chat-1", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 4, "temperature": 0}),
    line("chat-2", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 4, "temperature": 0}),
    line("text-1", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
    line("ids-1", "/v1/completions", {"prompt": [504, 3575, 282], "max_tokens": 3, "temperature": 0}),
    "{this is not json",
    "",
    line("too-hot", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 5}),
    line("bad-url", "/v1/embeddings", {"input": "x"}),
    line("choice-1", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "Red or blue?"}], "max_tokens": 8, "temperature": 0,
          "structured_outputs": {"choice": ["red", "blue"]}}),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[Any, dict[str, Any]], Any]:
    """(exit code, result lines by custom_id, the engine stack) of one run over INPUT."""
    from flashserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from flashserve.entrypoints.llm import build_engine

    stack = build_engine(ModelConfig(), CacheConfig(num_pages=128), SchedulerConfig(max_num_seqs=8,
                                                                                    max_num_batched_tokens=256))
    tmp = tmp_path_factory.mktemp("batch")
    (tmp / "in.jsonl").write_text("\n".join(INPUT) + "\n")
    code = main(batch_args("-i", str(tmp / "in.jsonl"), "-o", str(tmp / "out.jsonl"), "--no-progress",
                           "--max-concurrency", "3"), stack=stack)
    results = [json.loads(text) for text in (tmp / "out.jsonl").read_text().splitlines()]
    return code, {r["custom_id"]: r for r in results}, stack


@pytest.mark.slow
def test_the_run_exits_0_although_some_lines_failed(run: Any) -> None:
    assert run[0] == 0


@pytest.mark.slow
def test_every_non_blank_line_gets_one_result_line(run: Any) -> None:
    assert set(run[1]) == {"chat-1", "chat-2", "text-1", "ids-1", None, "too-hot", "bad-url", "choice-1"}


@pytest.mark.slow
@pytest.mark.parametrize(("custom_id", "kind"), [("chat-1", "chat.completion"), ("chat-2", "chat.completion"),
                                                 ("text-1", "text_completion"), ("ids-1", "text_completion")])
def test_a_valid_line_gets_the_servers_completion_body(run: Any, custom_id: str, kind: str) -> None:
    result = run[1][custom_id]
    assert result["id"].startswith("batch_req_") and result["error"] is None
    response = result["response"]
    assert response["status_code"] == 200 and response["request_id"]
    body = response["body"]
    assert body["object"] == kind and body["choices"][0]["finish_reason"] in ("length", "stop")
    assert body["usage"]["completion_tokens"] >= 1 and "prompt_tokens_details" in body["usage"]


@pytest.mark.slow
def test_an_invalid_body_gets_the_servers_400_as_the_response(run: Any) -> None:
    result = run[1]["too-hot"]
    assert result["error"] is None and result["response"]["status_code"] == 400
    assert result["response"]["body"]["error"]["param"] == "temperature"


@pytest.mark.slow
def test_the_400_body_equals_what_the_server_answers_over_http(run: Any) -> None:
    import asyncio

    import httpx

    from flashserve.entrypoints.stack import build_server

    server = build_server(batch_args("-i", "x", "-o", "y").serve, run[2])
    body = json.loads(INPUT[6])["body"]

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/chat/completions", json=body)

    answer = asyncio.run(ask())
    assert (answer.status_code, answer.json()) == (400, run[1]["too-hot"]["response"]["body"])


@pytest.mark.slow
@pytest.mark.parametrize(("custom_id", "code"), [(None, "invalid_json"), ("bad-url", "invalid_url")])
def test_a_malformed_line_gets_an_error_line_without_a_response(run: Any, custom_id: Any, code: str) -> None:
    result = run[1][custom_id]
    assert result["response"] is None and result["error"]["code"] == code and result["error"]["message"]


@pytest.mark.slow
def test_a_line_with_a_grammar_gets_output_that_follows_it(run: Any) -> None:
    body = run[1]["choice-1"]["response"]["body"]
    assert body["choices"][0]["message"]["content"] in ("red", "blue")


class InstantEngine:
    """Stands in for the engine process's `EngineCore` at the far end of the app client's pipes:
    each request gets its whole output at once; `events` records when the app starts a line and
    when each line's request reaches the engine."""

    def __init__(self) -> None:
        import multiprocessing

        from flashserve.message.codec import PROTOCOL_VERSION, EngineSetup
        from flashserve.entrypoints.run_batch.app import BatchEngineClient
        from flashserve.entrypoints.run_batch.pipes import Duplex

        self.events: list[tuple[str, int]] = []
        from_engine, self.outbox = multiprocessing.Pipe(duplex=False)
        self._to_engine = multiprocessing.Pipe(duplex=False)  # unused: `_put` is replaced
        setup = EngineSetup(PROTOCOL_VERSION, None, "m", 2048, (), 49152)
        self.remote = BatchEngineClient(Duplex(from_engine, self._to_engine[1]), setup, {})
        self.remote._put = self._put  # type: ignore[method-assign]

    def _put(self, message: Any) -> None:
        """The app client's messages, as they are handed to its pipe to the engine."""
        from flashserve.message.codec import AddRequest, StepOutputs, send
        from flashserve.message.outputs import RequestOutput

        if isinstance(message, AddRequest):
            self.events.append(("admit", self.remote.line.get().line_no))
            add = message.add
            send(self.outbox, StepOutputs([RequestOutput(add.request_id, [28], "a", True, "length",
                                                         len(add.prompt_token_ids), 1)]))

    def app(self, app: Any) -> Any:
        async def recording(scope: Any, receive: Any, send: Any) -> None:
            self.events.append(("start", self.remote.line.get().line_no))
            await app(scope, receive, send)

        return recording


def test_a_line_starts_only_once_the_line_before_it_reached_the_engine(smollm2_tokenizer: Any) -> None:
    import asyncio
    import io

    from flashserve.api.server import build_app
    from flashserve.entrypoints.run_batch.app import run_lines

    fake = InstantEngine()
    app = build_app(fake.remote, smollm2_tokenizer, ["m"], 2048, vocab_size=49152)
    requests = [parse_line(line(f"r{i}", "/v1/completions", {"prompt": [504, 3575, 282], "max_tokens": 1}), i)
                for i in range(1, 9)]
    asyncio.run(run_lines(fake.app(app), fake.remote, [], requests, io.StringIO(), 64, False))
    assert fake.events == [(kind, i) for i in range(1, 9) for kind in ("start", "admit")]


def test_the_app_process_imports_the_tokenizer_classes_without_torch_and_torch_still_imports_after() -> None:
    script = ("import sys\n"
              "from flashserve.entrypoints.run_batch.app import import_tokenizer_classes\n"
              "import_tokenizer_classes()\n"
              "from transformers import PreTrainedTokenizerFast\n"
              "print('torch' in sys.modules)\n"
              "import torch\n"
              "print(torch.ones(2).sum().item())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "2.0"]
    assert "PyTorch was not found" not in done.stderr


def test_the_pipe_to_the_engine_takes_64_long_requests_before_the_engine_reads() -> None:
    import multiprocessing
    import threading

    from flashserve.message.codec import AddRequest, send
    from flashserve.message.requests import Add
    from flashserve.message.sampling_params import SamplingParams
    from flashserve.entrypoints.run_batch.pipes import pipe

    reader, writer = pipe(multiprocessing.get_context("spawn"))
    add = Add("r", list(range(100_000, 102_200)), SamplingParams(max_tokens=100))
    sender = threading.Thread(target=lambda: [send(writer, AddRequest(add, None, (0, n))) for n in range(64)],
                              daemon=True)
    sender.start()
    sender.join(5)
    sent_without_a_read = not sender.is_alive()
    while reader.poll():  # let a blocked sender finish
        reader.recv_bytes()
    assert sent_without_a_read


def app_process_that_exits(reader: Any, writer: Any, done: Any) -> None:
    """Stands in for `batch_app.main` in a spawned app process: it dies before answering anything."""
    raise SystemExit(3)


@pytest.mark.slow
def test_an_app_process_that_dies_ends_the_run_with_exit_code_1(
        run: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import flashserve.entrypoints.run_batch.main

    monkeypatch.setattr(flashserve.entrypoints.run_batch.main.batch_app, "main", app_process_that_exits)
    (tmp_path / "in.jsonl").write_text("\n".join(INPUT[:4]) + "\n")
    code = main(batch_args("-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--no-progress"),
                stack=run[2])
    assert code == 1


@pytest.mark.slow
def test_an_engine_that_dies_fails_the_open_lines_and_the_run_exits_1(
        run: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stack = run[2]

    def broken_step() -> list:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(stack.engine, "step", broken_step)
    (tmp_path / "in.jsonl").write_text("\n".join(INPUT[:4]) + "\n")
    code = main(batch_args("-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--no-progress"),
                stack=stack)
    results = [json.loads(text) for text in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert code == 1 and len(results) == 4
    assert all(r["response"]["status_code"] >= 500 for r in results)


def test_under_cache_pressure_a_grouped_run_computes_far_fewer_prompt_tokens_than_file_order(
        tmp_path: Path, tiny_llama_config: Path) -> None:
    """BatchLLM through run-batch: 40 prefixes of 8 pages, 8 lines each, shuffled, in a cache of 160
    pages (the prefixes alone need 320); groups run together with their prefix pinned."""
    import random

    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 512) for _ in range(8 * 16)] for _ in range(40)]
    prompts = [p + [rng.randrange(1, 512) for _ in range(16)] for p in prefixes for _ in range(8)]
    rng.shuffle(prompts)
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    (tmp_path / "in.jsonl").write_text("\n".join(line(f"r{i}", "/v1/completions", {**body, "prompt": p})
                                                 for i, p in enumerate(prompts)) + "\n")
    computed = {}
    for grouping in ("--prefix-grouping", "--no-prefix-grouping"):
        out = tmp_path / f"out{grouping}.jsonl"
        code = main(batch_args("-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--model", str(tiny_llama_config),
                               "--served-model-name", "tiny", "--load-format", "dummy", "--num-pages", "160",
                               "--max-num-seqs", "16", "--cascade-attention", "off", "--no-progress", grouping))
        usage = [json.loads(text)["response"]["body"]["usage"] for text in out.read_text().splitlines()]
        assert code == 0 and len(usage) == len(prompts)
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
        computed[grouping] = 1 - cached / sum(u["prompt_tokens"] for u in usage)
    assert computed["--prefix-grouping"] < 0.3 < 0.6 < computed["--no-prefix-grouping"]
