#!/usr/bin/env bash
# `dsaserve profile` on one H200: the decode step of bench/engine.py's V4-Flash-width slice
# (6 layers: sliding, CSA and HCA; 16 routed experts; random weights, the byte tokenizer) by
# kernel class and model part, against the step's byte/FLOP floors, at the bench's headline
# point (64 requests, 32K tokens of context), with bf16 weights and with the release's formats
# (FP8 linears, FP4 experts: the Triton MoE kernels the profile must put in `moe`).
#
#   bash bench/gpu_profile.sh
#       -> bench/results/h200-profile-bf16.json, bench/results/h200-profile-release.json
#   EXPERTS=16 CONCURRENCY=64 CONTEXT=32768 STEPS=10 SLICES=/tmp/dsaserve-slices \
#       PYTHON=.venv/bin/python bash bench/gpu_profile.sh
#
# The slices are written once into $SLICES (dense: fp32, ~17 GB at 16 experts; release:
# ~5 GB) by `python -m bench.engine --write-slice`; a later run reuses them. Each profile runs
# even if the other failed; the script exits non-zero if any step failed.
#
# A dry run of the whole script on a CPU (the slice at bench/engine.py's --smoke widths):
#   SMOKE=1 DEVICE=cpu EXPERTS=8 CONCURRENCY=2 CONTEXT=64 STEPS=1 OUT=/tmp \
#       SLICES=/tmp/dsaserve-smoke-slices bash bench/gpu_profile.sh
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
EXPERTS=${EXPERTS:-16}
CONCURRENCY=${CONCURRENCY:-64}
CONTEXT=${CONTEXT:-32768}
STEPS=${STEPS:-10}
SLICES=${SLICES:-/tmp/dsaserve-slices}
OUT=${OUT:-bench/results}
DEVICE=${DEVICE:-cuda}
SMOKE=${SMOKE:-}
status=0

for fmt in dense release; do
    dir="$SLICES/v4-flash-slice-$EXPERTS-$fmt${SMOKE:+-smoke}"
    if [ ! -f "$dir/config.json" ]; then
        echo "== writing the $fmt slice into $dir"
        "$PYTHON" -m bench.engine --experts "$EXPERTS" --write-slice "$dir" \
            --slice-format "$fmt" ${SMOKE:+--smoke} || status=1
    fi
done

profile() {  # profile NAME SLICE_FORMAT
    local name=$1 dir="$SLICES/v4-flash-slice-$EXPERTS-$2${SMOKE:+-smoke}"
    echo "== dsaserve profile: $name weights, c=$CONCURRENCY, context $CONTEXT"
    # --max-num-seqs: graphs captured up to the concurrency only (capture time);
    # bfloat16 computes an FP8/FP4 checkpoint as the release does (--quantized-compute).
    "$PYTHON" -m dsaserve.services.cli profile --model "$dir" --device "$DEVICE" --dtype bfloat16 \
        --concurrency "$CONCURRENCY" --context "$CONTEXT" --steps "$STEPS" \
        --max-num-seqs "$CONCURRENCY" --json "$OUT/h200-profile-$name.json" || status=1
}

profile bf16 dense
profile release release
exit $status
