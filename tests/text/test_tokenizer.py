"""engine.text: the tokenizer, the byte tokenizer, chat templates, streaming decode."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

from dsaserve.engine.text.byte_tokenizer import BOS_TOKEN, EOS_TOKEN, write_byte_tokenizer
from dsaserve.engine.text.chat import tokens as v4
from dsaserve.engine.text.template import ChatTemplateError
from dsaserve.engine.text.text_stream import IncrementalDetokenizer
from dsaserve.engine.text.token_bound import min_tokens
from dsaserve.engine.text.tokenizer import Tokenizer, byte_level_alphabet
from tests import REPO_ROOT

BOS, EOS, USER, ASSISTANT, THINK, END_THINK = range(256, 262)

TEXTS = [
    "Hello, world!\n\ttabs and  spaces ",
    "中文、日本語とハングル 한국어",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷 clef 𝄞",
    "combining e\u0301 and NUL \x00 and DEL \x7f",
]

# Whitespace control, loop controls, tojson and special-token variables, as transformers sets them.
HELPERS_TEMPLATE = """\
{% for m in messages %}
    {% if loop.index > 2 %}{% break %}{% endif %}
{{ m.role }}
{% endfor %}
{{ {'k': '中 <&>'} | tojson }}|{{ bos_token }}"""

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "developer", "content": "Answer in French."},
    {"role": "user", "content": "et 3+3 ? 中文 😀"},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    write_byte_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def backend(tiny_dir: Path) -> BackendTokenizer:
    return BackendTokenizer.from_file(str(tiny_dir / "tokenizer.json"))


def _with_template(backend: BackendTokenizer, template: str) -> Tokenizer:
    return Tokenizer(backend, chat_template=template, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN)


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


# --- the tiny tokenizer's files -----------------------------------------------------------------


def test_tiny_tokenizer_is_small_and_byte_identical_across_runs(tmp_path: Path) -> None:
    assert write_byte_tokenizer(tmp_path / "a") == 262
    # Another process with another hash seed must write the same bytes.
    result = _run_python(
        "from dsaserve.engine.text.byte_tokenizer import write_byte_tokenizer as w; "
        f"w({str(tmp_path / 'b')!r})",
        PYTHONHASHSEED="12345",
    )
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    generation = json.loads((tmp_path / "a" / "generation_config.json").read_text())
    assert generation == {"bos_token_id": BOS, "eos_token_id": EOS}


def test_tiny_tokenizer_token_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 262
    assert tok.bos_token_id == BOS
    assert tok.eos_token_ids == frozenset({EOS})
    assert tok.all_special_ids == frozenset({BOS, EOS})
    markers = "<｜begin▁of▁sentence｜><｜end▁of▁sentence｜><｜User｜><｜Assistant｜><think></think>"
    assert tok.encode(markers) == [BOS, EOS, USER, ASSISTANT, THINK, END_THINK]
    # Every byte is its own token, and token id == byte value.
    text = "".join(TEXTS)
    assert tok.encode(text) == list(text.encode("utf-8"))
    # ...also for bytes that are not UTF-8: random ones decode as Python decodes them.
    rng = random.Random(0)
    for _ in range(500):
        data = rng.randbytes(8)
        assert tok.decode(list(data)) == data.decode("utf-8", errors="replace")


def test_release_variant_has_every_v4_marker_and_no_template(tmp_path: Path) -> None:
    assert write_byte_tokenizer(tmp_path, release=True) == 264
    tok = Tokenizer.from_pretrained(tmp_path)
    markers = [v4.BOS, v4.EOS, v4.USER, v4.ASSISTANT, v4.THINK_START, v4.THINK_END, v4.DSML]
    assert [tok.encode(m) for m in [*markers, v4.LATEST_REMINDER]] == [[i] for i in range(256, 264)]
    assert tok.all_special_ids == frozenset({BOS, EOS})  # DSML and think tags survive decoding
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_token_bytes_are_exact_even_for_part_of_a_character(tok: Tokenizer) -> None:
    # Byte-level: token id == byte value, so a token may be half of "é" (0xC3 0xA9).
    assert [tok.token_bytes(i) for i in tok.encode("aé")] == [b"a", b"\xc3", b"\xa9"]
    assert tok.token_bytes(THINK) == b"<think>"
    assert tok.token_bytes(EOS) == EOS_TOKEN.encode()
    # Other decoders: the token's decoded text.
    backend = BackendTokenizer(models.WordLevel({"hi": 0, "[UNK]": 1}, unk_token="[UNK]"))
    assert Tokenizer(backend).token_bytes(0) == b"hi"


# --- encode / decode ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text
    with_bos = tok.encode(text, add_special_tokens=True)
    assert with_bos == [BOS, *tok.encode(text)]
    assert tok.decode(with_bos) == text
    assert tok.decode(with_bos, skip_special_tokens=False) == BOS_TOKEN + text


def test_decode_skips_only_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(f"{BOS_TOKEN}<｜User｜>hi<｜Assistant｜><think>x</think>y{EOS_TOKEN}")
    assert tok.decode(ids) == "<｜User｜>hi<｜Assistant｜><think>x</think>y"
    assert tok.decode(ids, skip_special_tokens=False).endswith(f"y{EOS_TOKEN}")


def test_invalid_input(tok: Tokenizer) -> None:
    # Bytes that are not UTF-8 decode to U+FFFD instead of failing.
    assert tok.decode([0xE4, 0x41]) == "\ufffdA"
    assert tok.decode([0xFF, 0x80]) == "\ufffd\ufffd"
    with pytest.raises(ValueError, match=r"lone surrogate '\\ud83d' at index 2"):
        tok.encode("ab\ud83d")
    with pytest.raises(TypeError, match="must be a str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    for bad_id in (262, -1):
        with pytest.raises(ValueError, match=rf"token id {bad_id} is outside .*262"):
            tok.decode([65, bad_id])


# --- loading checkpoint files -------------------------------------------------------------------


def _checkpoint(tiny_dir: Path, dest: Path, **config_changes: object) -> Path:
    shutil.copytree(tiny_dir, dest)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(config_changes)
    config_path.write_text(json.dumps(config))
    return dest


def test_missing_tokenizer_json_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "tokenizer.json"))):
        Tokenizer.from_pretrained(tmp_path)


def test_config_variants(tiny_dir: Path, tmp_path: Path) -> None:
    added = {"__type": "AddedToken", "content": EOS_TOKEN, "lstrip": False, "special": True}
    named = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "default:{{ messages[0].content }}"},
    ]
    ckpt = _checkpoint(
        tiny_dir, tmp_path / "c", bos_token=None, eos_token=added, chat_template=named
    )
    (ckpt / "config.json").write_text(json.dumps({"eos_token_id": [EOS, END_THINK]}))
    tok = Tokenizer.from_pretrained(ckpt)
    assert tok.bos_token_id is None
    assert tok.eos_token_ids == frozenset({EOS, END_THINK})
    assert tok.apply_chat_template([{"role": "user", "content": "q"}]) == "default:q"
    # chat_template.jinja beside the config wins over the config's template.
    (ckpt / "chat_template.jinja").write_text("file:{{ messages[0].content }}")
    assert Tokenizer.from_pretrained(ckpt).apply_chat_template(CHAT[1:2]) == "file:2+2?"


def test_named_templates_without_default(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = _checkpoint(tiny_dir, tmp_path / "c", chat_template=[{"name": "a", "template": "x"}])
    with pytest.raises(ChatTemplateError, match=r"\['a'\] include none named 'default'"):
        Tokenizer.from_pretrained(ckpt)


def test_unknown_special_token(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = _checkpoint(tiny_dir, tmp_path / "c", bos_token="<s>")
    with pytest.raises(ValueError, match="'<s>' is not in the tokenizer's vocabulary"):
        Tokenizer.from_pretrained(ckpt)


@pytest.mark.parametrize("add_bos", [True, False])
def test_add_bos_token_applies_without_post_processor(
    tiny_dir: Path, tmp_path: Path, add_bos: bool
) -> None:
    ckpt = _checkpoint(tiny_dir, tmp_path / "c", add_bos_token=add_bos, add_eos_token=True)
    # tokenizer.json's post-processor (bos only) wins over the flags, as in transformers 5.
    assert Tokenizer.from_pretrained(ckpt).encode("hi", add_special_tokens=True) == [BOS, 104, 105]
    spec = json.loads((ckpt / "tokenizer.json").read_text())
    spec["post_processor"] = None
    (ckpt / "tokenizer.json").write_text(json.dumps(spec))
    ids = Tokenizer.from_pretrained(ckpt).encode("hi", add_special_tokens=True)
    assert ids == [BOS] * add_bos + [104, 105, EOS]


# --- chat templates -----------------------------------------------------------------------------


def test_chat_rendering(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(CHAT[1:2]) == f"{BOS_TOKEN}<｜User｜>2+2?<｜Assistant｜>"
    expected = (
        f"{BOS_TOKEN}Be brief.\n\nAnswer in French."
        f"<｜User｜>2+2?<｜Assistant｜>4{EOS_TOKEN}<｜User｜>et 3+3 ? 中文 😀"
    )
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(CHAT) == expected + "<｜Assistant｜>"


def test_encode_chat_has_one_bos_and_token_ids_for_markers(tok: Tokenizer) -> None:
    ids = tok.encode_chat(CHAT)
    assert ids[0] == BOS and ids.count(BOS) == 1
    assert ids.count(USER) == 2 and ids.count(EOS) == 1 and ids[-1] == ASSISTANT
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(CHAT)


def test_list_content_is_joined_text(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]
    as_list = tok.apply_chat_template([{"role": "user", "content": parts}])
    as_text = tok.apply_chat_template([{"role": "user", "content": "line one\nline two"}])
    assert as_list == as_text


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([CHAT[1], "oops"], "messages[1] must be an object with 'role' and 'content', got str"),
        ([{"content": "x"}], "messages[0].role must be one of system, user, assistant"),
        (
            [CHAT[1], {"role": "robot", "content": "x"}],
            "messages[1].role must be one of system, user, assistant, tool, developer; got 'robot'",
        ),
        ([{"role": "user"}], "messages[0] has no 'content'"),
        ([{"role": "user", "content": None}], "messages[0].content must be a string or a list"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
            'messages[0].content[0] must be {"type": "text", "text": <string>}; '
            "got {'type': 'image_url'",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}],
            "messages[0].content[1] must be",
        ),
    ],
)
def test_bad_messages(tok: Tokenizer, messages: object, expected: str) -> None:
    with pytest.raises(ChatTemplateError, match=re.escape(expected)):
        tok.apply_chat_template(messages)  # type: ignore[arg-type]


def test_template_raise_exception(tok: Tokenizer, backend: BackendTokenizer) -> None:
    tool_turn = [*CHAT[1:3], {"role": "tool", "content": "{}"}]
    with pytest.raises(ChatTemplateError, match="rejected the messages: .* has no tool role"):
        tok.encode_chat(tool_turn)
    strict = _with_template(backend, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="rejected the messages: roles must alternate$"):
        strict.apply_chat_template(CHAT)


def test_template_failures_are_chat_template_errors(backend: BackendTokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="TypeError"):
        _with_template(backend, "{{ messages[0].content + 1 }}").apply_chat_template(CHAT)
    with pytest.raises(ChatTemplateError, match="line 2"):
        _with_template(backend, "ok\n{% if %}")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(backend).apply_chat_template(CHAT)


def test_template_environment(backend: BackendTokenizer) -> None:
    rendered = _with_template(backend, HELPERS_TEMPLATE).apply_chat_template(CHAT)
    # trim_blocks and lstrip_blocks drop the block tags' lines; tojson keeps <&> and non-ASCII.
    assert rendered == f'system\nuser\n{{"k": "中 <&>"}}|{BOS_TOKEN}'
    year = _with_template(backend, "{{ strftime_now('%Y') }}").apply_chat_template(CHAT)
    assert year.isdigit() and len(year) == 4


def test_template_sees_what_transformers_passes(backend: BackendTokenizer) -> None:
    template = "{{ tools is none }} {{ documents is none }} {{ messages[0].name is defined }}"
    messages = [{"role": "user", "content": "x", "name": None}]
    assert _with_template(backend, template).apply_chat_template(messages) == "True True False"


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{{ messages[0].content.__class__.__base__ }}x{{ ''.__class__.__mro__ }}",
        "{{ messages.append({'role': 'user', 'content': 'injected'}) }}",
        "{{ messages[0].update({'content': 'changed'}) }}",
    ],
)
def test_sandbox_refuses_internals_and_mutation(backend: BackendTokenizer, template: str) -> None:
    messages = [dict(m) for m in CHAT]
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        _with_template(backend, template).apply_chat_template(messages)
    assert messages == CHAT


def test_sandbox_hides_attributes_it_does_not_fail_on(backend: BackendTokenizer) -> None:
    # Printing an unsafe attribute renders it as undefined (empty), never the object.
    rendered = _with_template(backend, "[{{ ''.__class__ }}]").apply_chat_template(CHAT)
    assert rendered == "[]"


def test_matches_transformers(tiny_dir: Path, tok: Tokenizer, backend: BackendTokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(tiny_dir)
    assert len(hf) == tok.vocab_size
    assert (hf.bos_token_id, {hf.eos_token_id}) == (tok.bos_token_id, tok.eos_token_ids)
    assert set(hf.all_special_ids) == tok.all_special_ids
    for messages in (CHAT[:2], CHAT[1:3], CHAT):
        for add_generation_prompt in (True, False):
            kwargs = {"add_generation_prompt": add_generation_prompt}
            text = hf.apply_chat_template(messages, tokenize=False, **kwargs)
            assert tok.apply_chat_template(messages, **kwargs) == text
            hf_ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
            assert tok.encode_chat(messages, **kwargs) == hf_ids
    hf_text = hf.apply_chat_template(CHAT, chat_template=HELPERS_TEMPLATE, tokenize=False)
    assert _with_template(backend, HELPERS_TEMPLATE).apply_chat_template(CHAT) == hf_text
    for text in [*TEXTS, f"{BOS_TOKEN}<｜User｜>x</think>{EOS_TOKEN}"]:
        for add_special_tokens in (True, False):
            ids = hf.encode(text, add_special_tokens=add_special_tokens)
            assert tok.encode(text, add_special_tokens=add_special_tokens) == ids
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
                    ids, skip_special_tokens=skip
                )


# --- incremental detokenizer --------------------------------------------------------------------


def _chunked_tokenizer(chunks: list[bytes]) -> tuple[Tokenizer, list[int]]:
    """A byte-level tokenizer whose vocabulary has `chunks` as tokens, and their ids in order.

    Chunks cut anywhere, so one token may end a character and start the next.
    """
    chars = byte_level_alphabet()
    vocab = {c: b for b, c in enumerate(chars)}
    spelled = ["".join(chars[b] for b in chunk) for chunk in chunks]
    for token in spelled:
        vocab.setdefault(token, len(vocab))
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend), [vocab[token] for token in spelled]


def _random_cuts(data: bytes, rng: random.Random, max_len: int = 6) -> list[bytes]:
    chunks, start = [], 0
    while start < len(data):
        end = min(len(data), start + rng.randint(1, max_len))
        chunks.append(data[start:end])
        start = end
    return chunks


def _stream(detok: IncrementalDetokenizer, ids: list[int], final: str) -> None:
    """Push `ids`, checking that what has been emitted is always a prefix of `final`."""
    for token_id in ids:
        piece = detok.push(token_id)
        assert final.startswith(detok.text), (detok.text, final)
        assert detok.text.endswith(piece)


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_one_byte_per_token(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) == detok.text == text
    assert "\ufffd" not in detok.text
    assert detok.token_ids == ids
    # A character is emitted by the push of its last byte, never earlier.
    assert pieces.count("") == len(ids) - len(text)


def test_detokenizer_random_byte_splits() -> None:
    rng = random.Random(0)
    alphabet = [*"ab z\n", "é", "ß", "中", "文", "😀", "👍🏽", "\u0301", "𝄞", "한"]
    for _ in range(200):
        text = "".join(rng.choices(alphabet, k=rng.randint(1, 30)))
        tok, ids = _chunked_tokenizer(_random_cuts(text.encode("utf-8"), rng))
        assert tok.decode(ids) == text
        detok = IncrementalDetokenizer(tok)
        _stream(detok, ids, text)
        assert detok.text == text
        assert detok.flush() == ""


def test_detokenizer_invalid_bytes_and_flush() -> None:
    rng = random.Random(1)
    for _ in range(200):
        data = rng.randbytes(rng.randint(1, 40))
        tok, ids = _chunked_tokenizer(_random_cuts(data, rng, max_len=3))
        final = tok.decode(ids)
        detok = IncrementalDetokenizer(tok)
        _stream(detok, ids, final)
        detok.flush()
        assert detok.text == final


def test_detokenizer_window_stays_bounded(tok: Tokenizer, backend: BackendTokenizer) -> None:
    decoded_lengths: list[int] = []

    class Recording(Tokenizer):
        def decode(self, token_ids, *, skip_special_tokens=True):  # type: ignore[no-untyped-def]
            decoded_lengths.append(len(token_ids))
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens)

    recording = Recording(backend)
    # Endless invalid continuation bytes, then unfinished 4-byte lead bytes, then text.
    ids = [0x80] * 2000 + [0xF0, 0x9F] * 500 + tok.encode("中文😀" * 300)
    detok = IncrementalDetokenizer(recording)
    for token_id in ids:
        detok.push(token_id)
    assert max(decoded_lengths) <= 8
    assert detok.text == tok.decode(ids)


def test_detokenizer_special_tokens(tok: Tokenizer) -> None:
    ids = [0xE4, 0xB8, EOS, 0xAD, END_THINK, ord("A")]
    for skip, final in ((True, "中</think>A"), (False, f"\ufffd{EOS_TOKEN}\ufffd</think>A")):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        _stream(detok, ids, final)
        assert detok.text == final == tok.decode(ids, skip_special_tokens=skip)


def test_detokenizer_keeps_space_a_decoder_strips_from_the_first_token() -> None:
    # SentencePiece-style: the decoder drops the leading space of the first token it sees.
    backend = BackendTokenizer(models.BPE(vocab={"▁Hello": 0, "▁world": 1}, merges=[]))
    backend.decoder = decoders.Metaspace()
    backend.add_special_tokens([AddedToken("</s>", special=True)])
    tok = Tokenizer(backend)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in (0, 2, 1)]
    assert pieces == ["Hello", "", " world"]
    assert detok.text == tok.decode([0, 2, 1]) == "Hello world"


# --- torch-free import --------------------------------------------------------------------------


def test_tokenizer_never_imports_torch(tmp_path: Path) -> None:
    code = f"""
import sys
from dsaserve.engine.text.byte_tokenizer import write_byte_tokenizer
from dsaserve.engine.text.text_stream import IncrementalDetokenizer
from dsaserve.engine.text.tokenizer import Tokenizer
write_byte_tokenizer({str(tmp_path)!r})
tok = Tokenizer.from_pretrained({str(tmp_path)!r})
detok = IncrementalDetokenizer(tok)
for token_id in tok.encode_chat([{{"role": "user", "content": "hi"}}]):
    detok.push(token_id)
heavy = [m for m in ("torch", "transformers") if m in sys.modules]
assert not heavy, heavy
print(detok.text)
"""
    result = _run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "<｜User｜>hi<｜Assistant｜>\n"


# ---------------------------------------------------------------- a bound without tokenizing

_CORPUS = [
    "the quick brown fox jumps over the lazy dog " * 3,
    "DeepSeek sparse attention: 稀疏注意力 and 😀 emoji, 1234567890 numbers\n\tend",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
]


def _byte_level_bpe() -> BackendTokenizer:
    """A byte-level BPE with real merges, trained here (as DeepSeek's is, at a larger scale)."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=False), pre_tokenizers.ByteLevel()]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(_CORPUS * 20, trainer)
    backend.add_tokens([AddedToken("<｜User｜>", normalized=False)])
    return backend


def _metaspace_bpe() -> BackendTokenizer:
    """A SentencePiece-style BPE: '▁' for spaces, unknown characters as byte tokens."""
    backend = BackendTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *bytes_])
    backend.train_from_iterator(_CORPUS * 20, trainer)
    return backend


def _random_text(rng: random.Random) -> str:
    pieces = ["a", " ", "the ", "fox", "稀疏", "😀", "1", "\n", "<｜User｜>", "\u0301", "Z"]
    return "".join(rng.choice(pieces) * rng.randint(1, 40) for _ in range(rng.randint(1, 30)))


@pytest.mark.parametrize("build", [_byte_level_bpe, _metaspace_bpe, None])
def test_token_bound_never_exceeds_the_real_count(build, tok: Tokenizer) -> None:
    tokenizer = tok if build is None else Tokenizer(build())
    max_chars = tokenizer.max_chars_per_token()
    assert max_chars is not None and max_chars > 1
    rng = random.Random(0)
    texts = [*_CORPUS, *(_random_text(rng) for _ in range(300))]
    counts = [(len(tokenizer.encode(t)), min_tokens(t, max_chars)) for t in texts]
    assert all(real >= bound for real, bound in counts)
    assert max(bound for _, bound in counts) > 1  # the bound says something


def test_token_bound_of_the_tiny_tokenizer_is_its_longest_added_token(tok: Tokenizer) -> None:
    assert tok.max_chars_per_token() == len(BOS_TOKEN)


def _without_bound(change) -> BackendTokenizer:
    backend = _byte_level_bpe()
    change(backend)
    return backend


@pytest.mark.parametrize(
    "backend",
    [
        # Each can make one token of an unbounded run of characters, or drop characters.
        BackendTokenizer(models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
        BackendTokenizer(models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=True)),
        _without_bound(lambda b: setattr(b, "pre_tokenizer", pre_tokenizers.Whitespace())),
        _without_bound(lambda b: setattr(b, "normalizer", normalizers.NFC())),
        _without_bound(lambda b: setattr(b, "normalizer", normalizers.Strip())),
        _without_bound(lambda b: b.add_tokens([AddedToken("<x>", lstrip=True)])),
        _without_bound(lambda b: b.enable_truncation(8)),
    ],
    ids=["wordpiece", "fused-unk", "whitespace", "nfc", "strip", "lstrip-token", "truncation"],
)
def test_no_token_bound_where_characters_may_vanish(backend: BackendTokenizer) -> None:
    assert Tokenizer(backend).max_chars_per_token() is None
