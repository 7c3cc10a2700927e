"""Compile the Gluon kernels of kernels.hopper for sm_90a without a GPU and print what their
SASS holds: registers, shared memory, spills and the instruction mix.

    python -m bench.gluon_sass                       # the FP4 GEMM, every decode at BT=8, 5 stages
    python -m bench.gluon_sass --block-t 64 --stages 2 --decode shift --sass out.sass
    python -m bench.gluon_sass --kernel sparse_mla   # the sparse-MLA decode, 512 and 576 wide

Needs the Triton the device runs (3.6: Gluon's API moves between releases) and no CUDA: the
JIT's driver is replaced by one that only answers the target, so ``warmup`` compiles through
ptxas and stops before loading anything. Use it before spending device time: a layout or API
error shows here, and so do a spill, a missing HGMMA/QGMMA or a barrier in the wrong loop.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime import driver


class _TargetOnly(CudaDriver):
    """What the JIT asks of a driver before it launches: the target, a device, a stream."""

    def __init__(self) -> None:  # (CudaDriver's would load libcuda)
        self.utils = None

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def compile_gemm(block_t: int, stages: int, decode: str) -> Any:
    """The compiled grouped GEMM at V4-Flash's gate/up shape (4096 x 4096, two K slices)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from dsaserve.kernels.hopper import fp4_decode, fp4_gemm, moe_rows

    e, n, k = 4, 4096, 4096
    w = torch.empty(e, n, k // 2, dtype=torch.uint8)
    s = torch.empty(e, n, k // 32, dtype=torch.uint8)
    xg, xs = moe_rows.activation_buffers(64, k, decode, torch.device("cpu"))
    w_desc, s_desc = fp4_gemm.weight_descriptors(w, s)
    x_dtype = gl.float8e4nv if decode == "fp8" else gl.bfloat16
    x_layout = gl.NVMMASharedLayout.get_default_for([block_t, fp4_gemm.SUB_K], x_dtype)
    x_desc = TensorDescriptor.from_tensor(xg, [block_t, fp4_gemm.SUB_K], x_layout)
    xs_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    xs_desc = TensorDescriptor.from_tensor(
        xs, [block_t, 4] if decode == "fp8" else [1, 4], xs_layout
    )
    out = torch.empty(2, 64, n)
    table = torch.empty(16, 3, dtype=torch.int32)
    nslot = torch.empty(1, dtype=torch.int32)
    # fmt: off
    compiled = fp4_gemm._fp4_gemm_kernel.warmup(
        w_desc, s_desc, x_desc, xs_desc, out, table, nslot,
        n, n // 2, 64, k // 2, out.stride(0), out.stride(1),
        NT=n // 128, SPLITS=2, BT=block_t, STAGES=stages,
        DECODE=fp4_decode.DECODES.index(decode), num_warps=4, maxnreg=168, grid=(1,),
    )
    # fmt: on
    return compiled


def compile_sparse_mla(dim: int, splits: int) -> Any:
    """The compiled sparse-MLA decode for rows `dim` wide (512: V4, 576: V3.2)."""
    from dsaserve.kernels.hopper import sparse_mla

    batch, heads, num_idx = 2, 128, 2048
    q = torch.empty(batch, heads, dim, dtype=torch.bfloat16)
    kv = torch.empty(4096, dim, dtype=torch.bfloat16)
    idx = torch.empty(batch, num_idx, dtype=torch.int32)
    lengths = torch.empty(batch, dtype=torch.int32)
    sinks = torch.empty(heads)
    o = torch.empty(batch, splits, heads, 512, dtype=torch.float32 if splits > 1 else q.dtype)
    lse = torch.empty(batch, splits, heads)
    # fmt: off
    compiled = sparse_mla._sparse_mla_kernel.warmup(
        q, kv, idx, lengths, sinks, o, lse,
        q.stride(0), q.stride(1), kv.stride(0), idx.stride(0),
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
        kv.shape[0], num_idx, 0.1, heads // sparse_mla.BLOCK_H, splits,
        ROPE=dim > 512, STAGES=sparse_mla.stages_for(dim), SPLIT=splits > 1, HAS_LENGTHS=True,
        HAS_SINKS=True,
        num_warps=4, maxnreg=168, grid=(1,),
    )
    # fmt: on
    return compiled


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def report(compiled: Any, sass_out: str | None) -> str:
    """Registers, spills and dynamic shared memory of a compiled kernel, and its SASS's 16 most
    frequent instructions."""
    cubin = compiled.asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
        sass = subprocess.run(
            [_tool("cuobjdump"), "--dump-sass", f.name], capture_output=True, text=True
        ).stdout
    if sass_out:
        Path(sass_out).write_text(sass)
    ops = collections.Counter(
        m.group(1).split(".")[0]
        for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)
    )
    resources = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", usage)
    top = " ".join(f"{op} {count}" for op, count in ops.most_common(16))
    resources_text = resources.group(0) if resources else usage.strip()
    return f"{resources_text} dynamic shared {compiled.metadata.shared} B\n  {top}"


def main() -> None:
    from dsaserve.kernels.hopper.fp4_decode import DECODES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=("fp4_gemm", "sparse_mla"), default="fp4_gemm")
    ap.add_argument("--block-t", type=int, default=8)
    ap.add_argument("--stages", type=int, default=5)
    ap.add_argument("--decode", choices=DECODES, action="append")
    ap.add_argument("--sass", help="write the (last) SASS here")
    args = ap.parse_args()
    driver.set_active(_TargetOnly())
    if args.kernel == "sparse_mla":
        for dim in (512, 576):
            for splits in (1, 2):
                compiled = compile_sparse_mla(dim, splits)
                print(f"sparse_mla dim={dim} splits={splits}: {report(compiled, args.sass)}")
        return
    for decode in args.decode or DECODES:
        compiled = compile_gemm(args.block_t, args.stages, decode)
        print(f"{decode} BT={args.block_t} stages={args.stages}: {report(compiled, args.sass)}")


if __name__ == "__main__":
    main()
