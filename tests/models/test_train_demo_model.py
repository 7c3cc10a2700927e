"""scripts/train_demo_model.py end to end on CPU with a tiny model: it trains, and its export is a
model directory the engine serves (the shipped demo model is made by the same code on a GPU)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from dsaserve.engine.llm import LLM
from dsaserve.engine.sampling_params import SamplingParams
from tests import REPO_ROOT

pytestmark = pytest.mark.e2e  # the training script, trained and served

SCRIPT = REPO_ROOT / "scripts" / "train_demo_model.py"

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers has no DeepSeek-V4", allow_module_level=True)


def _trainer():
    spec = importlib.util.spec_from_file_location("train_demo_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_training_exports_a_model_the_engine_serves(tmp_path):
    out = tmp_path / "dsaserve-demo-v4"
    _trainer().main(
        [
            "--device",
            "cpu",
            "--smoke",
            "--steps",
            "6",
            "--seq-len",
            "64",
            "--batch-size",
            "2",
            "--log-every",
            "3",
            "--eval-every",
            "3",
            "--eval-bytes",
            "1024",
            "--sample-tokens",
            "8",
            "--threads",
            "1",
            "--mtp-steps",
            "2",
            "--out",
            str(out),
        ]
    )
    files = {p.name for p in out.iterdir()}  # the GPU machine returns at most 8 files
    assert files <= {
        "README.md",
        "config.json",
        "generation_config.json",
        "loss.png",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "train_log.json",
    }
    assert "model.safetensors" in files and "README.md" in files
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 6 and log["evals"][-1]["heldout_bpb"] < log["evals"][0]["heldout_bpb"]
    check = log["engine_check"]
    assert check["rel_diff"] < 1e-4 and check["logits_rel_err"] < 1e-4, check
    assert "untrained" in (out / "README.md").read_text()

    llm = LLM(out, max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory_bytes=32 << 20)
    [res] = llm.generate(
        llm.tokenizer.encode_chat([{"role": "user", "content": "Speak."}]),
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
    )
    assert len(res.token_ids) == 5
