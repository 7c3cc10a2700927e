"""services.flags: every flag can come from DSASERVE_*; the command line wins."""

from __future__ import annotations

import argparse

import pytest

from services import flags
from services.router.main import add_arguments, config_from_args


def router_parser(environ: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags.env_defaults(parser, environ)
    return parser


def test_env_name() -> None:
    assert flags.env_name("--redis-url") == "DSASERVE_REDIS_URL"


def test_environment_fills_flags_with_types() -> None:
    env = {
        "DSASERVE_MODEL": "/models/tiny",
        "DSASERVE_PORT": "9001",
        "DSASERVE_REDIS_URL": "redis://r:6379/1",
        "DSASERVE_API_KEY": "k1, k2,",
        "DSASERVE_POLICY": "power_of_two",
        "DSASERVE_REGISTRY_TTL": "2.5",
    }
    config = config_from_args(router_parser(env).parse_args([]))
    assert (config.model_dir, config.port, config.redis_url) == (
        "/models/tiny",
        9001,
        "redis://r:6379/1",
    )
    assert config.api_keys == ("k1", "k2")
    assert (config.policy, config.registry_ttl_s) == ("power_of_two", 2.5)


def test_command_line_wins_and_replaces_env_lists() -> None:
    env = {"DSASERVE_MODEL": "/env", "DSASERVE_API_KEY": "env-key", "DSASERVE_PORT": "1"}
    args = router_parser(env).parse_args(["--model", "/cli", "--api-key", "a", "--api-key", "b"])
    assert (args.model, args.api_key, args.port) == ("/cli", ["a", "b"], 1)


def test_required_flag_still_required_without_env() -> None:
    with pytest.raises(SystemExit):
        router_parser({}).parse_args([])


def test_bad_env_value_names_the_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        router_parser({"DSASERVE_MODEL": "/m", "DSASERVE_POLICY": "fastest"})
    assert "DSASERVE_POLICY='fastest'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("raw", "expected"), [("1", True), ("yes", True), ("off", False), ("False", False)]
)
def test_switches(raw: str, expected: bool) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--no-color", dest="color", action="store_false")
    flags.env_defaults(parser, {"DSASERVE_VERBOSE": raw, "DSASERVE_NO_COLOR": raw})
    args = parser.parse_args([])
    assert (args.verbose, args.color) == (expected, not expected)


def test_help_mentions_the_variable() -> None:
    assert "[env DSASERVE_REDIS_URL]" in router_parser({}).format_help()
