"""scripts/demo_dspark.py end to end on CPU in seconds: it trains a DSpark head for a copy of the
demo model, writes the checkpoint with it (which the engine drafts with, its greedy tokens those
without speculation), and puts the run into the copy's model card."""

from __future__ import annotations

import shutil

import pytest

from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.llm import LLM
from dsaserve.engine.sampling_params import SamplingParams
from scripts import demo_dspark

pytestmark = pytest.mark.e2e  # the training script, trained and served


def test_a_smoke_run_writes_a_head_the_engine_drafts_with(tmp_path):
    model = shutil.copytree(DEMO_MODEL_DIR, tmp_path / "demo")
    out = tmp_path / "demo-dspark"
    demo_dspark.main(
        ["--model", str(model), "--out", str(out), "--sequences", "4", "--heldout", "2",
         "--seq-len", "48", "--prompt-bytes", "24", "--batch-size", "2", "--anchors", "4",
         "--steps", "2", "--threads", "1"]
    )  # fmt: skip
    assert "## DSpark" in (model / "README.md").read_text()  # (the copy's card, not the demo's)
    prompt = [256, *b"ROMEO:\nWhat light"]
    params = SamplingParams(max_tokens=8, temperature=0)
    spec = LLM(out, max_num_seqs=2, speculative_config={"method": "dspark"})
    got = spec.generate([prompt], params)[0].token_ids
    assert got == LLM(model, max_num_seqs=2).generate([prompt], params)[0].token_ids
    assert spec.engine.speculator.stats.num_drafts > 0
