"""The byte-level tokenizer of the tiny and demo models: one token per byte plus DeepSeek's
chat tokens.

Byte `b` is token id `b`, so any text (and any byte sequence a random model samples) round-trips;
then bos 256, eos 257, `<｜User｜>` 258, `<｜Assistant｜>` 259, `<think>` 260, `</think>` 261.
The files are the ones a DeepSeek checkpoint ships (tokenizer.json, tokenizer_config.json,
generation_config.json), so the tiny model exercises the same loading and chat-template path.

The release-format tiny model's variant (`release=True`) is the V4 release's tokenizer in
miniature: also `｜DSML｜` 262 and `<｜latest_reminder｜>` 263, and no chat
template (the release ships none; its prompts come from `engine.text.chat.encode_messages`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from dsaserve.engine.text.chat import tokens as v4
from dsaserve.engine.text.tokenizer import byte_level_alphabet

BOS_TOKEN = v4.BOS
EOS_TOKEN = v4.EOS
# As in DeepSeek's tokenizer.json, only bos/eos are "special" (dropped by skip_special_tokens);
# the turn and think markers are plain added tokens, so decoded replies keep `</think>` for
# reasoning parsers.
CONTROL_TOKENS = (v4.USER, v4.ASSISTANT, v4.THINK_START, v4.THINK_END)
# The release's other markers (tool calls, its internal reminder role), also plain added tokens.
RELEASE_TOKENS = (v4.DSML, v4.LATEST_REMINDER)

# DeepSeek's layout: bos, the system prompt(s), then `<｜User｜>q` / `<｜Assistant｜>a<eos>` turns,
# and an open `<｜Assistant｜>` to prompt a reply. Tool turns need tokens this vocabulary lacks,
# so the template refuses them instead of rendering something the model never saw.
CHAT_TEMPLATE = r"""{%- set ns = namespace(system='') -%}
{%- for message in messages if message.role in ['system', 'developer'] -%}
    {%- set ns.system = ns.system + ('\n\n' if ns.system else '') + message.content -%}
{%- endfor -%}
{{- bos_token + ns.system -}}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {{- '<｜User｜>' + message.content -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<｜Assistant｜>' + message.content + eos_token -}}
    {%- elif message.role not in ['system', 'developer'] -%}
        {{- raise_exception('the tiny demo model has no ' + message.role + ' role') -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<｜Assistant｜>' -}}
{%- endif -%}
"""


# The trained demo model (engine/assets/dsaserve-demo-v4) has only read plays, and never saw the
# turn tokens: a chat becomes a scene. System text opens it as plain prose; each user turn is a
# ROMEO speech and each assistant turn a JULIET speech (a message's optional `name` replaces
# the speaker), in the corpus's layout `NAME:\ntext\n\n`; the reply is prompted by `JULIET:\n`.
# The model never learned to end a turn (no eos in its data): replies run to max_tokens unless
# the client passes a stop string such as "\n\n".
PLAY_CHAT_TEMPLATE = r"""{%- set ns = namespace(system='') -%}
{%- for message in messages if message.role in ['system', 'developer'] -%}
    {%- set ns.system = ns.system + message.content | trim + '\n\n' -%}
{%- endfor -%}
{{- bos_token + ns.system -}}
{%- for message in messages -%}
    {%- if message.role in ['user', 'assistant'] -%}
        {%- set speaker = message.name if message.name is defined and message.name
                          else ('ROMEO' if message.role == 'user' else 'JULIET') -%}
        {{- speaker | upper + ':\n' + message.content | trim + '\n\n' -}}
    {%- elif message.role not in ['system', 'developer'] -%}
        {{- raise_exception('the demo model has no ' + message.role + ' role') -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- 'JULIET:\n' -}}
{%- endif -%}
"""


def write_byte_tokenizer(
    out_dir: str | os.PathLike, *, chat_template: str = CHAT_TEMPLATE, release: bool = False
) -> int:
    """Write the byte-level tokenizer's files into `out_dir`; return its vocab size.

    `out_dir` is created if needed. `chat_template` is the Jinja template stored in
    tokenizer_config.json (DeepSeek's turn layout by default; the trained demo model uses
    PLAY_CHAT_TEMPLATE). `release`: the release's variant, with all its markers and, as the
    release ships, no chat template (see the module docstring). The files are byte-identical
    on every run, so a model directory built twice hashes the same.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend = _build_backend(CONTROL_TOKENS + RELEASE_TOKENS if release else CONTROL_TOKENS)
    bos_id, eos_id = backend.token_to_id(BOS_TOKEN), backend.token_to_id(EOS_TOKEN)
    (out / "tokenizer.json").write_text(backend.to_str(pretty=True) + "\n", encoding="utf-8")
    template = {} if release else {"chat_template": chat_template}
    _write_json(
        out / "tokenizer_config.json",
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": BOS_TOKEN,
            **template,
            "clean_up_tokenization_spaces": False,
            "eos_token": EOS_TOKEN,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    _write_json(out / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    return backend.get_vocab_size(with_added_tokens=True)


def _build_backend(control_tokens: tuple[str, ...]) -> BackendTokenizer:
    # BPE with no merges over the byte alphabet: every byte is its own token, so no <unk> exists.
    vocab = {char: byte for byte, char in enumerate(byte_level_alphabet())}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges it would only cost time, and it never changes the ids.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    for tokens, special in (((BOS_TOKEN, EOS_TOKEN), True), (control_tokens, False)):
        backend.add_tokens([AddedToken(t, special=special, normalized=False) for t in tokens])
    bos_id = backend.token_to_id(BOS_TOKEN)
    # Like DeepSeek's tokenizer.json, encoding with special tokens prepends bos.
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return backend


def _write_json(path: Path, data: dict[str, object]) -> None:
    text = json.dumps(data, indent=2, ensure_ascii=False, sort_keys=True)
    path.write_text(text + "\n", encoding="utf-8")
