"""bench.fake_quant, the fp32 fake-quant reference that judges release-format paths: it keeps
the codes and scales, runs a prompt and decode rows on a pool of its own as the engine does,
and teacher forcing puts a layer's error in that layer alone."""

from __future__ import annotations

import importlib

import pytest
import torch

from bench.fake_quant import OnePrompt, compare, layer_labels, reference_model
from dsaserve.engine import models
from dsaserve.engine.llm import LLM
from tests.release_reference import ENGINE, release_ids

POOL_BYTES = 32 << 20


@pytest.fixture(scope="module", params=["deepseek_v4", "deepseek_v32"])
def checkpoint(request, tmp_path_factory):
    """A tiny release-format checkpoint of each family."""
    tiny = importlib.import_module(f"{models.FAMILIES[request.param]}.tiny")
    return tiny.make_tiny_model(tmp_path_factory.mktemp(request.param), fmt="release")


def quantized_model(model_dir, dtype: torch.dtype = torch.bfloat16):
    """The checkpoint with its FP8/FP4 weights kept, computed as the release does."""
    family = models.family(model_dir)
    model = family.build_model(
        family.ModelConfig.from_dir(model_dir), dtype, torch.device("cpu"), quantized=True
    )
    family.load_weights(model, model_dir)
    return model


def test_the_reference_keeps_codes_and_scales_and_widens_the_rest(checkpoint):
    model = quantized_model(checkpoint)
    ref = reference_model(model)
    got, want = model.state_dict(), ref.state_dict()
    kept = 0
    for name, t in want.items():
        if got[name].dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8):
            assert t.dtype == got[name].dtype and torch.equal(
                t.view(torch.uint8), got[name].view(torch.uint8)
            ), name
            kept += 1
        elif got[name].is_floating_point():
            assert t.dtype == torch.float32 and torch.equal(t, got[name].float()), name
    assert kept > 0


def test_one_prompt_computes_what_the_engine_computes(checkpoint):
    """The prefill's last row and one decode row, on the reference's own pool, equal the
    engine's fp32 fake-quant scores of the same tokens."""
    llm = LLM(checkpoint, dtype="float32", quantized_compute=True, **ENGINE)
    ids = release_ids(40, seed=3)
    want = llm.score([*ids, 5]).float()  # [41, vocab]
    prompt = OnePrompt(reference_model(quantized_model(checkpoint)), ids, POOL_BYTES)
    first = prompt.run()
    assert len(first.outputs) == len(first.inputs) == prompt.model.cfg.num_layers
    vocab = want.shape[-1]  # (the engine scores the tokenizer's ids, not the padded rows)
    torch.testing.assert_close(first.logits[0, :vocab], want[-2], rtol=1e-4, atol=1e-4)
    decoded = prompt.decode(5).logits[0, :vocab]
    torch.testing.assert_close(decoded, want[-1], rtol=1e-4, atol=1e-4)


def test_teacher_forcing_puts_an_error_in_its_own_layer(checkpoint):
    """A doubled FP8 scale block in layer 1's shared expert (w2: no norm after it to undo a
    power of two): teacher-forced, layer 1 alone differs (the others compute the same
    arithmetic on the same inputs: exactly equal); free-running, every later layer too."""
    ref = reference_model(quantized_model(checkpoint))
    bad = reference_model(ref)
    scale = bad.layers[1].ffn.shared_experts.w2.scale
    scale.view(torch.uint8)[0, 0] += 1  # one 128x128 block's scale times 2
    ids = release_ids(40, seed=4)
    want = OnePrompt(ref, ids, POOL_BYTES).run()
    labels = layer_labels(ref.cfg)
    forced = compare(OnePrompt(bad, ids, POOL_BYTES).run(teacher=want), want, labels)
    errors = [row["rel_err"] for row in forced["layers"]]
    assert errors[1] > 1e-2
    assert all(e == 0.0 for i, e in enumerate(errors) if i != 1), errors
    free = compare(OnePrompt(bad, ids, POOL_BYTES).run(), want, labels)
    assert free["layers"][0]["rel_err"] == 0.0
    assert all(row["rel_err"] > 1e-3 for row in free["layers"][1:]), free
