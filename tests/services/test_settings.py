"""services.settings: flags and DSASERVE_* variables come from the settings dataclasses."""

from __future__ import annotations

import argparse

import pytest

from dsaserve.engine.config import EngineConfig
from dsaserve.services import settings
from dsaserve.services.router.settings import RouterSettings
from dsaserve.services.worker.settings import DecodeSettings, PrefillSettings


def router_parser(environ: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    settings.add_settings(parser, RouterSettings, environ)
    return parser


def test_env_name() -> None:
    assert settings.env_name("--redis-url") == "DSASERVE_REDIS_URL"


def test_environment_fills_flags_with_types() -> None:
    env = {
        "DSASERVE_MODEL": "/models/tiny",
        "DSASERVE_PORT": "9001",
        "DSASERVE_REDIS_URL": "redis://r:6379/1",
        "DSASERVE_API_KEY": "k1, k2,",
        "DSASERVE_POLICY": "power_of_two",
        "DSASERVE_REGISTRY_TTL": "2.5",
        "DSASERVE_MAX_MODEL_LEN": "4096",
        "DSASERVE_CLUSTER_TOKEN": "t",
    }
    config = settings.from_args(RouterSettings, router_parser(env).parse_args([]))
    assert (config.model_dir, config.port, config.redis_url) == (
        "/models/tiny",
        9001,
        "redis://r:6379/1",
    )
    assert config.api_keys == ("k1", "k2")
    assert (config.policy, config.registry_ttl_s, config.max_model_len) == (
        "power_of_two",
        2.5,
        4096,
    )


def test_command_line_wins_and_replaces_env_lists() -> None:
    env = {"DSASERVE_MODEL": "/env", "DSASERVE_API_KEY": "env-key", "DSASERVE_PORT": "1"}
    env["DSASERVE_CLUSTER_TOKEN"] = "t"
    args = router_parser(env).parse_args(["--model", "/cli", "--api-key", "a", "--api-key", "b"])
    config = settings.from_args(RouterSettings, args)
    assert (config.model_dir, config.api_keys, config.port) == ("/cli", ("a", "b"), 1)


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
def test_switches_from_the_environment(raw: str, expected: bool) -> None:
    config = settings.parse(EngineConfig, [], "engine", {"DSASERVE_ENFORCE_EAGER": raw})
    assert config.enforce_eager is expected


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        ([], {}, None),
        (["--quantized-compute"], {}, True),
        (["--no-quantized-compute"], {}, False),
        ([], {"DSASERVE_QUANTIZED_COMPUTE": "0"}, False),
        (["--quantized-compute"], {"DSASERVE_QUANTIZED_COMPUTE": "0"}, True),
    ],
)
def test_undecided_switches_are_on_off_or_unset(argv, environ, expected) -> None:
    """A `bool | None` field left unset stays None (the engine decides from the dtype)."""
    assert settings.parse(EngineConfig, argv, "engine", environ).quantized_compute is expected


def test_nested_engine_settings_and_vllm_names() -> None:
    s = settings.parse(
        DecodeSettings,
        ["--cluster-token", "t", "--block-size", "16", "--max-model-len", "512", "--enforce-eager"],
        "decode",
    )
    assert (s.engine.page_size, s.engine.max_model_len, s.engine.enforce_eager) == (16, 512, True)
    assert (s.port, s.metrics_port, s.transfer_timeout) == (50052, 9101, 60.0)  # decode defaults
    assert s.engine.kv_cache_dtype == "auto"  # vLLM's --kv-cache-dtype: auto = the --dtype
    fp8 = settings.parse(DecodeSettings, ["--cluster-token", "t", "--kv-cache-dtype", "fp8"], "d")
    assert fp8.engine.kv_cache_dtype == "fp8"


def test_tensor_parallel_size_has_vllms_name_and_short_form() -> None:
    for argv in (["--tensor-parallel-size", "4"], ["-tp", "4"]):
        s = settings.parse(DecodeSettings, ["--cluster-token", "t", *argv], "decode")
        assert s.engine.tensor_parallel_size == 4
    environ = {"DSASERVE_TENSOR_PARALLEL_SIZE": "2"}
    assert settings.parse(EngineConfig, [], "engine", environ).tensor_parallel_size == 2


def test_old_flag_names_still_work_but_are_hidden() -> None:
    argv = ["--cluster-token", "t", "--context-length", "300", "--page-size", "8",
            "--no-cuda-graphs", "--kv-cache-memory", "1000000"]  # fmt: skip
    s = settings.parse(PrefillSettings, argv, "prefill")
    engine = s.engine
    assert (engine.max_model_len, engine.page_size, engine.enforce_eager) == (300, 8, True)
    assert engine.kv_cache_memory_bytes == 1_000_000
    from_env = settings.parse(
        PrefillSettings, ["--cluster-token", "t"], "prefill", {"DSASERVE_CONTEXT_LENGTH": "77"}
    )
    assert from_env.engine.max_model_len == 77
    parser = argparse.ArgumentParser()
    settings.add_settings(parser, PrefillSettings, {})
    help_text = parser.format_help()
    assert "--max-model-len" in help_text and "--context-length" not in help_text
    assert "[env DSASERVE_REDIS_URL]" in help_text


def test_settings_checks_become_errors() -> None:
    with pytest.raises(ValueError, match="cluster-token"):
        settings.parse(PrefillSettings, [], "prefill")
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")


def test_every_field_is_a_flag_once() -> None:
    for cls in (RouterSettings, PrefillSettings, DecodeSettings):
        options = [o for f in settings.flags(cls) for o in (f.option, *f.aliases)]
        assert len(options) == len(set(options)), cls
