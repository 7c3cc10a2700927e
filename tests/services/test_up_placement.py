"""`dsaserve up` on a GPU machine: which GPUs and tensor-parallel size each worker gets."""

from __future__ import annotations

import pytest

from dsaserve.services import settings
from dsaserve.services.up import Placement, UpSettings, place

EIGHT = [str(i) for i in range(8)]


def _place(argv: list[str], visible: list[str], splits=lambda n: True) -> dict[str, Placement]:
    return place(settings.parse(UpSettings, ["--device", "cuda", *argv], "up", {}), visible, splits)


def test_by_default_the_visible_gpus_split_in_half_prefill_first():
    assert _place([], EIGHT) == {
        "prefill": Placement(4, ("0", "1", "2", "3")),
        "decode": Placement(4, ("4", "5", "6", "7")),
    }
    # CUDA_VISIBLE_DEVICES entries pass through as they are (indices or UUIDs)
    assert _place([], ["GPU-a", "GPU-b"]) == {
        "prefill": Placement(1, ("GPU-a",)),
        "decode": Placement(1, ("GPU-b",)),
    }


def test_a_half_the_model_cannot_split_into_shrinks_to_the_largest_size_it_can():
    groups = _place([], EIGHT, splits=lambda n: 262 % n == 0)  # e.g. a vocabulary of 262
    assert groups == {"prefill": Placement(2, ("0", "1")), "decode": Placement(2, ("2", "3"))}


def test_sizes_and_devices_can_be_given_per_role():
    assert _place(["-tp", "2"], EIGHT) == {
        "prefill": Placement(2, ("0", "1")),
        "decode": Placement(2, ("2", "3")),
    }
    assert _place(["--prefill-tp", "2", "--decode-tp", "1"], EIGHT)["decode"] == Placement(
        1, ("2",)
    )
    groups = _place(["--prefill-devices", "6,7", "--decode-devices", "0,1,2,3"], EIGHT)
    assert groups == {
        "prefill": Placement(2, ("6", "7")),
        "decode": Placement(4, ("0", "1", "2", "3")),
    }
    # decode takes its default size (half) from the GPUs prefill left
    assert _place(["--prefill-devices", "0,5"], EIGHT)["decode"] == Placement(
        4, ("1", "2", "3", "4")
    )


def test_one_gpu_is_shared_and_impossible_requests_say_what_to_change():
    assert _place([], ["0"]) == {"prefill": Placement(1, ("0",)), "decode": Placement(1, ("0",))}
    with pytest.raises(SystemExit, match="decode worker needs 4 GPUs but only 2"):
        _place(["--prefill-tp", "2", "--decode-tp", "4"], ["0", "1", "2", "3"])
    with pytest.raises(SystemExit, match="--prefill-devices names 2 GPUs for .* size of 4"):
        _place(["--prefill-devices", "0,1", "--prefill-tp", "4"], EIGHT)


def test_on_the_cpu_only_the_sizes_matter():
    s = settings.parse(UpSettings, ["--decode-tp", "2"], "up", {})
    assert place(s, [], lambda n: True) == {"prefill": Placement(1), "decode": Placement(2)}


def test_engine_flags_give_a_worker_the_same_engine_config():
    """What `dsaserve up` passes on parses back to the config it was given, switches that
    default on turned off by their --no- form."""
    from dsaserve.engine.config import EngineConfig
    from dsaserve.services.up import engine_flags
    from dsaserve.services.worker.settings import WorkerSettings

    given = EngineConfig(
        enable_prefix_caching=False,
        async_scheduling=False,
        enforce_eager=True,
        kv_offloading_size=0.5,
        prefix_cache_checkpoint_interval=256,
    )
    argv = engine_flags(given)
    assert "--no-enable-prefix-caching" in argv and "--no-async-scheduling" in argv
    parsed = settings.parse(WorkerSettings, [*argv, "--cluster-token", "t"], "worker", environ={})
    assert parsed.engine == given
