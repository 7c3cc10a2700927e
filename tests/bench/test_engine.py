"""bench/engine.py --write-slice: the checkpoint bench/gpu_profile.sh hands to `dsaserve profile`
is the bench's slice, and the engine loads it in both formats (here at the --smoke widths)."""

from __future__ import annotations

import dataclasses

import pytest

from bench.engine import slice_config, write_slice
from dsaserve.engine.config import EngineConfig
from dsaserve.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.e2e  # a bench run end to end (--smoke)

ENGINE = EngineConfig(kv_cache_memory_bytes=96 << 20, max_num_seqs=2, max_num_batched_tokens=64)


@pytest.mark.parametrize(("fmt", "dtype"), [("dense", "float32"), ("release", "bfloat16")])
def test_the_written_slice_is_the_bench_slice_and_loads(tmp_path, fmt, dtype):
    model_dir = write_slice(str(tmp_path / fmt), num_experts=8, fmt=fmt, smoke=True)
    engine = LLMEngine(model_dir, dataclasses.replace(ENGINE, dtype=dtype))
    want = slice_config(8, smoke=True)
    got = engine.model_config
    for field in (
        "layer_types",
        "mlp_layer_types",
        "hidden_size",
        "num_heads",
        "head_dim",
        "index_topk",
        "num_experts",
        "vocab_size",
        "max_position_embeddings",
    ):
        assert getattr(got, field) == getattr(want, field), field
    assert (got.quantization is not None) == (fmt == "release")
    assert not got.mtp_layer_types


@pytest.mark.parametrize(("fmt", "dtype"), [("dense", "float32"), ("release", "bfloat16")])
def test_the_v32_slice_is_written_at_its_widths_and_loads(tmp_path, fmt, dtype):
    """--model-type deepseek_v32: the V3.2-width slice (here at the --smoke widths)."""
    model_dir = write_slice(str(tmp_path / fmt), 8, fmt, smoke=True, model_type="deepseek_v32")
    engine = LLMEngine(model_dir, dataclasses.replace(ENGINE, dtype=dtype))
    want = slice_config(8, smoke=True, model_type="deepseek_v32")
    got = engine.model_config
    assert got.family == "deepseek_v32"
    # the slice's widths and layers; the tokenizer's ids and the formats are the writer's
    mine = dict(quantization=None, bos_token_id=None, eos_token_ids=())
    assert dataclasses.replace(got, **mine) == dataclasses.replace(want, **mine)
    assert (got.quantization is not None) == (fmt == "release")
    assert engine.pool.groups["mla"].kv[0].shape[1] == 128 + 32  # the smoke latent + RoPE


def test_a_failed_reference_check_leaves_no_request_running(monkeypatch):
    """A check that fails mid-prefill (an out-of-memory on an 80 GB card, once) must not leave
    its request running: the next decode phase would step c + 1 rows, past the largest CUDA
    graph at c=64, and time eager steps."""
    import torch

    from bench import engine as bench_engine

    cfg = slice_config(8, smoke=True, model_type="deepseek_v32")
    bench = bench_engine.Bench(cfg, max_seqs=8, kv_bytes=64 << 20, dev=torch.device("cpu"))
    calls = []

    def fail_on_prefill(layer, args):
        calls.append(args[0].shape[0])
        if args[0].shape[0] > 4:
            raise torch.OutOfMemoryError("as on the H100")

    bench.model.layers[1].register_forward_pre_hook(fail_on_prefill)
    with pytest.raises(torch.OutOfMemoryError):
        bench_engine.check_against_reference(bench, context=32, prefill=48)
    assert calls[-1] == 48  # the decode check ran, then the prefill failed
    assert not bench.scheduler.running
    tok_s, _ = bench.decode_tokens_per_s(2, 32, steps=1)
    assert tok_s > 0
