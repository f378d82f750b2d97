#!/usr/bin/env bash
# The GPU measurements of the lambda kernels and models (issue: "Fast on the GPU"), for one lent GPU machine
# (device tool: torch 2.11, triton 3.6, timm, no network). Each stage fits one 10-minute call; results go to
# $OUT/<stage>/ (bench.md, CSV, JSON, plots) and the logs to $OUT/<stage>.log.
#
#   bash scripts/gpu_bench.sh check    # pytest -m device: kernels and layers on CUDA against the CPU/einsum
#   bash scripts/gpu_bench.sh layers   # LambdaLayer fwd+bwd vs timm/lucidrains (fp32), every impl, attention
#   bash scripts/gpu_bench.sh models   # models: bf16, channels_last, 256 px, batch 256, eager and compiled
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
stage=${1:-check}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  $PY -c "import lambdanet; print('lambdanet ok')"
} > "$OUT/env.txt" 2>&1
case "$stage" in
  check)
    $PY -m pytest -q -m device tests/test_device.py tests/test_kernels.py -p no:cacheprovider 2>&1 | tee "$OUT/check.log" | tail -30 ;;
  layers)
    $PY -m lambdanet bench targets impls attention --device cuda --repeats 20 --out "$OUT/layers" 2>&1 | tee "$OUT/layers.log" | tail -40 ;;
  models)
    for mode in "" "--compile"; do
      name=models${mode:+-compiled}
      $PY -m lambdanet bench models --device cuda --suites timm26 table13 table14 --amp bf16 --channels-last \
        --img-size 256 --batch-size 256 $mode --out "$OUT/$name" 2>&1 | tee "$OUT/$name.log" | tail -25
    done ;;
  *) echo "unknown stage $stage (check | layers | models)"; exit 2 ;;
esac
