#!/usr/bin/env bash
# Issue 39 on one GPU in one call: the V3.2 release slice's c=64 step (bench.engine, the fix of
# the leaked request), then bench.release_numerics (kernels, slices, the demo model's GPU half
# against the CPU half recorded in bench/results/cpu-release-demo.json). Logs and JSON go to
# $OUT (the device tool's folder; default bench/results/run).
#
#   bash bench/gpu_release.sh                 # on the GPU machine, from the repository root
#   SMOKE=1 bash bench/gpu_release.sh         # the same steps on the CPU at tiny widths
set -uo pipefail
OUT=${OUT:-bench/results/run}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
card=$($PY -c 'import torch; print(torch.cuda.get_device_name().split()[1].lower() if torch.cuda.is_available() else "cpu")')
smoke=()
[ "${SMOKE:-0}" = 1 ] && smoke=(--smoke)

timeout "${ENGINE_S:-240}" $PY -m bench.engine --model-type deepseek_v32 \
    --only correctness decode release --steps 10 "${smoke[@]}" \
    --out "$OUT/$card-engine-v32.json" 2>&1 | tee "$OUT/$card-engine-v32.log"
if [ "${SMOKE:-0}" = 1 ]; then
    $PY -m bench.release_numerics --smoke --out "$OUT/$card-release-numerics.json" 2>&1 |
        tee "$OUT/$card-release-numerics.log"
else
    timeout "${NUMERICS_S:-330}" $PY -m bench.release_numerics \
        --cpu-record bench/results/cpu-release-demo.json \
        --out "$OUT/$card-release-numerics.json" 2>&1 | tee "$OUT/$card-release-numerics.log"
fi
