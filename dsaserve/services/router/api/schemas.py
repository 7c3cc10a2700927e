"""Request bodies of the OpenAI API subset the router serves (pydantic), and vLLM's /tokenize.

Field names and ranges follow OpenAI's schema; `top_k`, `ignore_eos` and `chat_template_kwargs`
are the usual vLLM/SGLang extensions. Only what the router and its workers can honour is
accepted: message content is text, OpenAI fields the router does not implement pass only at
values that change nothing (`fields.py`), and unknown fields are refused by name. Every number
fits its wire type (proto/dsaserve.proto) and every string is valid Unicode, so building the
gRPC request cannot fail on anything a client sent.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from dsaserve.engine.sampling_params import MAX_LOGPROBS
from dsaserve.services.router.api import fields
from dsaserve.services.router.api.fields import NoOp
from dsaserve.services.rpc import pb

MAX_STOP_STRINGS = 4
UINT32_MAX = 2**32 - 1  # max_tokens on the wire
INT32_MAX = 2**31 - 1  # top_k on the wire
INT64 = 2**63  # OpenAI's seed is a signed 64-bit integer
# What `stop` takes on the wire, as OpenAI's does (a validator below makes it a list)
STOP_ON_THE_WIRE = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP_STRINGS},
        {"type": "null"},
    ]
}
SEED_SPAN = 2**63  # the worker takes seeds in [0, 2**63) (a torch generator's range)
MAX_CHOICES = 16  # `n`: each choice is a generation of its own (fanout.py)
MAX_PROMPTS = 64  # a completion's batch of prompts
MAX_GENERATIONS = 64  # prompts x n of one request
_SURROGATE = re.compile("[\ud800-\udfff]")


def _whole_unicode(text: str) -> str:
    # JSON escapes can smuggle half a UTF-16 pair into a str; it has no UTF-8 form, so neither
    # the tokenizer nor protobuf could take it.
    if (surrogate := _SURROGATE.search(text)) is not None:
        raise ValueError(
            f"the text is not valid Unicode: a lone UTF-16 surrogate "
            f"(\\u{ord(surrogate.group()):04x}) at index {surrogate.start()}"
        )
    return text


Text = Annotated[str, AfterValidator(_whole_unicode)]


class _Body(BaseModel):
    """A JSON object of the API: unknown fields refused, unimplemented ones only as no-ops."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    no_op_fields: ClassVar[Mapping[str, NoOp]] = {}

    @model_validator(mode="before")
    @classmethod
    def _drop_no_ops(cls, data: object) -> object:
        return fields.drop_no_ops(data, cls.no_op_fields, lambda name: name in cls.model_fields)


class StreamOptions(_Body):
    no_op_fields = fields.STREAM_OPTIONS
    include_usage: StrictBool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (not only the last)
    continuous_usage_stats: StrictBool = False


class TextFormat(_Body):
    type: Literal["text"]


class JsonObjectFormat(_Body):
    """OpenAI's JSON mode: the content is a JSON object."""

    type: Literal["json_object"]


class JsonSchema(_Body):
    name: Text = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any object
    # exactly the schema, or a 400 naming what cannot be; else unknown keywords are ignored
    strict: StrictBool | None = None


class JsonSchemaFormat(_Body):
    """Structured outputs: the content is JSON of the schema."""

    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


# OpenAI's logit_bias keys: token ids written as JSON object keys
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]


class _GenerationRequest(_Body):
    """Fields shared by chat and text completions."""

    model: Text | None = None  # None = the one served model
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    # -1 and 0 both mean off (vLLM accepts both)
    top_k: StrictInt | None = Field(default=None, ge=-1, le=INT32_MAX)
    seed: StrictInt | None = Field(default=None, ge=-INT64, lt=INT64)
    stop: Annotated[list[Text], WithJsonSchema(STOP_ON_THE_WIRE)] = Field(default_factory=list)
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0, le=UINT32_MAX)]] = Field(
        default_factory=list
    )
    # Each choice is its own generation (prefill included), with seed + i when a seed is given.
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    # the content's format, constrained while it is written (services.router.structured)
    response_format: ResponseFormat | None = None
    user: Text | None = None  # an end-user id for the provider's abuse monitoring: unused here
    # vLLM's: each prompt token's logprob (the first: null) and this many alternatives
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: the prompt resumes only from prefixes cached under the same salt (and key)
    cache_salt: Text | None = Field(default=None, min_length=1, max_length=256)
    # OpenAI's penalties and bias, vLLM's sampling extensions (dsaserve.engine.logits_processors)
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[TokenIdKey, StrictFloat] | None = None  # biases clamped to [-100, 100]
    min_tokens: StrictInt = Field(default=0, ge=0, le=UINT32_MAX)
    repetition_penalty: StrictFloat | None = Field(default=None, gt=0.0)
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    bad_words: list[Annotated[Text, Field(min_length=1)]] | None = None
    allowed_token_ids: list[Annotated[StrictInt, Field(ge=0, le=UINT32_MAX)]] | None = Field(
        default=None, min_length=1
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, stop: object) -> object:
        return [stop] if isinstance(stop, str) else [] if stop is None else stop

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: list[str]) -> list[str]:
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}"
            )
        if "" in stop:
            raise ValueError("stop strings must not be empty")
        return stop

    @model_validator(mode="after")
    def _min_tokens_within_max_tokens(self) -> _GenerationRequest:
        most = self.requested_max_tokens()
        if most is not None and self.min_tokens > most:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({most})")
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available when stream is true (as in vLLM)")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        """Alternatives per token the worker should list (None: no logprobs)."""
        raise NotImplementedError

    def prompt_logprobs_count(self) -> int | None:
        """Alternatives per prompt token the prefill worker should list (None: none)."""
        return self.prompt_logprobs

    def prompt_entries_per_token(self) -> int:
        """What the answer carries about each prompt token of each generation, in entries (a
        logprob, an alternative, an echoed token): with `prompt_logprobs: k`, k + 1."""
        return 0 if self.prompt_logprobs is None else self.prompt_logprobs + 1

    def sampling(
        self,
        max_tokens: int,
        choice: int = 0,
        grammar: str | None = None,
        cache_salt: str | None = None,
    ) -> pb.SamplingParams:
        """The wire sampling params of choice `choice` (`grammar`: the structured output's;
        `cache_salt`: the prefix-cache namespace, tenancy.cache_namespace); unset fields stay
        unset so the worker applies its defaults."""
        params = pb.SamplingParams(
            max_tokens=max_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            grammar=grammar,
            cache_salt=cache_salt,
        )
        if (logprobs := self.logprobs_count()) is not None:
            params.logprobs = logprobs
        if (prompt_logprobs := self.prompt_logprobs_count()) is not None:
            params.prompt_logprobs = prompt_logprobs
        if self.temperature is not None:
            params.temperature = self.temperature
        if self.top_p is not None:
            params.top_p = self.top_p
        if self.top_k is not None:
            params.top_k = max(self.top_k, 0)
        if self.seed is not None:
            # Folds OpenAI's signed seeds into the worker's range; equal seeds stay equal, and
            # the choices of one request differ.
            params.seed = (self.seed + choice) % SEED_SPAN
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            if (value := getattr(self, name)) is not None:
                setattr(params, name, value)
        params.min_tokens = self.min_tokens
        params.logit_bias.update({int(t): b for t, b in (self.logit_bias or {}).items()})
        params.bad_words.extend(self.bad_words or ())
        params.allowed_token_ids.extend(self.allowed_token_ids or ())
        return params


class TextPart(_Body):
    type: Literal["text"]
    text: Text


# OpenAI's rule for function names; it also keeps names from breaking out of the markup
# they are written into (the V4 encoder writes `<｜DSML｜invoke name="...">`).
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDefinition(_Body):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object
    strict: StrictBool | None = None  # a call's arguments are constrained to exactly `parameters`


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Body):
    name: Text
    arguments: Text  # JSON text, as the API returned it


class MessageToolCall(_Body):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    no_op_fields = fields.MESSAGE

    # OpenAI's roles and the DeepSeek-V4 release's `latest_reminder`
    role: Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]
    content: Text | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant: the calls it made
    tool_call_id: Text | None = None  # tool: the call this result answers
    # assistant: its reasoning (kept where tools are; a client may leave it out)
    reasoning_content: Text | None = None
    reasoning: Text | None = None  # vLLM's newer name for reasoning_content

    @model_validator(mode="after")
    def _fields_of_their_roles(self) -> ChatMessage:
        for name, role in (
            ("tool_calls", "assistant"),
            ("reasoning_content", "assistant"),
            ("reasoning", "assistant"),
            ("tool_call_id", "tool"),
        ):
            if getattr(self, name) and self.role != role:
                raise ValueError(f"'{name}' belongs on {role} messages, not on {self.role} ones")
        if None not in (self.reasoning, self.reasoning_content) and (
            self.reasoning != self.reasoning_content
        ):
            raise ValueError("'reasoning' and 'reasoning_content' differ; send one of them")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: object) -> object:
        # Before validation, so an image part is named as such, not as a malformed text part.
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") != "text":
                raise ValueError(
                    f"only text content parts are supported, got type {part.get('type')!r}"
                )
        return content

    def for_template(self) -> dict[str, Any]:
        """The message as chat formats take it: OpenAI's shape, unset fields left out."""
        message: dict[str, Any] = {"role": self.role}
        if isinstance(self.content, list):
            message["content"] = [{"type": "text", "text": p.text} for p in self.content]
        elif self.content is None and self.tool_calls:
            message["content"] = None  # a turn of tool calls only
        else:
            message["content"] = self.content or ""
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning is None else self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatPromptFields(_Body):
    """What makes a chat's prompt: shared by chat completions and /tokenize, which therefore
    render exactly the same prompt (services/router/chat.py)."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the prompt ends with the assistant turn's opening (the reply is a new message)
    add_generation_prompt: StrictBool = True
    # vLLM's: the reply continues the final message, an assistant's text (a prefill)
    continue_final_message: StrictBool = False

    @model_validator(mode="after")
    def _what_is_continued(self) -> ChatPromptFields:
        if not self.continue_final_message:
            return self
        last = self.messages[-1]
        if last.role != "assistant" or last.tool_calls:
            raise ValueError(
                "continue_final_message continues an assistant's text: the last message must "
                f"be an assistant message without tool calls, not a {last.role} message"
            )
        if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise ValueError(
                "add_generation_prompt and continue_final_message cannot both be true (the "
                "reply either starts a new message or continues the last one)"
            )
        return self

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [tool.function.name for tool in tools or []]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise ValueError(f"two tools are named {duplicate!r}")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _needs_its_tool(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if "tools" not in info.data:
            return choice  # tools were invalid: that error is the one to report
        names = [tool.function.name for tool in info.data["tools"] or []]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"names function {choice.function.name!r}, which is not in tools")
        if choice == "required" and not names:
            raise ValueError("'required' needs tools")
        return choice

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


class ChatCompletionRequest(ChatPromptFields, _GenerationRequest):
    no_op_fields = fields.CHAT

    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=UINT32_MAX)
    # vLLM's: in thinking mode, the most tokens the reasoning may take (then </think> is forced)
    thinking_token_budget: StrictInt | None = Field(default=None, ge=1, le=UINT32_MAX)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return top

    @model_validator(mode="after")
    def _a_reply_has_its_turn(self) -> ChatCompletionRequest:
        if not self.add_generation_prompt and not self.continue_final_message:
            raise ValueError(
                "add_generation_prompt: false is served only with continue_final_message: true "
                "(a reply is a new assistant message or continues the last one)"
            )
        return self

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        # OpenAI's newer name wins when a client sends both.
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class CompletionRequest(_GenerationRequest):
    """A text completion as vLLM serves it: a prompt or a batch of prompts (texts or token id
    lists; one choice per prompt and `n`, prompt-major), `echo` (the prompt before each choice's
    text, with its tokens' logprobs first when `logprobs` is set, the first one null), and
    `max_tokens: 0` with `echo` (the prompt alone: what loglikelihood evaluations ask)."""

    no_op_fields = fields.COMPLETION

    prompt: Text | list[StrictInt] | list[Text] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(default=None, ge=0, le=UINT32_MAX)
    # Each token's logprob and this many likeliest alternatives.
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    add_special_tokens: StrictBool = True  # vLLM's: BOS before a text prompt

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_count(self) -> int | None:
        wanted = [
            k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None
        ]
        return max(wanted, default=None)

    def prompt_entries_per_token(self) -> int:
        # echo: the token, and with logprobs: k its logprob and k alternatives
        echoed = 0 if not self.echo else 1 + (0 if self.logprobs is None else self.logprobs + 1)
        return super().prompt_entries_per_token() + echoed

    def prompts(self) -> list[str | list[int]]:
        """Every prompt of the request, in order."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)  # type: ignore[arg-type]

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[Any]) -> str | list[Any]:
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        if not isinstance(prompt, str) and isinstance(prompt[0], str | list):
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
            if any(len(p) == 0 for p in prompt):
                raise ValueError("a prompt of the batch is empty")
        return prompt

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing; it is only allowed with echo")
        if len(self.prompts()) * self.n > MAX_GENERATIONS:
            raise ValueError(
                f"prompts x n makes {len(self.prompts()) * self.n} generations; "
                f"at most {MAX_GENERATIONS} per request"
            )
        return self


class TokenizeChatRequest(ChatPromptFields):
    """vLLM's /tokenize of a chat: the prompt a chat completion would send to prefill."""

    model: Text | None = None
    return_token_strs: StrictBool = False


class TokenizeTextRequest(_Body):
    """vLLM's /tokenize of a text: a completion's prompt (BOS added unless told otherwise)."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


# The tags show in error locations; errors.py drops location parts with brackets, like the
# names pydantic gives the members of plain unions.
_CHAT, _TEXT = "[chat]", "[text]"


def _tokenize_kind(body: object) -> str:
    return _CHAT if isinstance(body, dict) and "messages" in body else _TEXT


TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag(_CHAT)] | Annotated[TokenizeTextRequest, Tag(_TEXT)],
    Discriminator(_tokenize_kind),
]


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[StrictInt] = Field(min_length=1)
