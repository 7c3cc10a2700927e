"""bench/v41_slice.py on the CPU: the slice is V4.1-Flash's widths and kinds of layer, its Engram
tables sized as asked, and at the --smoke widths the engram phase runs the serving path (the
loader's attach_engram, the device cache, dsaserve profile's Engram ranges) end to end, so the
first GPU run is not the script's first run."""

from __future__ import annotations

import pytest
import torch

from bench import v41_slice
from bench.fake_quant import layer_labels

pytestmark = pytest.mark.e2e  # a bench run end to end (--smoke)


def test_the_slice_has_v41_flash_widths_and_each_kind_of_layer():
    cfg = v41_slice.slice_config(16, engram_rows=1 << 25)
    assert (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank) == (5120, 64, 512, 1280)
    assert (cfg.index_n_heads, cfg.index_topk, cfg.sliding_window) == (32, 512, 128)
    assert (cfg.candidate_topk_blocks, cfg.candidate_block_size) == (2048, 8)
    assert layer_labels(cfg) == [
        "window",
        "window",
        "ratio 2 source",
        "ratio 2 reader",
        "ratio 2 source",
        "ratio 1 source",
        "ratio 1 reader",
        "ratio 1 reader",
    ]
    assert cfg.uses_candidates(6) and cfg.index_source_of(7) == 6
    assert [cfg.halo(i) for i in (5, 6, 7)] == [None, 128 + 127, 128]  # the decoder
    assert cfg.engram is not None and cfg.engram.hash_cols == 24
    for rows in cfg.engram.num_embeddings:  # each table its buckets: about the rows asked
        assert abs(rows / (1 << 25) - 1) < 1e-3


def test_the_engram_phase_runs_the_serving_path_at_smoke_widths():
    cfg = v41_slice.slice_config(4, engram_rows=1 << 12, smoke=True)
    bench = v41_slice.EngramBench(
        cfg, v41_slice.ZipfStream(cfg.vocab_size, 1.1), torch.device("cpu"), kv_bytes=64 << 20
    )
    assert cfg.engram is not None
    table = bench.v41.engrams()[0].table
    assert table is not None and table.slots == 1024  # a quarter of the table: CPU's budget
    codes, scales = bench.tables[0]
    ids = torch.tensor([0, 5, 4000])
    want = codes[ids].view(torch.float8_e4m3fn).float().view(3, -1, 32)
    want = (want * 2.0 ** (scales[ids].float() - 127)[..., None]).view(3, -1)
    assert torch.equal(table.lookup(ids).float(), want)  # the host table's rows

    with torch.no_grad():
        result = v41_slice.engram_profile(bench, 2, 32, None, "smoke")
    lookups_per_token = cfg.engram.hash_cols * len(cfg.engram.layer_ids)
    assert result["lookups"] % lookups_per_token == 0 and result["lookups"] > 0
    assert 0 < result["engram_lookup_ms"] <= result["engram_ms"] < result["profiled_step_ms"]
    assert 0 < result["cache_hit_rate"] < 1  # Zipfian n-grams: some recur, not all
    assert not bench.scheduler.running

    bench.set_engram_cache(0)  # every row from the host table
    assert table.slots == 0
    with torch.no_grad():
        result = v41_slice.engram_profile(bench, 1, 16, None, "no cache")
    assert result["cache_hit_rate"] == 0
