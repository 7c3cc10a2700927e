"""`dsaserve generate` (offline generation with the engine) and `dsaserve make-tiny-model`."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dsaserve.engine.config import EngineConfig, setting

if TYPE_CHECKING:
    from dsaserve.engine.llm import LLM


@dataclass(frozen=True)
class GenerateSettings:
    """Offline generation"""

    engine: EngineConfig = field(default_factory=EngineConfig)
    model: str | None = setting(None, "model directory (default: the built-in demo model)")
    prompt: tuple[str, ...] = setting((), "prompt text (repeat for several prompts)")
    prompt_token_ids: tuple[str, ...] = setting((), "comma-separated token ids (repeatable)")
    chat: str | None = setting(
        None, 'messages as JSON, e.g. \'[{"role": "user", "content": "Hi"}]\''
    )
    thinking: bool = setting(False, "with --chat: render the chat in thinking mode")
    max_tokens: int = setting(64, "tokens to generate per prompt")
    temperature: float = setting(1.0, "sampling temperature (0 = greedy)")
    top_p: float = setting(1.0, "nucleus sampling mass")
    top_k: int = setting(0, "sample among the k likeliest tokens (0 = off)")
    seed: int | None = setting(None, "sampling seed")
    stop: tuple[str, ...] = setting((), "stop string (repeatable)")
    ignore_eos: bool = setting(False, "keep generating past the end-of-sequence token")
    json: bool = setting(False, "print one JSON object per prompt")

    def __post_init__(self) -> None:
        given = [bool(self.prompt), bool(self.prompt_token_ids), self.chat is not None]
        if sum(given) != 1:
            raise ValueError("give exactly one of --prompt, --prompt-token-ids or --chat")


Settings = GenerateSettings


def run(s: GenerateSettings) -> None:
    from dsaserve.engine.demo_model import DEMO_MODEL_DIR
    from dsaserve.engine.llm import LLM

    with LLM(s.model or DEMO_MODEL_DIR, **dataclasses.asdict(s.engine)) as llm:
        _generate(llm, s)


def _generate(llm: LLM, s: GenerateSettings) -> None:
    from dsaserve.engine.request import RequestError
    from dsaserve.engine.sampling_params import SamplingParams
    from dsaserve.engine.text.chat import parse_completion
    from dsaserve.engine.text.chat_format import ChatOptions, chat_format, opens_reasoning

    reasoning = False
    prompts: list[str | list[int]]
    fmt = chat_format(llm.engine.model_dir, llm.tokenizer)
    if s.chat is not None:
        # The router's choice of chat format: the template, or the release's encoder.
        try:
            text = fmt.render(json.loads(s.chat), options=ChatOptions(thinking=s.thinking))
        except ValueError as e:  # bad JSON, or a chat the format cannot render
            sys.exit(f"--chat: {e}")
        reasoning = opens_reasoning(text)
        prompts = [llm.tokenizer.encode(text)]
    elif s.prompt_token_ids:
        prompts = [[int(t) for t in p.split(",") if t.strip()] for p in s.prompt_token_ids]
    else:
        prompts = list(s.prompt)
    params = SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop=list(s.stop),
        ignore_eos=s.ignore_eos,
    )
    try:
        results = llm.generate(prompts, params)
    except RequestError as e:  # e.g. a token id the tokenizer does not have
        sys.exit(f"dsaserve generate: {e}")
    for result in results:
        if s.json:
            answer: dict[str, object] = {
                "token_ids": result.token_ids,
                "text": result.text,
                "finish_reason": result.finish_reason,
            }
            if s.chat is not None:
                # The reply as the router's chat API reads it (reasoning, content, tool calls).
                message = parse_completion(result.text, reasoning, dialect=fmt.dialect)
                answer["message"] = {
                    "reasoning_content": message.reasoning_content,
                    "content": message.content,
                    "tool_calls": [
                        {"name": call.name, "arguments": call.arguments}
                        for call in message.tool_calls
                    ],
                }
            print(json.dumps(answer), flush=True)
        else:
            print(result.text, flush=True)
