"""Structured outputs: the reply grammars (engine.text.chat.constraint) read back by the reply
parser, and the engine sampling under them (engine.structured), the same with and without
async scheduling. Through the router and disaggregated workers: test_serving_chat_e2e.py."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import llguidance.torch
import numpy as np
import pytest
import torch

from dsaserve.engine.config import EngineConfig
from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.structured import Bitmask, apply_bitmask
from dsaserve.engine.text.byte_tokenizer import write_byte_tokenizer
from dsaserve.engine.text.chat import V4_DSML, V32_DSML, Dialect, parse_completion
from dsaserve.engine.text.chat.constraint import (
    JsonContent,
    ReplyConstraint,
    reply_grammar,
    tool_schemas,
)
from dsaserve.engine.text.chat.tokens import DSML, EOS, PARAMETER_CLOSE, THINK_END
from dsaserve.engine.text.grammar import GrammarCompiler, GrammarError
from dsaserve.engine.text.tokenizer import Tokenizer
from tests.engine_cases import assert_all_free, drain

ANSWER = {  # what pydantic writes for a model of a Literal, a bounded int and a bool
    "type": "object",
    "properties": {
        "verdict": {"type": "string", "enum": ["yes", "no"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 9},
        "sure": {"type": "boolean"},
    },
    "required": ["verdict", "confidence", "sure"],
    "additionalProperties": False,
}
WEATHER = {
    "name": "get_weather",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 7}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
NOW = {"name": "now", "parameters": {"type": "object", "properties": {}}}
TOOLS = tool_schemas([{"type": "function", "function": f} for f in (WEATHER, NOW)])
CONSTRAINTS = {
    "json_object": ReplyConstraint(json=JsonContent(None, False, "response_format")),
    "json_schema": ReplyConstraint(json=JsonContent(ANSWER, True, "response_format")),
    "required": ReplyConstraint(tools=TOOLS, calls_required=True),
    "named": ReplyConstraint(tools=TOOLS[:1], calls_required=True, single_call=True),
    "strict_auto": ReplyConstraint(tools=TOOLS),
}


@pytest.fixture(scope="module")
def release_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The release-format tiny model's tokenizer (every V4 marker one token)."""
    out = tmp_path_factory.mktemp("release-tokenizer")
    write_byte_tokenizer(out, release=True)
    return Tokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def compiler(release_tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(release_tokenizer)


def _allowed(compiler: GrammarCompiler, matcher: object) -> np.ndarray:
    """The token ids a matcher allows next."""
    mask = torch.zeros((1, (compiler.vocab_size + 31) // 32), dtype=torch.int32)
    llguidance.torch.fill_next_token_bitmask(matcher, mask)
    bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[: compiler.vocab_size])


@pytest.mark.parametrize(
    ("thinking", "dialect"),
    [(False, V4_DSML), (True, V4_DSML), (False, V32_DSML)],
    ids=["chat", "thinking", "v32"],
)
@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_every_reply_the_grammar_allows_parses_into_what_was_asked(
    compiler: GrammarCompiler,
    release_tokenizer: Tokenizer,
    name: str,
    thinking: bool,
    dialect: Dialect,
) -> None:
    """Random walks through the grammar (short ASCII pieces favoured, a string parameter's
    close tag and EOS taken when allowed): whatever the walk writes, the reply parser reads
    valid JSON, or calls whose arguments follow the strict tool's schema; EOS comes only where
    the constrained part is complete."""
    tokenizer = release_tokenizer
    (eos,) = tokenizer.eos_token_ids
    close = tokenizer.encode(PARAMETER_CLOSE)
    constraint = CONSTRAINTS[name]
    grammar = reply_grammar(constraint, compiler, dialect, thinking)
    assert grammar is not None
    rng, ended = random.Random(0), 0
    for _ in range(6):
        matcher, out = compiler.matcher(grammar), []
        while len(out) < 300 and eos not in out:
            if rng.random() < 0.2 and matcher.validate_tokens(close) == len(close):
                assert matcher.consume_tokens(close)
                out += close
            allowed = _allowed(compiler, matcher).tolist()
            short = [t for t in allowed if t in (10, 32, 34, 123, 125) or 48 <= t < 58]
            if eos in allowed and rng.random() < 0.5:
                token = eos
            else:
                token = rng.choice(short if short and rng.random() < 0.7 else allowed)
            assert matcher.consume_token(token)
            out.append(token)
        if eos not in out:
            continue
        ended += 1
        text = tokenizer.decode(out, skip_special_tokens=False)
        message = parse_completion(text, thinking, dialect=dialect)
        assert message.complete and not message.malformed
        if constraint.json is not None:
            value = json.loads(message.content)
            assert isinstance(value, dict)
            if constraint.json.schema is not None:
                assert set(value) == set(ANSWER["properties"]) and value["verdict"] in ("yes", "no")
        if constraint.calls_required:
            assert message.tool_calls and not message.content
        for call in message.tool_calls:
            arguments = json.loads(call.arguments)
            if call.name == "get_weather":
                assert set(arguments) == {"city", "days"} and arguments["days"] <= 7
    assert ended, "no walk reached the end of the reply"


def test_reasoning_is_free_and_the_constraint_starts_where_it_ends(
    compiler: GrammarCompiler, release_tokenizer: Tokenizer
) -> None:
    tokenizer = release_tokenizer
    (eos,) = tokenizer.eos_token_ids
    (think_end,) = tokenizer.encode(THINK_END)
    grammar = reply_grammar(CONSTRAINTS["json_schema"], compiler, V4_DSML, True)
    assert grammar is not None
    matcher = compiler.matcher(grammar)
    for token in tokenizer.encode("I think {so}."):
        allowed = _allowed(compiler, matcher)
        assert token in allowed and think_end in allowed and eos not in allowed  # no early end
        assert matcher.consume_token(token)
    assert matcher.consume_token(think_end)
    assert _allowed(compiler, matcher).tolist() == tokenizer.encode("{")
    for token in tokenizer.encode('{"verdict": "no", "confidence": 3, "sure": false}'):
        assert eos not in _allowed(compiler, matcher)
        assert matcher.consume_token(token)
    assert _allowed(compiler, matcher).tolist() == [eos]
    assert tokenizer.encode(EOS) == [eos]
    # thinking_token_budget: after that many tokens, </think> is all that is left
    bounded = replace(CONSTRAINTS["json_object"], thinking_token_budget=3)
    matcher = compiler.matcher(reply_grammar(bounded, compiler, V4_DSML, True) or "")
    assert matcher.consume_tokens(tokenizer.encode("abc"))
    assert _allowed(compiler, matcher).tolist() == [think_end]
    # with nothing else constrained, only the reasoning is: the rest is free
    free = reply_grammar(ReplyConstraint(thinking_token_budget=3), compiler, V4_DSML, True)
    matcher = compiler.matcher(free or "")
    assert matcher.consume_tokens(tokenizer.encode("ab") + [think_end])
    assert matcher.consume_tokens(tokenizer.encode(f"any <{DSML}tool_calls> text")) and eos in (
        _allowed(compiler, matcher)
    )
    assert reply_grammar(ReplyConstraint(thinking_token_budget=3), compiler, V4_DSML, False) is None


def test_a_strict_schema_is_compiled_exactly_or_refused_by_name(
    compiler: GrammarCompiler,
) -> None:
    conditional = {"type": "object", "if": {"required": ["a"]}}
    strict = ReplyConstraint(json=JsonContent(conditional, True, "response_format"))
    with pytest.raises(GrammarError, match=r'Unimplemented keys: \["if"\]') as error:
        reply_grammar(strict, compiler, V4_DSML, False)
    assert error.value.param == "response_format"
    lenient = ReplyConstraint(json=JsonContent(conditional, False, "response_format"))
    compiler.check(reply_grammar(lenient, compiler, V4_DSML, False) or "")
    pattern = {"type": "object", "patternProperties": {"^x": {}}}
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": pattern}}
    with pytest.raises(GrammarError, match="'patternProperties' is not supported"):
        reply_grammar(ReplyConstraint(tools=tool_schemas([tool])), compiler, V4_DSML, False)
    assert reply_grammar(ReplyConstraint(tools=TOOLS[1:]), compiler, V4_DSML, False) is None


@pytest.mark.parametrize("strict", [True, False])
def test_a_schema_with_no_finite_instance_is_refused_naming_its_refs(
    compiler: GrammarCompiler, strict: bool
) -> None:
    loop = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    constraint = ReplyConstraint(json=JsonContent(loop, strict, "response_format"))
    with pytest.raises(GrammarError, match="no finite instance.*'#', '#/\\$defs/a'") as error:
        reply_grammar(constraint, compiler, V4_DSML, False)
    assert error.value.param == "response_format"
    node = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
    parameters = {"type": "object", "properties": {"head": node}, "required": ["head"]}
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": parameters}}
    with pytest.raises(GrammarError, match="no finite instance") as error:
        reply_grammar(ReplyConstraint(tools=tool_schemas([tool])), compiler, V4_DSML, False)
    assert error.value.param == "tools[0].function.parameters.properties.head"


def test_a_grammar_over_its_size_bound_is_refused_before_it_is_written(
    compiler: GrammarCompiler,
) -> None:
    """Each parameter of a tool carries the tool's $defs: 50 parameters of a schema with
    20 kB of definitions would write 1 MB."""
    defs = {f"d{i}": {"enum": ["x" * 100] * 2} for i in range(100)}
    properties = {f"p{i}": {"$ref": f"#/$defs/d{i % 100}"} for i in range(50)}
    parameters = {"type": "object", "properties": properties, "$defs": defs}
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": parameters}}
    constraint = ReplyConstraint(tools=tool_schemas([tool]))
    with pytest.raises(GrammarError, match="larger than the router allows"):
        reply_grammar(constraint, compiler, V4_DSML, False, max_bytes=256 << 10)
    assert len(reply_grammar(constraint, compiler, V4_DSML, False) or "") > 256 << 10


def test_the_bitmask_forbids_what_it_clears_in_its_rows_only() -> None:
    logits = torch.randn(3, 70)
    bits = torch.zeros((1, 3), dtype=torch.int32)
    bits[0, 0], bits[0, 1] = 1 << 5, 1 << 3  # tokens 5 and 35
    masked = apply_bitmask(logits, Bitmask(rows=torch.tensor([1]), bits=bits))
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert allowed == [5, 35] and masked[1, 5] == logits[1, 5]


def test_the_engine_samples_under_the_grammar_with_and_without_async_scheduling() -> None:
    """The demo model: constrained requests beside an unconstrained one, each greedy reply the
    same with async scheduling on and off (a constrained row's previous token is then waited
    for while the step's forward runs), and each constrained one the schema's JSON."""
    tokenizer = Tokenizer.from_pretrained(DEMO_MODEL_DIR)
    compiler = GrammarCompiler(tokenizer)
    grammars = {
        rid: reply_grammar(CONSTRAINTS[rid], compiler, V4_DSML, False)
        for rid in ("json_schema", "json_object")
    }
    prompt = tokenizer.encode("ROMEO:\nIs it so?\n\nJULIET:\n", add_special_tokens=True)
    replies = []
    for async_scheduling in (True, False):
        engine = LLMEngine(DEMO_MODEL_DIR, EngineConfig(async_scheduling=async_scheduling))
        for rid, grammar in [*grammars.items(), ("free", None)]:
            params = SamplingParams(max_tokens=64, temperature=0, grammar=grammar)
            engine.add_request(rid, prompt, params)
        outputs = drain(engine)
        assert_all_free(engine)
        replies.append(
            {
                rid: ("".join(o.text for o in outs), outs[-1].finish_reason)
                for rid, outs in outputs.items()
            }
        )
    assert replies[0] == replies[1]
    text, reason = replies[0]["json_schema"]
    assert reason == "stop" and set(json.loads(text)) == set(ANSWER["properties"])
    text, reason = replies[0]["json_object"]
    assert reason == "stop" and isinstance(json.loads(text), dict)
    assert not replies[0]["free"][0].startswith("{")
