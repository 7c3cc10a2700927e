"""engine.text.chat_format: which chat format a checkpoint gets, and what each passes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsaserve.engine.text.byte_tokenizer import write_byte_tokenizer
from dsaserve.engine.text.chat import ChatEncodingError, encode_messages
from dsaserve.engine.text.chat.tokens import THINK_START
from dsaserve.engine.text.chat_format import ChatOptions, V4Chat, chat_format, opens_reasoning
from dsaserve.engine.text.template import ChatTemplateError
from dsaserve.engine.text.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def checkpoint(path: Path, *, template: str | None, model_type: str | None) -> Path:
    write_byte_tokenizer(path, release=True)
    if template is not None:
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config_path.write_text(json.dumps(config | {"chat_template": template}))
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


def test_a_v4_checkpoint_without_a_template_gets_the_release_encoder(tmp_path: Path) -> None:
    model = checkpoint(tmp_path, template=None, model_type="deepseek_v4")
    fmt = chat_format(model, Tokenizer.from_pretrained(model))
    assert isinstance(fmt, V4Chat) and fmt.renders_tools
    options = ChatOptions(thinking=True, reasoning_effort="max", variables={"drop_thinking": True})
    rendered = fmt.render(MESSAGES, tools=TOOLS, options=options)
    assert rendered == encode_messages(MESSAGES, thinking=True, reasoning_effort="max", tools=TOOLS)
    assert opens_reasoning(rendered) and rendered.endswith(THINK_START)
    assert not opens_reasoning(fmt.render(MESSAGES))
    with pytest.raises(ChatEncodingError) as bad:
        fmt.render(MESSAGES, options=ChatOptions(variables={"add_bos": False}))
    assert bad.value.param == "chat_template_kwargs.add_bos"
    with pytest.raises(ChatEncodingError, match="must be true"):
        fmt.render(MESSAGES, add_generation_prompt=False)


def test_a_template_wins_and_gets_tools_thinking_and_variables(tmp_path: Path) -> None:
    template = (
        "{{ tools | tojson }}|{{ thinking }}{{ enable_thinking }}|{{ style }}|"
        "{{ messages[1].tool_calls[0].function.arguments.x }}|{{ messages[1].content }}"
    )
    model = checkpoint(tmp_path, template=template, model_type="deepseek_v4")
    fmt = chat_format(model, Tokenizer.from_pretrained(model))
    assert fmt.name == "the chat template" and fmt.renders_tools
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 7}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}]
    options = ChatOptions(thinking=True, variables={"style": "terse"})
    rendered = fmt.render(messages, tools=TOOLS, options=options)
    # Arguments reach templates parsed (as vLLM and transformers hand them over).
    assert rendered == f"{json.dumps(TOOLS)}|TrueTrue|terse|7|"
    with pytest.raises(ChatTemplateError, match="may not be named messages"):
        fmt.render(MESSAGES, options=ChatOptions(variables={"messages": []}))


def test_other_checkpoints_without_a_template_have_no_chat_format(tmp_path: Path) -> None:
    model = checkpoint(tmp_path, template=None, model_type="llama")
    fmt = chat_format(model, Tokenizer.from_pretrained(model))
    assert not fmt.renders_tools
    with pytest.raises(ChatTemplateError, match="no chat template"):
        fmt.render(MESSAGES)
