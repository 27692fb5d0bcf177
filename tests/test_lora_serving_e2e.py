"""LoRA adapters served end to end on the embedded SmolLM2-135M: adapters written by PEFT from
random weights (B non-zero) for the model's shapes, one `flashserve serve --enable-lora` for the
module (engine core in its own process), the openai client and LangChain against it, runtime
loading and unloading, the prefix cache keyed by adapter, vLLM's LoRA gauge; and the offline side,
`LLM.generate(lora_request=...)` and run-batch lines that name an adapter, over one in-process
engine."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from live_server import live_server
from lora_helpers import ALL_MODULES, peft_wrap, save_adapter

pytestmark = pytest.mark.slow

BASE = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"


def write_adapter(root: Path, name: str, r: int, seed: int) -> str:
    """A PEFT adapter of rank `r` on every projection of a model of SmolLM2-135M's widths (four of
    its layers: an adapter may cover some layers only), A and B random."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    model = peft_wrap(LlamaForCausalLM(config), name, r=r, alpha=2 * r, modules=ALL_MODULES, seed=seed, std=0.1)
    return save_adapter(model, name, str(root))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {"sql": write_adapter(root, "sql", 8, 1), "fr": write_adapter(root, "fr", 8, 2),
            "too-big": write_adapter(root, "too-big", 32, 3)}


@pytest.fixture(scope="module")
def server(adapters: dict[str, str]) -> Iterator[str]:
    args = ["--enable-lora", "--lora-modules", f"sql={adapters['sql']}", "--max-loras", "2", "--max-lora-rank", "16",
            "--allow-runtime-lora-updating"]
    with live_server(args) as (base, _proc):
        yield base


def completion(server: str, model: str, **fields: Any) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **fields}
    return httpx.post(f"{server}/v1/completions", json=body, timeout=120)


def prompt_logprobs(server: str, model: str) -> list[float]:
    r = completion(server, model, max_tokens=1, echo=True, logprobs=0)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["token_logprobs"][1:-1]  # the prompt's, past its first


def test_an_adapters_prompt_logprobs_differ_from_the_base_models(server: str) -> None:
    base, sql = prompt_logprobs(server, BASE), prompt_logprobs(server, "sql")
    assert len(base) == len(sql)
    assert max(abs(a - b) for a, b in zip(base, sql)) > 0.1
    assert prompt_logprobs(server, "sql") == pytest.approx(sql, abs=1e-4)  # and the adapter's are its own


def test_an_adapter_never_reuses_the_base_models_cached_prompt(server: str) -> None:
    prompt = "A prompt no other test sends, long enough to fill two pages of the cache: " * 3

    def cached(model: str) -> int:
        r = completion(server, model, prompt=prompt, max_tokens=1)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(BASE)
    assert cached("sql") == 0
    assert cached("sql") > 0  # its own pages, though


def test_the_openai_client_completes_with_an_adapter_as_its_model(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    resp = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0)
    assert resp.model == "sql"
    assert resp.usage.completion_tokens > 0


def test_langchain_chat_openai_answers_with_an_adapter_as_its_model(server: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="sql", base_url=f"{server}/v1", api_key="unused", temperature=0, max_tokens=4)
    message = llm.invoke("Hi")
    assert message.response_metadata["model_name"] == "sql"
    assert message.usage_metadata["output_tokens"] > 0


def test_models_lists_the_adapter_with_its_folder_and_the_base_model(server: str, adapters: dict[str, str]) -> None:
    cards = {card["id"]: card for card in httpx.get(f"{server}/v1/models").json()["data"]}
    assert (cards["sql"]["root"], cards["sql"]["parent"]) == (adapters["sql"], BASE)


def test_an_adapter_loaded_while_serving_serves_until_unloaded(server: str, adapters: dict[str, str]) -> None:
    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "fr", "lora_path": adapters["fr"]})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'fr' added successfully.")
    assert completion(server, "fr").status_code == 200
    r = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "fr"})
    assert r.status_code == 200, r.text
    gone = completion(server, "fr")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_an_adapter_over_max_lora_rank_is_a_400_and_the_server_keeps_serving(server: str,
                                                                            adapters: dict[str, str]) -> None:
    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "too-big", "lora_path": adapters["too-big"]})
    assert r.status_code == 400
    assert "too-big" in r.json()["error"]["message"] and "--max-lora-rank" in r.json()["error"]["message"]
    assert completion(server, "sql").status_code == 200


def test_a_missing_adapter_folder_is_a_400_naming_it(server: str, tmp_path: Path) -> None:
    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(tmp_path / "no")})
    assert r.status_code == 400
    assert "gone" in r.json()["error"]["message"]


def streaming(server: str, model: str) -> tuple[threading.Event, list[dict[str, Any]], threading.Thread]:
    """A streamed completion of 16 tokens read in a thread: (first chunk came, chunks, thread)."""
    started, chunks = threading.Event(), []

    def read() -> None:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    started.set()

    thread = threading.Thread(target=read)
    thread.start()
    return started, chunks, thread


def test_unloading_an_adapter_with_a_running_stream_is_a_409_and_the_stream_finishes(server: str) -> None:
    started, chunks, thread = streaming(server, "sql")
    assert started.wait(120)
    r = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "sql"})
    thread.join(120)
    assert r.status_code == 409 and "running or waiting" in r.json()["error"]["message"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert completion(server, "sql").status_code == 200  # still loaded


def test_vllms_lora_gauge_names_the_running_adapter_and_max_lora(server: str) -> None:
    started, _, thread = streaming(server, "sql")
    assert started.wait(120)
    text = httpx.get(f"{server}/metrics").text
    thread.join(120)
    samples = [(float(value), labels) for labels, value in
               re.findall(r"^vllm:lora_requests_info\{([^}]*)\} (\S+)$", text, re.MULTILINE)]
    _, latest = max(samples)  # the endpoint picker reads the series of the latest time
    assert 'running_lora_adapters="sql"' in latest and 'max_lora="2"' in latest


# ---- offline: LLM and run-batch over one in-process engine ------------------------------------------
@pytest.fixture(scope="module")
def llm() -> Iterator[Any]:
    from flashserve.entrypoints.llm import LLM

    with LLM(enable_lora=True, max_loras=2, num_pages=64) as engine:
        yield engine


def test_llm_generate_with_a_lora_request_runs_the_adapter(llm: Any, adapters: dict[str, str]) -> None:
    from flashserve.message.lora import LoRARequest
    from flashserve.message.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    base, sql = llm.generate([PROMPT, PROMPT], params, lora_request=[None, LoRARequest("sql", 1, adapters["sql"])])
    assert base.error is None and sql.error is None
    assert base.token_ids != sql.token_ids
    again = llm.generate([PROMPT], params, lora_request=LoRARequest("sql", 1, adapters["sql"]))[0]
    assert again.token_ids == sql.token_ids


def test_run_batch_lines_name_adapters_as_their_model(llm: Any, adapters: dict[str, str], tmp_path: Path) -> None:
    from flashserve.cli import build_parser
    from flashserve.serve_args import to_batch_args
    from flashserve.entrypoints.run_batch.main import main
    from flashserve.message.lora import LoRARequest
    from flashserve.message.sampling_params import SamplingParams

    llm.generate([PROMPT], SamplingParams(max_tokens=1), lora_request=LoRARequest("sql", 1, adapters["sql"]))
    lines = [{"custom_id": model, "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}}
             for model in ("sql", "nope")]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--no-progress"]
    assert main(to_batch_args(build_parser({}).parse_args(argv)), stack=llm.stack) == 0
    results = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert results["sql"]["response"]["status_code"] == 200
    assert results["sql"]["response"]["body"]["model"] == "sql"
    assert results["nope"]["response"]["status_code"] == 404
