#!/usr/bin/env bash
# The tensor-parallel run on one host with two GPUs (2 x H200, NVLink; torch 2.11+cu130, Triton
# 3.6, NCCL): the GPU tests of tensor parallelism and of the kernel path it added, then the
# decode step at TP=1 against TP=2 on the 256-expert V4-Flash-width slice (bench/tp.py).
#   scripts/gpu_tp.sh [OUT_DIR]    # default bench/results: h200x2-tp.json, h200x2-tp-tests.log
# Needs the project's runtime dependencies and pytest in $PYTHON (default python3); not NIXL,
# Redis or HF transformers. --noconftest -p tests.model_fixtures: tests/conftest.py imports the
# serving stack's client libraries; the tiny checkpoints come from tests/model_fixtures.py.
# NVLink multicast (NVLS) stays off.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python3}
nvidia-smi -L
"$python" -c "import torch; assert torch.cuda.device_count() >= 2, 'needs two GPUs'" || exit 1
"$python" -m pytest -q -rs -m gpu --noconftest -p tests.model_fixtures -p no:cacheprovider \
  tests/engine/test_tensor_parallel_gpu.py tests/engine/test_engine_gpu.py \
  tests/kernels/test_quant.py::test_cuda_fp4_expert_ranges_add_up_to_all_experts \
  2>&1 | tee "$out/h200x2-tp-tests.log"
tests=${PIPESTATUS[0]}
"$python" -m bench.tp --experts 256 --tensor-parallel-size 2 --out "$out/h200x2-tp.json"
bench=$?
echo "tests: exit $tests; bench: exit $bench"
exit $((tests || bench))
