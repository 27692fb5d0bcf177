"""The benchmark suite on a CPU: floor formulas, the offline runner, the peers, targets, the smoke run."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmark.floor import (DeviceRates, ModelShape, decode_step_floor_s, first_token_floor_s, measure_rates,
                             offline_floor_s, prefill_floor_s)
from benchmark.metrics import build_summary
from benchmark.plan import Plan, with_overrides
from benchmark.report import evaluate_targets, format_targets
from benchmark.workloads import Phase, uniform_requests

REPO = Path(__file__).resolve().parent.parent
# One layer, q/k/v/o 2x2-ish, 1-byte weights: small enough to check every formula by hand.
TOY = ModelShape(num_layers=1, hidden_size=2, num_heads=1, num_kv_heads=1, head_dim=2, intermediate_size=1,
                 vocab_size=4, dtype_bytes=1)
TOY_RATES = DeviceRates("toy", copy_bytes_per_s=4.0, matmul_flop_per_s=4.0)
TINY_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512,
               "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
               "tie_word_embeddings": True, "rope_theta": 10000.0}


@pytest.fixture
def tiny_model(tmp_path: Path) -> str:
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY_CONFIG))
    return str(path)


def test_the_8b_shape_reads_15_gb_per_step_and_its_floor_is_3_5_ms_at_4_3_tb_per_s():
    from flashserve.model_loader.loader import DUMMY_SHAPES

    shape = ModelShape.from_config(DUMMY_SHAPES["llama-3.1-8b"])
    assert shape.weight_bytes == pytest.approx(15.01e9, rel=1e-3)
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    rates = DeviceRates("h200", 4.3e12, 790e12)
    assert decode_step_floor_s(shape, rates, [0]) == pytest.approx(3.49e-3, rel=1e-3)


def test_toy_shape_counts_its_weights_by_hand():
    # projections 2*(2+2*2) + 2*2 + 3*2*1 = 22, head 4*2 = 8, norms (2*1+1)*2 = 6
    assert (TOY.matmul_params, TOY.head_params, TOY.weight_bytes, TOY.kv_bytes_per_token) == (22, 8, 36, 4)


def test_decode_step_floor_reads_the_weights_once_and_every_requests_kv():
    assert decode_step_floor_s(TOY, TOY_RATES, []) == 36 / 4
    assert decode_step_floor_s(TOY, TOY_RATES, [3, 2]) == (36 + 5 * 4) / 4


def test_prefill_floor_counts_projections_one_head_row_and_causal_attention():
    # 2*22*L + 2*8 + 2*L*(L+1)*q_size: L=2 -> 88 + 16 + 24 = 128, L=1 -> 44 + 16 + 8 = 68
    assert prefill_floor_s(TOY, TOY_RATES, [2]) == 128 / 4
    assert prefill_floor_s(TOY, TOY_RATES, [2, 1]) == (128 + 68) / 4
    assert first_token_floor_s(TOY, TOY_RATES, [1]) == 68 / 4  # above the weight read, 36 / 4


def test_offline_floor_is_prefill_plus_per_step_max_of_bytes_and_flops():
    floor = offline_floor_s(TOY, TOY_RATES, [(2, 3), (1, 2)])
    assert floor["prefill_s"] == (128 + 68) / 4
    # step 1: both at contexts 3 and 2: bytes (36 + 20) / 4 = 14, FLOPs (2*2*30 + 4*5*2) / 4 = 40
    # step 2: the first only, context 4: bytes (36 + 16) / 4 = 13, FLOPs (2*30 + 4*4*2) / 4 = 23
    assert (floor["decode_bytes_s"], floor["decode_flops_s"], floor["decode_s"]) == (27, 63, 63)
    assert floor["total_s"] == 49 + 63


def test_rates_are_measured_on_a_cpu_too():
    rates = measure_rates("cpu")
    assert rates.device == "cpu" and rates.copy_bytes_per_s > 0 and rates.matmul_flop_per_s > 0


def test_offline_runner_completes_every_request_with_the_tokens_it_asked_for(tiny_model: str):
    from benchmark.offline import prompt_spec_for, run_phase
    from flashserve.entrypoints.llm import LLM

    llm = LLM(tiny_model, load_format="dummy", device="cpu", num_pages=256)
    reqs = uniform_requests(5, (10, 40), (3, 12), prompt_spec_for(512), seed=1)
    m = run_phase(llm, Phase("mixed", reqs))
    assert (m["completed"], m["failed"], m["output_len_mismatch"]) == (5, 0, 0)
    assert m["total_output_tokens"] == sum(r.output_len for r in reqs)
    assert m["total_input_tokens"] == sum(r.prompt_len for r in reqs)
    assert m["output_token_throughput"] == pytest.approx(m["total_output_tokens"] / m["duration_s"])


def _docs(folder: Path) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["workload"], d["label"]): d for d in (json.loads(p.read_text()) for p in folder.glob("*.json"))}


def test_offline_main_writes_throughputs_and_the_fraction_of_the_floor(tiny_model: str, tmp_path: Path):
    from benchmark import offline

    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps(TOY_RATES.to_json() | {"copy_bytes_per_s": 1e11, "matmul_flop_per_s": 1e12}))
    out = tmp_path / "out"
    assert offline.main(["--model", tiny_model, "--device", "cpu", "--num-requests", "3", "--phases",
                         "fixed512x128", "--warmup", "2", "--rates", str(rates), "--out-dir", str(out)]) == 0
    doc = _docs(out)[("offline@tiny", "flashserve")]
    (phase,) = doc["phases"]
    assert phase["metrics"]["total_output_tokens"] == 3 * 128 and phase["metrics"]["failed"] == 0
    assert phase["floor_fraction"] == pytest.approx(phase["floor"]["total_s"] / phase["metrics"]["duration_s"])
    assert {"fixed512x128_req_per_s", "fixed512x128_output_tok_per_s", "fixed512x128_total_tok_per_s",
            "fixed512x128_duration_s"} == set(doc["headline"])  # no whole-workload figure from one phase


def test_offline_shapes_run_one_phase_each_beside_tensorrt_llms_published_figure(tiny_model: str, tmp_path: Path):
    from benchmark import offline

    out = tmp_path / "out"
    assert offline.main(["--model", tiny_model, "--device", "cpu", "--num-requests", "2", "--shapes", "128x128,24x3",
                         "--warmup", "0", "--out-dir", str(out)]) == 0
    doc = _docs(out)[("offline@tiny", "flashserve")]
    phases = {p["name"]: p for p in doc["phases"]}
    assert [p["metrics"]["total_output_tokens"] for p in phases.values()] == [2 * 128, 2 * 3]
    assert phases["fixed128x128"]["trtllm_h100_fp8_8b_output_tok_per_s"] == 28_312
    assert "trtllm_h100_fp8_8b_output_tok_per_s" not in phases["fixed24x3"]


def test_an_offline_shape_is_in_x_out_with_positive_integers():
    from benchmark.offline import parse_shapes

    assert parse_shapes("128x128, 2048x128") == [(128, 128), (2048, 128)]
    for bad in ("128", "0x8", "8x", "ax8"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_shapes(bad)


def test_hf_generate_peer_reports_latency_and_static_batch_throughput(tiny_model: str, tmp_path: Path):
    from benchmark import peers

    assert peers.main(["--system", "hf-generate", "--model", tiny_model, "--device", "cpu", "--num-requests", "2",
                       "--batch-size", "2", "--latency-repeats", "1", "--out-dir", str(tmp_path)]) == 0
    docs = _docs(tmp_path)
    latency = docs[("latency@tiny", "hf-generate")]["headline"]
    assert latency["bs1_e2e_mean_ms"] > latency["bs1_ttft_median_ms"] > 0 and latency["bs8_tpot_median_ms"] > 0
    offline = docs[("offline@tiny", "hf-generate")]
    assert offline["phases"][0]["metrics"]["completed"] == 2 and offline["settings"]["subset"] is True
    assert offline["headline"]["fixed512x128_output_tok_per_s"] > 0
    assert not any(k.endswith("_duration_s") for k in offline["headline"])


def test_hf_continuous_batching_peer_completes_every_request(tiny_model: str, tmp_path: Path):
    from benchmark import peers

    assert peers.main(["--system", "hf-continuous-batching", "--model", tiny_model, "--device", "cpu",
                       "--num-requests", "3", "--no-cb-warmup", "--out-dir", str(tmp_path)]) == 0
    doc = _docs(tmp_path)[("offline@tiny", "hf-continuous-batching")]
    m = doc["phases"][0]["metrics"]
    assert (m["completed"], m["total_output_tokens"]) == (3, 3 * 128)
    assert doc["headline"]["fixed512x128_output_tok_per_s"] > 0


def _result(workload: str, label: str, headline: dict[str, float]) -> dict[str, Any]:
    return {"workload": workload, "label": label, "gpu": "H", "timestamp": "2025-01-01T00:00:00+00:00",
            "headline": headline}


def _summary(tmp_path: Path, docs: list[dict[str, Any]]) -> dict[str, Any]:
    paths = []
    for i, doc in enumerate(docs):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(doc))
    return build_summary(paths)


def test_targets_are_judged_met_or_not_from_the_summary(tmp_path: Path):
    summary = _summary(tmp_path, [
        _result("latency@big", "flashserve", {"bs1_tpot_median_ms": 3.8}),
        _result("latency@big", "floor", {"bs1_tpot_median_ms": 3.5}),
        _result("offline@small", "flashserve", {"fixed512x128_output_tok_per_s": 20000, "workload_duration_s": 10}),
        _result("offline@small", "hf-continuous-batching", {"fixed512x128_output_tok_per_s": 1500}),
        _result("offline@small", "floor", {"workload_duration_s": 5}),
        _result("goodput@big", "flashserve", {"goodput_req_per_s": 9, "itl_median_ms": 6.0}),
        _result("goodput@big", "floor", {"itl_median_ms": 3.5}),
        _result("concurrency@small", "flashserve", {"c5_tpot_median_ms": 10, "c100_tpot_median_ms": 25,
                                                    "c50_output_tok_per_s": 1000, "c100_output_tok_per_s": 1200}),
    ])
    rows = evaluate_targets(summary, "H", large="big", small="small", offline="small")
    got = [(r["target"], r["met"], None if r["figure"] is None else round(r["figure"], 3)) for r in rows]
    assert got == [("1", True, 1.086), ("2", True, 13.333), ("2", False, 0.5), ("3", True, 9.0),
                   ("3", False, 1.714), ("4", False, 2.5), ("4", True, 1.2), ("5", None, None)]


def test_a_target_without_its_figures_is_reported_missing(tmp_path: Path):
    summary = _summary(tmp_path, [_result("latency@big", "flashserve", {"bs1_tpot_median_ms": 3.8})])
    rows = evaluate_targets(summary, "H", large="big", small="small", offline="small")
    assert rows[0]["met"] is None and rows[0]["figure"] is None  # no floor in the same run
    assert "missing" in format_targets(rows, "H").splitlines()[2]


def test_plan_overrides_parse_lists_numbers_and_caps():
    plan = with_overrides(Plan(), ["concurrency=5,100", "goodput_start=2", "caps.goodput=120", "phases=floor,offline"])
    assert plan.concurrency == (5, 100) and plan.goodput_start == 2.0 and plan.caps["goodput"] == 120
    assert plan.phases == ("floor", "offline") and Plan().caps["goodput"] == 90
    with pytest.raises(ValueError):
        with_overrides(Plan(), ["no_such=1"])


def test_the_default_plan_states_what_it_cuts():
    cuts = " | ".join(Plan().cuts())
    assert "random: 128 requests per rate (workload: 256)" in cuts
    assert "peers: the first 128 of the 256 offline requests" in cuts
    assert "llama-3.1-8b: serve workloads concurrency, random not run" in cuts


def test_a_tokenizer_free_stream_counts_each_empty_text_chunk_as_a_token():
    from benchmark.client import _StreamParser

    chunks = [b'data: {"choices": [{"text": "", "finish_reason": null}]}'] * 3
    chunks += [b'data: {"choices": [{"text": "", "finish_reason": "length"}]}', b"data: [DONE]"]
    for empty, expected in ((True, 3), (False, 0)):
        parser = _StreamParser(chat=False, empty_text_chunks=empty)
        for i, line in enumerate(chunks):
            parser.feed(line, float(i))
        assert len(parser.chunk_times) == expected


@pytest.mark.slow
def test_the_smoke_suite_runs_every_phase_end_to_end_on_a_cpu(tmp_path: Path):
    proc = subprocess.run([sys.executable, "-m", "benchmark.suite", str(tmp_path), "--smoke"], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert [s["status"] for s in suite["steps"]] == ["ok"] * 8
    workloads = json.loads((tmp_path / "summary.json").read_text())["workloads"]
    systems = workloads["offline@tiny-llama"]["cpu"]["systems"]
    assert set(systems) == {"flashserve", "floor", "hf-generate", "hf-continuous-batching"}
    assert {"latency@tiny-llama", "concurrency@tiny-llama", "goodput@tiny-llama", "device"} <= set(workloads)
    assert (tmp_path / "plots" / "concurrency-tiny-llama.png").exists()
    assert [r["target"] for r in suite["targets"]] == ["1", "2", "2", "3", "3", "4", "4", "5"]
    assert "PERFORMANCE.md targets on cpu" in proc.stdout


def test_batchllm_bench_reports_every_configuration(tiny_model: str, tmp_path: Path) -> None:
    from benchmark import batchllm_bench

    assert batchllm_bench.main([
        "--model", tiny_model, "--groups", "2", "--per-group", "3", "--shared", "40", "--unique", "5",
        "--out-tokens", "3", "--rounds", "1", "--decode-groups", "2", "--decode-requests", "3", "--decode-prefix", "40",
        "--decode-out", "4", "--sweep-groups", "2", "--sweep-prefixes", "32", "--sweep-group-sizes", "2,3",
        "--out", str(tmp_path),
    ]) == 0
    doc = json.loads((tmp_path / "cpu" / "batchllm" / "batchllm.json").read_text())
    assert list(doc["offline"]) == ["no caching", "prefix caching, arrival order", "prefix-sharing groups",
                                    "groups + cascade", "groups, steps in turn (no overlap scheduling)",
                                    "run-batch (groups)"]
    assert doc["offline"]["no caching"]["computed_share"] == 1.0
    assert doc["offline"]["prefix-sharing groups"]["computed_share"] < 0.6  # each prefix computed once
    assert list(doc["decode"]) == ["cascade off", "cascade on", "cascade auto"]
    assert [(r["prefix"], r["per_group"], r["batch"]) for r in doc["sweep"]] == [(32, 2, 4), (32, 3, 6)]


def test_profile_diff_counts_each_function_once_per_stack_in_the_named_thread(tmp_path: Path) -> None:
    from benchmark.profile_diff import inclusive

    profile = tmp_path / "p.txt"
    profile.write_text(
        "thread (1): flashserve-engine;run (a/engine.py:10);step (a/engine.py:20);step (a/engine.py:21) 3\n"
        "thread (1): flashserve-engine;run (a/engine.py:10);fill (b/grammar.py:5) 2\n"
        "thread (2): MainThread;serve (c/api.py:1) 7\n"
    )
    counts, total = inclusive(profile, "flashserve-engine")
    assert total == 5
    assert counts == {"run engine.py": 5, "step engine.py": 3, "fill grammar.py": 2}
