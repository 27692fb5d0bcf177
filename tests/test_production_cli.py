"""The production options: flags and FLASHSERVE_* environment variables."""

from __future__ import annotations

import pytest

from flashserve.cli import build_parser
from flashserve.serve_args import to_configs


def test_production_options_default_to_open_unbounded_and_a_thirty_second_drain() -> None:
    args = to_configs(build_parser({}).parse_args(["serve"]))
    assert args.api.api_keys == () and args.api.allowed_origins == () and not args.api.log_requests
    assert args.max_waiting is None and args.queue_timeout is None
    assert args.shutdown_timeout == 30.0 and args.api.max_body_bytes == 8 << 20


def test_production_options_come_from_environment_variables() -> None:
    env = {"FLASHSERVE_API_KEY": "k1,k2", "FLASHSERVE_MAX_WAITING": "64", "FLASHSERVE_QUEUE_TIMEOUT": "2.5",
           "FLASHSERVE_SHUTDOWN_TIMEOUT": "0", "FLASHSERVE_ALLOWED_ORIGINS": "https://a.example",
           "FLASHSERVE_LOG_REQUESTS": "true", "FLASHSERVE_MAX_BODY_BYTES": "1000"}
    args = to_configs(build_parser(env).parse_args(["serve"]))
    assert args.api.api_keys == ("k1", "k2") and args.server.api_keys == ("k1", "k2")
    assert (args.max_waiting, args.queue_timeout, args.shutdown_timeout) == (64, 2.5, 0.0)
    assert args.api.allowed_origins == ("https://a.example",) and args.api.log_requests
    assert args.api.max_body_bytes == 1000


def test_production_flags_override_the_environment() -> None:
    args = to_configs(build_parser({"FLASHSERVE_API_KEY": "env"}).parse_args(
        ["serve", "--api-key", "a", "b", "--max-waiting", "3", "--allow-credentials"]))
    assert args.api.api_keys == ("a", "b") and args.max_waiting == 3 and args.api.allow_credentials


@pytest.mark.parametrize("flags", [["--max-waiting", "0"], ["--queue-timeout", "0"], ["--shutdown-timeout", "-1"],
                                   ["--max-body-bytes", "0"]])
def test_out_of_range_production_options_are_refused(flags: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["serve", *flags])
