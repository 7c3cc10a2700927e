"""loadtest/: stream timing, benchmark statistics and the report, on recorded synthetic timings;
the locustfile and its scenario config as Locust itself loads them.

Running the clients against a live stack is the end-to-end test's job; here `run_benchmark` only
meets a closed port, which exercises its real HTTP path and failure accounting.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dsaserve.engine.ports import free_port
from loadtest import bench_serving as bench
from loadtest import report
from loadtest.openai_stream import StreamRecord, auth_headers, chat_payload
from loadtest.prompts import calibrated_words, load_tokenizer, make_prompt
from tests import REPO_ROOT


def chunk(content: str | None = None, usage: dict | None = None, role: bool = False) -> str:
    delta = {"role": "assistant"} if role else {"content": content}
    choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": None}]
    return "data: " + json.dumps(
        {"object": "chat.completion.chunk", "choices": choices, "usage": usage}
    )


def recorded(
    start: float,
    ttft: float,
    gaps: list[float],
    *,
    tokens: int | None = None,
    prompt: int = 10,
    tail: float = 0.0,
) -> StreamRecord:
    """Replay a stream: role chunk, one content chunk per token at the given times, usage, DONE."""
    r = StreamRecord(start=start)
    r.feed(chunk(role=True), start + ttft / 2)
    t = start + ttft
    r.feed(chunk("a"), t)
    for gap in gaps:
        t += gap
        r.feed(chunk("b"), t)
    n = len(gaps) + 1 if tokens is None else tokens
    r.feed(
        chunk(usage={"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}),
        t,
    )
    r.feed("", t)
    r.feed("data: [DONE]", t + tail)
    r.finish(t + tail + 5.0)  # the body closing later must not stretch E2E
    return r


# --- one stream -----------------------------------------------------------------------------------


def test_stream_record_times_content_chunks_and_trusts_usage() -> None:
    r = recorded(100.0, 0.5, [0.1, 0.2], tokens=7, prompt=12, tail=0.05)
    assert r.ok
    assert r.ttft == pytest.approx(0.5)  # the role-only first delta is not a token
    assert r.itl == pytest.approx([0.1, 0.2])
    assert r.latency == pytest.approx(0.85)  # at [DONE], not when the body closed
    assert (r.chunks, r.output_tokens, r.prompt_tokens) == (3, 7, 12)


def test_stream_without_usage_counts_chunks() -> None:
    r = StreamRecord(start=0.0)
    for i, line in enumerate([chunk("x"), ": keep-alive", chunk("y"), "data: [DONE]"]):
        r.feed(line + "\r\n", float(i))
    r.finish(9.0)
    assert r.ok and r.output_tokens == 2 and r.ttft == 0.0 and r.itl == [2.0]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (
            [
                chunk("x"),
                'data: {"error": {"message": "decode worker lost", "code": 503}}',
                "data: [DONE]",
            ],
            "decode worker lost",
        ),
        (
            [chunk("x"), "data: {'error': {'message': 'bad'}}"],
            "unparseable",
        ),  # SGLang's Python-repr error
        ([chunk("x"), chunk("y")], "before data: [DONE]"),
    ],
)
def test_failures_inside_a_200_stream(lines: list[str], message: str) -> None:
    r = StreamRecord(start=0.0)
    for line in lines:
        r.feed(line, 1.0)
    r.finish(2.0)
    assert not r.ok
    assert message in (r.error or "")


def test_payload_and_auth() -> None:
    p = chat_payload("m", "hi", 32)
    assert p["stream"] and p["ignore_eos"] and p["max_tokens"] == 32
    assert p["stream_options"] == {"include_usage": True}
    assert auth_headers("k1, k2") == {"Authorization": "Bearer k1"}
    assert auth_headers(None) == {} and auth_headers("") == {}


# --- statistics -----------------------------------------------------------------------------------


def test_percentile_matches_numpy_linear() -> None:
    values = [random.Random(3).uniform(0, 10) for _ in range(101)]
    np = pytest.importorskip("numpy")
    for p in (0, 1, 50, 90, 99, 99.9, 100):
        assert bench.percentile(values, p) == pytest.approx(float(np.percentile(values, p)))
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    with pytest.raises(ValueError):
        bench.percentile([], 50)


def test_summarize_recorded_run() -> None:
    # Three successes: TTFT 100/200/300 ms, 5 tokens at a steady 10/20/30 ms per token; one failure.
    ok = [recorded(float(i), 0.1 * i, [0.01 * i] * 4, prompt=8) for i in (1, 2, 3)]
    bad = StreamRecord(start=0.0)
    bad.feed('data: {"error": {"message": "KV transfer failed"}}', 0.1)
    bad.finish(0.2)
    s = bench.summarize(ok + [bad], duration_s=2.0, percentiles=(50, 99), expected_output_len=5)

    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["errors"] == {"error event in stream: KV transfer failed": 1}
    assert s["total_output_tokens"] == 15 and s["total_input_tokens"] == 24
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 7.5
    assert s["total_token_throughput"] == 19.5
    assert s["wrong_output_len"] == 0
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(298.0)  # 200 + 0.98 * 100
    assert s["ttft_ms"]["max"] == pytest.approx(300.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(20.0)  # (E2E - TTFT) / (5 - 1)
    assert s["itl_ms"]["median"] == pytest.approx(20.0)  # 12 gaps: 4 each of 10, 20, 30 ms
    assert s["e2e_ms"]["mean"] == pytest.approx(1000 * (0.14 + 0.28 + 0.42) / 3)
    assert s["concurrency"] == pytest.approx((0.14 + 0.28 + 0.42) / 2.0)


def test_errors_are_grouped_by_cause() -> None:
    records = []
    for tokens in (797, 802):
        r = StreamRecord(start=0.0)
        r.error = f"HTTP 400: the prompt has {tokens} tokens"
        records.append(r)
    assert bench.summarize(records, 1.0)["errors"] == {"HTTP 400: the prompt has N tokens": 2}


def test_summarize_flags_short_outputs_and_empty_runs() -> None:
    s = bench.summarize([recorded(0.0, 0.1, [0.01], tokens=2)], 1.0, expected_output_len=64)
    assert s["wrong_output_len"] == 1
    empty = bench.summarize([], 1.0)
    assert empty["completed"] == 0 and empty["ttft_ms"]["p99"] is None


def test_arrival_gaps() -> None:
    assert bench.arrival_gaps(5, math.inf, random.Random(0)) == [0.0] * 5
    gaps = bench.arrival_gaps(20000, 4.0, random.Random(0))
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.03)  # Poisson at 4 req/s
    assert min(gaps) > 0
    with pytest.raises(ValueError):
        bench.arrival_gaps(3, 0.0, random.Random(0))


def test_prompt_lengths(tmp_path: Path) -> None:
    assert len(make_prompt(37, random.Random(1)).split()) == 37
    assert make_prompt(20, random.Random(1)) != make_prompt(20, random.Random(2))
    tokenizers = pytest.importorskip("tokenizers")
    # One token per byte, like the tiny demo model: a word is several tokens, so the tokenizer
    # path must cut the prompt rather than count words.
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[])
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path))
    assert loaded is not None
    prompt = make_prompt(50, random.Random(1), loaded)
    assert len(prompt.encode()) == 50 == len(loaded[0](prompt))
    assert len(prompt.split()) < 50


def test_calibration_from_server_token_counts() -> None:
    # Byte-level server: 8 words -> 60 tokens, 40 words -> 252 (template overhead 12, 6 per word).
    assert calibrated_words(128, [(8, 60), (40, 252)]) == 21
    assert calibrated_words(1, [(8, 60), (40, 252)]) == 1
    assert calibrated_words(100, [(8, 11), (40, 43)]) == 100  # BPE-like: one token per word
    with pytest.raises(ValueError):
        calibrated_words(100, [(8, 40), (40, 40)])


# --- the client end to end, against nothing -------------------------------------------------------


def test_run_benchmark_counts_connection_failures() -> None:
    port = free_port()  # nothing listens there: connections are refused
    result = bench.run_benchmark(
        {
            "base_url": f"http://127.0.0.1:{port}",
            "model": "m",
            "num_prompts": 4,
            "max_concurrency": 2,
            "api_key": "secret",
        }
    )
    s = result["summary"]
    assert (s["completed"], s["failed"]) == (0, 4)
    assert all(error.startswith("ConnectError") for error in s["errors"])
    assert result["config"]["request_rate"] == "inf"
    assert "secret" not in json.dumps(result)  # the key never lands in a result file


def test_bench_serving_runs_as_a_script() -> None:
    out = subprocess.run(
        [sys.executable, "loadtest/bench_serving.py", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    for flag in (
        "--base-url",
        "--num-prompts",
        "--request-rate",
        "--max-concurrency",
        "--input-len",
        "--output-len",
        "--output",
    ):
        assert flag in out.stdout


# --- report ---------------------------------------------------------------------------------------


def _result(label: str, rate: float, ttft: float) -> dict:
    records = [recorded(0.0, ttft, [0.02] * 3), recorded(1.0, 2 * ttft, [0.04] * 3)]
    cfg = bench.BenchConfig(model="m", request_rate=rate, label=label, input_len=256, output_len=4)
    return {"config": cfg.public(), "summary": bench.summarize(records, 2.0, cfg.percentiles, 4)}


def test_report_renders_one_row_per_run(tmp_path: Path) -> None:
    paths = []
    for label, rate, ttft in (("rate2", 2.0, 0.05), ("burst", math.inf, 0.5)):
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps(_result(label, rate, ttft)))
        paths.append(path)
    text = report.render_markdown(report.load(paths))
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert len(lines) == 4 and "TTFT p99 (ms)" in lines[0]
    assert lines[2].startswith("| rate2 | 256 / 4 | 2.0 | - | 2 / 0 | 1.00 | 4.0 | 75.0 | 99.5 |")
    assert lines[3].startswith("| burst | 256 / 4 | inf |")
    out = tmp_path / "report.md"
    assert report.main([str(p) for p in paths] + ["--output", str(out)]) == 0
    assert out.read_text() == text


def test_report_plots_throughput_and_tail_latency(tmp_path: Path) -> None:
    from matplotlib.image import imread

    runs = [("a", _result("a", 1.0, 0.05)), ("b", _result("b", 4.0, 0.1))]
    png = tmp_path / "plot.png"
    assert report.plot(runs, png)
    image = imread(png)  # [height, width, channels]
    assert image.shape[0] > 300 and image.shape[1] > 1000  # two panels at 120 dpi
    assert image[..., :3].std() > 0.05  # lines were drawn, not a blank canvas


def test_random_range_ratio_draws_lengths_within_bounds() -> None:
    rng = random.Random(0)
    drawn = [bench.drawn_length(8192, 0.875, rng) for _ in range(2000)]
    assert min(drawn) >= 1024 and max(drawn) <= 8192
    assert min(drawn) < 1200 and max(drawn) > 8000  # the whole range is used
    assert bench.drawn_length(512, 0.0, rng) == 512


def test_goodput_counts_requests_within_both_slos() -> None:
    from bench.disagg import goodput

    result = {
        "summary": {"duration_s": 4.0},
        "requests": [
            {"error": None, "ttft": 0.5, "itl": [0.02, 0.04]},  # meets both
            {"error": None, "ttft": 2.5, "itl": [0.01]},  # TTFT too slow
            {"error": None, "ttft": 0.5, "itl": [0.03, 0.09]},  # mean ITL 60 ms: too slow
            {"error": "HTTP 503", "ttft": None, "itl": []},
            {"error": None, "ttft": 1.9, "itl": []},  # one token: TTFT decides
        ],
    }
    assert goodput(result, 2.0, 0.05) == 2 / 4.0


def test_plot_series_draws_one_line_pair_per_group(tmp_path: Path) -> None:
    from matplotlib.image import imread

    runs = []
    for placement, scale in (("disagg", 1.0), ("colocated", 2.0)):
        for rate in (1.0, 2.0, 4.0):
            r = _result(placement, rate, 0.05 * scale)
            r["placement"] = placement
            runs.append(r)
    png = tmp_path / "ttft.png"
    assert report.plot_series(runs, "ttft_ms", png, by="placement")
    assert imread(png)[..., :3].std() > 0.05


# --- prefix-cache workloads ----------------------------------------------------------------------


def test_stream_record_keeps_the_answer_and_the_cached_tokens() -> None:
    r = StreamRecord(start=0.0)
    for t, line in enumerate([chunk(role=True), chunk("Hel"), chunk("lo")]):
        r.feed(line, float(t))
    usage = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    r.feed(chunk(usage=usage | {"prompt_tokens_details": {"cached_tokens": 8}}), 3.0)
    r.feed("data: [DONE]", 3.0)
    r.finish(3.0)
    assert "".join(r.text) == "Hello" and r.cached_tokens == 8
    s = bench.summarize([r, recorded(0.0, 0.1, [0.01], prompt=30)], 4.0)
    assert s["total_cached_tokens"] == 8 and s["cache_hit_rate"] == 8 / 40


def test_the_workloads_share_what_they_promise() -> None:
    rng = random.Random(3)
    cfg = bench.BenchConfig(
        dataset="generated-shared-prefix",
        gsp_num_groups=3,
        gsp_prompts_per_group=4,
        gsp_system_prompt_len=50,
        gsp_question_len=5,
        gsp_output_len=7,
    )
    convs = bench.conversations(cfg, rng, lambda tokens: tokens)
    systems = [c.first[0]["content"] for c in convs]  # type: ignore[index]
    assert len(convs) == 12 and len(set(systems)) == 3
    assert all(systems.count(s) == 4 and len(s.split()) == 50 for s in systems)
    assert len({c.first[1]["content"] for c in convs}) == 12  # type: ignore[index]
    assert {c.output_len for c in convs} == {7} and not any(c.questions for c in convs)
    cfg = bench.BenchConfig(dataset="multi-turn", num_prompts=2, multi_turn_turns=3, input_len=6)
    convs = bench.conversations(cfg, rng, lambda tokens: tokens)
    assert [len(c.questions) for c in convs] == [2, 2]
    assert all(len(q.split()) == 6 for c in convs for q in [c.first, *c.questions])
    with pytest.raises(ValueError, match="unknown dataset"):
        bench.conversations(bench.BenchConfig(dataset="sharegpt"), rng, lambda t: t)
