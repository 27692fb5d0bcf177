"""Prompt scoring on the real server (embedded SmolLM2), and lm-evaluation-harness run against it
as its users run it: a multiple-choice (loglikelihood) task through `local-completions`, which finds
the server's tokenizer itself (/tokenizer_info, /tokenize, /detokenize), and a `generate_until`
task through `local-chat-completions`, both defined from JSONL files the test writes (no download:
the datasets library reads them offline).

The scores are checked against the same GGUF checkpoint run by transformers in float32."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from live_server import live_server
from test_server_e2e import MODEL, client

pytestmark = pytest.mark.slow

RTOL = 1e-4
PROMPT = "The capital of France is Paris. The capital of Italy is"
MULTIPLE_CHOICE = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a large city"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five", " the number four"], "answer": 0},
]
QUESTIONS = [{"question": "What is the capital of France?", "answer": "Paris"},
             {"question": "Name a colour of the rainbow.", "answer": "red"}]
MAX_GEN_TOKS = 12


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with live_server() as (base, _proc):
        yield base


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    """The embedded GGUF checkpoint in transformers, float32, eager attention."""
    from transformers import AutoModelForCausalLM

    from flashserve.model_loader.loader import embedded_gguf_path

    path = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@torch.inference_mode()
def token_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, from the model's float32 logits."""
    logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def assert_close(actual: list[float], expected: list[float]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert math.isclose(a, e, rel_tol=RTOL, abs_tol=1e-5), (actual, expected)


# ---- max_tokens 0: the prompt alone, scored ------------------------------------------------------


def test_a_completion_of_0_tokens_returns_the_prompt_scored_by_the_model_and_generates_nothing(
        server: str, reference: torch.nn.Module, smollm2_tokenizer: Any) -> None:
    r = httpx.post(f"{server}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    (choice,) = body["choices"]
    ids = smollm2_tokenizer.encode(PROMPT)
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                             "prompt_tokens_details": body["usage"]["prompt_tokens_details"]}
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [smollm2_tokenizer.decode([i]) for i in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert_close(logprobs["token_logprobs"][1:], token_logprobs(reference, ids))


def test_a_streamed_completion_of_0_tokens_sends_the_prompt_with_its_logprobs_then_ends_by_length(
        server: str) -> None:
    whole = client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    chunks = list(client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                                    logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs


# ---- lm-evaluation-harness --------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm_eval_tasks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A TaskManager that knows the two tasks, whose data are JSONL files here; the datasets
    library offline, with its cache here too."""
    root = tmp_path_factory.mktemp("lm_eval")
    (root / "choices.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MULTIPLE_CHOICE))
    (root / "questions.jsonl").write_text("".join(json.dumps(d) + "\n" for d in QUESTIONS))
    (root / "choices.yaml").write_text(json.dumps({
        "task": "flashserve_choices", "dataset_path": "json", "output_type": "multiple_choice",
        "dataset_kwargs": {"data_files": {"test": str(root / "choices.jsonl")}}, "test_split": "test",
        "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
        "target_delimiter": "", "metric_list": [{"metric": "acc"}]}))
    (root / "questions.yaml").write_text(json.dumps({
        "task": "flashserve_questions", "dataset_path": "json", "output_type": "generate_until",
        "dataset_kwargs": {"data_files": {"test": str(root / "questions.jsonl")}}, "test_split": "test",
        "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n\n"], "max_gen_toks": MAX_GEN_TOKS, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "ignore_case": True, "ignore_punctuation": True}]}))
    with pytest.MonkeyPatch.context() as mp:
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(name, "1")
        mp.setenv("HF_DATASETS_CACHE", str(root / "cache"))
        import huggingface_hub.constants

        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import, which came first
        from lm_eval.tasks import TaskManager

        yield TaskManager(include_path=str(root), include_defaults=False)  # not its thousands of tasks


def evaluate(tasks: Any, task: str, model: Any, model_args: dict[str, Any] | None = None,
             **kwargs: Any) -> dict[str, Any]:
    from lm_eval import simple_evaluate

    return simple_evaluate(model=model, model_args=model_args, tasks=[task], task_manager=tasks,
                           log_samples=True, **kwargs)


def test_lm_eval_multiple_choice_through_local_completions_scores_as_the_models_logits(
        server: str, lm_eval_tasks: Any, reference: torch.nn.Module, smollm2_tokenizer: Any) -> None:
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    # No tokenizer given, as users of a vLLM server run it: lm-eval finds the server's own.
    lm = LocalCompletionsAPI(base_url=f"{server}/v1/completions", model=MODEL, batch_size=3, max_retries=1)
    assert lm.tokenizer_backend == "remote"
    results = evaluate(lm_eval_tasks, "flashserve_choices", lm)
    samples = results["samples"]["flashserve_choices"]
    assert len(samples) == len(MULTIPLE_CHOICE)
    scores, expected = [], []
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            context_ids = smollm2_tokenizer.encode(context, add_special_tokens=False)
            ids = smollm2_tokenizer.encode(context + continuation, add_special_tokens=False)
            scores.append(resp[0][0])
            expected.append(sum(token_logprobs(reference, ids)[len(context_ids) - 1:]))
    assert len(scores) == sum(len(d["choices"]) for d in MULTIPLE_CHOICE)
    assert_close(scores, expected)
    assert results["results"]["flashserve_choices"]["acc,none"] in (0.0, 0.5, 1.0)


def test_lm_eval_generate_until_through_local_chat_completions_gives_the_models_greedy_answers(
        server: str, lm_eval_tasks: Any) -> None:
    results = evaluate(lm_eval_tasks, "flashserve_questions", "local-chat-completions", {
        "base_url": f"{server}/v1/chat/completions", "model": MODEL, "max_retries": 1},
        apply_chat_template=True)
    samples = sorted(results["samples"]["flashserve_questions"], key=lambda s: s["doc_id"])
    for doc, sample in zip(QUESTIONS, samples):
        direct = client(server).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": doc["question"]}], max_tokens=MAX_GEN_TOKS,
            temperature=0, stop=["\n\n"])
        assert sample["resps"][0][0] == direct.choices[0].message.content
    assert "exact_match,none" in results["results"]["flashserve_questions"]
