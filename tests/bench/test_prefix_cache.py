"""bench/prefix_cache.py end to end on the tiny model, its slice option at the smoke widths: the
scenarios it times resume what they should, and its summary says so."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import REPO_ROOT

pytestmark = pytest.mark.e2e  # a bench run end to end


@pytest.mark.parametrize("model", ["tiny", "slice"])
def test_the_bench_times_what_it_says(tiny, tmp_path, model) -> None:
    out = tmp_path / "record.json"
    which = ["--slice"] if model == "slice" else ["--model", str(tiny)]
    args = ["--prompt-tokens", "200", "--extend-tokens", "30", "--reps", "1", "--out", str(out)]
    subprocess.run(
        [sys.executable, "-m", "bench.prefix_cache", *which, *args, "--no-compare-engine"],
        cwd=REPO_ROOT,
        check=True,
        timeout=300,
        capture_output=True,
    )
    record = json.loads(out.read_text())
    cached = record["cached_engine"]
    assert [cached[s]["cached_tokens"] for s in ("first", "extends", "fresh")] == [0, 200, 0]
    assert record["extends_over_first_ttft"] == pytest.approx(
        cached["extends"]["ttft_ms"] / cached["first"]["ttft_ms"]
    )
    assert "uncached_engine" not in record
