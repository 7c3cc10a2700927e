"""`dsaserve profile` (engine.profile): the command end to end on the CPU with the built-in model,
the attribution rules on synthetic profiler events, the floors against a hand calculation, and
the errors a user meets. No timed assertions: times only have to add up."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from dsaserve.engine.kv.layout import KVCacheConfig
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.models.deepseek_v4.config import ModelConfig
from dsaserve.engine.models.deepseek_v4.tiny import tiny_config
from dsaserve.engine.models.deepseek_v4.weights import build_model
from dsaserve.engine.profile import capture
from dsaserve.engine.profile.attribution import (
    HOST,
    OTHER,
    CpuOp,
    Kernel,
    Span,
    attribute_cpu,
    attribute_device,
    kernel_class,
)
from dsaserve.engine.profile.capture import StepProfile
from dsaserve.engine.profile.floors import (
    ExpertLoad,
    Work,
    _matmul_work,
    attention_work,
    decode_work,
    expected_expert_load,
    weight_work,
)
from dsaserve.engine.profile.hardware import H200, Hardware, known
from dsaserve.engine.profile.ranges import PARTS, profiled
from dsaserve.engine.profile.report import Report, format_table
from dsaserve.services.cli import main as cli_main
from tests import REPO_ROOT

# ---------------------------------------------------------------- the command, end to end


def _dsaserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dsaserve.services.cli", "profile", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _table(stdout: str, title: str) -> dict[str, float]:
    """name -> ms of one section of the printed table ("total" included)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = {}
    for line in lines[start + 1 :]:
        m = re.match(r"  (\S+)\s+(\d+\.\d+)", line)
        if not m:
            break
        rows[m.group(1)] = float(m.group(2))
    return rows


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> tuple[str, dict]:
    """One real `dsaserve profile` of the built-in model on the CPU: its stdout and JSON."""
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    run = _dsaserve("--concurrency", "3", "--context", "200", "--steps", "2", "--json", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout, json.loads(out.read_text())


@pytest.mark.e2e  # a dsaserve command as a process
def test_the_printed_parts_and_classes_add_up_to_the_profiled_step(cpu_run):
    stdout, report = cpu_run
    profiled_ms = float(re.search(r"under the profiler (\d+\.\d+) ms", stdout).group(1))
    for title in ("by model part", "by kernel class"):
        rows = _table(stdout, title)
        total = rows.pop("total")
        assert total == pytest.approx(profiled_ms, abs=1e-3)
        # each row is rounded to 1 µs
        assert sum(rows.values()) == pytest.approx(total, abs=1e-3 * len(rows))
    parts = _table(stdout, "by model part")
    for part in ("attention", "compressor", "indexer", "indexer_topk", "sparse_mla", "mhc"):
        assert parts[part] > 0, part
    for part in ("moe", "head", "embed", "schedule", "inputs", "sample", HOST):
        assert part in parts
    classes = _table(stdout, "by kernel class")
    assert {"gemm", "attention", "indexer", "moe", "elementwise", HOST} <= set(classes)
    assert "no hardware figures for cpu: times only" in stdout
    assert re.search(r"\n  gemm\s+\d+\.\d+\s+\d+\.\d%\s+-\s+-\n", stdout)  # no floor on a CPU


@pytest.mark.e2e  # a dsaserve command as a process
def test_the_json_is_the_table(cpu_run):
    stdout, report = cpu_run
    total = report["profiled_step_ms"]
    assert report["setup"] == {
        "model": "dsaserve-demo-v4",
        "dtype": "float32",
        "quantized_compute": False,
        "kv_dtype": "float32",
        "tensor_parallel_size": 1,
        "concurrency": 3,
        "context": 200,
        "steps": 2,
        "device": "cpu",
    }
    assert report["hardware"] is None and report["floor_ms"] is None
    assert report["step_mode"] == "eager" and report["step_ms"] > 0
    for axis in ("parts", "classes"):
        rows = report[axis]
        assert sum(r["ms"] for r in rows.values()) == pytest.approx(total)
        assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0)
        assert all(r["floor_ms"] is None for r in rows.values())
        printed = _table(stdout, "by model part" if axis == "parts" else "by kernel class")
        assert {k: round(v["ms"], 3) for k, v in rows.items()} == {
            k: v for k, v in printed.items() if k != "total"
        }
    for part, row in report["parts"].items():
        assert sum(row["classes"].values()) == pytest.approx(row["ms"]), part
    by_class: dict[str, float] = {}
    for row in report["parts"].values():
        for cls, ms in row["classes"].items():
            by_class[cls] = by_class.get(cls, 0.0) + ms
    assert by_class == pytest.approx({c: r["ms"] for c, r in report["classes"].items()})
    # the attention kernel's and the indexer's reference ops have the classes of their kernels
    assert report["parts"]["sparse_mla"]["classes"].keys() <= {"attention", HOST}
    assert report["parts"]["indexer_topk"]["classes"].keys() <= {"indexer", HOST}
    assert report["parts"]["moe"]["classes"].keys() <= {"moe", HOST}
    # the work is there, for a GPU to divide: 4 MoE layers, routed experts measured
    assert report["work"]["sparse_mla"]["attention"]["bytes"] > 0
    assert len(report["routed_experts"]) == 4
    for layer in report["routed_experts"]:
        assert 1 <= layer["experts_hit"] <= 8 and layer["pairs"] == 3 * 2
    assert format_table(report) == stdout.rstrip("\n")


@pytest.mark.e2e  # a dsaserve command as a process
def test_a_missing_model_directory_exits_with_an_error(tmp_path):
    run = _dsaserve("--model", str(tmp_path / "nowhere"))
    assert run.returncode != 0
    assert f"--model {tmp_path / 'nowhere'}: no such directory" in run.stderr


@pytest.mark.e2e  # dsaserve commands as processes
def test_a_tiny_v41_checkpoint_made_and_profiled_by_the_commands(tmp_path):
    """`dsaserve make-tiny-model --model-type deepseek_v41`, then `dsaserve profile` of it: each
    of V4.1's parts takes time, Engram's lookups (its table rows) under a range of their own."""
    model, out = tmp_path / "v41", tmp_path / "profile.json"
    made = subprocess.run(
        [sys.executable, "-m", "dsaserve.services.cli", "make-tiny-model", str(model)]
        + ["--model-type", "deepseek_v41", "--format", "release"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    run = _dsaserve(
        "--model", str(model), "--concurrency", "2", "--context", "40", "--steps", "1",
        "--json", str(out),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["setup"]["model"] == "v41"
    for part in ("attention", "compressor", "indexer", "sparse_mla", "mhc", "moe", "head"):
        assert report["parts"][part]["ms"] > 0, part
    assert report["parts"]["engram"]["ms"] > 0 and report["parts"]["engram_lookup"]["ms"] > 0


def test_a_family_the_profile_does_not_know_is_refused(tmp_path, capsys):
    """Its floors and parts are DeepSeek-V4's: a V3.2 checkpoint is refused before loading."""
    from dsaserve.engine.models.deepseek_v32.tiny import make_tiny_model as make_v32

    model = make_v32(tmp_path / "v32")
    with pytest.raises(SystemExit) as e:
        cli_main(["profile", "--model", str(model)])
    assert "profiles DeepSeek-V4 and V4.1 checkpoints only" in str(
        e.value
    ) and "deepseek_v32" in str(e.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "0"], "--concurrency must be >= 1, got 0"),
        (["--context", "-5"], "--context must be >= 1, got -5"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
    ],
)
def test_nonsense_sizes_are_refused_by_the_parser(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["profile", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # the built-in model's context is 2048 tokens
        (
            ["--context", "2040"],
            "--context 2040 leaves too little room within the max-model-len 2048 for the 13 "
            "decode steps the profile runs (--context 2034 at most)",
        ),
        (["--context", "500", "--max-model-len", "400"], "within the max-model-len 400"),
        (["--concurrency", "9", "--max-num-seqs", "8"], "raise --max-num-seqs"),
        (["--kv-cache-memory-bytes", "0"], "KV cache budget"),
    ],
)
def test_what_the_engine_cannot_hold_is_refused_with_what_to_change(args, message):
    with pytest.raises(SystemExit) as e:
        cli_main(["profile", *args])
    assert isinstance(e.value.code, str) and message in e.value.code  # (printed; exit status 1)


def test_a_pool_too_small_for_the_history_says_so():
    # 100 requests of 1K tokens do not fit the 128 MiB left after the fixed costs
    with pytest.raises(SystemExit) as e:
        cli_main(
            [
                "profile",
                "--concurrency",
                "100",
                "--context",
                "1024",
                "--max-num-seqs",
                "128",
                "--max-num-batched-tokens",
                "256",
                "--kv-cache-memory-bytes",
                str(256 << 20),
            ]
        )
    assert "--kv-cache-memory-bytes" in e.value.code and "pages of the" in e.value.code


# ---------------------------------------------------------------- attribution


def _device_cells(kernels, spans, wall=1000.0):
    cells = attribute_device(kernels, spans, wall)
    assert sum(cells.values()) == pytest.approx(max(wall, sum(k.end - k.start for k in kernels)))
    return cells


def test_a_triton_moe_kernel_under_the_moe_range_is_moe():
    # The FP4 MoE kernels are Triton launches the profiler links to no op; the moe range's
    # annotation spans them (its torch kernels run before and after), as in
    # bench/results/h200-engine-256.json where a 13 ms moe_up_kernel was counted elementwise.
    kernels = [
        Kernel("void cutlass_gemm_router", 0, 10, part="moe"),
        Kernel("_moe_up_kernel", 10, 500, part=None),
        Kernel("_moe_down_kernel", 500, 700, part=None),
        Kernel("elementwise_kernel<add>", 700, 710, part="moe"),
    ]
    cells = _device_cells(kernels, [Span("moe", 0, 710)])
    assert cells[("moe", "moe")] == pytest.approx(710)
    assert cells[(HOST, HOST)] == pytest.approx(290)


def test_kernels_without_a_range_of_their_own_go_to_the_part_their_name_belongs_to():
    # sparse_mla and indexer_topk open ranges around Triton launches only: the profiler draws
    # no span for them, the attention span covers them.
    kernels = [
        Kernel("nvjet_gemm_wq_b", 0, 10, part="attention"),
        Kernel("_sparse_mla_kernel", 10, 50),
        Kernel("_combine_kernel", 50, 55),
        Kernel("_score_kernel", 55, 60),
        Kernel("_merge_kernel", 60, 62),
        Kernel("_compress_decode_kernel", 62, 64),
        Kernel("ncclDevKernel_AllReduce_Sum_f32", 66, 76, part="attention"),
        Kernel("_hc_mix_kernel", 81, 83),  # outside every span: its name says mhc
        Kernel("unknown_kernel", 83, 84),
        Kernel("Memcpy DtoD (Device -> Device)", 84, 85, part=OTHER),
    ]
    cells = _device_cells(kernels, [Span("attention", 0, 80)], wall=100)
    assert cells == pytest.approx(
        {
            ("attention", "gemm"): 10,
            ("sparse_mla", "attention"): 45,
            ("indexer_topk", "indexer"): 7,
            ("compressor", "elementwise"): 2,
            ("attention", "communication"): 10,
            ("mhc", "elementwise"): 2,
            (OTHER, "elementwise"): 2,
            (HOST, HOST): 22,
        }
    )


def test_a_draft_heads_layers_count_as_drafting_split_by_kernel_class():
    """Inside `draft` (a WHOLE part) the draft layers' own ranges do not take the time: the
    report says what drafting costs, by kernel class."""
    spans = [Span("draft", 0, 100), Span("attention", 10, 50), Span("sparse_mla", 20, 30)]
    kernels = [
        Kernel("_sparse_mla_decode_kernel", 22, 26),
        Kernel("_rms_norm_kernel", 12, 13),
        Kernel("gemm_of_a_draft_layer", 60, 70, part="draft"),
    ]
    cells = _device_cells(kernels, spans, wall=100)
    assert cells[("draft", "attention")] == pytest.approx(4)
    assert cells[("draft", "elementwise")] == pytest.approx(1)
    assert cells[("draft", "gemm")] == pytest.approx(10)
    assert not any(part in ("attention", "sparse_mla") for part, _ in cells)


def test_the_innermost_span_wins_and_a_name_does_not_pull_a_kernel_out_of_it():
    # The indexer's own compressor: its compress kernel lies in the indexer span, not in the
    # layer's compressor part.
    spans = [
        Span("attention", 0, 100),
        Span("compressor", 5, 20),
        Span("indexer", 30, 60),
        Span("attention", 200, 300),  # the next layer
    ]
    kernels = [
        Kernel("_compress_decode_kernel", 10, 12),
        Kernel("_compress_decode_kernel", 35, 37),
        Kernel("_indexer_query_kernel", 40, 41),
        Kernel("_rms_norm_kernel", 62, 63),
        Kernel("_rms_norm_kernel", 250, 251),
        Kernel("gemm_in_layer_0_compressor", 6, 8, part="compressor"),
    ]
    cells = _device_cells(kernels, spans, wall=300)
    assert cells[("compressor", "elementwise")] == pytest.approx(2)
    assert cells[("compressor", "gemm")] == pytest.approx(2)
    assert cells[("indexer", "elementwise")] == pytest.approx(3)
    assert cells[("attention", "elementwise")] == pytest.approx(2)


def test_kernel_classes():
    assert kernel_class("_moe_up_kernel", OTHER) == "moe"
    assert kernel_class("aten::mm", "moe") == "moe"
    assert kernel_class("aten::mm", "attention") == "gemm"
    assert kernel_class("_fp8_gemm_kernel", "attention") == "gemm"
    assert kernel_class("sm90_xmma_gemm_bf16", "head") == "gemm"
    assert kernel_class("aten::topk", "indexer_topk") == "indexer"
    assert kernel_class("aten::einsum", "sparse_mla") == "attention"
    assert kernel_class("gloo:all_reduce", "moe") == "communication"
    assert kernel_class("aten::broadcast_tensors", "attention") == "elementwise"
    assert kernel_class("_rms_norm_kernel", "attention") == "elementwise"


def test_cpu_ops_take_their_self_time_and_the_rest_is_host():
    ops = [
        CpuOp("dsaserve.moe", 5, "moe"),  # Python between the MoE's ops
        CpuOp("aten::mm", 20, "moe"),
        CpuOp("aten::topk", 7, "indexer_topk"),
        CpuOp("aten::bmm", 3, "attention"),
        CpuOp("aten::add", 1, OTHER),
    ]
    cells = attribute_cpu(ops, wall_us=50)
    assert cells == {
        ("moe", HOST): 5,
        ("moe", "moe"): 20,
        ("indexer_topk", "indexer"): 7,
        ("attention", "gemm"): 3,
        (OTHER, "elementwise"): 1,
        (HOST, HOST): 14,
    }


def test_a_real_cpu_profile_finds_each_ops_innermost_range():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with profiled("attention"):
            a + b
            with profiled("sparse_mla"):
                torch.mm(a, b)
        torch.mm(a, b)
    ops = capture.cpu_ops(prof.events())
    parts = {(op.name, op.part) for op in ops}
    assert ("aten::mm", "sparse_mla") in parts and ("aten::mm", OTHER) in parts
    assert ("aten::add", "attention") in parts
    assert ("dsaserve.sparse_mla", "sparse_mla") in parts


def test_device_records_link_kernels_to_their_ops_and_read_the_annotations():
    # torch.profiler's shapes, as a CUDA run fills them (no GPU here)
    cpu = torch.autograd.DeviceType.CPU
    cuda = torch.autograd.DeviceType.CUDA

    def op(id_, name, parent=None):
        return SimpleNamespace(
            id=id_,
            name=name,
            cpu_parent=parent,
            device_type=cpu,
            is_async=False,
            time_range=SimpleNamespace(start=id_),
            self_cpu_time_total=1.0,
        )

    moe = op(1, "dsaserve.moe")
    mm = op(2, "aten::mm", moe)

    def activity(name, start_ns, dur_ns, linked=0, device=cuda):
        return SimpleNamespace(
            name=lambda: name,
            device_type=lambda: device,
            start_ns=lambda: start_ns,
            duration_ns=lambda: dur_ns,
            linked_correlation_id=lambda: linked,
        )

    prof = SimpleNamespace(
        events=lambda: [moe, mm],
        profiler=SimpleNamespace(
            kineto_results=SimpleNamespace(
                events=lambda: [
                    activity("aten::mm", 0, 5000, device=cpu),
                    activity("dsaserve.moe", 1000, 9000),
                    activity("sm90_gemm", 1000, 2000, linked=2),
                    activity("_moe_up_kernel", 3000, 5000),
                    activity("dsaserve.unknown_range", 0, 100),
                    activity("CUPTI Overhead", 0, 100),
                    activity("Stream Sync", 0, 9000),
                ]
            )
        ),
    )
    kernels, spans = capture.device_records(prof)
    assert kernels == [Kernel("sm90_gemm", 1.0, 3.0, "moe"), Kernel("_moe_up_kernel", 3.0, 8.0)]
    assert spans == [Span("moe", 1.0, 10.0)]


def test_every_range_the_model_opens_is_a_known_part():
    names = set()
    for path in (REPO_ROOT / "dsaserve" / "engine").rglob("*.py"):
        names |= set(re.findall(r'profiled\("(\w+)"\)', path.read_text()))
    assert names and names <= set(PARTS)
    assert {"attention", "compressor", "indexer", "sparse_mla", "mhc", "moe", "head"} <= names


# ---------------------------------------------------------------- floors


@pytest.fixture(scope="module")
def tiny_shapes():
    """The dense tiny model's shapes (hidden 64, 4 heads x 64, window 16, CSA rate 4 with
    top-8 of 16 x 32 indexer heads, HCA rate 16, 8 experts of 32 top-2, vocab 258, fp32)."""
    cfg = ModelConfig.from_hf(tiny_config(258))
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    pool = KVPool(
        cfg,
        KVCacheConfig(memory_bytes=8 << 20, max_num_seqs=4, max_num_batched_tokens=64),
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return model, pool


def test_attention_floors_match_a_hand_calculation(tiny_shapes):
    model, pool = tiny_shapes
    n, context = 3, 100  # position 100: 101 tokens visible
    cells = attention_work(model, pool, n, context)
    # rows per query: sliding 16; CSA 16 + min(8, 101 // 4 = 25); HCA 16 + 101 // 16 = 6
    rows = 16 + 3 * (16 + 8) + 2 * (16 + 6)
    assert cells["sparse_mla", "attention"] == Work(
        bytes=n * rows * 64 * 4, flops=n * rows * 4 * 4 * 64
    )
    # three CSA layers, 25 keys of 32 fp32 each per query, 16 heads of 32 scoring them
    assert cells["indexer_topk", "indexer"] == Work(
        bytes=3 * n * 25 * 32 * 4, flops=3 * n * 25 * 2 * 16 * 32
    )


def test_v41_attention_floors_match_a_hand_calculation():
    """DeepSeek-V4.1's tiny shapes at position 100 (101 tokens visible): every layer's window
    of 8 rows; the compressed layers' top-8 of their source's entries (ratio 2: 50 visible,
    ratio 1: 101); the index sources' keys: layers 1 and 3 and the candidate source 4 score all
    they see, layer 6 only its 3 candidate blocks of 4."""
    from dsaserve.engine.models.deepseek_v41 import ModelConfig as V41Config
    from dsaserve.engine.models.deepseek_v41 import build_model as build_v41
    from dsaserve.engine.models.deepseek_v41.tiny import text_config

    text = text_config(272) | {"engram_layer_ids": []}
    cfg = V41Config.from_hf({"model_type": "deepseek_v41", "text_config": text})
    model = build_v41(cfg, torch.float32, torch.device("cpu"))
    kv_cfg = KVCacheConfig(memory_bytes=8 << 20, max_num_seqs=4, max_num_batched_tokens=64)
    pool = KVPool(cfg, kv_cfg, dtype=torch.float32, device=torch.device("cpu"))
    n, context = 3, 100
    cells = attention_work(model, pool, n, context)
    rows = 8 * 8 + 3 * 8 + 4 * 8
    assert cells["sparse_mla", "attention"] == Work(
        bytes=n * rows * 64 * 4, flops=n * rows * 4 * 4 * 64
    )
    keys = 50 + 50 + 101 + 12
    assert cells["indexer_topk", "indexer"] == Work(
        bytes=n * keys * 32 * 4, flops=n * keys * 2 * 16 * 32
    )


def test_weight_floors_match_a_hand_calculation(tiny_shapes):
    model, _ = tiny_shapes
    n = 3
    loads = [ExpertLoad(experts=2, pairs=5)] * 6
    cells = weight_work(model, n, loads)
    # head: the LM head [258, 64] and the last mHC collapse [4, 4 * 64]
    head = 258 * 64 + 4 * 256
    assert cells["head", "gemm"] == Work(bytes=4 * head, flops=2 * n * head)
    # per layer: router [8, 64] and shared expert (3 x [32, 64]), on all rows; two routed
    # experts (w1|w3 [64, 64] + w2 [64, 32]) read, five (token, expert) pairs through them
    dense, expert = 8 * 64 + 3 * 32 * 64, 64 * 64 + 64 * 32
    assert cells["moe", "moe"] == Work(
        bytes=6 * 4 * (dense + 2 * expert), flops=6 * (2 * n * dense + 2 * 5 * expert)
    )
    # mHC: two mixes [24, 256] per layer
    assert cells["mhc", "gemm"] == Work(bytes=6 * 2 * 4 * 24 * 256, flops=6 * 2 * 2 * n * 24 * 256)
    # attention: wq_a [32, 64], wq_b [256, 32], wkv [64, 64], wo_a [2 * 16, 128], wo_b [64, 32]
    attn = 32 * 64 + 256 * 32 + 64 * 64 + 32 * 128 + 64 * 32
    assert cells["attention", "gemm"] == Work(bytes=6 * 4 * attn, flops=6 * 2 * n * attn)
    assert ("embed", "gemm") not in cells  # a gather of n rows, not a matmul


def test_expected_routing_and_quantized_formats():
    load = expected_expert_load(n=3, top_k=2, num_experts=8, local=8)
    assert load.experts == pytest.approx(8 * (1 - 0.75**3)) and load.pairs == 6
    assert expected_expert_load(n=3, top_k=2, num_experts=8, local=4).pairs == 3
    fp8 = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    assert _matmul_work("wq_b.weight", fp8, rows=2) == Work(256 * 128, 0, 2 * 2 * 256 * 128)
    scale = torch.zeros(2, 1, dtype=torch.float8_e8m0fnu)
    assert _matmul_work("wq_b.scale", scale, rows=2) == Work(bytes=2)
    fp4 = torch.zeros(64, 32, dtype=torch.int8)  # two e2m1 codes a byte: a [64, 64] matrix
    assert _matmul_work("w13", fp4, rows=1) == Work(64 * 32, 0, 2 * 64 * 64)


def test_a_floor_is_bytes_or_flops_whichever_takes_longer():
    hw = Hardware("test", copy_GBps=1000, bf16_matmul_TFLOPs=100, fp8_matmul_TFLOPs=200)
    assert Work(bytes=1e9).ms(hw) == pytest.approx(1.0)  # 1 GB at 1000 GB/s
    assert Work(bytes=1, flops=1e11).ms(hw) == pytest.approx(1.0)  # 100 GFLOP at 100 TFLOP/s
    assert Work(flops=1e11, fp8_flops=2e11).ms(hw) == pytest.approx(2.0)
    no_fp8 = Hardware("test", copy_GBps=1000, bf16_matmul_TFLOPs=100)
    assert Work(fp8_flops=1e11).ms(no_fp8) == pytest.approx(1.0)
    assert known("NVIDIA H200") is H200 and known("NVIDIA A100-SXM4-80GB") is None


def test_a_report_with_hardware_sets_each_row_against_its_floor(tiny_shapes):
    model, pool = tiny_shapes
    work = decode_work(model, pool, 3, 100)
    profile = StepProfile(
        cells={
            ("moe", "moe"): 2.0,
            ("sparse_mla", "attention"): 1.0,
            ("attention", "gemm"): 0.5,
            ("attention", "elementwise"): 0.25,
            (HOST, HOST): 0.25,
        },
        wall_ms=4.0,
        steps=1,
    )
    hw = Hardware("test GPU", copy_GBps=0.001, bf16_matmul_TFLOPs=1e-6)  # 1 byte/ms, 1 FLOP/ms
    report = Report({"model": "tiny", "device": "cuda"}, 3.0, "cuda graphs", profile, work, hw)
    d = report.as_dict()
    floors = {key: w.ms(hw) for key, w in work.items()}
    assert d["floor_ms"] == pytest.approx(sum(floors.values()))
    assert d["step_over_floor"] == pytest.approx(3.0 / d["floor_ms"])
    assert d["classes"]["attention"]["floor_ms"] == pytest.approx(floors["sparse_mla", "attention"])
    assert d["classes"]["elementwise"]["floor_ms"] is None
    assert d["parts"]["attention"]["floor_ms"] == pytest.approx(floors["attention", "gemm"])
    assert d["parts"]["compressor"]["ms"] == 0  # work but no time: still listed
    assert list(d["parts"])[:2] == ["moe", "sparse_mla"] and list(d["parts"])[-1] == HOST
    table = format_table(report)
    assert "floors on test GPU: copy 0 GB/s" in table
    moe_row = next(line for line in table.splitlines() if line.startswith("  moe "))
    ratio = 2.0 / floors["moe", "moe"]
    assert moe_row.split()[3:5] == [f"{floors['moe', 'moe']:.3f}", f"{ratio:.1f}"]
    assert f"{d['step_over_floor']:.2f}x" in table
    assert json.loads(json.dumps(d)) == d
    assert math.isclose(sum(r["share"] for r in d["parts"].values()), 1.0)
