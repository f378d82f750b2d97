#!/usr/bin/env bash
# The GPU measurements of the lambda kernels, layers and models (issue 23), for one lent GPU machine (device
# tool: torch 2.11, triton 3.6, timm, no network). Results go to $OUT/r/<stage>/ (bench.md, CSV, JSON) and the
# logs to $OUT/r/<stage>.log; the bundles pack $OUT/r into $OUT/results.tgz (the device tool returns at most 8
# files). Each stage runs under its own time limit so that a bundle ends inside one 10-minute call.
#
#   bash scripts/gpu_bench.sh check      # pytest -m device: kernels, layers and models on CUDA against the CPU
#   bash scripts/gpu_bench.sh kernels    # the position kernels' roofline against measured ceilings
#   bash scripts/gpu_bench.sh layers     # LambdaLayer fwd+bwd vs timm/lucidrains, fp32 and bf16; attention
#   bash scripts/gpu_bench.sh impls      # every LambdaLayer implementation (what ImplPolicy is fitted to)
#   bash scripts/gpu_bench.sh models     # models: bf16, channels_last, 256 px, batch 256, eager
#   bash scripts/gpu_bench.sh compiled   # the timm26 suite under torch.compile
#   bash scripts/gpu_bench.sh lm         # the causal lambda op vs fla / SDPA, the LMs' training, generation and
#                                        # launches (scripts/gpu_lm.py; fla-core carried as a wheel in .whl/)
#   bash scripts/gpu_bench.sh lm-first   # the causal op in one call (~9 minutes): the GPU check, per-kernel
#                                        # times (also of the channel loop forced, and of .gl/base's package), the
#                                        # op against fla / SDPA, the models, the launch-settings sweep, Nsight
#                                        # Compute on the product kernels (lm-ncu alone too)
#   bash scripts/gpu_bench.sh lm-quality # issue 37: *_lm_small (and heads=8) against the transformer, contexts 1024
#                                        # and 4096 (~8 minutes)
#   bash scripts/gpu_bench.sh free26t    # resnet26t with the three convolutions lambda_resnet26t replaces made free
#                                        # (scripts/gpu_free_layers.py: the ceiling of ">= 2x timm's", ~1 minute)
#   bash scripts/gpu_bench.sh run1|run2|run3  # bundles of one 10-minute call each (check kernels layers impls |
#                                            # models compiled | compiled timm26 impls and the layer checks)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
R="$OUT/r"
mkdir -p "$R"
if [ -d .whl ]; then  # peers carried as wheels (lambda-networks is not on the device image)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BENCH="$PY -m lambdanet bench --device cuda"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  $PY -c "import timm, lambda_networks, lambdanet; print('timm', timm.__version__, 'lambdanet', lambdanet.__version__)"
} > "$R/env.txt" 2>&1

trap 'tar czf "$OUT/results.tgz" -C "$OUT" r' EXIT  # the bundle also when a stage or the call is cut short

stage() {  # stage NAME SECONDS COMMAND...: run under a time limit, log to $R/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$limit" "$@" > "$R/$name.log" 2>&1
  echo "   exit $? after $((SECONDS - t0))s"
  tail -n 12 "$R/$name.log"
}

run_stage() {
  case "$1" in
    check) stage check 170 $PY -m pytest -n 0 -q -m device tests/test_device.py tests/test_kernels.py -p no:cacheprovider -rf ;;
    kernels) stage kernels 80 $BENCH kernels --out "$R/kernels" ;;
    layers)
      stage layers-fp32 80 $BENCH targets attention --repeats 20 --out "$R/layers-fp32"
      stage layers-bf16 70 $BENCH targets attention --amp bf16 --repeats 20 --out "$R/layers-bf16" ;;
    impls) stage impls-fp32 150 $BENCH impls --repeats 10 --out "$R/impls-fp32" ;;
    impls-bf16) stage impls-bf16 120 $BENCH impls --amp bf16 --repeats 10 --out "$R/impls-bf16" ;;
    models) stage models 300 $BENCH models --suites timm26 table13 table14 --amp bf16 --channels-last \
      --img-size 256 --batch-size 256 --out "$R/models" ;;
    compiled) stage compiled 270 $BENCH models --suites timm26 --amp bf16 --channels-last --img-size 256 \
      --batch-size 256 --compile --out "$R/compiled" ;;
    timm26) stage timm26 90 $BENCH models --suites timm26 --amp bf16 --channels-last --img-size 256 \
      --batch-size 256 --out "$R/timm26" ;;
    lm) stage lm 540 $PY scripts/gpu_lm.py "$R/lm" ;;
    lm-first)  # one 10-minute call: Triton's cache filled at the defaults (untimed, beside the GPU check), then the
               # per-kernel profile and the op against fla / SDPA, the models' training, generation and launches,
               # and the per-kernel sweep of launch settings (scripts/gpu_tune.py) with its own warm-up
      # With .gl/base/lambdanet (an earlier version's package, carried: `mkdir -p .gl/base && git archive COMMIT
      # lambdanet | tar -x -C .gl/base`), its kernels are timed too, per kernel, in the same call (lm-base).
      local W="$PY scripts/gpu_lm.py" BASE="$PWD/.gl/base:$PYTHONPATH"
      GPU_LM_PEERS=0 GPU_LM_WARM_MODELS=1 timeout 120 $W "$R/warm-default" --parts warm > "$R/warm-default.log" 2>&1 &
      local pid=$!
      if [ -d .gl/base/lambdanet ]; then
        PYTHONPATH="$BASE" GPU_LM_PEERS=0 timeout 120 $W "$R/warm-base" --parts warm > "$R/warm-base.log" 2>&1 &
      fi
      # the channel loop in every chunk (the kernels before the factored content weights), timed beside the default
      LAMBDANET_CAUSAL_SAFE=-inf GPU_LM_PEERS=0 timeout 120 $W "$R/warm-loop" --parts warm > "$R/warm-loop.log" 2>&1 &
      stage lm-check 90 $W "$R/lm-check" --parts check --quick
      echo "   warming ..."; wait; tail -n 3 "$R"/warm-*.log
      stage lm-default 110 $W "$R/lm-default" --parts opprof,op --quick
      [ -d .gl/base/lambdanet ] && stage lm-base 60 env PYTHONPATH="$BASE" $W "$R/lm-base" --parts opprof --quick
      stage lm-loop 60 env LAMBDANET_CAUSAL_SAFE=-inf $W "$R/lm-loop" --parts opprof --quick
      stage lm-models 80 $W "$R/lm-models" --parts lm,gen,profile --quick
      stage lm-tune 120 $PY scripts/gpu_tune.py "$R/lm-tune"
      run_stage lm-ncu ;;  # last: the call's limit may cut it
    lm-quality)  # issue 37 on the GPU: *_lm_small at context 1024, equal steps (1,200 of 32 sequences), and at 4096
                 # (1,200 of 8) with the validation curve per epoch and bytes/s in metrics.csv (equal time read off it)
      local T="$PY -m lambdanet lm train --device cuda --amp bf16 --eval-bytes 262144 --seed 0 --no-progress --no-tensorboard"
      stage q1024-lambda 110 $T --model lambda_lm_small --context 1024 --batch-size 32 --epochs 4 --steps-per-epoch 300 --out "$R/q1024-lambda"
      stage q1024-transformer 90 $T --model transformer_lm_small --context 1024 --batch-size 32 --epochs 4 --steps-per-epoch 300 --out "$R/q1024-transformer"
      stage q1024-heads8 110 $T --model lambda_lm_small --model-kwargs heads=8 --context 1024 --batch-size 32 --epochs 4 --steps-per-epoch 300 --out "$R/q1024-heads8"
      stage q4096-lambda 100 $T --model lambda_lm_small --context 4096 --batch-size 8 --epochs 6 --steps-per-epoch 200 --out "$R/q4096-lambda"
      stage q4096-transformer 100 $T --model transformer_lm_small --context 4096 --batch-size 8 --epochs 6 --steps-per-epoch 200 --out "$R/q4096-transformer"
      rm -f "$R"/q*/last.pt "$R"/q*/model.safetensors ;;  # the results only (the tarball comes back)
    lm-ncu)  # Nsight Compute on the three product kernels of the second forward + backward (after the compile)
      local NCU
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
      [ -n "$NCU" ] || { echo "== lm-ncu skipped: no ncu on this machine"; return 0; }
      stage lm-ncu 60 "$NCU" --kernel-name-base function --kernel-name regex:"_chunk_output|_grad_local|_grad_keys_values" \
        --launch-skip 3 --launch-count 3 --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        $PY scripts/gpu_lm.py "$R/lm-ncu" --parts ncu ;;
    run1) for s in check kernels layers impls; do run_stage $s; done ;;
    run2) for s in models compiled; do run_stage $s; done ;;
    compiled-26t) stage compiled-26t 330 $PY scripts/gpu_compiled.py "$R/compiled-26t" ;;
    free26t) stage free26t 90 $PY scripts/gpu_free_layers.py "$R/free26t" ;;  # the ceiling of any lambda layer
    run4) for s in impls compiled-26t; do run_stage $s; done ;;
    run3) for s in compiled timm26 impls; do run_stage $s; done
      stage check-layers 60 $PY -m pytest -n 0 -q -m device tests/test_device.py -k "lambda or autocast" -p no:cacheprovider -rf ;;
    *) echo "unknown stage $1 (check | kernels | layers | impls | impls-bf16 | models | compiled | timm26 | lm | lm-first | lm-ncu | lm-quality | free26t | run1-3)"; exit 2 ;;
  esac
}

run_stage "${1:-check}"
