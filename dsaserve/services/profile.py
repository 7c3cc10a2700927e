"""`dsaserve profile`: where the decode step's time goes, by kernel class and model part, against
the step's byte/FLOP floors (engine.profile).

Builds the engine from the checkpoint as a worker does (`LLMEngine`, with every engine flag:
device, dtype, KV memory, tensor parallelism, ...), gives it `--concurrency` requests whose
`--context` tokens are already in the KV cache (written into the pages, no prefill), times
`--steps` decode steps as they run, profiles as many eager ones, and prints the table
(`--json PATH`: also as JSON).
"""

from __future__ import annotations

import json as json_module
import os
import sys
from dataclasses import dataclass, field

from dsaserve.engine.config import EngineConfig, setting

HARDWARE = ("auto", "measure", "none")


@dataclass(frozen=True)
class ProfileSettings:
    """Decode-step profile"""

    engine: EngineConfig = field(default_factory=EngineConfig)
    model: str | None = setting(None, "model directory (default: the built-in demo model)")
    concurrency: int = setting(8, "requests decoding together: the rows of each step")
    context: int = setting(1024, "tokens of history each request has in the KV cache")
    steps: int = setting(5, "decode steps timed, and as many profiled")
    json: str | None = setting(None, "also write the report as JSON to this path")
    hardware: str = setting(
        "auto",
        "figures the floors divide by: auto (recorded for a known GPU, else measured), "
        "measure, or none (times only; the CPU has none)",
        choices=HARDWARE,
    )
    seed: int = setting(0, "seed of the synthetic history and of the first tokens")

    def __post_init__(self) -> None:
        for name in ("concurrency", "context", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")


Settings = ProfileSettings


def run(s: ProfileSettings) -> None:
    import torch

    from dsaserve.engine import models
    from dsaserve.engine.demo_model import DEMO_MODEL_DIR
    from dsaserve.engine.llm_engine import LLMEngine
    from dsaserve.engine.model_dir import ConfigError
    from dsaserve.engine.profile import hardware, history
    from dsaserve.engine.profile.decode import profile_engine, steps_run
    from dsaserve.engine.profile.history import HistoryError
    from dsaserve.engine.profile.report import format_table
    from dsaserve.engine.rank import device_of

    model = s.model or str(DEMO_MODEL_DIR)
    if not os.path.isdir(model):
        sys.exit(f"dsaserve profile: --model {model}: no such directory")
    try:
        # What the checkpoint allows, before minutes of loading it.
        cfg = models.family(model).ModelConfig.from_dir(model)
        if cfg.family != "deepseek_v4":  # the floors and parts of engine.profile are V4's
            raise ConfigError(f"profiles DeepSeek-V4 checkpoints only; {model} is {cfg.family}")
        max_len = s.engine.max_model_len or cfg.max_position_embeddings
        history.check(s.concurrency, s.context, steps_run(s.steps), max_len, s.engine)
        # Before the engine claims its KV memory (a measurement allocates 8 GiB).
        hw = hardware.for_device(device_of(s.engine, 0), s.hardware)
        engine = LLMEngine(model, s.engine)
    except (ConfigError, HistoryError, ValueError, OSError) as e:
        sys.exit(f"dsaserve profile: {e}")
    try:
        with torch.inference_mode():
            report = profile_engine(
                engine,
                concurrency=s.concurrency,
                context=s.context,
                steps=s.steps,
                hardware=hw,
                seed=s.seed,
            )
    except HistoryError as e:
        sys.exit(f"dsaserve profile: {e}")
    finally:
        engine.close()
    print(format_table(report), flush=True)
    if s.json:
        with open(s.json, "w") as f:
            json_module.dump(report.as_dict(), f, indent=2)
            f.write("\n")
