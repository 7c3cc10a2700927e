"""The marker strings of DeepSeek-V4's chat format, and what a V4 tokenizer must hold for them.

Every bar below is U+FF5C FULLWIDTH VERTICAL LINE ("｜"), never "|", and the word separator in
BOS/EOS is U+2581 LOWER ONE EIGHTH BLOCK ("▁"). Strings as the release's
`encoding/encoding_dsv4.py` spells them:

    BOS              <｜begin▁of▁sentence｜>
    EOS              <｜end▁of▁sentence｜>     ends every assistant turn; generation stops on it
    USER             <｜User｜>                 opens a user turn (also tool results)
    ASSISTANT        <｜Assistant｜>            opens the assistant turn
    THINK_START      <think>
    THINK_END        </think>
    DSML             ｜DSML｜                   no "<": tags are "<" + DSML + "tool_calls>" etc.
    LATEST_REMINDER  <｜latest_reminder｜>      a release-internal role; unreachable from the API

A tokenizer for this format (the real one, or a tiny test one) needs these as added tokens. In the
released tokenizer they are single tokens: BOS 0, EOS 1, <｜User｜> 128803, <｜Assistant｜> 128804,
<think> 128821, </think> 128822, ｜DSML｜ 128825, <｜latest_reminder｜> 128828. Only BOS and EOS
are `special: true`; the others are added but not special, so `decode(...,
skip_special_tokens=True)` keeps them in the text: the parsers in `dsml` rely on seeing
`</think>` and `｜DSML｜` in detokenized output. A DSML tag is therefore several tokens
("<", "｜DSML｜", "tool", "_calls", ">", ...) and a marker can end mid-delta.

(Ids and flags were read from third-party copies of the V4 tokenizer -- a tokenizer test that
encodes "<｜User｜>你好<｜Assistant｜><think>推理</think>答案<｜end▁of▁sentence｜>" as
[128803, 30594, 128804, 128821, 36101, 128822, 7624, 1], and a test fixture listing each token's
`special` flag "as in tokenizer.json" -- not from the release's tokenizer.json itself. The
later V4.1 tokenizer uses the same ids for these.)
"""

from __future__ import annotations

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

# DSML tags as the model writes them (a tool-call block's name is the family's: engine.text.chat
# .dsml.Dialect; V4's `tool_calls`, V3.2's `function_calls`).
INVOKE_OPEN = f"<{DSML}invoke"  # followed by ' name="...">'
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAMETER_OPEN = f"<{DSML}parameter"  # followed by ' name="..." string="true|false">'
PARAMETER_CLOSE = f"</{DSML}parameter>"

TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"

# DeepSeek-V3.2's tool results: after the assistant's turn, one <result> a call in a block.
FUNCTION_RESULTS_OPEN = "<function_results>"
FUNCTION_RESULTS_CLOSE = "</function_results>"
RESULT_OPEN = "<result>"
RESULT_CLOSE = "</result>"
