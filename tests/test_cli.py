"""Command-line options: flags, environment variables, --help."""

from __future__ import annotations

import subprocess
import sys

from flashserve.cli import SERVE_OPTIONS, build_parser
from flashserve.serve_args import to_configs


def test_defaults_serve_the_embedded_model_on_localhost_8000():
    args = to_configs(build_parser({}).parse_args(["serve"]))
    assert args.model.model == ""
    assert (args.server.host, args.server.port) == ("127.0.0.1", 8000)
    assert args.cache.page_size == 16


def test_environment_variables_set_defaults():
    env = {"FLASHSERVE_PORT": "9001", "FLASHSERVE_MAX_NUM_SEQS": "7", "FLASHSERVE_SERVED_MODEL_NAME": "a,b",
           "FLASHSERVE_CUDA_GRAPH": "false"}
    args = to_configs(build_parser(env).parse_args(["serve"]))
    assert args.server.port == 9001
    assert args.scheduler.max_num_seqs == 7
    assert args.model.served_model_names == ("a", "b")
    assert args.cuda_graph is False


def test_flags_override_environment_variables():
    args = to_configs(build_parser({"FLASHSERVE_PORT": "9001"}).parse_args(["serve", "--port", "9002"]))
    assert args.server.port == 9002


def test_enforce_eager_disables_cuda_graphs():
    args = to_configs(build_parser({}).parse_args(["serve", "--enforce-eager"]))
    assert args.cuda_graph is False


def test_help_lists_every_flag_with_its_environment_variable():
    out = subprocess.run([sys.executable, "-m", "flashserve", "serve", "--help"], capture_output=True, text=True,
                         env={"COLUMNS": "200", "PATH": ""}, check=True).stdout
    for opt in SERVE_OPTIONS:
        assert opt.flag in out
        assert opt.env in out


def test_model_impl_selects_the_generic_hf_path():
    args = to_configs(build_parser({"FLASHSERVE_MODEL_IMPL": "hf"}).parse_args(["serve"]))
    assert args.model.model_impl == "hf"


def test_torch_compile_flag_reaches_the_model_config():
    assert to_configs(build_parser({}).parse_args(["serve", "--torch-compile"])).model.torch_compile is True
    assert to_configs(build_parser({}).parse_args(["serve"])).model.torch_compile is False


def test_fused_decode_is_off_by_default_and_reaches_only_the_flashinfer_backend():
    from flashserve.worker.assembly import backend_options

    assert to_configs(build_parser({}).parse_args(["serve"])).model.fused_decode is False
    on = to_configs(build_parser({"FLASHSERVE_FUSED_DECODE": "1"}).parse_args(["serve"])).model
    assert on.fused_decode is True
    assert backend_options(on, "flashinfer") == {"fused_decode": True}
    assert backend_options(on, "torch") == {}


def test_step_budget_defaults_to_auto_and_takes_an_explicit_value():
    assert to_configs(build_parser({}).parse_args(["serve"])).scheduler.max_num_batched_tokens is None
    args = to_configs(build_parser({}).parse_args(["serve", "--max-num-batched-tokens", "512"]))
    assert args.scheduler.max_num_batched_tokens == 512


def test_the_chat_page_is_on_by_default_and_no_ui_or_its_environment_variable_turns_it_off():
    assert to_configs(build_parser({}).parse_args(["serve"])).api.ui is True
    assert to_configs(build_parser({}).parse_args(["serve", "--no-ui"])).api.ui is False
    assert to_configs(build_parser({"FLASHSERVE_UI": "false"}).parse_args(["serve"])).api.ui is False


def test_tp_overlap_min_tokens_reaches_the_model_config_and_takes_only_a_positive_count(capsys):
    import pytest

    assert to_configs(build_parser({}).parse_args(["serve"])).model.tp_overlap_min_tokens is None
    ns = build_parser({}).parse_args(["serve", "--tp-overlap-min-tokens", "1024"])
    assert to_configs(ns).model.tp_overlap_min_tokens == 1024
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["serve", "--tp-overlap-min-tokens", "0"])
    assert "--tp-overlap-min-tokens" in capsys.readouterr().err


def test_tp_overlap_comm_reaches_the_model_config_nccl_unless_asked(capsys):
    import pytest

    assert to_configs(build_parser({}).parse_args(["serve"])).model.tp_overlap_comm == "nccl"
    ns = build_parser({}).parse_args(["serve", "--tp-overlap-min-tokens", "1024", "--tp-overlap-comm", "copy-engine"])
    assert to_configs(ns).model.tp_overlap_comm == "copy-engine"
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["serve", "--tp-overlap-comm", "nvls"])
    assert "--tp-overlap-comm" in capsys.readouterr().err


def test_piecewise_graphs_serve_512_tokens_unless_asked(capsys):
    import pytest

    assert to_configs(build_parser({}).parse_args(["serve"])).model.piecewise_graph_tokens() == 512
    ns = build_parser({}).parse_args(["serve", "--piecewise-cuda-graph-max-tokens", "1024"])
    assert to_configs(ns).model.piecewise_graph_tokens() == 1024
    ns = build_parser({}).parse_args(["serve", "--piecewise-cuda-graph-max-tokens", "0"])
    assert to_configs(ns).model.piecewise_graph_tokens() == 0
    for bad in ("-1", "8193"):
        with pytest.raises(SystemExit):
            build_parser({}).parse_args(["serve", "--piecewise-cuda-graph-max-tokens", bad])
        assert "--piecewise-cuda-graph-max-tokens" in capsys.readouterr().err


def test_piecewise_graphs_serve_2304_tokens_for_fp8_projections_unless_asked():
    default = to_configs(build_parser({}).parse_args(["serve", "--quantization", "fp8"])).model
    assert default.piecewise_graph_tokens(fp8_projections=True) == 2304
    ns = build_parser({}).parse_args(["serve", "--piecewise-cuda-graph-max-tokens", "512"])
    assert to_configs(ns).model.piecewise_graph_tokens(fp8_projections=True) == 512


def test_max_prefill_tokens_reaches_the_scheduler_config_and_defaults_to_the_devices_choice():
    assert to_configs(build_parser({}).parse_args(["serve"])).scheduler.max_prefill_tokens is None
    ns = build_parser({}).parse_args(["serve", "--max-prefill-tokens", "4096"])
    assert to_configs(ns).scheduler.max_prefill_tokens == 4096


def test_a_model_config_refuses_piecewise_graph_tokens_out_of_range_as_llm_passes_them():
    import pytest

    from flashserve.config import ModelConfig

    for bad in (-1, 8193):
        with pytest.raises(ValueError, match="piecewise_cuda_graph_max_tokens"):
            ModelConfig(piecewise_cuda_graph_max_tokens=bad)
