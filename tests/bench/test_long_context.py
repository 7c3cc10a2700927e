"""bench/long_context.py on CPU (its --smoke sizes: tiny shapes through the Triton interpreter,
times NaN): every phase runs its whole code path, checks the kernels it would time, and writes its
part of the JSON; a phase that fails records its own error. So the first GPU run is not the
script's first run."""

from __future__ import annotations

import json
import math

import pytest

from bench import long_context

pytestmark = pytest.mark.e2e  # a bench run end to end (--smoke)


def run(phase: str, out) -> dict:
    long_context.run_phase(phase, str(out), smoke=True)
    return json.loads(out.read_text())


def test_capacity_counts_the_allocated_bytes(tmp_path):
    cap = run("capacity", tmp_path / "r.json")["capacity"]
    assert cap["bf16"]["kv_bytes_per_entry"] == 1024 and cap["fp8"]["kv_bytes_per_entry"] == 584
    assert cap["fp8"]["index_key_bytes_per_entry"] == 132
    # 21 CSA layers x (entry + key) / 4 + 20 HCA layers x entry / 128, per token of context
    want = (21 * (1024 + 256) / 4 + 20 * 1024 / 128) / (21 * (584 + 132) / 4 + 20 * 584 / 128)
    assert math.isclose(cap["fp8_over_bf16_tokens_per_GiB"]["v4_flash"], want)


def test_store_bytes_match_the_reference(tmp_path):
    rows = run("store", tmp_path / "r.json")["store"]
    assert len(rows) == 8 and all(r["bytes_equal_reference"] for r in rows)
    assert not any("error" in r for r in rows)


def test_long_decode_checks_both_pools(tmp_path):
    result = run("long-decode", tmp_path / "r.json")
    rows = result["long_decode"]
    sizes = long_context.SMOKE
    assert len(rows) == 2 * 2 * len(sizes.contexts) * len(sizes.batches)
    assert all("error" not in r and r["rel_err"] < 1e-2 for r in rows)
    assert {r["format"] for r in rows} == {"bf16", "fp8"}
    assert all("x_bf16" in r for r in rows if r["format"] == "fp8")
    assert len(result["long_decode_alternatives"]) == 2 * 2 * sizes.alternatives
    assert "errors" not in result


def test_long_indexer_checks_both_pools(tmp_path):
    result = run("long-indexer", tmp_path / "r.json")
    rows = result["long_indexer"] + result["long_indexer_alternatives"]
    assert all("error" not in r and r["score_rel_err"] < 1e-5 for r in rows)
    assert {(r["format"], r["config"]["prefetch"]) for r in rows} == {
        (f, p) for f in ("bf16", "fp8") for p in (True, False)
    }
    assert "indexer_fp8_1M_B8_x_floor" in result["summary"]


def test_a_failing_phase_records_its_error_and_a_rerun_clears_it(tmp_path, monkeypatch):
    def boom(*args):
        raise RuntimeError("boom")

    out = tmp_path / "r.json"
    with monkeypatch.context() as m:
        m.setitem(long_context.PHASES, "capacity", boom)
        with pytest.raises(SystemExit) as exc:
            long_context.run_phase("capacity", str(out), smoke=True)
    assert exc.value.code == 1
    assert "RuntimeError: boom" in json.loads(out.read_text())["errors"]["capacity"]
    result = run("capacity", out)
    assert result["errors"] == {} and len(result["runs"]) == 2
