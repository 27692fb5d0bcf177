"""`flashserve serve --speculative-config`: a streamed chat completion over HTTP speculates in the
engine core process, and /metrics counts its drafts under vLLM's names."""

from __future__ import annotations

import inspect
import json
import re

import httpx
import pytest
from live_server import live_server

pytestmark = pytest.mark.slow

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
QUOTE = "Repeat this text exactly, word for word:\n\n" + inspect.getdoc(inspect)[:600]


def counter(metrics: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+]+)$", metrics, re.M)
    assert match is not None, name
    return float(match.group(1))


def test_a_streamed_chat_completion_speculates_and_metrics_count_its_drafts():
    with live_server(["--speculative-config", SPEC, "--num-pages", "160", "--max-num-seqs", "4"]) as (base, _):
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": QUOTE}], "max_tokens": 24,
                "temperature": 0, "stream": True}
        text = []
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=300) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        text.append(choice["delta"].get("content") or "")
        assert "".join(text)
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
        assert counter(metrics, "vllm:spec_decode_num_drafts_total") > 0
        assert counter(metrics, "vllm:spec_decode_num_accepted_tokens_total") > 0
        assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{' in metrics
