"""`--speculative-config`: vLLM's JSON shape, and the start-up errors for what cannot run."""

from __future__ import annotations

import json

import pytest

from flashserve.cli import build_parser
from flashserve.serve_args import to_configs
from flashserve.config import ModelConfig
from flashserve.spec_decode.config import SpeculativeConfig
from flashserve.entrypoints.speculative import check_speculative

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'


def serve_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        build_parser({}).parse_args(["serve", *argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_ngram_config_in_vllms_shape_reaches_the_scheduler_config():
    args = to_configs(build_parser({}).parse_args(["serve", "--speculative-config", NGRAM]))
    assert args.scheduler.speculative == SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=4)


def test_speculative_config_is_read_from_its_environment_variable():
    args = to_configs(build_parser({"FLASHSERVE_SPECULATIVE_CONFIG": NGRAM}).parse_args(["serve"]))
    assert args.scheduler.speculative is not None and args.scheduler.speculative.num_speculative_tokens == 4


def test_speculation_is_off_by_default():
    assert to_configs(build_parser({}).parse_args(["serve"])).scheduler.speculative is None


def test_prompt_lookup_bounds_default_to_each_other_as_in_vllm():
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_min": 2}).prompt_lookup_max == 2


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_eagle3_and_mtp_are_refused_as_not_supported_yet(capsys, method):
    err = serve_error(capsys, "--speculative-config", json.dumps({"method": method, "num_speculative_tokens": 2}))
    assert f'method "{method}" is not supported yet' in err


def test_an_unknown_method_is_refused_by_name(capsys):
    err = serve_error(capsys, "--speculative-config", '{"method": "guess", "num_speculative_tokens": 2}')
    assert 'unknown method "guess"' in err


@pytest.mark.parametrize("k", [0, 17])
def test_num_speculative_tokens_must_be_from_1_to_16(capsys, k):
    err = serve_error(capsys, "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": k}))
    assert "num_speculative_tokens must be an integer from 1 to 16" in err


def test_unparsable_json_is_refused_at_start(capsys):
    assert "not JSON" in serve_error(capsys, "--speculative-config", '{"method": "ngram",')


def test_an_unknown_field_is_refused_by_name(capsys):
    err = serve_error(capsys, "--speculative-config", '{"num_speculative_tokens": 2, "lookahead": 3}')
    assert "unknown field(s) ['lookahead']" in err


def test_a_draft_model_with_another_vocabulary_is_refused_before_loading(tmp_path, tiny_llama_config):
    draft = tmp_path / "draft"
    draft.mkdir()
    config = json.loads(tiny_llama_config.read_text())
    (draft / "config.json").write_text(json.dumps({**config, "vocab_size": 1024}))
    target = ModelConfig(model=str(tiny_llama_config), load_format="dummy")
    spec = SpeculativeConfig.from_dict({"model": str(draft / "config.json"), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="vocabulary of 1024 tokens.*one of 512"):
        check_speculative(spec, target)


def test_the_start_up_log_states_the_configuration(caplog):
    spec = SpeculativeConfig.from_json(NGRAM.replace("}", ', "disable_by_batch_size": 8}'))
    with caplog.at_level("INFO", logger="flashserve.entrypoints.speculative"):
        check_speculative(spec, ModelConfig())
    assert ("speculative decoding: ngram (prompt lookup 2..4 tokens), 4 draft tokens per step, "
            "off above 8 running requests") in caplog.text
