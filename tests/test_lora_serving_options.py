"""LoRA serving's options and the parts around the engine core: the command line (vLLM's flags, the
environment twins, options that do not go together refused before anything starts), adapters named
at start, the data-parallel client (adapters on every engine core) and its router (a prompt's prefix
keyed by adapter)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from flashserve.cli import build_parser
from flashserve.serve_args import to_batch_args, to_configs
from flashserve.client.dp_client import DataParallelClient
from flashserve.client.router import PrefixRouter
from flashserve.config import LoRAConfig
from flashserve.entrypoints.stack import load_lora_modules
from flashserve.message.lora import LoRAAdapterError, LoRAInUse, LoRANotFound, LoRARequest


def serve_args(*argv: str, env: dict[str, str] | None = None) -> Any:
    return to_configs(build_parser(env or {}).parse_args(["serve", *argv]))


# ---- the command line --------------------------------------------------------------------------------
def test_lora_is_off_by_default_and_the_runner_gets_no_lora_config() -> None:
    args = serve_args()
    assert args.model.lora is None and args.lora_modules == () and not args.api.allow_runtime_lora_updating


def test_enable_lora_takes_vllms_limits() -> None:
    args = serve_args("--enable-lora", "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "8")
    assert args.model.lora == LoRAConfig(max_loras=4, max_lora_rank=64, max_cpu_loras=8)


def test_lora_modules_take_name_equals_path_and_vllms_json_form() -> None:
    args = serve_args("--enable-lora", "--lora-modules", "sql=/a/sql",
                      '{"name": "fr", "path": "/a/fr", "base_model_name": "base"}')
    assert args.lora_modules == (LoRARequest("sql", 1, "/a/sql"), LoRARequest("fr", 2, "/a/fr", "base"))


def test_the_environment_twins_set_the_lora_options() -> None:
    env = {"FLASHSERVE_ENABLE_LORA": "1", "FLASHSERVE_LORA_MODULES": "sql=/a/sql,fr=/a/fr",
           "FLASHSERVE_MAX_LORAS": "2"}
    args = serve_args(env=env)
    assert [m.lora_name for m in args.lora_modules] == ["sql", "fr"] and args.model.lora.max_loras == 2


def test_the_lora_modules_variable_takes_a_json_list_whose_paths_hold_commas() -> None:
    env = {"FLASHSERVE_ENABLE_LORA": "1", "FLASHSERVE_LORA_MODULES": '[{"name": "a", "path": "/x,y"}]'}
    assert serve_args(env=env).lora_modules == (LoRARequest("a", 1, "/x,y"),)


def test_runtime_updates_are_allowed_by_the_flag_or_vllms_variable() -> None:
    assert serve_args("--allow-runtime-lora-updating").api.allow_runtime_lora_updating
    assert serve_args(env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}).api.allow_runtime_lora_updating


def test_run_batch_takes_the_lora_options() -> None:
    ns = build_parser({}).parse_args(["run-batch", "-i", "in", "-o", "out", "--enable-lora", "--lora-modules", "a=/x"])
    assert to_batch_args(ns).serve.lora_modules == (LoRARequest("a", 1, "/x"),)


@pytest.mark.parametrize("argv, message", [
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "given more than once: a"),
    (["--enable-lora", "--served-model-name", "m", "--lora-modules", "m=/x"], "m is the base model's name"),
    (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "--max-cpu-loras (2) must be at least --max-loras"),
    (["--enable-lora", "--lora-modules", "nopath"], "expected name=path or a JSON object"),
    (["--enable-lora", "--lora-modules", '{"name": "a", "pth": "/x"}'], "unknown field(s) ['pth']"),
    (["--enable-lora", "--max-loras", "0"], "must be at least 1"),
])
def test_options_that_do_not_go_together_stop_the_start_with_a_clear_error(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from flashserve.__main__ import main

    with pytest.raises(SystemExit) as stopped:  # before anything is imported or started
        main(["serve", *argv])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


# ---- adapters named at start ---------------------------------------------------------------------------
class _Registry:
    def __init__(self, refuse: str | None = None) -> None:
        self.refuse, self.loaded = refuse, []

    def load(self, name: str, path: str, base_model_name: str | None = None) -> None:
        if self.refuse:
            raise LoRAAdapterError(self.refuse)
        self.loaded.append(name)


def _stack(registry: _Registry) -> Any:
    stack = SimpleNamespace(engine=SimpleNamespace(loras=registry), closed=False)
    stack.close = lambda: setattr(stack, "closed", True)
    return stack


def test_lora_modules_load_at_start_in_order() -> None:
    stack = _stack(_Registry())
    load_lora_modules(stack, serve_args("--enable-lora", "--lora-modules", "a=/x", "b=/y"))
    assert stack.engine.loras.loaded == ["a", "b"] and not stack.closed


def test_a_lora_module_that_does_not_load_stops_the_start_naming_it() -> None:
    stack = _stack(_Registry(refuse="adapter_config.json is missing in /x"))
    with pytest.raises(LoRAAdapterError, match=r"--lora-modules a=/x: adapter_config.json is missing"):
        load_lora_modules(stack, serve_args("--enable-lora", "--lora-modules", "a=/x"))
    assert stack.closed  # what started is closed again


# ---- data parallelism ----------------------------------------------------------------------------------
class _Core:
    """What DataParallelClient uses of one engine core's client."""

    max_model_len, vocab_size, lora_enabled = 512, 100, True

    def __init__(self, refuse: Exception | None = None) -> None:
        self.refuse = refuse
        self.lora_adapters: dict[str, LoRARequest] = {}

    async def load_lora_adapter(self, name: str, path: str, base_model_name: str | None = None) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.lora_adapters[name] = LoRARequest(name, 1, path)

    async def unload_lora_adapter(self, name: str) -> None:
        if self.refuse is not None:
            raise self.refuse
        if self.lora_adapters.pop(name, None) is None:
            raise LoRANotFound(name)


def _dp(*cores: _Core) -> DataParallelClient:
    return DataParallelClient(cores, PrefixRouter(len(cores), 16))  # type: ignore[arg-type]


def test_a_load_reaches_every_engine_core() -> None:
    cores = (_Core(), _Core())
    asyncio.run(_dp(*cores).load_lora_adapter("a", "/x"))
    assert all("a" in core.lora_adapters for core in cores)
    assert set(_dp(*cores).lora_adapters) == {"a"}


def test_a_load_refused_by_one_engine_core_is_undone_on_the_others() -> None:
    ok, refusing = _Core(), _Core(refuse=LoRAAdapterError("rank 64 exceeds --max-lora-rank 16"))
    with pytest.raises(LoRAAdapterError, match="rank 64"):
        asyncio.run(_dp(ok, refusing).load_lora_adapter("a", "/x"))
    assert ok.lora_adapters == {}


def test_an_unload_refused_for_running_requests_is_reported() -> None:
    with pytest.raises(LoRAInUse):
        asyncio.run(_dp(_Core(), _Core(refuse=LoRAInUse("busy"))).unload_lora_adapter("a"))


def test_the_router_keys_a_prompts_prefix_by_adapter() -> None:
    prompt = list(range(100, 164))
    router = PrefixRouter(2, 16)
    first = router.choose(prompt, None, [0, 0], "sql")
    assert router.choose(prompt, None, [0, 0], "sql") == first  # its cached prefix
    assert router.choose(prompt, None, [0, 0], "fr") != first  # no prefix there: the next in turn
