"""bench/dspark.py --smoke: the GPU bench's steps (the slice's DSpark head written, a decode step
and a speculating step timed at each concurrency) run end to end on the tiny release model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import REPO_ROOT

pytestmark = pytest.mark.e2e  # a bench run end to end (--smoke)


def test_the_bench_times_both_steps_and_writes_its_record(tmp_path):
    out = tmp_path / "dspark.json"
    subprocess.run(
        [sys.executable, "-m", "bench.dspark", "--smoke", "--model-dir", str(tmp_path / "m"),
         "--out", str(out)],
        cwd=REPO_ROOT, check=True, timeout=600,
    )  # fmt: skip
    record = json.loads(out.read_text())
    assert set(record["rows"]) == {"c=1", "c=4"}
    for row in record["rows"].values():
        assert row["decode_step_ms"] > 0 and row["dspark_step_ms"] > 0
        assert set(row["tpot_vs_none"]) == {"2.8", "3.51"}
