"""Tensor-parallel ranks over NCCL (2, and 4 where four GPUs are visible; FLASHSERVE_TEST_TP=4
picks sizes) compute what one GPU computes, and leave no process behind. A small float32 Llama (8
query heads and 2 KV heads of 128 dimensions, a head size FlashInfer's attention takes: at TP=4 a
rank's 2 query heads share one replicated KV head; a vocabulary of 1,001 that does not divide by 2
or 4), dummy weights seeded alike on every rank. Its projections and norms run in float32
(PyTorch's ops) and FlashInfer attends in bfloat16, so logits are compared within the suite's bfloat16 tolerance;
greedy tokens are compared with PyTorch's float32 attention. Decode steps of the ranks replay
CUDA graphs with the collectives inside, or run eagerly. The same model in bfloat16 runs with
FlashInfer's fused all-reduce + add + RMSNorm, which GPUs that NVLink connects take by default
(FlashInfer builds its module on first use, for over 5 minutes on a fresh machine, unless
`make kernels-prebuilt` put it in the wheel that carries FlashInfer there). Skipped on a machine with
fewer than two GPUs."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from test_flashinfer_backend import TOL, rel_err
from test_tp_engine import gone, worker_pids

from flashserve.distributed.comm import nvlink_gap
from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
from flashserve.entrypoints.llm import LLM
from flashserve.message.sampling_params import SamplingParams



def tp_sizes() -> list[int]:
    """The tensor-parallel sizes under test: FLASHSERVE_TEST_TP (comma-separated), else 2 and 4,
    each where that many GPUs are visible."""
    wanted = os.environ.get("FLASHSERVE_TEST_TP")
    return [n for n in ([int(s) for s in wanted.split(",")] if wanted else [2, 4]) if n <= torch.cuda.device_count()]


TP_SIZES = tp_sizes()
pytestmark = pytest.mark.skipif(not TP_SIZES, reason="needs two GPUs")

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=512,
              head_dim=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=1001,
              max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-5,
              rope_theta=10000.0)  # fmt: skip
ENGINE = dict(load_format="dummy", dtype="float32", num_pages=256, max_num_batched_tokens=64)
PROMPTS = [[1, 2, 3], [5] * 40, list(range(7, 200))]  # whole, chunked and mixed prefills, then decodes
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(params=TP_SIZES, ids=[f"tp{n}" for n in TP_SIZES])
def tp(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture(scope="module")
def model(tmp_path_factory: Any) -> str:
    path = tmp_path_factory.mktemp("tp-model") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


@pytest.fixture(scope="module")
def one_gpu_tokens(model: str) -> list[list[int]]:
    with LLM(model, cuda_graph=False, attention_backend="torch", **ENGINE) as llm:
        return [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]


def step_logits(llm: LLM, prompts: list[list[int]] = PROMPTS, lids: list[int] | None = None) -> list[torch.Tensor]:
    """The logits of a prefill step of `prompts`, then of 4 decode steps of all of them (teacher-forced
    tokens; a decode step of 3 replays the graph of 4 where graphs were captured), straight
    through the engine's runner on pages no request holds; `lids`: each prompt's LoRA adapter."""
    runner: Any = llm.engine.executor
    lids = lids or [0] * len(prompts)
    pages = [list(range(1 + 16 * i, 17 + 16 * i)) for i in range(len(prompts))]
    step = [ScheduledRequest(f"r{i}", p, 0, pages[i], True, GREEDY, p, [], lora_int_id=lids[i])
            for i, p in enumerate(prompts)]  # fmt: skip
    logits = [runner.forward(SchedulerOutput(step)).clone()]
    for k in range(4):
        step = [ScheduledRequest(f"r{i}", [11 + k], len(p) + k, pages[i], True, GREEDY, p, [11] * (k + 1),
                                 lora_int_id=lids[i]) for i, p in enumerate(prompts)]  # fmt: skip
        logits.append(runner.forward(SchedulerOutput(step)).clone())
    return logits


SHORT = [[5] * 40, list(range(7, 47))]  # an 80-token prefill step: two overlapped chunks


@pytest.fixture(scope="module")
def one_gpu_runs(model: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One GPU's `step_logits` of PROMPTS and of SHORT."""
    with LLM(model, cuda_graph=False, **ENGINE) as llm:
        return step_logits(llm), step_logits(llm, SHORT)


@pytest.fixture(scope="module")
def one_gpu_logits(one_gpu_runs: tuple[list[torch.Tensor], list[torch.Tensor]]) -> list[torch.Tensor]:
    return one_gpu_runs[0]


@pytest.fixture(scope="module")
def one_gpu_short_logits(one_gpu_runs: tuple[list[torch.Tensor], list[torch.Tensor]]) -> list[torch.Tensor]:
    return one_gpu_runs[1]


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graphs"])
def test_tp_ranks_compute_the_logits_of_one_gpu(model: str, one_gpu_logits: list[torch.Tensor], cuda_graph: bool,
                                                tp: int) -> None:  # fmt: skip
    with LLM(model, tensor_parallel_size=tp, cuda_graph=cuda_graph, enable_flashinfer_allreduce_fusion=False,
             **ENGINE) as llm:  # fmt: skip
        assert (llm.engine.executor.graphs is not None) == cuda_graph  # type: ignore[attr-defined]
        logits = step_logits(llm)
    errs = [rel_err(a, b) for a, b in zip(logits, one_gpu_logits)]
    assert max(errs) < TOL[torch.bfloat16], errs


@pytest.fixture(scope="module")
def one_gpu_bf16_logits(model: str) -> list[torch.Tensor]:
    with LLM(model, cuda_graph=False, **{**ENGINE, "dtype": "bfloat16"}) as llm:
        return step_logits(llm)


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graphs"])
def test_tp_ranks_with_the_fused_allreduce_compute_the_logits_of_one_gpu(
    model: str, one_gpu_bf16_logits: list[torch.Tensor], cuda_graph: bool, tp: int
) -> None:
    # bfloat16 (the fused kernel's dtypes); the prefill step (236 tokens) and the decode steps all
    # take the fused kernel.
    engine = {**ENGINE, "dtype": "bfloat16"}
    with LLM(model, tensor_parallel_size=tp, cuda_graph=cuda_graph, enable_flashinfer_allreduce_fusion=True,
             **engine) as llm:  # fmt: skip
        assert llm.engine.executor.model.model.fused_allreduce is not None  # type: ignore[attr-defined]
        logits = step_logits(llm)
    errs = [rel_err(a, b) for a, b in zip(logits, one_gpu_bf16_logits)]
    assert max(errs) < TOL[torch.bfloat16], errs


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "piecewise-graphs"])
def test_tp_ranks_with_overlapped_all_reduces_compute_the_logits_of_one_gpu(
    model: str, one_gpu_logits: list[torch.Tensor], tp: int, cuda_graph: bool
) -> None:
    # --tp-overlap-min-tokens 64: the prefill step (236 tokens) runs its token-wise parts in two
    # chunks, each chunk's NCCL all-reduce started while the other's GEMMs run; decode steps run
    # whole. With graphs the prefill step replays piecewise graphs that captured the all-reduces' streams.
    with LLM(model, tensor_parallel_size=tp, cuda_graph=cuda_graph, enable_flashinfer_allreduce_fusion=False,
             tp_overlap_min_tokens=64, **ENGINE) as llm:  # fmt: skip
        native = llm.engine.executor.model.model  # type: ignore[attr-defined]
        assert len(native.token_chunks(236)) == 2 and native.overlap_sums is None
        logits = step_logits(llm)
    errs = [rel_err(a, b) for a, b in zip(logits, one_gpu_logits)]
    assert max(errs) < TOL[torch.bfloat16], errs


def copy_engine_llm(model: str, tp: int) -> LLM:
    """Ranks whose overlapped all-reduces (steps of 64 tokens or more) go by the copy engines, with
    piecewise graphs up to 128 tokens."""
    return LLM(model, tensor_parallel_size=tp, enable_flashinfer_allreduce_fusion=False, tp_overlap_min_tokens=64,
               tp_overlap_comm="copy-engine", piecewise_cuda_graph_max_tokens=128, **ENGINE)  # fmt: skip


def in_a_new_process(fn: Any, *args: Any) -> Any:
    """`fn(*args)` in a new process (rank 0 of the model it builds): torch's symmetric memory takes
    one model with copy-engine all-reduces a process."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result(timeout=300)


def copy_engine_logits(model: str, tp: int) -> list[torch.Tensor]:
    with copy_engine_llm(model, tp) as llm:
        runner: Any = llm.engine.executor
        assert runner.model.model.overlap_sums is not None
        assert runner.piecewise_graphs.covers(80) and not runner.piecewise_graphs.covers(236)
        return [t.cpu() for t in step_logits(llm) + step_logits(llm, SHORT)]


def second_copy_engine_model(model: str, tp: int) -> str:
    """Builds and closes one model with copy-engine all-reduces, then tries a second: its error."""
    with copy_engine_llm(model, tp):
        pass
    try:
        copy_engine_llm(model, tp).close()
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_tp_ranks_with_copy_engine_all_reduces_compute_the_logits_of_one_gpu(
    model: str, one_gpu_logits: list[torch.Tensor], one_gpu_short_logits: list[torch.Tensor], tp: int
) -> None:
    # Both paths in one model: the 236-token prefill step runs its two chunks eagerly, peer copies
    # through symmetric memory on side streams; the 80-token one replays the piecewise graphs that
    # captured those streams.
    logits = in_a_new_process(copy_engine_logits, model, tp)
    errs = [rel_err(a, b.cpu()) for a, b in zip(logits, one_gpu_logits + one_gpu_short_logits)]
    assert max(errs) < TOL[torch.bfloat16], errs


def test_a_second_model_with_copy_engine_all_reduces_in_one_process_is_refused_naming_why(model: str, tp: int) -> None:
    error = in_a_new_process(second_copy_engine_model, model, tp)
    assert error.startswith("--tp-overlap-comm copy-engine: one model a process"), error


def test_tp_ranks_replay_piecewise_graphs_of_a_prompt_step_computing_the_logits_of_one_gpu(
    model: str, one_gpu_logits: list[torch.Tensor], tp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Piecewise graphs up to 256 tokens, captured on every rank with the all-reduces inside: the
    prefill step (236 tokens) replays 256's pieces, the decode steps their own graphs."""
    with LLM(model, tensor_parallel_size=tp, enable_flashinfer_allreduce_fusion=False,
             piecewise_cuda_graph_max_tokens=256, **ENGINE) as llm:  # fmt: skip
        runner: Any = llm.engine.executor
        pieces = runner.piecewise_graphs
        assert pieces is not None and pieces.covers(236) and not pieces.covers(257)
        replayed: list[int] = []
        replay = type(pieces).__call__

        def counted(self: Any, ids: torch.Tensor, *rest: Any) -> torch.Tensor:
            replayed.append(ids.shape[0])
            return replay(self, ids, *rest)

        monkeypatch.setattr(type(pieces), "__call__", counted)
        logits = step_logits(llm)
    assert replayed == [236]
    errs = [rel_err(a, b) for a, b in zip(logits, one_gpu_logits)]
    assert max(errs) < TOL[torch.bfloat16], errs


LORA_LIDS = [1, 0, 2]  # the prompts' adapters (0: the base model)


def lora_logits(model: str, root: Path, tp: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`step_logits` of bfloat16 ranks with two adapters of ranks 8 and 16 on every projection (the
    same random weights on one GPU and on several) and a base row; then of the same rows without
    adapters."""
    from test_lora_gpu import write_adapter

    from flashserve.message.lora import LoRARequest

    engine = {**ENGINE, "dtype": "bfloat16"}
    with LLM(model, tensor_parallel_size=tp, enable_lora=True, max_loras=2, max_lora_rank=16, **engine) as llm:
        runner: Any = llm.engine.executor
        spec = runner.model.model.spec  # the whole model's (rank 0's runner at TP > 1)
        for lid, rank in ((1, 8), (2, 16)):
            folder = write_adapter(str(root / f"r{rank}"), spec, rank, seed=lid, std=0.1)
            runner.add_lora(LoRARequest(f"r{rank}", lid, folder))
        return step_logits(llm, lids=LORA_LIDS), step_logits(llm)


def test_tp_ranks_with_lora_adapters_compute_the_logits_of_one_gpu(model: str, tp: int, tmp_path: Path) -> None:
    """Adapters sharded with the layers (lora_B's rows of q/k/v and gate/up, lora_A's columns of o
    and down; on a GPU each rank's slots of A stacked under its shard of the weight), a mixed
    prefill step and decode steps replayed from graphs: one GPU's logits within bfloat16's
    tolerance, where the adapters move them by more than that."""
    one, one_base = lora_logits(model, tmp_path / "one", 1)
    got, _ = lora_logits(model, tmp_path / "tp", tp)
    errs = [rel_err(a, b) for a, b in zip(got, one)]
    assert max(errs) < TOL[torch.bfloat16], errs
    assert min(rel_err(a, b) for a, b in zip(one, one_base)) > 2 * TOL[torch.bfloat16]


def test_gpus_that_nvlink_connects_take_the_fused_allreduce_by_default(model: str, tp: int) -> None:
    with LLM(model, tensor_parallel_size=tp, **{**ENGINE, "dtype": "bfloat16"}) as llm:
        fused = llm.engine.executor.model.model.fused_allreduce  # type: ignore[attr-defined]
    assert (fused is not None) == (nvlink_gap(range(tp)) is None)


def test_tp_ranks_generate_the_greedy_tokens_of_one_gpu(model: str, one_gpu_tokens: list[list[int]], tp: int) -> None:
    with LLM(model, tensor_parallel_size=tp, attention_backend="torch", **ENGINE) as llm:
        tokens = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert tokens == one_gpu_tokens


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


class AlwaysDrafts:
    """k drafts for every decoding request (its last token repeated): every verify step uniform."""

    def propose(self, token_ids: Any, k: int) -> list[int]:
        return [int(token_ids[-1])] * k


def test_tp_ranks_with_speculation_generate_the_greedy_tokens_of_one_gpu(model: str, one_gpu_tokens: list[list[int]],
                                                                          tp: int) -> None:  # fmt: skip
    """n-gram drafts (the repeated prompts give some) verified over the ranks: one GPU's greedy
    tokens without speculation, exactly (float32, PyTorch's attention)."""
    with LLM(model, tensor_parallel_size=tp, attention_backend="torch", speculative_config=SPEC, **ENGINE) as llm:
        tokens = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
        stats = llm.engine.scheduler.spec_stats
        assert stats is not None and stats.num_drafts > 0
    assert tokens == one_gpu_tokens


def test_tp_ranks_verify_a_draft_model_s_drafts_made_on_rank_zero(model: str, one_gpu_tokens: list[list[int]],
                                                                   tp: int) -> None:  # fmt: skip
    """The model as its own draft, on rank 0's GPU: its drafts reach every rank with the step, are
    accepted, and the tokens are one GPU's greedy tokens (float32, PyTorch's attention)."""
    spec = {"model": model, "num_speculative_tokens": 3}
    with LLM(model, tensor_parallel_size=tp, attention_backend="torch", speculative_config=spec, **ENGINE) as llm:
        tokens = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
        stats = llm.engine.scheduler.spec_stats
        assert stats is not None and stats.num_accepted_tokens > 0
    assert tokens == one_gpu_tokens


def test_tp_ranks_replay_verify_graphs_with_the_collectives_inside(model: str, tp: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """FlashInfer with CUDA graphs: uniform verify steps (3 drafts a row, from a proposer that
    always drafts) replay their graphs on every rank, all-reduces inside, and every request ends
    with its tokens."""
    with LLM(model, tensor_parallel_size=tp, speculative_config=SPEC, **ENGINE) as llm:
        runner = llm.engine.executor
        assert runner.verify_graphs is not None and runner.verify_graphs.captured
        replays: list[int] = []
        plan = runner.backend.plan_verify_graph
        monkeypatch.setattr(runner.backend, "plan_verify_graph", lambda *a: (replays.append(a[1]), plan(*a))[1])
        llm.engine.scheduler.speculator.proposer = AlwaysDrafts()
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params)
    assert replays, "no verify step replayed a graph"
    assert [len(r.token_ids) for r in outputs] == [16] * len(PROMPTS)


def test_close_ends_the_workers_promptly(model: str, tp: int) -> None:
    llm = LLM(model, tensor_parallel_size=tp, **ENGINE)
    pids = worker_pids(llm)
    start = time.monotonic()
    llm.close()
    assert time.monotonic() - start < 10  # not the 30 s join timeout and a kill
    assert all(gone(pid) for pid in pids)


@pytest.fixture(scope="module")
def one_gpu_fp8_logits(model: str) -> list[torch.Tensor]:
    with LLM(model, cuda_graph=False, quantization="fp8", kv_cache_dtype="fp8", **{**ENGINE, "dtype": "bfloat16"}) as llm:
        return step_logits(llm)


@pytest.mark.parametrize("fused", [False, True], ids=["nccl", "fused-allreduce"])
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graphs"])
def test_two_gpus_with_fp8_weights_and_kv_compute_the_logits_of_one(
    model: str, one_gpu_fp8_logits: list[torch.Tensor], cuda_graph: bool, fused: bool
) -> None:
    # Each rank quantizes its own slice at load: o_proj's and down_proj's per-channel scales then
    # cover a rank's columns, not the whole row, so the FP8 roundings (not the formats) differ a
    # little from one GPU's. With the fused all-reduce, its kernel also quantizes the norms that
    # feed qkv and gate_up (per token, in FlashInfer's kernel instead of the Triton one).
    with LLM(model, tensor_parallel_size=2, cuda_graph=cuda_graph, quantization="fp8", kv_cache_dtype="fp8",
             enable_flashinfer_allreduce_fusion=fused, **{**ENGINE, "dtype": "bfloat16"}) as llm:  # fmt: skip
        logits = step_logits(llm)
    errs = [rel_err(a, b) for a, b in zip(logits, one_gpu_fp8_logits)]
    print(f"FP8 TP=2 vs one GPU ({'graphs' if cuda_graph else 'eager'}, {'fused' if fused else 'NCCL'}): {errs}")
    assert max(errs) < 0.1, errs


ONE_SEQUENCE = PROMPTS[2:]


@pytest.fixture(scope="module")
def one_gpu_fp8_one_sequence_logits(model: str) -> list[torch.Tensor]:
    with LLM(model, cuda_graph=False, quantization="fp8", kv_cache_dtype="fp8", **{**ENGINE, "dtype": "bfloat16"}) as llm:
        return step_logits(llm, ONE_SEQUENCE)


def test_two_gpus_with_fp8_weights_decode_one_sequence_as_one_gpu_does(
    model: str, one_gpu_fp8_one_sequence_logits: list[torch.Tensor]
) -> None:
    # A decode step of one sequence runs the one-row FP8 GEMV (unquantized activations, fused gate_up
    # and SiLU-and-mul) on each rank; from graphs, with the fused all-reduce, as served by default.
    with LLM(model, tensor_parallel_size=2, cuda_graph=True, quantization="fp8", kv_cache_dtype="fp8",
             enable_flashinfer_allreduce_fusion=True, **{**ENGINE, "dtype": "bfloat16"}) as llm:  # fmt: skip
        logits = step_logits(llm, ONE_SEQUENCE)
    errs = [rel_err(a, b) for a, b in zip(logits, one_gpu_fp8_one_sequence_logits)]
    print(f"FP8 TP=2 vs one GPU, one sequence (graphs, fused): {errs}")
    assert max(errs) < 0.1, errs
