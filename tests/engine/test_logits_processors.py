"""vLLM's sampling extensions (engine.logits_processors, the sampler's min_p): each against a
reference written from vLLM's formulas one token at a time, then in the engine: min_tokens
never ends a request early, the stop reason is reported, a speculative step keeps greedy
tokens under the same parameters."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dsaserve.engine.config import EngineConfig
from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.logits_processors import RowTokens, adjust, bad_words_ids
from dsaserve.engine.request import RequestError
from dsaserve.engine.sampler import probabilities, sample
from dsaserve.engine.sampling_params import SamplingParams
from tests.engine_cases import assert_all_free, drain

VOCAB = 40
EOS = 1
INF = float("inf")


def reference(
    logits: list[float],
    p: SamplingParams,
    prompt: list[int],
    output: list[int],
    bad: list[list[int]],
) -> list[float]:
    """One row as vLLM's sampler processes it, token by token."""
    x = list(logits)
    if p.allowed_token_ids is not None:
        x = [v if t in p.allowed_token_ids else -INF for t, v in enumerate(x)]
    for word in bad:
        if len(word) == 1 or output[len(output) - len(word) + 1 :] == word[:-1]:
            x[word[-1]] = -INF
    if len(output) < p.min_tokens:
        for t in {EOS, *p.stop_token_ids}:
            x[t] = -INF
    for t, b in p.logit_bias.items():
        x[t] += b
    for t in range(len(x)):
        if x[t] == -INF:
            continue
        if t in prompt or t in output:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        count = output.count(t)
        x[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return x


CASES = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7),
    SamplingParams(frequency_penalty=0.8),
    SamplingParams(presence_penalty=-1.5),
    SamplingParams(presence_penalty=0.5, frequency_penalty=-0.4, repetition_penalty=1.2),
    SamplingParams(logit_bias={3: 5.0, 7: -100.0, 9: 250.0}),  # (250 clamps to 100)
    SamplingParams(allowed_token_ids=[2, 3, 5, 30]),
    SamplingParams(min_tokens=4, stop_token_ids=[6]),
    SamplingParams(min_tokens=2),  # (the output below is longer: nothing masked)
    SamplingParams(bad_words=["x"]),
    SamplingParams(
        min_tokens=9, logit_bias={EOS: 30.0}, repetition_penalty=1.5, allowed_token_ids=[1, 4, 8]
    ),
]
BAD = [[12], [20, 21], [22, 4, 23]]  # one token; a pair whose head ends the output; a miss


@pytest.mark.parametrize("params", CASES, ids=range(len(CASES)))
def test_each_processor_matches_the_written_reference(params):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=gen) * 3
    prompt, output = [2, 3, 3, 11], [5, 3, 20, 9, 9]
    bad = BAD if params.bad_words else []
    rows = [
        RowTokens(
            params, prompt, output, len(output), frozenset({EOS, *params.stop_token_ids}), bad
        ),
        None,  # a row without parameters is left alone
        RowTokens(SamplingParams(), prompt, output, len(output), frozenset({EOS})),
    ]
    got = adjust(logits, rows)
    want = torch.tensor(reference(logits[0].tolist(), params, prompt, output, bad))
    assert torch.equal(torch.isinf(got[0]), torch.isinf(want))
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got[0][finite], want[finite], rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1:], logits[1:])


def test_nothing_to_do_returns_the_same_logits():
    logits = torch.randn(2, VOCAB)
    plain = RowTokens(SamplingParams(), [1], [2], 1, frozenset({EOS}))
    assert adjust(logits, [plain, None]) is logits
    biased = RowTokens(SamplingParams(logit_bias={4: 1.0}), [1], [2], 1, frozenset({EOS}))
    out = adjust(logits, [biased, None])
    assert out is not logits and out[0, 4] == logits[0, 4] + 1  # (the input is left as it was)


def test_min_p_keeps_only_tokens_near_the_likeliest():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    for min_p, kept in ((0.0, 5), (0.15, 3), (0.5, 2), (1.0, 1)):
        params = [SamplingParams(temperature=1.0, min_p=min_p)]
        probs = probabilities(logits, params)[0]
        assert int((probs > 0).sum()) == kept, min_p
        drawn = {int(sample(logits, params, [i])[0]) for i in range(200)}
        assert drawn <= set(range(kept)) and (len(drawn) > 1) == (kept > 1)
    # temperature first: at t = 4 the tail is likelier against the head, and min_p keeps more
    hot = probabilities(logits, [SamplingParams(temperature=4.0, min_p=0.55)])[0]
    assert int((hot > 0).sum()) == 4


def test_bad_words_are_tokenized_alone_and_after_a_space():
    engine = LLMEngine(DEMO_MODEL_DIR, EngineConfig(max_num_seqs=2))
    tok = engine.tokenizer
    ids = bad_words_ids(tok, ["thee", " thou"])
    assert tok.encode("thee") in ids and tok.encode("thou") in ids
    assert all(tok.decode(i).strip() in ("thee", "thou") for i in ids)


@pytest.fixture(scope="module")
def demo() -> LLMEngine:
    return LLMEngine(DEMO_MODEL_DIR, EngineConfig(max_num_seqs=4, enable_prefix_caching=False))


def _run(engine: LLMEngine, params: SamplingParams, prompt: list[int] | None = None):
    engine.add_request("r", prompt or [256, *b"ROMEO:"], params)
    outs = drain(engine)["r"]
    assert_all_free(engine)
    return [t for o in outs for t in o.new_token_ids], outs[-1]


def test_min_tokens_keeps_eos_and_stops_out_until_then(demo):
    eos = min(demo.eos_token_ids)
    forced = SamplingParams(max_tokens=20, temperature=0, logit_bias={eos: 100.0})
    tokens, last = _run(demo, forced)
    assert tokens == [eos] and last.finish_reason == "stop" and last.stop_reason is None
    tokens, last = _run(demo, SamplingParams(**{**vars(forced), "min_tokens": 5}))
    assert len(tokens) == 6 and tokens[-1] == eos and eos not in tokens[:5]
    assert last.finish_reason == "stop" and last.stop_reason is None
    # a stop token ends it the same way, and is the stop reason
    stop = SamplingParams(max_tokens=20, temperature=0, logit_bias={65: 100.0}, stop_token_ids=[65])
    tokens, last = _run(demo, SamplingParams(**{**vars(stop), "min_tokens": 3}))
    assert len(tokens) == 4 and tokens[-1] == 65 and 65 not in tokens[:3]
    assert last.stop_reason == 65


def test_min_tokens_keeps_stop_strings_out_until_then(demo):
    # every token forced to "a": the stop string "a" ends the text at the min_tokens-th token
    params = SamplingParams(max_tokens=20, temperature=0, logit_bias={97: 100.0}, stop=["a"])
    tokens, last = _run(demo, params)
    assert len(tokens) == 1 and last.stop_reason == "a"
    tokens, last = _run(demo, SamplingParams(**{**vars(params), "min_tokens": 4}))
    assert len(tokens) == 4 and last.finish_reason == "stop" and last.stop_reason == "a"


def test_penalties_and_bans_change_what_is_drawn(demo):
    plain, _ = _run(demo, SamplingParams(max_tokens=24, temperature=0))
    assert len(set(plain)) < len(plain)  # (greedy repeats itself: the penalties have work)
    for params in (
        SamplingParams(max_tokens=24, temperature=0, presence_penalty=2.0),
        SamplingParams(max_tokens=24, temperature=0, frequency_penalty=2.0),
        SamplingParams(max_tokens=24, temperature=0, repetition_penalty=3.0),
    ):
        tokens, _ = _run(demo, params)
        assert tokens != plain and len(set(tokens)) > len(set(plain)), params
    allowed, _ = _run(
        demo, SamplingParams(max_tokens=12, temperature=0, allowed_token_ids=[97, 98])
    )
    assert set(allowed) <= {97, 98}
    banned = sorted(set(plain))[:3]
    words = [bytes([t]).decode("latin-1") for t in banned if 33 <= t < 127]
    tokens, _ = _run(demo, SamplingParams(max_tokens=24, temperature=0, bad_words=words))
    assert not {ord(w) for w in words} & set(tokens)


def test_token_ids_out_of_the_vocabulary_are_refused(demo):
    for params in (
        SamplingParams(logit_bias={10**6: 1.0}),
        SamplingParams(allowed_token_ids=[3, 10**6]),
    ):
        with pytest.raises(RequestError, match="must be in"):
            demo.add_request("x", [256, 65], params)
    for bad in (
        dict(min_tokens=9, max_tokens=4),
        dict(presence_penalty=2.5),
        dict(repetition_penalty=0),
        dict(min_p=1.5),
        dict(logit_bias={3: math.nan}),
        dict(allowed_token_ids=[]),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_a_speculative_step_draws_the_same_greedy_tokens_under_the_parameters(demo):
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    engine = LLMEngine(
        DEMO_MODEL_DIR,
        EngineConfig(max_num_seqs=4, enable_prefix_caching=False, speculative_config=spec),
    )
    eos = min(demo.eos_token_ids)
    for params in (
        SamplingParams(max_tokens=20, temperature=0, repetition_penalty=2.0, min_tokens=6),
        SamplingParams(max_tokens=20, temperature=0, frequency_penalty=1.5, logit_bias={eos: 9.0}),
        SamplingParams(max_tokens=20, temperature=0, min_tokens=4, logit_bias={eos: 100.0}),
    ):
        assert _run(engine, params)[0] == _run(demo, params)[0], params
